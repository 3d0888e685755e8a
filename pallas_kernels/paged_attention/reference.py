"""Pure-JAX reference for attention over the paged KV cache (the oracle of the kernels, and their fallback),
and for the decode step's attention inputs (q/k norms, RoPE, K/V write) and gated output.

Layout: per layer `k_pages` / `v_pages` are `[num_pages, page_size, Hkv, hd]`; a token at position `p` of a
sequence lives in page `page_tables[seq, p // page_size]` at offset `p % page_size`, i.e. at flat slot
`page * page_size + offset`. Page 0 is the null page: padded rows write there and its content is garbage
that must never reach a real row. Softmax runs in fp32; rows that see no key output zeros.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.math.attention import attention_gate
from pallas_kernels.math.norm import zero_centred_rms_norm
from pallas_kernels.math.rope import apply_rope


def write_kv(
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    k_new: jax.Array,  # [T, Hkv, hd]
    v_new: jax.Array,  # [T, Hkv, hd]
    slot_mapping: jax.Array,  # [T] int32, page * page_size + offset (padding: a slot of page 0)
) -> tuple[jax.Array, jax.Array]:
    """Scatters new K/V rows into their slots; in place when the pools are donated."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    k_pages = k_pages.reshape(flat).at[slot_mapping].set(k_new.astype(k_pages.dtype)).reshape(k_pages.shape)
    v_pages = v_pages.reshape(flat).at[slot_mapping].set(v_new.astype(v_pages.dtype)).reshape(v_pages.shape)
    return k_pages, v_pages


def decode_attention_inputs(
    qg: jax.Array,  # [>= B, Hq * 2 hd] per head: query, then gate
    k: jax.Array,  # [>= B, Hkv * hd]
    v: jax.Array,  # [>= B, Hkv * hd]
    cos: jax.Array,  # [>= B, r] in qg's dtype (`rope_cos_sin`)
    sin: jax.Array,  # [>= B, r]
    q_norm: jax.Array,  # [hd]
    k_norm: jax.Array,  # [hd]
    slot_mapping: jax.Array,  # [B] int32
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    *,
    num_q_heads: int,
    eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [B, Hq, hd] in the pages' dtype, k_pages, v_pages
    """A decode step's attention inputs from the raw projections: the q/k norms and RoPE as the model's
    layer applies them, q for the attention and the new K/V written to their slots. Rows past B are not read."""
    batch = slot_mapping.shape[0]
    head_dim = k_pages.shape[-1]
    q = qg[:batch].reshape(batch, num_q_heads, 2 * head_dim)[..., :head_dim]  # [B, Hq, hd]
    k = k[:batch].reshape(batch, -1, head_dim)  # [B, Hkv, hd]
    v = v[:batch].reshape(batch, -1, head_dim)
    q = apply_rope(zero_centred_rms_norm(q, q_norm, eps), cos[:batch], sin[:batch])
    k = apply_rope(zero_centred_rms_norm(k, k_norm, eps), cos[:batch], sin[:batch])
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, slot_mapping)
    return q.astype(k_pages.dtype), k_pages, v_pages


def decode_attention_output(o: jax.Array, qg: jax.Array, out_rows: int) -> jax.Array:
    """o [B, Hq, hd] gated by the gate half of qg [>= B, Hq * 2 hd] (`attention_gate`), flattened and padded
    with zero rows: [out_rows, Hq * hd] in qg's dtype, as the output projection takes it."""
    batch, num_q_heads, head_dim = o.shape
    gate = qg[:batch].reshape(batch, num_q_heads, 2 * head_dim)[..., head_dim:]
    y = attention_gate(o, gate).reshape(batch, num_q_heads * head_dim)
    return jnp.pad(y, ((0, out_rows - batch), (0, 0)))


def _gather_sequences(
    pages: jax.Array,  # [P, page_size, Hkv, hd]
    page_tables: jax.Array,  # [S, max_pages] int32
) -> jax.Array:  # [S, max_pages * page_size, Hkv, hd]
    seqs = pages[page_tables]  # [S, max_pages, page_size, Hkv, hd]
    return seqs.reshape(page_tables.shape[0], -1, *pages.shape[2:])


