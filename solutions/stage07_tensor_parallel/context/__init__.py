"""Stage 07 part 3b: context parallelism, a long prompt's positions split across processes (README.md here)."""

from labkit.impl import share_given_modules  # given modules live only in the stage folder

share_given_modules(__path__, __name__)
