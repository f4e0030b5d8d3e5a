"""Kernels for NVIDIA GPUs: portable Pallas (Triton lowering; interpret mode on CPU) and Mosaic GPU."""
