"""Stage 01: the forward pass of GPT-2 and of a Llama-style decoder, in plain NumPy."""

from labkit.impl import share_given_modules  # given modules live only in the stage folder

share_given_modules(__path__, __name__)
