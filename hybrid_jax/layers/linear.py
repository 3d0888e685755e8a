"""Bias-free linear layer with the kernel stored ``[in, out]`` (HF stores ``[out, in]``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, dtype, *, rngs: nnx.Rngs):
        std = in_features**-0.5
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (in_features, out_features), dtype) * std)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        w = self.kernel[...]
        return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(w.dtype)
