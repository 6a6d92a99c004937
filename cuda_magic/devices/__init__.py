"""Reading devices: torch's CUDA/MPS counters, NVML, the CPU view, the simulated device, the meters that
time a guarded run, and the allocator's settings. Knows nothing of IPython, notebooks or displays."""
