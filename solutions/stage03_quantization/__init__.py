"""Stage 03: quantization — INT8, INT4, NF4, FP8, GPTQ, AWQ, SmoothQuant and a quality gate."""

from labkit.impl import share_given_modules  # given modules live only in the stage folder

share_given_modules(__path__, __name__)
