"""Dense causal attention with grouped KV heads (the model's plain-JAX path and the kernels' oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def dense_causal_attention(q, k, v, q_positions, scale: float):
    """Attention where key slot j holds position j and query t sees slots j <= q_positions[t].

    q: [B, T, Hq, hd]; k, v: [B, S, Hkv, hd]; q_positions: [B, T] int. Returns [B, T, Hq, hd] in q.dtype.
    Query head h uses kv head h // (Hq / Hkv). Softmax in fp32.
    """
    b, t, hq, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, hd)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=F32) * scale
    visible = jnp.arange(k.shape[1])[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v, preferred_element_type=F32)
    return out.reshape(b, t, hq, hd).astype(q.dtype)
