"""Pallas kernels for the chunked gated-delta-rule prefill over a packed ragged batch.

Same signature and semantics as `reference.py` (plus tuning keywords), except that O comes in the input
dtype. Written for Pallas' Triton lowering (the `pallas_call` GPU default in jax 0.11/0.12) and runnable with
`interpret=True` on CPU.

Algorithm (the WY / UT form of `pallas_kernels.math.gated_delta.gated_delta_chunked`, as fla's
`chunk_gated_delta_rule`), per sequence and value head, chunks of C = 64 tokens that never straddle
sequences, gc = the in-chunk cumulative log-decay:

    A = strict_lower(diag(beta) K K^T * exp(gc_i - gc_j))     T = (I + A)^-1   (unit lower triangular)
    W = T diag(beta exp(gc)) K        U = T diag(beta) V
    per chunk, in order:  V' = U - W S
                          O  = (Q * exp(gc)) S + causal(Q K^T * exp(gc_i - gc_j)) V'
                          S <- exp(gc_last) S + (K * exp(gc_last - gc))^T V'

Three `pallas_call`s (the split of fla's chunk_gated_delta_rule: only the state update is sequential):
1. `_prepare_kernel`, grid (chunk, value head): everything that needs no state, in parallel over all chunks of
   all sequences: gc, the blocked inverse T and W, U. Sequence s owns chunk slots `cu[s] // C + s` onwards
   (T // C + S slots bound the batch); a program finds its sequence by binary search over `cu_seqlens` (cheaper
   than a table of chunk ranges built by XLA in launches of its own). T is built from 16 x 16 blocks (tl.dot's
   minimum): each diagonal block by the doubling product (I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8)
   (A^16 = 0: six fp32 products instead of 15 dependent row steps of forward substitution), the blocks below by
   block substitution `T_ij = -T_ii sum_m A_im T_mj` (TF32 products with bf16 inputs, fp32 with fp32 inputs;
   see Precision); then W, U are sums of block products.
2. `_state_kernel`, grid (sequence, value head, dv block): the state recurrence, sequential over the chunks
   of one sequence with the [dk, block_v] fp32 state slice in registers (the dv columns of the delta rule
   are independent, so dv blocks add parallelism without communication). Per chunk it stores V' and the
   chunk's starting state, two products and nothing else on the sequential path, the decay applied to V'
   (the smaller tile) rather than to K, as fla does. It reads the state from its slot and writes it back in
   place (the pool is aliased input -> output).
3. `_output_kernel`, grid (chunk slot, value head, dv block): O of every chunk in parallel, from the
   stored starting state and V', q S and Q K^T accumulated over slices of dk; chunks of padding tokens
   (past `cu_seqlens[S]`) get zeros. O is written in the input dtype (bf16 in the model, as HF rounds it).

Loads that feed a product directly are software-pipelined by Triton (`num_stages` tiles in flight through
shared memory); a select on the loaded tile (zeroing rows past the sequence) stops that. So the state and
output passes load whole 64-row tiles of in-bounds rows and mask rows past the sequence on the smaller
operand or the result: V' (state pass), the causal select, V' and the store (output pass).

Tiles (the defaults of `gdn_chunk`, from H200 sweeps at 9B shapes): the prepare pass on 2 warps, loading
the k and v tiles for W and U after the solve rather than holding them through it; the state pass 32 dv
columns a program, 4 warps, 4 stages; the output pass 128 dv columns, dk slices of 32, 2 warps, 4 stages.
The variants measured against these are in docs/DESIGN.md ("Alternatives measured").

Why the Triton lowering:
- Ragged rows: every tile is a gather of token rows through `cu_seqlens` (pointer tensors in Triton; TMA in
  Mosaic GPU moves rectangular boxes, which chunks of ragged sequences are not without a copy per sequence).
- The matmuls are small (64 x 64 x 128 per chunk, 16 x 16 blocks in the solve): Triton's mma.sync
  path handles them without wgmma's M = 64 per warpgroup constraint and without hand-written barriers.
- Grouped value heads read key head `h // group` directly: no repeated keys in memory.
Mosaic GPU would add: TMA loads of the q/k/w/u tiles with a multi-stage ring in the sequential kernel
(the recurrence is latency-bound per chunk) and wgmma for the 64-row products.

Precision: the diagonal 16 x 16 inverses are fp32. The doubling product cancels where forward substitution
does not: with near-equal keys and beta = 1 its error reaches ~1e-4 on entries of size 1 (tested), below the
bf16 rounding that T gets for the W and U products; in TF32 the same case gives errors of ~25 on W. The blocks
below the diagonal take one TF32 product each with bf16 inputs (as fla 0.6.0's fused solve does on TF32 GPUs,
`ops/gated_delta_rule/chunk_fwd.py`; ~1e-3 relative, under that bf16 rounding; fp32 with fp32 inputs).
Products whose operands are q/k/v-sized take the input dtype (bf16 inputs: tensor cores with fp32
accumulation, the state and T rounded to bf16 for the product, as fla does; fp32 inputs: full fp32 products,
slower). W and U are stored in the input dtype, gc in fp32.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gdn_chunk.tiles import GDN_CHUNK

CHUNK = 64  # tokens per chunk (the reference's CHUNK_SIZE)
BLOCK = 16  # rows of a block of the triangular solve (tl.dot needs M, N, K >= 16)
NUM_BLOCKS = CHUNK // BLOCK
F32 = jnp.float32


def _div(x: jax.Array, d: int) -> jax.Array:
    """x // d for non-negative int32 x (lax.div truncates)."""
    return lax.div(x, jnp.int32(d))


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0), *, tf32: bool = False) -> jax.Array:
    """2-D product contracting a's axis contract[0] with b's axis contract[1]; fp32 result.

    fp32 operands get full fp32 precision unless ``tf32`` (one TF32 tensor-core product, ~1e-3 relative).
    """
    precision = None if a.dtype != F32 else lax.Precision.DEFAULT if tf32 else lax.Precision.HIGHEST
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _unit_lower_inverses(blocks: list[jax.Array]) -> list[jax.Array]:  # each [n, n] fp32
    """(I + a)^-1 = (I - a)(I + a^2)(I + a^4)...(I + a^(n/2)) of each strictly lower triangular a (a^n = 0):
    2 log2(n) - 2 fp32 products a block instead of n - 1 dependent row steps."""
    n = blocks[0].shape[0]  # a power of two
    identity = (jnp.arange(n)[:, None] == jnp.arange(n)[None, :]).astype(F32)
    out = []
    for a in blocks:
        power = -a  # (-a)^(2^j)
        inv = identity + power
        for _ in range((n - 1).bit_length() - 1):
            power = _dot(power, power)
            inv = inv + _dot(inv, power)
        out.append(inv)
    return out


