"""Stage 06: speculative decoding — draft and verify, exact rejection sampling, prompt lookup, the speedup math."""
