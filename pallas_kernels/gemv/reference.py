"""Pure-JAX reference of the few-row matmul: x times each weight, fp32 accumulation."""

import jax
import jax.numpy as jnp


def gemv(x: jax.Array, weights: tuple[jax.Array, ...], out_dtype=None) -> tuple[jax.Array, ...]:
    """x [..., K] times each w [K, N_i] -> ([..., N_i], ...) in ``out_dtype`` (default: each weight's dtype)."""
    return tuple(jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(out_dtype or w.dtype)
                 for w in weights)
