"""Pure-JAX reference of the few-row matmul: x (optionally RMS-normalised) times each weight, fp32 accumulation."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


class RowNorm(NamedTuple):
    """An RMSNorm applied to x before the matmul: ``x / rms(x) * scale`` in fp32, then cast to the weights'
    dtype (what a zero-centred norm gives with scale = 1 + w)."""

    scale: jax.Array  # [K] fp32
    eps: float


def normalize(x: jax.Array, norm: RowNorm | None, dtype) -> jax.Array:
    """x [..., K] -> the matmul's input in ``dtype``: normalised by ``norm`` first when there is one."""
    if norm is None:
        return x.astype(dtype)
    xf = x.astype(F32)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm.eps)
    return (xf * rstd * norm.scale.astype(F32)).astype(dtype)


def gemv(x: jax.Array, weights: tuple[jax.Array, ...], out_dtype=None,
         norm: RowNorm | None = None) -> tuple[jax.Array, ...]:
    """x [..., K] (normalised by ``norm`` when given) times each w [K, N_i] -> ([..., N_i], ...) in ``out_dtype``
    (default: each weight's dtype)."""
    return tuple(jnp.dot(normalize(x, norm, w.dtype), w, preferred_element_type=F32).astype(out_dtype or w.dtype)
                 for w in weights)
