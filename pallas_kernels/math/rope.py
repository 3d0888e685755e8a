"""Partial NeoX-style rotary embedding: the first ``rotary_dim`` dims of each head rotate, pairs (j, j+r/2).

Qwen3.5's interleaved M-RoPE reduces to this 1-D form for text (all three position rows are equal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """positions [...] int -> cos, sin [..., rotary_dim] (halves duplicated), cast to ``dtype``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=F32) / rotary_dim))  # [r/2]
    angles = positions.astype(F32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., T, H, hd]; cos, sin [..., T, r] -> x with its first r dims rotated."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    first, second = rot[..., : r // 2], rot[..., r // 2:]
    rotated_half = jnp.concatenate([-second, first], axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    return jnp.concatenate([rot * cos + rotated_half * sin, rest], axis=-1)
