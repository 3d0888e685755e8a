"""Pallas kernels for attention over the paged KV cache: decode, prefill/extend, and the K/V write; and the
decode step's two launches around them: `decode_attention_inputs` (q/k norms, RoPE and the K/V write from
the raw projections) and the split combine with the output gate (`paged_decode_attention(gate=...)`).

Same signatures and semantics as `reference.py` (plus tuning keywords). Written for Pallas' Triton
lowering (the `pallas_call` GPU default in jax 0.11/0.12) and runnable with `interpret=True` on CPU.

Why the Triton lowering:
- The paged layout needs a gather: each key of a block lives at its own slot
  `page_tables[seq, pos // page_size] * page_size + pos % page_size`. Under Triton a ref indexed by an
  int32 array is a tensor of pointers, so a block of `block_kv` keys is one load whatever the page size.
  Mosaic GPU moves rectangular tiles with TMA: one copy per page and a hand-built multi-stage pipeline.
- Decode is bandwidth bound (each K/V byte is used by only `G = Hq / Hkv` query rows): what matters is
  reading K/V once per KV head and having enough programs in flight (KV splits), not wgmma throughput.
- The scheme is the one vLLM's Triton "unified attention" runs on Hopper, and it runs in interpret mode.
Mosaic GPU would change: per-page TMA copies `k_pages[page, :, h, :]` into an SMEM ring with barriers
(TMA gathers of rows only come with Blackwell), wgmma with M = 64 per warpgroup (decode would pad its
`G` rows to 64 or swap operands so the keys form M), page table and lengths read from SMEM.

Tiles: `tiles.py` (decode: block_kv 64, 2 stages, 4 warps, enough KV splits to fill the GPU). On the H200
decode reads K/V at ~4.2-4.3 TB/s of device time, split combine included.

Shared scheme of the attention kernels:
- One program handles the query rows of ONE KV head: rows are (token, q head) pairs of that head's group,
  so K/V are loaded once for the whole GQA group and never repeated in memory.
- Online softmax in fp32 over blocks of `block_kv` keys; the K/V rows of a block are gathered per token
  through the page table (any page size). Blocks past the context are never visited; only the blocks that
  cross a row's limit are masked, and there V is zeroed past the context (garbage there may be NaN).
- Page tables, lengths and cu_q_lens are plain int32 inputs read with scalar/vector loads (Triton has no
  scalar prefetch). All block shapes are powers of two, dots have M, N, K >= 16 (Triton's `tl.dot`).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import next_pow2
from pallas_kernels.paged_attention.reference import decode_attention_output
from pallas_kernels.paged_attention.tiles import DECODE, PREFILL
from pallas_kernels.tiles import programs

F32 = jnp.float32

_MIN_DOT_DIM = 16  # tl.dot needs M, N, K >= 16


def _div(x: jax.Array, d: int) -> jax.Array:
    """x // d for non-negative int32 x (lax.div truncates; jnp's floor division costs extra ops)."""
    return lax.div(x, jnp.int32(d))


def _cdiv(x: jax.Array, d: int) -> jax.Array:
    return _div(x + (d - 1), d)


def _check_block(name: str, n: int) -> None:
    if n < _MIN_DOT_DIM or n & (n - 1):
        raise ValueError(f"{name} must be a power of two >= {_MIN_DOT_DIM}, got {n}")


def _load_kv_block(
    k_ref,  # [P * page_size, Hkv, hd]
    v_ref,  # [P * page_size, Hkv, hd]
    pt_ref,  # [S, max_pages] int32
    seq: jax.Array,  # scalar int32, page table row
    kv_head: jax.Array,  # scalar int32
    block: jax.Array,  # scalar int32, KV block index
    block_kv: int,
    page_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # keys [N], k [N, hd], v [N, hd]
    """Gathers the K/V rows of key positions block*N .. block*N+N-1 through the page table."""
    head_dim = k_ref.shape[-1]
    keys = block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # [N]
    page_idx = jnp.minimum(_div(keys, page_size), pt_ref.shape[1] - 1)  # [N]; past the table: masked anyway
    page = pt_ref[seq, page_idx]  # [N]
    slot = page * page_size + lax.rem(keys, jnp.int32(page_size))  # [N]
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]  # [1, hd]
    k = k_ref[slot[:, None], kv_head, cols]  # [N, hd]
    v = v_ref[slot[:, None], kv_head, cols]  # [N, hd]
    return keys, k, v


