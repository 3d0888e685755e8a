"""Gated DeltaNet's pieces around the delta rule: the causal depthwise conv over raw columns, where a conv ring
keeps them, and the L2 norm of q and k."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
L2_EPS = 1e-6


def l2_normalize(x: jax.Array) -> jax.Array:
    """x [..., d] -> x / |x| over the last axis, in fp32."""
    xf = x.astype(F32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2_EPS)


def causal_conv(window: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise causal conv. window [..., K-1+T, C] (cached raw columns first), weight [K, C] -> [..., T, C] fp32."""
    kernel = weight.shape[0]
    t = window.shape[-2] - (kernel - 1)
    w = weight.astype(F32)
    return sum(window[..., j: j + t, :].astype(F32) * w[j] for j in range(kernel))


def conv_ring_columns(next_pos: jax.Array, kernel: int) -> jax.Array:
    """Where the K-1 raw columns before position ``next_pos`` sit in a conv ring of K columns (position t at
    column t mod K): next_pos [...] int -> [..., K-1] int32, oldest first. Column next_pos mod K is free, so
    a step can write its new column there while others still read these."""
    offsets = jnp.arange(1, kernel, dtype=jnp.int32)  # t - (K-1) + j = t + 1 + j mod K: never negative
    return (next_pos.astype(jnp.int32)[..., None] + offsets) % kernel
