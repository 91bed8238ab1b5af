"""Stage 07 part 3a: pipeline parallelism, the layers split across processes (README.md here says what to build)."""
