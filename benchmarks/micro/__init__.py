"""Pieces alone: kernels, the sampler, the scheduler's host time, a step's parts, decode steps by rows; and the GPU
check (``gpu_check.sh``), which runs the kernels and the engine on a GPU."""