def _masked_attention(
    q: jax.Array,  # [R, Hkv, G, hd]
    k: jax.Array,  # [R or 1, L, Hkv, hd], 1: the keys are shared by all rows
    v: jax.Array,  # [R or 1, L, Hkv, hd]
    written: jax.Array,  # [R or 1, L] bool, slots holding real tokens (the others may hold garbage, even NaN)
    visible: jax.Array,  # [R, L] bool, a subset of `written`
    scale: float,
) -> jax.Array:  # [R, Hkv, G, hd] fp32
    """Softmax attention of each row over its visible keys; rows with none give zeros."""
    k = jnp.where(written[:, :, None, None], k, 0)
    v = jnp.where(written[:, :, None, None], v, 0)
    hi = jax.lax.Precision.HIGHEST  # an oracle: no TF32 for fp32 operands on GPUs
    s = jnp.einsum("rhgd,rlhd->rhgl", q, k, preferred_element_type=jnp.float32, precision=hi) * scale  # [R, Hkv, G, L]
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)  # [R, Hkv, G, 1]
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # [R, Hkv, G, L]; 0 where invisible
    denom = jnp.sum(p, axis=-1, keepdims=True)  # [R, Hkv, G, 1]
    o = jnp.einsum("rhgl,rlhd->rhgd", p, v.astype(jnp.float32), precision=hi)  # [R, Hkv, G, hd]
    return o / jnp.where(denom > 0, denom, 1.0)


def paged_decode_attention(
    q: jax.Array,  # [B, Hq, hd]
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    page_tables: jax.Array,  # [B, max_pages] int32
    context_lens: jax.Array,  # [B] int32, keys to attend (the new token's included); 0 for padded rows
    *,
    scale: float,
    gate: jax.Array | None = None,
    out_rows: int | None = None,
) -> jax.Array:  # [B, Hq, hd]; with gate, [out_rows, Hq * hd] (`decode_attention_output`)
    """One query token per sequence attends to the first `context_lens[b]` tokens of its pages. ``gate``: qg
    [>= B, Hq * 2 hd], whose gate half multiplies the output (`decode_attention_output`)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    k = _gather_sequences(k_pages, page_tables)  # [B, L, Hkv, hd]
    v = _gather_sequences(v_pages, page_tables)  # [B, L, Hkv, hd]
    visible = jnp.arange(k.shape[1])[None, :] < context_lens[:, None]  # [B, L]
    q = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [B, Hkv, G, hd]
    o = _masked_attention(q, k, v, visible, visible, scale)  # [B, Hkv, G, hd]
    o = o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
    return o if gate is None else decode_attention_output(o, gate, out_rows or batch)


def paged_prefill_attention(
    q: jax.Array,  # [T, Hq, hd], the new tokens of S sequences packed, then padding
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    page_tables: jax.Array,  # [S, max_pages] int32
    cu_q_lens: jax.Array,  # [S + 1] int32, sequence s owns q rows cu_q_lens[s]:cu_q_lens[s + 1]
    context_lens: jax.Array,  # [S] int32, cached prefix + new tokens (whose K/V are already written)
    *,
    scale: float,
) -> jax.Array:  # [T, Hq, hd]
    """Causal attention of packed ragged new tokens over their sequences' paged context.

    The new tokens of sequence s are the last `q_len` positions of its context, so row `cu_q_lens[s] + i`
    sits at position `context_lens[s] - q_len + i` and sees keys `0..position`. Prefill (no prefix) and
    extend / chunked prefill (a cached prefix) are the same call. Rows past `cu_q_lens[S]` output zeros.
    One pass per sequence over all rows keeps the memory at [T, Hq, max_pages * page_size] scores.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = page_tables.shape[0]
    num_kv_heads = k_pages.shape[2]
    q4 = q.reshape(num_tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [T, Hkv, G, hd]
    rows = jnp.arange(num_tokens)  # [T]
    key_pos = jnp.arange(page_tables.shape[1] * k_pages.shape[1])  # [L]

    def add_sequence(s, out):  # out: [T, Hkv, G, hd] fp32
        k = _gather_sequences(k_pages, page_tables[s][None])  # [1, L, Hkv, hd]
        v = _gather_sequences(v_pages, page_tables[s][None])  # [1, L, Hkv, hd]
        start, end = cu_q_lens[s], cu_q_lens[s + 1]
        owned = (rows >= start) & (rows < end)  # [T]
        pos = context_lens[s] - (end - start) + (rows - start)  # [T]
        written = key_pos[None, :] < context_lens[s]  # [1, L]
        visible = owned[:, None] & (key_pos[None, :] <= pos[:, None])  # [T, L]
        o = _masked_attention(q4, k, v, written, visible, scale)  # [T, Hkv, G, hd]
        return out + o  # rows outside the sequence see no key: their o is 0

    out = jax.lax.fori_loop(0, num_seqs, add_sequence, jnp.zeros(q4.shape, jnp.float32))
    return out.reshape(q.shape).astype(q.dtype)
