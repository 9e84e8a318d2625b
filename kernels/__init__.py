"""Hot loops of the engine: paged attention and the KV-cache write, as PyTorch references (the CPU
path) and Triton kernels (the CUDA path) with the same signatures. ``kernels.attention`` picks one."""
