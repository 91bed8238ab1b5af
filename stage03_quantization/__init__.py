"""Stage 03: quantization — INT8, INT4, NF4, FP8, GPTQ, AWQ, SmoothQuant and a quality gate."""
