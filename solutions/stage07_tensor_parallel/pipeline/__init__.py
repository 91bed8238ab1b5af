"""Stage 07 part 3a: pipeline parallelism, the layers split across processes (README.md here says what to build)."""

from labkit.impl import share_given_modules  # given modules live only in the stage folder

share_given_modules(__path__, __name__)
