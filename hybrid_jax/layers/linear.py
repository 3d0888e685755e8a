"""Bias-free linear layer with the kernel stored ``[in, out]`` (HF stores ``[out, in]``)."""

from __future__ import annotations

import jax
from flax import nnx

from pallas_kernels.gemv.reference import gemv as xla_gemv


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, dtype, *, std: float, rngs: nnx.Rngs):
        """The kernel drawn from normal(0, std), as HF initializes nn.Linear."""
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (in_features, out_features), dtype) * std)

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        """x [..., in] -> [..., out] in ``out_dtype`` (default: the kernel's dtype); fp32 accumulation (XLA's dot;
        a forward over a cache projects through its cache's `projections` instead)."""
        return xla_gemv(x, (self.kernel[...],), out_dtype)[0]
