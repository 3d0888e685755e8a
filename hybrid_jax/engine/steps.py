"""The engine's two fixed-shape steps over the cache pools: packed chunked prefill, and batched decode.

Both are pure functions of (weights, pools, batch) that the engine jits once per shape bucket with the
pools donated, so every cache update is in place. Attention and the gated delta rule go through the
kernels' dispatch functions (Pallas on a GPU, the XLA reference elsewhere).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hybrid_jax.engine.sampler import Sampled, SamplingRows, sample
from hybrid_jax.layers.attention import GatedAttention
from hybrid_jax.layers.gdn import GatedDeltaNet
from hybrid_jax.layers.linear import add_projection, arrival_counters
from hybrid_jax.model import Qwen35ForCausalLM
from hybrid_jax.sharding import TP, expand_kv_heads
from pallas_kernels.gdn_chunk import gdn_chunk
from pallas_kernels.gdn_decode import gdn_decode, gdn_decode_fused
from pallas_kernels.gemv import padded_rows
from pallas_kernels.math.gdn import conv_ring_columns
from pallas_kernels.math.rope import rope_cos_sin
from pallas_kernels.paged_attention import (
    decode_attention_inputs,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

F32 = jnp.float32
REP = P()
HEADS3 = P(None, TP, None)  # [tokens, heads, dim]
HEADS2 = P(None, TP)  # [tokens, heads]
STATE = P(None, TP, None, None)  # [slots, Hv, dk, dv]
PAGES = P(None, None, TP, None)  # [pages, page_size, kv heads, hd]


class Kernels:
    """The kernels' dispatch functions, each run per shard inside shard_map when there is a mesh."""

    def __init__(self, model: Qwen35ForCausalLM, mesh: Mesh | None):
        self.mesh, self.config = mesh, model.config
        self.tp = 1 if mesh is None else mesh.shape[TP]
        wrap = self._wrap
        self.gdn_chunk = wrap(gdn_chunk, (HEADS3, HEADS3, HEADS3, HEADS2, HEADS2, REP, REP, STATE), (HEADS3, STATE))
        self.gdn_decode = wrap(gdn_decode, (HEADS3, HEADS3, HEADS3, HEADS2, HEADS2, REP, STATE), (HEADS3, STATE))
        self.write_kv = wrap(write_kv, (PAGES, PAGES, HEADS3, HEADS3, REP), (PAGES, PAGES))
        self.decode_attention = wrap(paged_decode_attention, (HEADS3, PAGES, PAGES, REP, REP), HEADS3)
        self.prefill_attention = wrap(paged_prefill_attention, (HEADS3, PAGES, PAGES, REP, REP, REP), HEADS3)

    def _wrap(self, fn, in_specs, out_specs):
        if self.mesh is None:
            return fn

        def call(*args, **kw):
            per_shard = lambda *a: fn(*a, **kw)
            return jax.shard_map(per_shard, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False)(*args)
        return call

    def kv_heads(self, x):
        """[T, Hkv, hd] -> the KV heads the pool stores (one per shard when Hkv < tp)."""
        return x if self.mesh is None else expand_kv_heads(x, self.config, self.tp)


class PrefillBatch(NamedTuple):
    """T packed new tokens of up to S sequences (chunks of their prompts); padding at the end."""

    tokens: jax.Array  # [T] i32
    positions: jax.Array  # [T] i32 position of each token in its sequence
    seq_index: jax.Array  # [T] i32 which of the S sequences the token belongs to (padding: 0)
    valid: jax.Array  # [T] bool real token (not padding)
    cu_seqlens: jax.Array  # [S + 1] i32 token offsets; unused sequences have 0 tokens
    slot_ids: jax.Array  # [S] i32 state slot (unused: 0)
    page_tables: jax.Array  # [S, max_pages] i32
    context_lens: jax.Array  # [S] i32 tokens in the cache after this chunk
    is_first: jax.Array  # [S] bool this chunk starts the sequence: its slot is reset
    is_last: jax.Array  # [S] bool the prompt ends in this chunk: the sample is the first output token
    rows: SamplingRows  # [S] settings; a sequence whose prompt ends in this chunk samples its first token
    want_top: jax.Array  # [] bool some row wants top logprobs


