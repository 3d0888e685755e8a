"""Gated full attention: q/gate interleaved per head, q/k zero-centred norms, partial RoPE, sigmoid gate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import Qwen35Config
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.norm import RMSNorm
from pallas_kernels.gemv import NormedRows
from pallas_kernels.math.attention import attention_gate
from pallas_kernels.math.rope import apply_rope, rope_cos_sin


class GatedAttention(nnx.Module):
    def __init__(self, config: Qwen35Config, dtype, *, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rotary_dim, self.rope_theta = c.rotary_dim, c.rope_theta
        self.scale = c.head_dim**-0.5
        # q_proj rows per head: [query (hd) | gate (hd)], so its output is viewed as [.., Hq, 2 hd].
        std = c.initializer_range
        self.q_proj = Linear(c.hidden_size, 2 * c.num_attention_heads * c.head_dim, dtype, std=std, rngs=rngs)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, dtype, std=std, rngs=rngs)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, dtype, std=std, rngs=rngs)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, dtype, std=std, rngs=rngs)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)

    @property
    def output_projection(self) -> Linear:
        return self.o_proj

    def __call__(self, x: jax.Array | NormedRows, positions: jax.Array, cache, index: int) -> jax.Array:
        """x [..., D] normed, positions [...] -> the output projection's input [..., Hq hd], over layer
        ``index`` of ``cache`` (a `caches.base.Cache`: it writes the new K/V and attends)."""
        qg, k, v = cache.proj.project(x, (self.q_proj, self.k_proj, self.v_proj))
        return cache.attention(index, self, qg, k, v, positions)

    def heads(self, qg: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array):
        """The projections qg [..., Hq * 2 hd] (per head: query, then gate), k, v [..., Hkv * hd] and positions
        [...] -> q [..., Hq, hd], k, v [..., Hkv, hd] (q/k normed, RoPE applied), gate [..., Hq, hd]."""
        lead = qg.shape[:-1]
        qg = qg.reshape(*lead, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim:]
        k = k.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta, qg.dtype)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        return q, k, v, gate

    def gated(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        """o, gate [..., Hq, hd] -> the output projection's input [..., Hq hd]."""
        o = attention_gate(o, gate)
        return o.reshape(*o.shape[:-2], self.num_heads * self.head_dim)

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
