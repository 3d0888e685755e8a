"""Pure-JAX reference of the residual add fused with the zero-centred RMSNorm that follows it."""

import jax
import jax.numpy as jnp

F32 = jnp.float32


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float,
                 out_dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] fp32 residual stream, delta [..., D] (any float dtype) or None, weight [D] ->
    (s = x + delta in fp32, s / rms(s) * (1 + weight) in ``out_dtype``)."""
    s = x.astype(F32) if delta is None else x.astype(F32) + delta.astype(F32)
    y = s * jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps) * (1.0 + weight.astype(F32))
    return s, y.astype(out_dtype)
