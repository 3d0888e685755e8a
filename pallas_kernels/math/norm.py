"""RMS normalisation, and the zero-centred ``(1 + w)`` RMS norm of the residual stream and of q/k."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in fp32."""
    xf = x.astype(F32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def zero_centred_rms_norm(x: jax.Array, weight: jax.Array, eps: float, out_dtype=None) -> jax.Array:
    """``normalize(x) * (1 + weight)`` in fp32 over the last axis, cast to ``out_dtype`` (default: x.dtype)."""
    return (rms_normalize(x, eps) * (1.0 + weight.astype(F32))).astype(out_dtype or x.dtype)
