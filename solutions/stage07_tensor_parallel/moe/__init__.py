"""Stage 07 part 4: a Mixture-of-Experts block, grouped execution, expert parallelism, MoEfied SmolLM2."""

from labkit.impl import share_given_modules  # given modules live only in the stage folder

share_given_modules(__path__, __name__)
