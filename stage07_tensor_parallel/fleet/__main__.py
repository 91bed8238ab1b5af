"""`python -m stage07_tensor_parallel.fleet`: the fleet CLI (launch.py)."""

from .launch import main

main()
