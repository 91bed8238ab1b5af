"""Stage 07 part 2: a fleet of replicas behind one OpenAI endpoint (README.md here says what to build)."""

from labkit.impl import share_given_modules  # given modules live only in the stage folder

share_given_modules(__path__, __name__)
