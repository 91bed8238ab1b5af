"""Stage 07 part 4: a Mixture-of-Experts block, grouped execution, expert parallelism, MoEfied SmolLM2."""