def _store_rows(o_view, o: jax.Array, row_mask: jax.Array) -> None:
    """Stores rows o [M, hd] where row_mask [M]; the masked rows' indices must point past the end.

    The GPU never touches masked lanes. The interpreter reads, selects and scatters back every row, and
    drops out-of-bounds updates: a masked row aliasing a real one would race with it, one past the end can't.
    """
    plgpu.store(o_view, o.astype(o_view.dtype), mask=jnp.broadcast_to(row_mask[:, None], o.shape))


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """a [M, K] . b (K on axis contract_b) -> [M, N] fp32; fp32 operands in full fp32 (Triton's DEFAULT is TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (contract_b,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],  # m [M], l [M], acc [M, hd], all fp32
    q: jax.Array,  # [M, hd]
    k: jax.Array,  # [N, hd]
    v: jax.Array,  # [N, hd]
    visible: jax.Array | None,  # [M, N] bool; None: the whole block is visible to every row
    scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One online-softmax update with a block of keys."""
    m, l, acc = carry
    s = _dot(q, k, contract_b=1) * scale  # [M, N]
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [M]
    # Masked: a row may have seen no key yet (m_new = -inf); keep exp() away from -inf - -inf.
    m_new_safe = m_new if visible is None else jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_new_safe)  # [M]
    p = jnp.exp(s - m_new_safe[:, None])  # [M, N]
    l = l * alpha + jnp.sum(p, axis=1)
    return m_new, l, acc * alpha[:, None] + _dot(p.astype(v.dtype), v, contract_b=0)


def _combine_splits(o_part: jax.Array, lse: jax.Array, axis: int) -> jax.Array:
    """The log-sum-exp weighted sum over ``axis`` of KV splits' normalised outputs o_part [..., hd] with their
    lse [...] (fp32; -inf: the split saw no key, and weighs 0). Returns fp32, the split axis gone."""
    m = jnp.max(lse, axis=axis, keepdims=True)
    w = jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0))  # empty splits weigh 0
    denom = jnp.sum(w, axis=axis)
    return jnp.sum(w[..., None] * o_part, axis=axis) / jnp.where(denom > 0, denom, 1.0)[..., None]


def _attend(q, load_block, row_pos, first_pos, context_len, lo, hi, *, scale: float, block_kv: int):
    """Online softmax of q rows [M, hd] over KV blocks lo..hi-1; row i sees key positions <= row_pos[i] [M].

    load_block(j) -> keys [N], k [N, hd], v [N, hd]. first_pos (scalar) = min(row_pos): blocks wholly at or
    before it need no mask. context_len: keys at or past it may be garbage. Returns m [M], l [M], acc [M, hd]
    (fp32, acc not normalised).
    """
    rows, head_dim = q.shape
    carry = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    unmasked_hi = jnp.clip(_div(jnp.maximum(first_pos + 1, 0), block_kv), lo, hi)

    def full_block(j, carry):
        _, k, v = load_block(j)
        return _softmax_step(carry, q, k, v, None, scale)

    def edge_block(j, carry):
        keys, k, v = load_block(j)
        v = jnp.where((keys < context_len)[:, None], v, jnp.zeros_like(v))
        visible = keys[None, :] <= row_pos[:, None]  # [M, N]
        return _softmax_step(carry, q, k, v, visible, scale)

    carry = lax.fori_loop(lo, unmasked_hi, full_block, carry)
    return lax.fori_loop(unmasked_hi, hi, edge_block, carry)


