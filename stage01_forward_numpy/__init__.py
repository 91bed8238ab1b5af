"""Stage 01: the forward pass of GPT-2 and of a Llama-style decoder, in plain NumPy."""
