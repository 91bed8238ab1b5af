"""Stage 07 part 2: a fleet of replicas behind one OpenAI endpoint (README.md here says what to build)."""
