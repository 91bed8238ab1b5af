"""One module per stage with a speed or memory claim: `python -m labkit.bench NN` runs it."""
