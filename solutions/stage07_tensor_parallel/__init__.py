"""Stage 07: tensor parallelism."""