def _decode_kernel(
    lens_ref,
    pt_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    scale: float,
    group: int,
    rows: int,
    block_kv: int,
    page_size: int,
    num_splits: int,
):
    """Program (b, kv head h, split): the `group` q heads of h for sequence b, over one share of its blocks."""
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    context_len = jnp.minimum(lens_ref[b], pt_ref.shape[1] * page_size)
    r = jnp.arange(rows, dtype=jnp.int32)  # [R]
    heads = h * group + jnp.minimum(r, group - 1)  # [R]; pad rows repeat the group's last head
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]  # [1, hd]
    q = q_ref[b, heads[:, None], cols]  # [R, hd]

    num_blocks = _cdiv(context_len, block_kv)
    per_split = _cdiv(num_blocks, num_splits)
    lo = split * per_split
    hi = jnp.maximum(jnp.minimum(lo + per_split, num_blocks), lo)
    row_pos = jnp.full((rows,), context_len - 1, jnp.int32)  # [R]
    load_block = functools.partial(_load_kv_block, k_ref, v_ref, pt_ref, b, h, block_kv=block_kv, page_size=page_size)
    m, l, acc = _attend(q, load_block, row_pos, context_len - 1, context_len, lo, hi, scale=scale, block_kv=block_kv)
    o = acc / jnp.where(l > 0, l, 1.0)[:, None]  # [R, hd]; no key (empty row or split): 0
    if num_splits == 1:
        (o_ref,) = out_refs  # [B, Hq, hd]
        in_group = r < group  # [R]
        out_heads = jnp.where(in_group, heads, o_ref.shape[1])  # [R]; pad rows: past the end (see _store_rows)
        _store_rows(o_ref.at[b, out_heads[:, None], cols], o, in_group)
    else:
        o_part_ref, lse_ref = out_refs  # blocks [R, hd], [R]
        o_part_ref[...] = o
        lse_ref[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "out_rows", "block_kv", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def paged_decode_attention(
    q: jax.Array,  # [B, Hq, hd]
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    page_tables: jax.Array,  # [B, max_pages] int32
    context_lens: jax.Array,  # [B] int32
    *,
    scale: float,
    gate: jax.Array | None = None,  # [>= B, Hq * 2 hd]: qg, per head query then gate
    out_rows: int | None = None,
    block_kv: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, Hq, hd]; with gate, [out_rows, Hq * hd]
    """Decode attention (one query token per sequence), split-KV ("flash decoding") when B * Hkv is small.

    block_kv: keys per block (power of two >= 16, independent of the page size).
    num_splits: KV shares per (sequence, KV head), combined by a log-sum-exp weighted sum; None picks
    enough to fill the GPU for this batch and cache capacity. Tiles left None: `tiles.DECODE`'s.
    gate: the output is `reference.decode_attention_output`'s (gated, flattened, zero rows to out_rows),
    with the split combine and the gate in one launch (`_combine_gate_kernel`; with one split, XLA gates).
    The gate's dtype must be q's (the reference rounds o to q's dtype, then to the gate's).
    """
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    tiles = DECODE.get((num_q_heads, num_kv_heads, head_dim), block_kv=block_kv, num_warps=num_warps,
                       num_stages=num_stages)
    block_kv = tiles.block_kv
    _check_block("block_kv", block_kv)
    group = num_q_heads // num_kv_heads
    rows = max(_MIN_DOT_DIM, next_pow2(group))
    if num_splits is None:
        max_blocks = -(-page_tables.shape[1] * page_size // block_kv)
        want = -(-programs(tiles.waves) // (batch * num_kv_heads))
        num_splits = max(1, min(next_pow2(want), max_blocks))
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    kernel = functools.partial(
        _decode_kernel,
        scale=scale,
        group=group,
        rows=rows,
        block_kv=block_kv,
        page_size=page_size,
        num_splits=num_splits,
    )
    grid = (batch, num_kv_heads, num_splits)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = pl.no_block_spec
    else:
        part = (batch, num_kv_heads, num_splits, rows)
        out_shape = (jax.ShapeDtypeStruct((*part, head_dim), jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32))
        out_specs = (
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        )
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[pl.no_block_spec] * 5,
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name="paged_decode_attention",
    )(context_lens.astype(jnp.int32), page_tables.astype(jnp.int32), q, k_pages.reshape(flat), v_pages.reshape(flat))
    if num_splits == 1:
        return out if gate is None else decode_attention_output(out, gate, out_rows or batch)
    o_part, lse = out  # [B, Hkv, splits, R, hd], [B, Hkv, splits, R]
    if gate is not None:
        out_rows = out_rows or batch
        return pl.pallas_call(
            functools.partial(_combine_gate_kernel, group=group, batch=batch),
            out_shape=jax.ShapeDtypeStruct((out_rows, num_q_heads * head_dim), gate.dtype),
            grid=(out_rows, num_q_heads),
            in_specs=[pl.no_block_spec] * 3,
            out_specs=pl.no_block_spec,
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
            name="decode_attention_combine_gate",
        )(lse, o_part, gate)
    o = _combine_splits(o_part, lse, axis=2)  # [B, Hkv, R, hd]
    return o[:, :, :group].reshape(q.shape).astype(q.dtype)


def _combine_gate_kernel(lse_ref, o_part_ref, gate_ref, out_ref, *, group: int, batch: int):
    """Program (row b, q head j): the log-sum-exp combine of head j's splits, times sigmoid of its gate,
    rounded as `reference.decode_attention_output`; rows past the batch are zeros."""
    b, j = pl.program_id(0), pl.program_id(1)
    head_dim = o_part_ref.shape[-1]
    cols = jnp.arange(head_dim, dtype=jnp.int32)  # [hd]
    out_cols = j * head_dim + cols

    @pl.when(b < batch)
    def _():
        h, r = j // group, lax.rem(j, group)
        num_splits = o_part_ref.shape[2]
        lanes = jnp.arange(next_pow2(num_splits), dtype=jnp.int32)  # [S'] (Triton's shapes are powers of two)
        real = lanes < num_splits
        splits = jnp.minimum(lanes, num_splits - 1)  # lanes past the splits re-read the last one, then drop it
        lse = jnp.where(real, lse_ref[b, h, splits, r], -jnp.inf)  # [S']
        o_part = jnp.where(real[:, None], o_part_ref[b, h, splits[:, None], r, cols[None, :]], 0.0)  # [S', hd]
        m = jnp.max(lse)
        w = jnp.exp(lse - jnp.where(m > -jnp.inf, m, 0.0))  # [S']; empty splits weigh 0
        denom = jnp.sum(w)
        o = jnp.sum(w[:, None] * o_part, axis=0) / jnp.where(denom > 0, denom, 1.0)  # [hd]
        dtype = out_ref.dtype  # `attention_gate`'s roundings as casts, which Triton keeps
        g = gate_ref[b, j * 2 * head_dim + head_dim + cols].astype(F32)
        y = o.astype(dtype).astype(F32) * jax.nn.sigmoid(g).astype(dtype).astype(F32)
        out_ref[b, out_cols] = y.astype(dtype)

    @pl.when(b >= batch)
    def _():
        out_ref[b, out_cols] = jnp.zeros((head_dim,), out_ref.dtype)


def _inputs_kernel(slot_ref, qg_ref, k_ref, v_ref, cos_ref, sin_ref, q_norm_ref, k_norm_ref, k_in_ref, v_in_ref,
                   q_ref, k_pages_ref, v_pages_ref, *, num_q_heads: int, eps: float):
    """Program (row b, head j): j < Hq normalises and rotates query head j into q; the others normalise and
    rotate KV head j - Hq's key and write it and the value to row b's slot (pools aliased in and out).

    Rounded as `reference.decode_attention_inputs`: the norm to qg's dtype, then each RoPE product and the
    sum. The rotation pairs dims (i, i + r/2): each lane loads its own element and its partner's."""
    del k_in_ref, v_in_ref  # the same buffers as k_pages_ref / v_pages_ref
    b, j = pl.program_id(0), pl.program_id(1)
    head_dim = q_ref.shape[-1]
    rotary = cos_ref.shape[1]
    half = rotary // 2
    dtype = qg_ref.dtype
    cols = jnp.arange(head_dim, dtype=jnp.int32)  # [hd]
    partner = jnp.where(cols < half, cols + half, jnp.where(cols < rotary, cols - half, cols))
    sign = jnp.where(cols < half, -1.0, 1.0)
    rope_cols = jnp.minimum(cols, rotary - 1)
    cos = cos_ref[b, rope_cols].astype(F32)  # [hd]; past r unused
    sin = sin_ref[b, rope_cols].astype(F32)

    def rounded(x):
        return x.astype(dtype).astype(F32)

    def norm_rope(src_ref, start, w_ref):  # -> [hd] in dtype: the head at src_ref[b, start:start + hd]
        x = src_ref[b, start + cols].astype(F32)
        x_partner = src_ref[b, start + partner].astype(F32)
        inv = lax.rsqrt(jnp.mean(x * x) + eps)
        n = rounded(x * inv * (1.0 + w_ref[cols].astype(F32)))
        n_partner = rounded(x_partner * inv * (1.0 + w_ref[partner].astype(F32)))
        roped = rounded(n * cos) + rounded(sign * n_partner * sin)
        return jnp.where(cols < rotary, roped, n).astype(dtype)

    @pl.when(j < num_q_heads)
    def _():
        q_ref[b, j, cols] = norm_rope(qg_ref, j * 2 * head_dim, q_norm_ref).astype(q_ref.dtype)

    @pl.when(j >= num_q_heads)
    def _():
        h = j - num_q_heads
        slot = slot_ref[b]
        k_pages_ref[slot, h, cols] = norm_rope(k_ref, h * head_dim, k_norm_ref).astype(k_pages_ref.dtype)
        v_pages_ref[slot, h, cols] = v_ref[b, h * head_dim + cols].astype(v_pages_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_q_heads", "eps", "num_warps", "interpret"))
def decode_attention_inputs(
    qg: jax.Array,  # [>= B, Hq * 2 hd]
    k: jax.Array,  # [>= B, Hkv * hd]
    v: jax.Array,  # [>= B, Hkv * hd]
    cos: jax.Array,  # [>= B, r]
    sin: jax.Array,  # [>= B, r]
    q_norm: jax.Array,  # [hd]
    k_norm: jax.Array,  # [hd]
    slot_mapping: jax.Array,  # [B] int32
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    *,
    num_q_heads: int,
    eps: float,
    num_warps: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [B, Hq, hd] in the pages' dtype, k_pages, v_pages
    """`reference.decode_attention_inputs` in one launch (q/k norms, RoPE, the K/V write); in place on the
    pools when the caller donates them. Grid (B, Hq + Hkv)."""
    batch = slot_mapping.shape[0]
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    pool = jax.ShapeDtypeStruct(flat, k_pages.dtype)
    q, k_out, v_out = pl.pallas_call(
        functools.partial(_inputs_kernel, num_q_heads=num_q_heads, eps=eps),
        out_shape=(jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), k_pages.dtype), pool, pool),
        grid=(batch, num_q_heads + num_kv_heads),
        in_specs=[pl.no_block_spec] * 10,
        out_specs=(pl.no_block_spec,) * 3,
        input_output_aliases={8: 1, 9: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="decode_attention_inputs",
    )(slot_mapping.astype(jnp.int32), qg, k, v, cos, sin, q_norm, k_norm, k_pages.reshape(flat),
      v_pages.reshape(flat))
    return q, k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)


def _prefill_kernel(
    cu_ref,
    lens_ref,
    pt_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    scale: float,
    group: int,
    block_q: int,
    block_kv: int,
    page_size: int,
    num_splits: int,
):
    """Program (tile, kv head h, split): block_q (token, q head) pairs of one sequence, heads of h's group,
    over one share of the KV blocks those rows see.

    Sequence s owns tiles first_tile(s) = cu_q_lens[s] * group // block_q + s onwards (enough for its
    q_len * group pairs; the gaps left are idle tiles). s == S stands for the padding rows after
    cu_q_lens[S]: context 0, so they get zeros. Tiles run last-first: long-context tiles start early.
    """
    num_tiles, h, split = pl.num_programs(0), pl.program_id(1), pl.program_id(2)
    tile = num_tiles - 1 - pl.program_id(0)
    num_tokens, _, head_dim = q_ref.shape
    num_seqs = lens_ref.shape[0]

    def first_tile(s):
        return _div(cu_ref[s] * group, block_q) + s

    lo, hi = jnp.int32(0), jnp.int32(num_seqs + 1)  # largest s in [0, S] with first_tile(s) <= tile
    for _ in range(num_seqs.bit_length()):
        mid = _div(lo + hi, 2)
        go_right = first_tile(mid) <= tile
        lo, hi = jnp.where(go_right, mid, lo), jnp.where(go_right, hi, mid)
    s = lo
    is_seq = s < num_seqs
    q_start = cu_ref[s]
    q_end = jnp.where(is_seq, cu_ref[jnp.minimum(s + 1, num_seqs)], num_tokens)
    seq = jnp.minimum(s, num_seqs - 1)
    context_len = jnp.where(is_seq, jnp.minimum(lens_ref[seq], pt_ref.shape[1] * page_size), 0)
    q_len = q_end - q_start
    num_pairs = q_len * group
    pair0 = (tile - first_tile(s)) * block_q

    @pl.when(pair0 < num_pairs)
    def _():
        pair = pair0 + jnp.arange(block_q, dtype=jnp.int32)  # [M]
        valid = pair < num_pairs  # [M]
        pair = jnp.minimum(pair, num_pairs - 1)  # [M]; rows past the sequence repeat its last pair
        tok = _div(pair, group)  # [M], token index within the sequence's new tokens
        token = q_start + tok  # [M]
        head = h * group + lax.rem(pair, jnp.int32(group))  # [M]
        cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]  # [1, hd]
        q = q_ref[token[:, None], head[:, None], cols]  # [M, hd]
        pos0 = context_len - q_len  # position of the first new token
        row_pos = pos0 + tok  # [M]
        first_pos = pos0 + _div(pair0, group)
        last_pos = pos0 + _div(jnp.minimum(pair0 + block_q, num_pairs) - 1, group)
        num_blocks = _cdiv(jnp.maximum(last_pos + 1, 0), block_kv)
        per_split = _cdiv(num_blocks, num_splits)
        lo = split * per_split
        hi = jnp.maximum(jnp.minimum(lo + per_split, num_blocks), lo)
        load_block = functools.partial(
            _load_kv_block, k_ref, v_ref, pt_ref, seq, h, block_kv=block_kv, page_size=page_size
        )
        m, l, acc = _attend(q, load_block, row_pos, first_pos, context_len, lo, hi, scale=scale, block_kv=block_kv)
        o = acc / jnp.where(l > 0, l, 1.0)[:, None]  # [M, hd]; no key (padding row or empty split): 0
        out_token = jnp.where(valid, token, num_tokens)  # [M]; rows past the sequence: past the end
        if num_splits == 1:
            (o_ref,) = out_refs  # [T, Hq, hd]
            _store_rows(o_ref.at[out_token[:, None], head[:, None], cols], o, valid)
        else:  # row split * T + token of the parts; rows past the sequence: past the end
            o_part_ref, lse_ref = out_refs  # [splits * T, Hq, hd], [splits * T, Hq] fp32
            part_row = jnp.where(valid, split * num_tokens + token, num_splits * num_tokens)  # [M]
            _store_rows(o_part_ref.at[part_row[:, None], head[:, None], cols], o, valid)
            lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)  # [M]
            plgpu.store(lse_ref.at[part_row, head], lse, mask=valid)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def paged_prefill_attention(
    q: jax.Array,  # [T, Hq, hd]
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    page_tables: jax.Array,  # [S, max_pages] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    context_lens: jax.Array,  # [S] int32
    *,
    scale: float,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, hd]
    """Causal prefill / extend attention of packed ragged new tokens over their paged context.

    block_q: (token, q head) rows per program, power of two >= 16 (block_q / G tokens of one sequence);
    None: `tiles.PREFILL`'s wide tiles (128 rows, 8 warps) where they give its waves of programs per SM, else
    its narrow ones (64, 4 warps).
    block_kv: keys per block, power of two >= 16, independent of the page size. Tiles left None: `tiles.PREFILL`'s.
    num_splits: KV shares per tile, combined by a log-sum-exp weighted sum (a few new tokens over a long cached
    prefix: one program per tile would walk the whole context alone); None: the largest power of two that keeps
    the tiles with rows within `tiles.PREFILL`'s split waves of programs (1 where they already fill them).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs = page_tables.shape[0]
    group = num_q_heads // num_kv_heads
    tiles = PREFILL.get((num_q_heads, num_kv_heads, head_dim), block_kv=block_kv, num_stages=num_stages)
    block_kv = tiles.block_kv
    if block_q is None:  # programs with wide tiles: (T * G / block_q) * Hkv
        wide = num_tokens * num_q_heads // tiles.block_q >= programs(tiles.waves)
        block_q = tiles.block_q if wide else tiles.narrow_block_q
    if num_warps is None:
        num_warps = tiles.num_warps if block_q >= tiles.block_q else tiles.narrow_num_warps
    _check_block("block_q", block_q)
    _check_block("block_kv", block_kv)
    num_tiles = num_tokens * group // block_q + num_seqs + 1  # bound on the tiles of S sequences + padding
    if num_splits is None:  # from the tiles that hold rows (those of a full batch of new tokens)
        row_programs = max(1, num_tokens * group // block_q) * num_kv_heads
        want = programs(tiles.split_waves) // row_programs
        max_blocks = -(-page_tables.shape[1] * page_size // block_kv)
        num_splits = max(1, min(next_pow2(want + 1) // 2, max_blocks))  # the largest power of two <= want
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    kernel = functools.partial(_prefill_kernel, scale=scale, group=group, block_q=block_q, block_kv=block_kv,
                               page_size=page_size, num_splits=num_splits)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((num_splits * num_tokens, num_q_heads, head_dim), F32),
                     jax.ShapeDtypeStruct((num_splits * num_tokens, num_q_heads), F32))
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tiles, num_kv_heads, num_splits),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.no_block_spec if num_splits == 1 else (pl.no_block_spec,) * 2,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=tiles.num_stages),
        name="paged_prefill_attention",
    )(
        cu_q_lens.astype(jnp.int32),
        context_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        q,
        k_pages.reshape(flat),
        v_pages.reshape(flat),
    )
    if num_splits == 1:
        return out
    o_part = out[0].reshape(num_splits, *q.shape)  # [splits, T, Hq, hd]
    lse = out[1].reshape(num_splits, num_tokens, num_q_heads)  # [splits, T, Hq]
    return _combine_splits(o_part, lse, axis=0).astype(q.dtype)


def _write_kv_kernel(slot_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_ref, v_ref):
    """Program t: copies token t's K/V rows [Hkv, hd] to its slot (the pools are aliased in and out)."""
    del k_in_ref, v_in_ref  # the same buffers as k_ref / v_ref
    t = pl.program_id(0)
    slot = slot_ref[t]
    k_ref[slot] = k_new_ref[t].astype(k_ref.dtype)
    v_ref[slot] = v_new_ref[t].astype(v_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_warps", "interpret"))
def write_kv(
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    k_new: jax.Array,  # [T, Hkv, hd]
    v_new: jax.Array,  # [T, Hkv, hd]
    slot_mapping: jax.Array,  # [T] int32
    *,
    num_warps: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Scatters new K/V rows into their slots, one program per token; in place when the pools are donated."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    pool = jax.ShapeDtypeStruct(flat, k_pages.dtype)
    k_out, v_out = pl.pallas_call(
        _write_kv_kernel,
        out_shape=(pool, pool),
        grid=(k_new.shape[0],),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=(pl.no_block_spec, pl.no_block_spec),
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="write_kv",
    )(slot_mapping.astype(jnp.int32), k_new, v_new, k_pages.reshape(flat), v_pages.reshape(flat))
    return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)
