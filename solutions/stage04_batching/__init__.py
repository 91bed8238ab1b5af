"""Stage 04: paged KV cache, prefix caching, a continuous-batching engine and a streaming server."""
