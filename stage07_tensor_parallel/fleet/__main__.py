"""`python -m stage07_tensor_parallel.fleet`: the fleet CLI (launch.py), from the implementation LABS_IMPL picks,
as the notebooks and tests load it (the replicas it starts come from the same side)."""

from labkit.impl import load

load("stage07_tensor_parallel.fleet.launch").main()
