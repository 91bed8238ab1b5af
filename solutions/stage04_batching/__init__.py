"""Stage 04: paged KV cache, prefix caching, a continuous-batching engine and a streaming server."""

from labkit.impl import share_given_modules  # given modules live only in the stage folder

share_given_modules(__path__, __name__)
