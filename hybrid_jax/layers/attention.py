"""Gated full attention: q/gate interleaved per head, q/k zero-centred norms, partial RoPE, sigmoid gate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import Qwen35Config
from hybrid_jax.layers.linear import Linear, project
from hybrid_jax.layers.norm import RMSNorm
from hybrid_jax.layers.rope import apply_rope, rope_cos_sin
from hybrid_jax.ops.attention import dense_causal_attention
from pallas_kernels.gemv import NormedRows


def attention_gate(o: jax.Array, gate: jax.Array) -> jax.Array:
    """o * sigmoid(gate) in gate's dtype, rounded as HF's bf16 attention: o and the sigmoid to that dtype, then
    the product. The roundings are `reduce_precision`s, which XLA keeps (it may drop a convert pair)."""
    bits = jnp.finfo(gate.dtype)
    keep = lambda v: jax.lax.reduce_precision(v, exponent_bits=bits.nexp, mantissa_bits=bits.nmant)
    return (keep(o.astype(jnp.float32)) * keep(jax.nn.sigmoid(gate.astype(jnp.float32)))).astype(gate.dtype)


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

    def projections(self, x: jax.Array | NormedRows) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [..., D] -> qg [..., Hq * 2 hd] (per head: query, then gate), k, v [..., Hkv * hd]: one launch."""
        return project(x, (self.q_proj, self.k_proj, self.v_proj))

    def project(self, x: jax.Array, positions: jax.Array):
        """x [..., T, D], positions [..., T] -> q [..., T, Hq, hd], k, v [..., T, Hkv, hd], gate [..., T, Hq, hd]."""
        lead = x.shape[:-1]
        qg, k, v = self.projections(x)
        qg = qg.reshape(*lead, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim:]
        k = k.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta, x.dtype)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        return q, k, v, gate

    def gated(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        """o, gate [..., T, Hq, hd] -> the output projection's input [..., T, Hq hd]."""
        o = attention_gate(o, gate)
        return o.reshape(*o.shape[:-2], self.num_heads * self.head_dim)

    def output(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        """o, gate [..., T, Hq, hd] -> [..., T, D]."""
        return self.o_proj(self.gated(o, gate))

    def __call__(self, x: jax.Array, positions: jax.Array, cache: dict | None = None):
        """x [B, T, D], positions [B, T]. ``cache`` {"k", "v": [B, S, Hkv, hd]} is written at ``positions``.

        Returns (y [B, T, D], new cache or None).
        """
        q, k, v, gate = self.project(x, positions)
        if cache is not None:
            write = jax.vmap(lambda buf, pos, new: buf.at[pos].set(new.astype(buf.dtype)))
            cache = {"k": write(cache["k"], positions, k), "v": write(cache["v"], positions, v)}
            k, v = cache["k"], cache["v"]
        o = dense_causal_attention(q, k.astype(q.dtype), v.astype(q.dtype), positions, self.scale)
        return self.output(o, gate), cache

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
