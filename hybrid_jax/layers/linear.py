"""Bias-free linear layer with the kernel stored ``[in, out]`` (HF stores ``[out, in]``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, dtype, *, rngs: nnx.Rngs):
        std = in_features**-0.5
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (in_features, out_features), dtype) * std)

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        """x [..., in] -> [..., out] in ``out_dtype`` (default: the kernel's dtype); fp32 accumulation."""
        w = self.kernel[...]
        return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(out_dtype or w.dtype)
