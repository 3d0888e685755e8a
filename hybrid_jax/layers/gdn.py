"""Gated DeltaNet (linear attention) layer of Qwen3.5.

Projections (flat layout: q | k | v channels), a causal depthwise conv (kernel 4) + SiLU over the q/k/v
channels, L2-normalised q/k, ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, the gated
delta rule with an fp32 state, a gated RMSNorm with ``silu(z)`` and the output projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import Qwen35Config
from hybrid_jax.layers.linear import Linear, project
from hybrid_jax.layers.norm import GatedRMSNorm
from hybrid_jax.ops import gated_delta
from pallas_kernels.gemv import NormedRows

F32 = jnp.float32
L2_EPS = 1e-6


def l2_normalize(x: jax.Array) -> jax.Array:
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


class DepthwiseConv(nnx.Module):
    """Holds the conv kernel ``[K, C]`` (HF stores ``conv1d.weight`` as ``[C, 1, K]``)."""

    def __init__(self, channels: int, kernel: int, dtype, *, std: float, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (kernel, channels), dtype) * std)


class GatedDeltaNet(nnx.Module):
    def __init__(self, config: Qwen35Config, dtype, *, rngs: nnx.Rngs):
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.k_dim, self.v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = c.linear_key_dim, c.linear_value_dim, c.conv_dim
        self.kernel = c.linear_conv_kernel_dim
        std = c.initializer_range
        self.in_proj_qkv = Linear(c.hidden_size, c.conv_dim, dtype, std=std, rngs=rngs)
        self.in_proj_z = Linear(c.hidden_size, c.linear_value_dim, dtype, std=std, rngs=rngs)
        self.in_proj_b = Linear(c.hidden_size, c.linear_num_value_heads, dtype, std=std, rngs=rngs)
        self.in_proj_a = Linear(c.hidden_size, c.linear_num_value_heads, dtype, std=std, rngs=rngs)
        self.conv1d = DepthwiseConv(c.conv_dim, c.linear_conv_kernel_dim, dtype, std=std, rngs=rngs)
        hv = c.linear_num_value_heads
        # As HF: A = -exp(A_log) with exp(A_log) ~ uniform(0.01, 16); dt_bias ones.
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), F32, 0.01, 16.0)))
        self.dt_bias = nnx.Param(jnp.ones((hv,), dtype))
        self.norm = GatedRMSNorm(c.linear_value_head_dim, c.rms_norm_eps)
        self.out_proj = Linear(c.linear_value_dim, c.hidden_size, dtype, std=std, rngs=rngs)

    def in_projections(self, x: jax.Array | NormedRows):
        """x [..., D] -> raw conv input mixed [..., C], z [..., Hv, dv], b, a [..., Hv] logits, all fp32."""
        mixed, z, b, a = project(x, (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a), F32)
        return mixed, z.reshape(*z.shape[:-1], self.num_v_heads, self.v_dim), b, a

    def heads(self, conv_out: jax.Array):
        """conv_out [..., C] fp32 (before SiLU) -> q, k [..., Hk, dk] normalised (q scaled), v [..., Hv, dv] fp32."""
        mixed = jax.nn.silu(conv_out)
        lead = mixed.shape[:-1]
        q = mixed[..., : self.key_dim].reshape(*lead, self.num_k_heads, self.k_dim)
        k = mixed[..., self.key_dim: 2 * self.key_dim].reshape(*lead, self.num_k_heads, self.k_dim)
        v = mixed[..., 2 * self.key_dim:].reshape(*lead, self.num_v_heads, self.v_dim)
        return l2_normalize(q) * self.k_dim**-0.5, l2_normalize(k), v

    def gates(self, b: jax.Array, a: jax.Array):
        """b, a [..., Hv] fp32 logits -> g (log decay <= 0), beta, both fp32."""
        g = -jnp.exp(self.A_log[...].astype(F32)) * jax.nn.softplus(a + self.dt_bias[...].astype(F32))
        return g, jax.nn.sigmoid(b)

    def project(self, x: jax.Array, conv_state: jax.Array):
        """Everything before the delta rule, for whole sequences.

        x [B, T, D]; conv_state [B, K-1, C] (raw columns before the conv). Returns q, k [B, T, Hk, dk],
        v [B, T, Hv, dv], g, beta [B, T, Hv] (fp32), z [B, T, Hv, dv] and the new conv state [B, K-1, C].
        """
        mixed, z, b, a = self.in_projections(x)
        window = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=-2)
        new_conv_state = window[..., window.shape[-2] - (self.kernel - 1):, :].astype(conv_state.dtype)
        q, k, v = self.heads(causal_conv(window, self.conv1d.weight[...]))
        g, beta = self.gates(b, a)
        return q, k, v, g, beta, z, new_conv_state

    def gated(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """o [..., T, Hv, dv] (delta-rule output), z [..., T, Hv, dv] -> the output projection's input [..., T, Hv dv].

        o is rounded to the model's dtype first (the weights'; z comes in fp32), as HF rounds it and the prefill
        kernel writes it, so the model's forward, prefill and decode normalise the same values."""
        y = self.norm(o.astype(self.out_proj.kernel[...].dtype), z)
        return y.reshape(*y.shape[:-2], self.value_dim)

    def output(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """o, z [..., T, Hv, dv] -> [..., T, D]: `gated`, then the output projection."""
        return self.out_proj(self.gated(o, z))

    def __call__(self, x: jax.Array, cache: dict | None = None):
        """x [B, T, D]; cache {"conv": [B, K-1, C], "state": [B, Hv, dk, dv] fp32} or None (zeros).

        Returns (y [B, T, D], new cache or None).
        """
        state = self.init_cache(x.shape[0], x.dtype) if cache is None else cache
        q, k, v, g, beta, z, conv = self.project(x, state["conv"])
        if x.shape[1] == 1 and cache is not None:
            o, s = gated_delta.gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state["state"])
            o = o[:, None]
        else:
            o, s = gated_delta.gated_delta_chunked(q, k, v, g, beta, state["state"])
        y = self.output(o, z)
        return y, (None if cache is None else {"conv": conv, "state": s})

    def init_cache(self, batch: int, dtype) -> dict:
        return {"conv": jnp.zeros((batch, self.kernel - 1, self.conv_dim), dtype),
                "state": jnp.zeros((batch, self.num_v_heads, self.k_dim, self.v_dim), F32)}
