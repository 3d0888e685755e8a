"""RMS norms: zero-centred ``(1 + w)`` for the residual stream and q/k, plain ``w`` gated norm in GDN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.math.norm import rms_normalize, zero_centred_rms_norm

F32 = jnp.float32


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: ``normalize(x) * (1 + w)`` in fp32, then cast back (w = 0 is identity)."""

    def __init__(self, dim: int, eps: float, dtype, *, rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        """x [..., dim] -> same shape, in ``out_dtype`` (default: x.dtype)."""
        return zero_centred_rms_norm(x, self.weight[...], self.eps, out_dtype)


class GatedRMSNorm(nnx.Module):
    """GDN output norm: ``w * normalize(o)`` (plain weight, kept fp32) gated by ``silu(z)``."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(jnp.ones((dim,), F32))
        self.eps = eps

    def __call__(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """o [..., dv] (delta-rule output), z [..., dv] -> [..., dv] in z.dtype."""
        n = rms_normalize(o, self.eps) * self.weight[...].astype(F32)
        return (n * jax.nn.silu(z.astype(F32))).astype(z.dtype)
