"""Stage 06: speculative decoding — draft and verify, exact rejection sampling, prompt lookup, the speedup math;
part 2: speculation inside a batching engine (lab2.ipynb) and Medusa heads with tree verification (lab3.ipynb)."""