class DecodeBatch(NamedTuple):
    """One new token for each of B rows (padding rows: slot 0, page 0, context 0)."""

    tokens: jax.Array  # [B] i32
    positions: jax.Array  # [B] i32
    slot_ids: jax.Array  # [B] i32
    page_tables: jax.Array  # [B, max_pages] i32
    rows: SamplingRows  # [B]
    want_top: jax.Array  # [] bool


def _slot_mapping(page_tables, seq_rows, positions, valid, page_size: int):
    """Flat KV slot (page * page_size + offset) of each token; padding writes slot 0 of the null page."""
    pages = jnp.take_along_axis(page_tables[seq_rows], (positions // page_size)[:, None], axis=1)[:, 0]
    return jnp.where(valid, pages * page_size + positions % page_size, 0)


def _packed_conv(gdn: GatedDeltaNet, mixed, conv_prev, batch: PrefillBatch):
    """Causal conv over packed sequences, each continuing from its cached columns.

    mixed [T, C] raw projections; conv_prev [S, K-1, C]. Returns conv output [T, C] fp32 and the new
    conv state [S, K-1, C] (the last K-1 raw columns of each sequence, cache first).
    """
    kernel = gdn.kernel
    num_seqs = conv_prev.shape[0]
    cached = conv_prev.reshape(num_seqs * (kernel - 1), -1).astype(mixed.dtype)
    ext = jnp.concatenate([cached, mixed], axis=0)  # [S (K-1) + T, C]
    starts = batch.cu_seqlens[:-1]  # [S]

    def source(seq, offset):  # row of ext holding time ``offset`` (may be negative) of sequence ``seq``
        from_cache = seq * (kernel - 1) + (kernel - 1) + offset
        from_new = num_seqs * (kernel - 1) + starts[seq] + offset
        return jnp.where(offset >= 0, from_new, from_cache)

    t = jnp.arange(mixed.shape[0])
    seq = batch.seq_index
    offset = t - starts[seq]
    w = gdn.conv1d.weight[...].astype(F32)  # [K, C]
    conv = sum(ext[source(seq, offset - (kernel - 1) + j)].astype(F32) * w[j] for j in range(kernel))
    lengths = batch.cu_seqlens[1:] - starts  # [S]
    seqs = jnp.arange(num_seqs)[:, None]
    tail = lengths[:, None] - (kernel - 1) + jnp.arange(kernel - 1)[None, :]  # [S, K-1]
    new_conv = ext[source(seqs, tail)]
    return conv, new_conv


def _reset_rows(pool, slot_ids, reset):
    """Zero the pool rows of slots whose request starts now. pool [slots, ...]; reset [S] bool."""
    rows = pool[slot_ids]
    mask = reset.reshape(reset.shape + (1,) * (rows.ndim - 1))
    return pool.at[slot_ids].set(jnp.where(mask, jnp.zeros_like(rows), rows))


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    """a [N, ...] -> [rows, ...] with zero rows after the N."""
    return a if a.shape[0] == rows else jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _decoder_layers(model: Qwen35ForCausalLM, pools: dict, x, positions, full_attention, linear_attention, *,
                    defer_norms: bool = False):
    """The layer loop both steps share. x [N, D] fp32 residual stream of N tokens, positions [N].

    The stream runs padded with zero rows to the rows the few-row kernel multiplies (`padded_rows`), so the
    projections that read it pad nothing and the decode kernels take their outputs as they come (they read
    the N real rows and hand back outputs padded to the rows, zeros past N). ``full_attention(attn, h, pool,
    positions, dtype)`` and ``linear_attention(gdn, h, pool, dtype)`` run a mixer from the padded normed
    stream h [rows, D] (positions padded too) over its layer's pool -> (its output projection's input
    [N or rows, ...], that projection, new pool). The output and down projections are added to the stream by
    `add_projection` (one launch each on the few-row kernel: no separate sum-and-add; the padding rows come
    out zero there). ``defer_norms``: those launches also write the norm that follows (the last layer's final
    norm aside) as `NormedRows`, whose division the projections that read it finish on their outputs, so
    the mixers must only project h.
    Returns the final residual stream [N, D] and the new per-layer pools.
    """
    n = x.shape[0]
    rows = padded_rows(n)
    x = _pad_rows(x, rows)  # [rows, D]
    padded_positions = _pad_rows(positions, rows)  # [rows]
    arrivals = arrival_counters(x.shape[-1])
    normed = None  # the next norm of the stream from the last add, as NormedRows (None: apply the norm)
    norms = [norm for layer in model.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    next_norms = iter([*norms[1:], None] if defer_norms else [None] * len(norms))
    new_layers = []
    for layer, pool in zip(model.layers, pools["layers"], strict=True):
        dtype = layer.mlp.down_proj.kernel.dtype
        h = layer.input_layernorm(x, dtype) if normed is None else normed  # [rows, D]
        if layer.is_attention:
            y, out_proj, pool = full_attention(layer.self_attn, h, pool, padded_positions, dtype)
        else:
            y, out_proj, pool = linear_attention(layer.linear_attn, h, pool, dtype)
        new_layers.append(pool)
        x, normed, arrivals = add_projection(x, _pad_rows(y, rows), out_proj, arrivals, next_norm=next(next_norms),
                                             real_rows=n)
        h = layer.post_attention_layernorm(x, dtype) if normed is None else normed
        x, normed, arrivals = add_projection(x, layer.mlp.hidden(h), layer.mlp.down_proj, arrivals,
                                             next_norm=next(next_norms), real_rows=n)
    return x[:n], new_layers


def _paged_attention(attn: GatedAttention, h, pool, positions, dtype, *, n: int, slot_mapping, kernels: Kernels,
                     attend):
    """Attention over the KV pages from the padded normed stream h [rows, D]: the layer's projections, norms
    and RoPE, the N new tokens' K/V written, then ``attend(q, k_pages, v_pages, scale) -> o [N, Hq, hd]``.
    Returns (the output projection's input [N, Hq hd], the projection, new pool)."""
    q, k, v, gate = (t[:n] for t in attn.project(h, positions))  # [N, H, hd]
    k, v = (kernels.kv_heads(t.astype(pool["k"].dtype)) for t in (k, v))
    k_pages, v_pages = kernels.write_kv(pool["k"], pool["v"], k, v, slot_mapping)
    y = attn.gated(attend(q.astype(k_pages.dtype), k_pages, v_pages, attn.scale).astype(dtype), gate)
    return y, attn.o_proj, {"k": k_pages, "v": v_pages}


def prefill_step(model: Qwen35ForCausalLM, pools: dict, batch: PrefillBatch, *, kernels: Kernels, page_size: int,
                 valid_vocab: int) -> tuple[Sampled, dict]:
    """Run one packed prefill chunk; returns a sample for every sequence's last token, and the new pools."""
    seq = batch.seq_index
    slot_mapping = _slot_mapping(batch.page_tables, seq, batch.positions, batch.valid, page_size)

    def attend(q, k_pages, v_pages, scale):
        return kernels.prefill_attention(q, k_pages, v_pages, batch.page_tables, batch.cu_seqlens,
                                         batch.context_lens, scale=scale)

    full_attention = functools.partial(_paged_attention, n=batch.tokens.shape[0], slot_mapping=slot_mapping,
                                       kernels=kernels, attend=attend)

    new_tokens = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]  # [S]
    seqs = jnp.arange(new_tokens.shape[0])[:, None]  # [S, 1]

    def linear_attention(gdn: GatedDeltaNet, h, pool, dtype):
        conv_pool = _reset_rows(pool["conv"], batch.slot_ids, batch.is_first)
        state_pool = _reset_rows(pool["state"], batch.slot_ids, batch.is_first)
        n = batch.tokens.shape[0]
        mixed, z, b, a = (t[:n] for t in gdn.in_projections(h))
        ring = conv_pool[batch.slot_ids]  # [S, K, C]
        before = conv_ring_columns(batch.context_lens - new_tokens, gdn.kernel)  # [S, K-1]: the cached columns
        conv_out, new_conv = _packed_conv(gdn, mixed, jnp.take_along_axis(ring, before[..., None], axis=1), batch)
        q, k, v = (t.astype(dtype) for t in gdn.heads(conv_out))  # the kernel's fast path takes bf16
        g, beta = gdn.gates(b, a)
        o, state_pool = kernels.gdn_chunk(q, k, v, g, beta, batch.cu_seqlens, batch.slot_ids, state_pool)
        after = conv_ring_columns(batch.context_lens, gdn.kernel)  # [S, K-1]: where the last K-1 columns go
        new_ring = ring.at[seqs, after].set(new_conv.astype(ring.dtype))
        conv_pool = conv_pool.at[batch.slot_ids].set(jnp.where((new_tokens > 0)[:, None, None], new_ring, ring))
        return gdn.gated(o, z), gdn.out_proj, {"conv": conv_pool, "state": state_pool}

    x = model.embed_tokens(batch.tokens).astype(F32)  # [T, D]
    x, new_layers = _decoder_layers(model, pools, x, batch.positions, full_attention, linear_attention)
    last = jnp.maximum(batch.cu_seqlens[1:] - 1, 0)  # [S]
    logits, _ = model.logits(model.norm(x[last], model.dtype))  # [S, V]

    counts = _reset_rows(pools["output_counts"], batch.slot_ids, batch.is_first)
    prompt_mask = _reset_rows(pools["prompt_mask"], batch.slot_ids, batch.is_first)
    token_slots = jnp.where(batch.valid, batch.slot_ids[seq], 0)
    prompt_mask = prompt_mask.at[token_slots, batch.tokens].set(True)
    sampled = sample(logits, batch.rows, counts[batch.slot_ids], prompt_mask[batch.slot_ids], batch.want_top,
                     valid_vocab)
    counts = counts.at[batch.slot_ids, sampled.tokens].add(batch.is_last.astype(jnp.int32))
    return sampled, {"layers": new_layers, "output_counts": counts, "prompt_mask": prompt_mask}


def decode_step(model: Qwen35ForCausalLM, pools: dict, batch: DecodeBatch, *, kernels: Kernels, page_size: int,
                valid_vocab: int, greedy_only: bool = False) -> tuple[Sampled, dict]:
    """One token for each row; returns the samples and the new pools. ``greedy_only``: see `sample`."""
    real = batch.slot_ids > 0
    rows = jnp.arange(batch.tokens.shape[0])
    slot_mapping = _slot_mapping(batch.page_tables, rows, batch.positions, real, page_size)
    context_lens = jnp.where(real, batch.positions + 1, 0)

    def attend(q, k_pages, v_pages, scale):
        return kernels.decode_attention(q, k_pages, v_pages, batch.page_tables, context_lens, scale=scale)

    def full_attention(attn: GatedAttention, h, pool, positions, dtype):
        if kernels.mesh is not None:  # KV heads may be replicated across shards (`kv_heads`): unfused
            return _paged_attention(attn, h, pool, positions, dtype, n=batch.tokens.shape[0],
                                    slot_mapping=slot_mapping, kernels=kernels, attend=attend)
        # After the projections: one launch for the q/k norms, RoPE and the K/V write, then the attention and
        # one more for its split combine and the gate, written as the output projection's padded rows.
        qg, k, v = attn.projections(h)  # [rows, Hq * 2 hd], [rows, Hkv * hd] x 2
        cos, sin = rope_cos_sin(positions, attn.rotary_dim, attn.rope_theta, dtype)  # [rows, r]
        q, k_pages, v_pages = decode_attention_inputs(
            qg, k, v, cos, sin, attn.q_norm.weight[...], attn.k_norm.weight[...], slot_mapping, pool["k"],
            pool["v"], num_q_heads=attn.num_heads, eps=attn.q_norm.eps)  # q [B, Hq, hd]; both norms' eps: the config's
        o = paged_decode_attention(q, k_pages, v_pages, batch.page_tables, context_lens, scale=attn.scale,
                                   gate=qg, out_rows=qg.shape[0])  # [rows, Hq * hd], zeros past B
        return o, attn.o_proj, {"k": k_pages, "v": v_pages}

    def linear_attention(gdn: GatedDeltaNet, h, pool, dtype):
        n = batch.tokens.shape[0]
        mixed, z, b, a = gdn.in_projections(h)  # padded: [rows, C], [rows, Hv, dv], [rows, Hv], [rows, Hv]
        if kernels.mesh is None:  # one kernel: conv over the ring, norms, gates, state update (reads the B rows)
            o, conv_pool, state_pool = gdn_decode_fused(  # o [rows, Hv, dv], zero past the B: no pad before out_proj
                mixed, a, b, gdn.conv1d.weight[...], gdn.A_log[...], gdn.dt_bias[...], batch.slot_ids,
                batch.positions, pool["conv"], pool["state"], num_k_heads=gdn.num_k_heads, head_k_dim=gdn.k_dim,
                head_v_dim=gdn.v_dim, out_rows=mixed.shape[0])
        else:  # conv channels are split across shards by position, not by head: unfused
            mixed, z, b, a = mixed[:n], z[:n], b[:n], a[:n]
            conv_pool = pool["conv"]  # [slots, K, C] ring
            before = conv_ring_columns(batch.positions, gdn.kernel)[..., None]  # [B, K-1, 1]
            cached = jnp.take_along_axis(conv_pool[batch.slot_ids], before, axis=1)  # [B, K-1, C]
            window = jnp.concatenate([cached.astype(F32), mixed[:, None]], axis=1)  # the new column unrounded
            q, k, v = gdn.heads(_window_conv(window, gdn.conv1d.weight[...]))
            g, beta = gdn.gates(b, a)
            o, state_pool = kernels.gdn_decode(q, k, v, g, beta, batch.slot_ids, pool["state"])
            conv_pool = conv_pool.at[batch.slot_ids, batch.positions % gdn.kernel].set(mixed.astype(conv_pool.dtype))
        return gdn.gated(o, z), gdn.out_proj, {"conv": conv_pool, "state": state_pool}

    x = model.embed_tokens(batch.tokens).astype(F32)  # [B, D]
    x, new_layers = _decoder_layers(model, pools, x, batch.positions, full_attention, linear_attention,
                                    defer_norms=kernels.mesh is None)
    logits, _ = model.logits(model.norm(x, model.dtype))  # [B, V]
    counts = pools["output_counts"]
    sampled = sample(logits, batch.rows, counts[batch.slot_ids], pools["prompt_mask"][batch.slot_ids],
                     batch.want_top, valid_vocab, greedy_only=greedy_only)
    counts = counts.at[batch.slot_ids, sampled.tokens].add(1)
    return sampled, {"layers": new_layers, "output_counts": counts, "prompt_mask": pools["prompt_mask"]}


def multi_decode_step(model: Qwen35ForCausalLM, pools: dict, batch: DecodeBatch, *, num_steps: int,
                      **kw) -> tuple[Sampled, dict]:
    """``num_steps`` decode steps in one call, each feeding its samples to the next (no host round trip).

    Returns samples with a leading [num_steps] axis. Rows that finish early (eos, max_tokens) keep running
    on garbage that the engine discards; positions past their pages map to the null page.
    """
    def body(carry, _):
        pools, tokens, positions, step = carry
        sub = batch._replace(tokens=tokens, positions=positions, rows=batch.rows._replace(step=step))
        sampled, pools = decode_step(model, pools, sub, **kw)
        return (pools, sampled.tokens, positions + 1, step + 1), sampled

    carry = (pools, batch.tokens, batch.positions, batch.rows.step)
    (pools, *_), sampled = jax.lax.scan(body, carry, None, length=num_steps)
    return sampled, pools


def _window_conv(window, weight):
    """window [B, K, C] (oldest first), weight [K, C] -> [B, C] fp32."""
    return jnp.einsum("bkc,kc->bc", window.astype(F32), weight.astype(F32))
