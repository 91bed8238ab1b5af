"""Stage 07 part 2 learner bugs, one edit each, planted in solutions/stage07_tensor_parallel (see labkit/grading/mutants.py)."""

MUTANTS = [
    # --- radix_cache.py (lab2) ---
    # --- policies.py, kv_index.py (lab3) ---
    # --- loadgen.py, slo.py (lab4) ---
]
