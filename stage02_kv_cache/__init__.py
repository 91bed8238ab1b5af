"""Stage 02: the KV cache — memory math, GQA, cached decode that equals uncached decode."""
