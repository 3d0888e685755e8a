"""A dense cache per sequence: KV ``[B, max_len, Hkv, hd]`` for attention layers, conv ``[B, K-1, C]`` + fp32
state ``[B, Hv, dk, dv]`` for GDN layers (`Qwen35ForCausalLM.init_cache`); or none (whole sequences from
zero state). Inputs are [B, T, ...]."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrid_jax.caches.base import Cache
from hybrid_jax.layers.projections import XlaProjections
from hybrid_jax.ops.attention import dense_causal_attention
from pallas_kernels.math import gated_delta
from pallas_kernels.math.gdn import causal_conv

F32 = jnp.float32


class DenseCache(Cache):
    """``layers``: the cache (None: none kept); ``proj``: how the projections run (default: XLA's dots)."""

    def __init__(self, layers: list[dict] | None, proj: XlaProjections | None = None):
        self.layers = layers
        if proj is not None:
            self.proj = proj
        self.updated = None if layers is None else list(layers)  # the new cache, layer by layer

    def attention(self, index, attn, qg, k, v, positions):
        q, k, v, gate = attn.heads(qg, k, v, positions)  # positions [B, T]
        if self.layers is not None:
            write = jax.vmap(lambda buf, pos, new: buf.at[pos].set(new.astype(buf.dtype)))
            cache = self.layers[index]
            cache = {"k": write(cache["k"], positions, k), "v": write(cache["v"], positions, v)}
            self.updated[index] = cache
            k, v = cache["k"], cache["v"]
        o = dense_causal_attention(q, k.astype(q.dtype), v.astype(q.dtype), positions, attn.scale)
        return attn.gated(o, gate)

    def linear_attention(self, index, gdn, mixed, b, a):
        batch, steps = mixed.shape[0], mixed.shape[1]
        state = gdn.init_cache(batch, F32) if self.layers is None else self.layers[index]
        window = jnp.concatenate([state["conv"].astype(mixed.dtype), mixed], axis=-2)  # [B, K-1+T, C]
        q, k, v = gdn.heads(causal_conv(window, gdn.conv1d.weight[...]))
        g, beta = gdn.gates(b, a)
        if steps == 1 and self.layers is not None:
            o, s = gated_delta.gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state["state"])
            o = o[:, None]
        else:
            o, s = gated_delta.gated_delta_chunked(q, k, v, g, beta, state["state"])
        if self.layers is not None:
            conv = window[..., window.shape[-2] - (gdn.kernel - 1):, :].astype(state["conv"].dtype)
            self.updated[index] = {"conv": conv, "state": s}
        return o
