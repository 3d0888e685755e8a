"""Pallas kernels of hybrid-jax: one folder per op (kernel.py + reference.py), one dispatch entry each."""