def _find_chunk(cu_ref, p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Chunk slot p -> (sequence s in [0, S], chunk index within s). Sequence s owns slots cu[s] // C + s on."""
    num_seqs = cu_ref.shape[0] - 1

    def first_slot(s):
        return _div(cu_ref[s], CHUNK) + s

    lo, hi = jnp.int32(0), jnp.int32(num_seqs + 1)  # largest s with first_slot(s) <= p
    for _ in range(num_seqs.bit_length()):
        mid = _div(lo + hi, 2)
        go_right = first_slot(mid) <= p
        lo, hi = jnp.where(go_right, mid, lo), jnp.where(go_right, hi, mid)
    return lo, p - first_slot(lo)


def _prepare_kernel(cu_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, gc_ref, *, group: int):
    """Program (chunk slot p, value head h): gc, W and U of one chunk (see the module docstring)."""
    p, h = pl.program_id(0), pl.program_id(1)
    num_tokens, _, dk = k_ref.shape
    dv = v_ref.shape[-1]
    num_seqs = cu_ref.shape[0] - 1
    s, chunk = _find_chunk(cu_ref, p)
    start = cu_ref[s] + chunk * CHUNK
    end = cu_ref[jnp.minimum(s + 1, num_seqs)]

    @pl.when((s < num_seqs) & (start < end))
    def _():
        hk = h // group
        dtype = k_ref.dtype
        cols_k = jnp.arange(dk, dtype=jnp.int32)[None, :]  # [1, dk]
        cols_v = jnp.arange(dv, dtype=jnp.int32)[None, :]  # [1, dv]
        r = jnp.arange(BLOCK, dtype=jnp.int32)  # [n]
        lower = r[:, None] > r[None, :]  # [n, n]

        # Rows of block i: tokens start + i*n + r. Rows past the sequence read in-bounds tokens (finite) with
        # beta = g = 0: their rows of A are 0, so they update nothing and their columns of W, U get weight 0.
        valid, tok, k, gc, beta = [], [], [], [], []
        offset = jnp.zeros((), F32)
        for i in range(NUM_BLOCKS):
            ok = start + i * BLOCK + r < end  # [n]
            t = jnp.where(ok, start + i * BLOCK + r, start)  # [n], in bounds
            valid.append(ok)
            tok.append(t)
            k.append(k_ref[t[:, None], hk, cols_k])  # [n, dk]
            g_i = jnp.where(ok, g_ref[t, h].astype(F32), 0.0)  # [n]
            gc.append(offset + jnp.cumsum(g_i))  # [n], log-decay from the chunk start, inclusive
            offset = offset + jnp.sum(g_i)
            beta.append(jnp.where(ok, beta_ref[t, h].astype(F32), 0.0))  # [n]

        def a_block(i, j):  # [n, n] block (i, j) of A, j <= i
            diff = gc[i][:, None] - gc[j][None, :]
            if i == j:  # strictly lower; mask before exp (the upper triangle's exponent is >= 0)
                return jnp.where(
                    lower, beta[i][:, None] * _dot(k[i], k[j], (1, 1)) * jnp.exp(jnp.where(lower, diff, 0.0)), 0.0
                )
            return beta[i][:, None] * _dot(k[i], k[j], (1, 1)) * jnp.exp(diff)

        a = {(i, j): a_block(i, j) for i in range(NUM_BLOCKS) for j in range(i + 1)}
        diagonal = _unit_lower_inverses([a[i, i] for i in range(NUM_BLOCKS)])
        t_blk = {(i, i): diagonal[i] for i in range(NUM_BLOCKS)}  # blocks of T = (I + A)^-1
        tf32 = dtype != F32  # the blocks below feed bf16 products: TF32 is exact enough (see Precision)
        for i in range(1, NUM_BLOCKS):
            for j in range(i):
                acc = sum(_dot(a[i, m], t_blk[m, j], tf32=tf32) for m in range(j, i))  # [n, n]
                t_blk[i, j] = -_dot(t_blk[i, i], acc, tf32=tf32)

        # k again and v only now: fewer registers held through the solve
        k = [k_ref[t[:, None], hk, cols_k] for t in tok]  # [n, dk] each
        v = [v_ref[t[:, None], h, cols_v] for t in tok]  # [n, dv] each
        for i in range(NUM_BLOCKS):
            w_i = sum(  # [n, dk]
                _dot((t_blk[i, j] * (beta[j] * jnp.exp(gc[j]))[None, :]).astype(dtype), k[j]) for j in range(i + 1)
            )
            u_i = sum(_dot((t_blk[i, j] * beta[j][None, :]).astype(dtype), v[j]) for j in range(i + 1))  # [n, dv]
            out = jnp.where(valid[i], tok[i], num_tokens)  # [n]; rows past the sequence: past the end
            plgpu.store(
                w_ref.at[out[:, None], h, cols_k],
                w_i.astype(w_ref.dtype),
                mask=jnp.broadcast_to(valid[i][:, None], w_i.shape),
            )
            plgpu.store(
                u_ref.at[out[:, None], h, cols_v],
                u_i.astype(u_ref.dtype),
                mask=jnp.broadcast_to(valid[i][:, None], u_i.shape),
            )
            plgpu.store(gc_ref.at[out, h], gc[i], mask=valid[i])


def _load_rows(ref, tok: jax.Array, ok: jax.Array, head, cols: jax.Array) -> jax.Array:
    """ref[tok, head, cols] -> [C, len(cols)], zero on rows where not ok."""
    return jnp.where(ok[:, None], ref[tok[:, None], head, cols], 0)


def _store_rows(ref, rows: jax.Array, ok: jax.Array, head, cols: jax.Array, x: jax.Array) -> None:
    """ref[rows, head, cols] = x [C, len(cols)] where ok [C] (masked rows point past the end)."""
    out = jnp.where(ok, rows, ref.shape[0])
    plgpu.store(ref.at[out[:, None], head, cols], x.astype(ref.dtype), mask=jnp.broadcast_to(ok[:, None], x.shape))


def _state_kernel(cu_ref, slot_ref, k_ref, w_ref, u_ref, gc_ref, *refs, group: int, block_v: int,
                  snapshots: bool):
    """Program (sequence s, value head h, dv block): the state recurrence of s, sequential over its chunks.

    Stores each chunk's V' and its starting state (in the input dtype, as the output pass multiplies them)
    and the final state in place; with ``snapshots``, also the fp32 state after chunk c into snapshot
    ``snap_ids[s, c]`` where that is > 0. The k, w, u tiles go from their loads straight into the products (rows
    past the sequence are masked on V' instead), so Triton's pipeliner prefetches them chunks ahead."""
    if snapshots:
        _, snap_ids_ref, _, vnew_ref, h_ref, state_ref, snap_ref = refs  # the pools' inputs alias their outputs
    else:
        _, vnew_ref, h_ref, state_ref = refs
    s, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_tokens, _, dk = k_ref.shape
    hk = h // group
    cols_k = jnp.arange(dk, dtype=jnp.int32)[None, :]  # [1, dk]
    cols_v = vb * block_v + jnp.arange(block_v, dtype=jnp.int32)[None, :]  # [1, bv]
    r = jnp.arange(CHUNK, dtype=jnp.int32)  # [C]
    start, end = cu_ref[s], cu_ref[s + 1]
    first_slot = _div(start, CHUNK) + s

    @pl.when(end > start)
    def _():
        dtype = k_ref.dtype
        state_view = state_ref.at[slot_ref[s], h, :, pl.ds(vb * block_v, block_v)]  # [dk, bv] fp32
        num_chunks = _div(end - start + CHUNK - 1, CHUNK)

        def store_snapshot(snap, state):  # masked, not a branch: the loop body stays one block for the pipeliner
            plgpu.store(snap_ref.at[snap, h, :, pl.ds(vb * block_v, block_v)], state,
                        mask=jnp.broadcast_to(snap > 0, state.shape))

        def chunk_step(c, carry):  # state [dk, bv] fp32, the state after chunk c - 1; snap: that chunk's id
            state, snap = carry
            first = start + c * CHUNK
            ok = first + r < end  # [C]
            rows = jnp.minimum(first + r, num_tokens - 1)[:, None]  # [C, 1], in bounds; past the end: other tokens'
            s_op = state.astype(dtype)
            h_ref[first_slot + c, h, :, pl.ds(vb * block_v, block_v)] = s_op.astype(h_ref.dtype)
            if snapshots:  # beside the chunk-start store, with its id loaded an iteration ahead (faster than a
                # store after the update: BENCHMARKS, prefix caching)
                store_snapshot(snap, state)
                snap = snap_ids_ref[s, c]
            v_new = u_ref[rows, h, cols_v].astype(F32) - _dot(w_ref[rows, h, cols_k], s_op)  # [C, bv]
            _store_rows(vnew_ref, rows[:, 0], ok, h, cols_v, v_new)
            gc = jnp.where(ok, gc_ref[rows[:, 0], h], 0.0)  # [C]
            gc_last = gc_ref[jnp.minimum(first + CHUNK, end) - 1, h]
            # (K * exp(gc_last - gc))^T V' with the decay on V' (the smaller tile); rows past the end add nothing.
            v_decayed = jnp.where(ok[:, None], v_new * jnp.exp(gc_last - gc)[:, None], 0.0).astype(dtype)
            state = state * jnp.exp(gc_last) + _dot(k_ref[rows, hk, cols_k], v_decayed, (0, 0))
            return state, snap

        final, snap = lax.fori_loop(0, num_chunks, chunk_step, (state_view[...], jnp.int32(0)))
        state_view[...] = final
        if snapshots:  # the state after the last chunk
            store_snapshot(snap, final)


def _output_kernel(cu_ref, q_ref, k_ref, vnew_ref, gc_ref, h_ref, o_ref, *, group: int, block_v: int,
                   block_k: int):
    """Program (chunk slot p, value head h, dv block): the outputs of one chunk from its starting state and V',
    or zeros on a chunk of padding tokens (past cu_seqlens[S]). q S and Q K^T accumulate over dk in
    ``block_k`` slices (loads pipelined by Triton)."""
    p, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_tokens, _, dk = q_ref.shape
    num_seqs = cu_ref.shape[0] - 1
    hk = h // group
    cols_v = vb * block_v + jnp.arange(block_v, dtype=jnp.int32)[None, :]  # [1, bv]
    r = jnp.arange(CHUNK, dtype=jnp.int32)  # [C]
    s, chunk = _find_chunk(cu_ref, p)
    first = cu_ref[s] + chunk * CHUNK
    end = jnp.where(s < num_seqs, cu_ref[jnp.minimum(s + 1, num_seqs)], num_tokens)
    ok = first + r < end  # [C]
    tok = jnp.where(ok, first + r, 0)  # [C], in bounds

    @pl.when((s < num_seqs) & (first < end))
    def _sequence():
        dtype = q_ref.dtype

        def dk_slice(i, carry):  # (q S, Q K^T) over dk columns i * bk ...
            qs, qk = carry
            cols = i * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]  # [1, bk]
            q, k = q_ref[tok[:, None], hk, cols], k_ref[tok[:, None], hk, cols]  # [C, bk]
            state = h_ref[p, h, pl.ds(i * block_k, block_k), pl.ds(vb * block_v, block_v)]  # [bk, bv]
            return qs + _dot(q, state), qk + _dot(q, k, (1, 1))

        qs, qk = lax.fori_loop(0, dk // block_k, dk_slice,
                               (jnp.zeros((CHUNK, block_v), F32), jnp.zeros((CHUNK, CHUNK), F32)))
        gc = jnp.where(ok, gc_ref[tok, h], 0.0)  # [C]
        causal = (r[:, None] >= r[None, :]) & ok[:, None]  # [C, C]
        # a select, not a multiply by 0: rows past the sequence may hold anything
        attn = jnp.where(causal, qk * jnp.exp(jnp.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
        v_new = _load_rows(vnew_ref, tok, ok, h, cols_v)  # [C, bv]
        o = qs * jnp.exp(gc)[:, None] + _dot(attn.astype(dtype), v_new)
        _store_rows(o_ref, tok, ok, h, cols_v, o)

    @pl.when((s == num_seqs) & (first < end))
    def _padding():
        _store_rows(o_ref, tok, ok, h, cols_v, jnp.zeros((CHUNK, block_v), F32))


@functools.partial(jax.jit, static_argnames=("state_block_v", "output_block_v", "output_block_k", "num_warps",
                                             "num_stages", "interpret"))
def gdn_chunk(
    q: jax.Array,  # [T, Hk, dk]
    k: jax.Array,  # [T, Hk, dk]
    v: jax.Array,  # [T, Hv, dv]
    g: jax.Array,  # [T, Hv] fp32
    beta: jax.Array,  # [T, Hv] fp32
    cu_seqlens: jax.Array,  # [S + 1] int32
    slot_ids: jax.Array,  # [S] int32
    state_pool: jax.Array,  # [slots, Hv, dk, dv] fp32
    snapshot_ids: jax.Array | None = None,  # [S, ceil(T / 64)] int32
    snapshot_pool: jax.Array | None = None,  # [snapshots, Hv, dk, dv] fp32
    *,
    state_block_v: int | None = None,
    output_block_v: int | None = None,
    output_block_k: int | None = None,
    num_warps: tuple[int, int, int] | None = None,
    num_stages: tuple[int, int, int] | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:  # o [T, Hv, dv] in q's dtype, state_pool (, snapshot_pool)
    """Chunked gated delta rule over a packed ragged batch; the state pool is updated in place when donated.

    With ``snapshot_ids`` and ``snapshot_pool``, sequence s's state after its first (c + 1) * 64 tokens also goes
    to ``snapshot_pool[snapshot_ids[s, c]]`` where that id is > 0 (in place when donated), and the updated
    snapshot pool comes back third.

    q, k, v share one dtype (bf16 or fp32); dk, dv are powers of two >= 16. The state pass's programs each
    carry ``state_block_v`` of the state's dv columns, the output pass's each write ``output_block_v`` columns
    of O, accumulating over ``output_block_k`` columns of dk at a time (powers of two >= 16; capped at dv and dk).
    ``num_warps`` and ``num_stages``: per pass (prepare, state, output). Those left None: `tiles.GDN_CHUNK`'s.
    """
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    num_seqs = slot_ids.shape[0]
    group = num_v_heads // num_k_heads
    tiles = GDN_CHUNK.get((num_k_heads, num_v_heads, dk, dv), state_block_v=state_block_v,
                          output_block_v=output_block_v, output_block_k=output_block_k)
    passes = (tiles.prepare, tiles.state, tiles.output)
    num_warps = tuple(launch.num_warps for launch in passes) if num_warps is None else num_warps
    num_stages = tuple(launch.num_stages for launch in passes) if num_stages is None else num_stages
    state_block_v, output_block_v = min(tiles.state_block_v, dv), min(tiles.output_block_v, dv)
    output_block_k = min(tiles.output_block_k, dk)
    for name, block, width in (("state_block_v", state_block_v, dv), ("output_block_v", output_block_v, dv),
                               ("output_block_k", output_block_k, dk)):
        if block < 16 or block & (block - 1) or width % block:
            raise ValueError(f"{name} must be a power of two >= 16 dividing {width}, got {block}")
    cu = cu_seqlens.astype(jnp.int32)
    prepare_params, state_params, output_params = (
        plgpu.CompilerParams(num_warps=w, num_stages=st) for w, st in zip(num_warps, num_stages, strict=True))

    w, u, gc = pl.pallas_call(
        functools.partial(_prepare_kernel, group=group),
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, num_v_heads, dk), q.dtype),  # W
            jax.ShapeDtypeStruct((num_tokens, num_v_heads, dv), q.dtype),  # U
            jax.ShapeDtypeStruct((num_tokens, num_v_heads), F32),  # gc
        ),
        grid=(num_tokens // CHUNK + num_seqs, num_v_heads),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=(pl.no_block_spec,) * 3,
        interpret=interpret,
        compiler_params=prepare_params,
        name="gdn_chunk_prepare",
    )(cu, k, v, g, beta)

    num_slots = num_tokens // CHUNK + num_seqs + 1  # chunk slots: every sequence's and the padding's
    snapshots = snapshot_pool is not None
    if snapshots != (snapshot_ids is not None):
        raise ValueError("snapshot_ids and snapshot_pool: give both or neither")
    pools = (state_pool, snapshot_ids.astype(jnp.int32), snapshot_pool) if snapshots else (state_pool,)
    out_pools = (jax.ShapeDtypeStruct(state_pool.shape, F32),)
    if snapshots:
        out_pools += (jax.ShapeDtypeStruct(snapshot_pool.shape, F32),)
    v_new, chunk_states, *pools = pl.pallas_call(
        functools.partial(_state_kernel, group=group, block_v=state_block_v, snapshots=snapshots),
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, num_v_heads, dv), q.dtype),  # V'
            jax.ShapeDtypeStruct((num_slots, num_v_heads, dk, dv), q.dtype),  # state at each chunk's start
            *out_pools,
        ),
        grid=(num_seqs, num_v_heads, dv // state_block_v),
        in_specs=[pl.no_block_spec] * (6 + len(pools)),
        out_specs=(pl.no_block_spec,) * (2 + len(out_pools)),
        input_output_aliases={6: 2, 8: 3} if snapshots else {6: 2},
        interpret=interpret,
        compiler_params=state_params,
        name="gdn_chunk_state",
    )(cu, slot_ids.astype(jnp.int32), k, w, u, gc, *pools)

    o = pl.pallas_call(
        functools.partial(_output_kernel, group=group, block_v=output_block_v, block_k=output_block_k),
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_v_heads, dv), q.dtype),
        grid=(num_slots, num_v_heads, dv // output_block_v),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.no_block_spec,
        interpret=interpret,
        compiler_params=output_params,
        name="gdn_chunk_output",
    )(cu, q, k, v_new, gc, chunk_states)
    return (o, *pools)
