"""Stage 04: paged KV cache, prefix caching, a continuous-batching engine and a streaming server;
part 2: structured output (lab2.ipynb) and multi-LoRA serving (lab3.ipynb)."""

from labkit.impl import share_given_modules  # given modules live only in the stage folder

share_given_modules(__path__, __name__)
