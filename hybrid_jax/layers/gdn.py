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
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.norm import GatedRMSNorm
from pallas_kernels.gemv import NormedRows
from pallas_kernels.math.gdn import l2_normalize

F32 = jnp.float32


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

    @property
    def output_projection(self) -> Linear:
        return self.out_proj

    def __call__(self, x: jax.Array | NormedRows, cache, index: int) -> jax.Array:
        """x [..., D] normed -> the output projection's input [..., Hv dv], over layer ``index`` of ``cache`` (a
        `caches.base.Cache`: it runs the conv and the delta rule over its conv and recurrent state)."""
        mixed, z, b, a = self.in_projections(x, cache.proj)
        return self.gated(cache.linear_attention(index, self, mixed, b, a), z)

    def in_projections(self, x: jax.Array | NormedRows, proj):
        """x [..., D] -> raw conv input mixed [..., C], z [..., Hv, dv], b, a [..., Hv] logits, all fp32."""
        mixed, z, b, a = proj.project(x, (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a), F32)
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

    def gated(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """o [..., Hv, dv] (delta-rule output), z [..., Hv, dv] -> the output projection's input [..., Hv dv].

        o is rounded to the model's dtype first (the weights'; z comes in fp32), as HF rounds it and the prefill
        kernel writes it, so every cache's path normalises the same values."""
        y = self.norm(o.astype(self.out_proj.kernel[...].dtype), z)
        return y.reshape(*y.shape[:-2], self.value_dim)

    def init_cache(self, batch: int, dtype) -> dict:
        return {"conv": jnp.zeros((batch, self.kernel - 1, self.conv_dim), dtype),
                "state": jnp.zeros((batch, self.num_v_heads, self.k_dim, self.v_dim), F32)}
