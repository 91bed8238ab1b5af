"""Stage 07 part 3b: context parallelism, a long prompt's positions split across processes (README.md here)."""
