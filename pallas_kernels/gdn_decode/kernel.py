"""Pallas kernels for the one-token gated-delta-rule decode over state slots, in place.

Same signatures and semantics as `reference.py` (plus tuning keywords), except on padded rows (slot 0): the
kernels skip them, with zero output and no pool touched, so a padded batch costs no state traffic.
Written for Pallas' Triton lowering (the `pallas_call` GPU default in jax 0.11/0.12) and runnable with
`interpret=True` on CPU.

The step is bandwidth bound: per value head a [dk, dv] fp32 state (64 KiB at 128 x 128) is read once,
decayed, corrected with one rank-1 write and stored once, for ~4 flops per element. The pools are aliased
input -> output, so the update is in place when the caller donates them; each program loads its state tile,
updates it in registers and stores it back (the columns of the delta rule are independent, so a tile is a
block of dv columns):

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

- `gdn_decode`: grid (row, value head, dv block), key head `h // group` read in place.
- Snapshots (the prefix cache's): given snapshot ids [B] (0: none) and the snapshot pools, a row with one also
  stores its new state tile (and, fused, its channels' K ring columns) at that snapshot, in the same
  program: the state after the row's token, with no second pass over any slot.
- `gdn_decode_fused`: the same grid, from the raw projections. The conv state is a ring of K raw columns
  per slot (position t at column t mod K), so no column moves: a program reads the K-1 columns before its
  token, and the token's own column, the one ring column nobody reads this step, is written by the program
  that owns those channels (its v block's; the key head's q and k by the first program of that head). Each
  program applies the depthwise conv + SiLU in fp32 to its key head's q and k channels and its v block,
  L2-normalises q and k (q also scaled by dk^-1/2), computes g = -exp(A_log) softplus(a + dt_bias) and
  beta = sigmoid(b), and updates its state tile. State traffic: one read and one write; q and k of a key
  head are convolved by each of its programs (a few KiB, against the tile's 2 x 64 KiB / (dv / block_v)).
  Splitting dv keeps one-row batches on many SMs (a program per key head would run batch 1 on 16).

Why the Triton lowering (the kernels move 65-76% of the H200's HBM bandwidth at batch 64): the work is
elementwise products and reductions over [dk, block_v] tiles with no matmul worth a tensor core (one key
per step), so wgmma and TMA, Mosaic GPU's strengths, buy little; what matters is enough programs / loads in
flight to saturate HBM, which plain vectorised loads under Triton give, with no barrier or pipeline
bookkeeping.

Within a program, Triton does not order a thread's global store after another thread's load of the same
address. The conv ring needs no ordering (no address is both read and written in a step), and the state
needs none: each stored element depends, through the reduction S^T k, on every loaded element of its column.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gdn_decode.reference import output_rows
from pallas_kernels.gdn_decode.tiles import DECODE, FUSED, GdnDecodeTiles
from pallas_kernels.math.gdn import l2_normalize
from pallas_kernels.tiles import programs

F32 = jnp.float32


def _update_state(
    state_view,  # ref view [dk, bv] fp32, read and written in place
    q: jax.Array,  # [dk] fp32
    k: jax.Array,  # [dk] fp32
    v: jax.Array,  # [bv] fp32
    g: jax.Array,  # scalar fp32
    beta: jax.Array,  # scalar fp32
    snapshot=None,  # (id, ref view [dk, bv] fp32 at that id) the new state is also stored to where id > 0
) -> jax.Array:  # o [bv] fp32
    """One delta-rule step of a block of state columns."""
    s = state_view[...] * jnp.exp(g)  # [dk, bv]
    delta = beta * (v - jnp.sum(s * k[:, None], axis=0))  # [bv]
    s = s + k[:, None] * delta[None, :]
    state_view[...] = s
    if snapshot is not None:
        snapshot_id, snapshot_view = snapshot

        @pl.when(snapshot_id != 0)
        def _store():
            snapshot_view[...] = s

    return jnp.sum(s * q[:, None], axis=0)


def _decode_kernel(slot_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_in_ref, *refs, group: int, block_v: int,
                   snapshots: bool):
    """Program (row b, value head h, dv block): one step of state_pool[slot_ids[b], h, :, block] (and its copy
    into snapshot_pool[snapshot_ids[b]] where that is > 0). refs: [snapshot ids, snapshot pool in,] o, state
    pool[, snapshot pool]; the pools' inputs are the same buffers as their outputs (aliased)."""
    del state_in_ref
    if snapshots:
        snapshot_ref, _, o_ref, state_ref, snapshot_pool_ref = refs
    else:
        o_ref, state_ref = refs
    b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    cols = pl.ds(vb * block_v, block_v)
    slot = slot_ref[b]

    @pl.when(slot != 0)
    def _real_row():
        snapshot = None
        if snapshots:
            snapshot_id = snapshot_ref[b]
            snapshot = snapshot_id, snapshot_pool_ref.at[snapshot_id, h, :, cols]
        o_ref[b, h, cols] = _update_state(
            state_ref.at[slot, h, :, cols],
            q_ref[b, hk, :].astype(F32),
            k_ref[b, hk, :].astype(F32),
            v_ref[b, h, cols].astype(F32),
            g_ref[b, h].astype(F32),
            beta_ref[b, h].astype(F32),
            snapshot,
        )

    @pl.when(slot == 0)
    def _padding_row():
        o_ref[b, h, cols] = jnp.zeros((block_v,), F32)


def _check_block_v(block_v: int, dv: int) -> None:
    if block_v < 16 or block_v & (block_v - 1) or dv % block_v:
        raise ValueError(f"block_v must be a power of two >= 16 dividing dv = {dv}, got {block_v}")


def pick_block_v(programs_per_block: int, dv: int, tiles: GdnDecodeTiles) -> int:
    """The widest dv block in [tiles.narrowest_block_v, tiles.widest_block_v] (capped at dv) whose grid of
    ``programs_per_block`` programs per dv block still gives ``tiles.waves`` programs per SM."""
    block_v = min(dv, tiles.widest_block_v)
    while block_v > tiles.narrowest_block_v and programs_per_block * (dv // block_v) < programs(tiles.waves):
        block_v //= 2
    return block_v


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "interpret"))
def gdn_decode(
    q: jax.Array,  # [B, Hk, dk]
    k: jax.Array,  # [B, Hk, dk]
    v: jax.Array,  # [B, Hv, dv]
    g: jax.Array,  # [B, Hv] fp32
    beta: jax.Array,  # [B, Hv] fp32
    slot_ids: jax.Array,  # [B] int32
    state_pool: jax.Array,  # [slots, Hv, dk, dv] fp32
    snapshot_ids: jax.Array | None = None,  # [B] int32 (0: none)
    snapshot_pool: jax.Array | None = None,  # [snapshots, Hv, dk, dv] fp32
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:  # o [B, Hv, dv] fp32, state_pool[, snapshot_pool]
    """One decode step per row, in place on the (donated) state pool; with ``snapshot_ids`` and
    ``snapshot_pool`` (donated too) a row's new state is also stored at its snapshot.

    block_v: dv columns per program (power of two dividing dv); None: enough programs to fill the GPU
    (`tiles.DECODE`, whose warps a None ``num_warps`` takes).
    """
    batch, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    tiles = DECODE.get((num_v_heads, dk, dv), num_warps=num_warps)
    block_v = pick_block_v(batch * num_v_heads, dv, tiles) if block_v is None else block_v
    _check_block_v(block_v, dv)
    snapshots = snapshot_pool is not None
    out_shape = (jax.ShapeDtypeStruct(v.shape, F32), jax.ShapeDtypeStruct(state_pool.shape, F32))
    extra = (snapshot_ids.astype(jnp.int32), snapshot_pool) if snapshots else ()
    return pl.pallas_call(
        functools.partial(_decode_kernel, group=num_v_heads // num_k_heads, block_v=block_v, snapshots=snapshots),
        out_shape=out_shape + ((jax.ShapeDtypeStruct(snapshot_pool.shape, F32),) if snapshots else ()),
        grid=(batch, num_v_heads, dv // block_v),
        in_specs=[pl.no_block_spec] * (7 + len(extra)),
        out_specs=(pl.no_block_spec,) * (len(out_shape) + snapshots),
        input_output_aliases={6: 1, 8: 2} if snapshots else {6: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        name="gdn_decode",
    )(slot_ids.astype(jnp.int32), q, k, v, g, beta, state_pool, *extra)


def _fused_kernel(
    slot_ref,
    pos_ref,
    mixed_ref,
    a_ref,
    b_ref,
    w_ref,
    a_log_ref,
    dt_bias_ref,
    conv_in_ref,
    state_in_ref,
    *refs,
    num_k_heads: int,
    head_k_dim: int,
    block_v: int,
    snapshots: bool,
    snapshot_ring: int,
):
    """Program (row b, value head h, dv block): the conv of its channels, the norms, gates and the state update
    of one [dk, block_v] tile of h; where the row names a snapshot, its tile and its channels' ring columns
    stored there too (the ring at conv rows ``snapshot_ring`` .. + K - 1 of the snapshot). refs: [snapshot ids,
    snapshot conv and state pools in,] o, conv pool, state pool[, snapshot conv and state pools]; the pools'
    inputs are the same buffers as their outputs (aliased)."""
    del conv_in_ref, state_in_ref
    if snapshots:
        snapshot_ref, _, _, o_ref, conv_ref, state_ref, snap_conv_ref, snap_state_ref = refs
    else:
        o_ref, conv_ref, state_ref = refs
    b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, num_v_heads, head_v_dim = o_ref.shape
    group = num_v_heads // num_k_heads
    hk = h // group
    key_dim = num_k_heads * head_k_dim
    width = w_ref.shape[0]  # conv kernel size K = ring columns
    slot, pos = slot_ref[b], pos_ref[b]
    cached = [jax.lax.rem(pos + 1 + j, width) for j in range(width - 1)]  # ring columns of pos-K+1 .. pos-1
    new = jax.lax.rem(pos, width)  # the token's column: read by no program of this step
    q_ch = pl.ds(hk * head_k_dim, head_k_dim)
    k_ch = pl.ds(key_dim + hk * head_k_dim, head_k_dim)
    v_ch = pl.ds(2 * key_dim + h * head_v_dim + vb * block_v, block_v)
    cols = pl.ds(vb * block_v, block_v)
    key_head_writer = (vb == 0) & (jax.lax.rem(h, group) == 0)  # one writer of the key head's q and k columns

    def conv_silu(ch):  # -> silu(conv) [n] fp32 of the window: K-1 cached raw columns, then the new one
        window = [conv_ref[slot, c, ch].astype(mixed_ref.dtype) for c in cached] + [mixed_ref[b, ch]]
        x = sum(window[j].astype(F32) * w_ref[j, ch].astype(F32) for j in range(width))
        return x * jax.nn.sigmoid(x)

    def store_ring(ring_ref, row, chs, with_cached: bool, first: int = 0):
        """The token's raw column (and the K-1 before it) into ring_ref's row, ring column c at column first + c."""
        for ch in chs:
            if with_cached:
                for c in cached:
                    ring_ref[row, first + c, ch] = conv_ref[slot, c, ch]
            ring_ref[row, first + new, ch] = mixed_ref[b, ch].astype(ring_ref.dtype)

    @pl.when(slot != 0)
    def _real_row():
        q = l2_normalize(conv_silu(q_ch)) * head_k_dim**-0.5  # [dk]
        k = l2_normalize(conv_silu(k_ch))  # [dk]
        v = conv_silu(v_ch)  # [bv]
        store_ring(conv_ref, slot, [v_ch], False)
        pl.when(key_head_writer)(lambda: store_ring(conv_ref, slot, [q_ch, k_ch], False))
        snapshot = None
        if snapshots:
            snapshot_id = snapshot_ref[b]
            snapshot = snapshot_id, snap_state_ref.at[snapshot_id, h, :, cols]

            @pl.when(snapshot_id != 0)
            def _ring_snapshot():
                store_ring(snap_conv_ref, snapshot_id, [v_ch], True, snapshot_ring)
                pl.when(key_head_writer)(
                    lambda: store_ring(snap_conv_ref, snapshot_id, [q_ch, k_ch], True, snapshot_ring))

        g = -jnp.exp(a_log_ref[h].astype(F32)) * jax.nn.softplus(a_ref[b, h].astype(F32) + dt_bias_ref[h].astype(F32))
        beta = jax.nn.sigmoid(b_ref[b, h].astype(F32))
        o_ref[b, h, cols] = _update_state(state_ref.at[slot, h, :, cols], q, k, v, g, beta, snapshot)

    @pl.when(slot == 0)
    def _padding_row():
        o_ref[b, h, cols] = jnp.zeros((block_v,), F32)

    batch = slot_ref.shape[0]
    for extra in range(batch, o_ref.shape[0], batch):  # rows past the batch (out_rows): zeros
        @pl.when(b + extra < o_ref.shape[0])
        def _(row=b + extra):
            o_ref[row, h, cols] = jnp.zeros((block_v,), F32)


@functools.partial(
    jax.jit, static_argnames=("num_k_heads", "head_k_dim", "head_v_dim", "out_rows", "snapshot_layer", "block_v",
                              "num_warps", "interpret")
)
def gdn_decode_fused(
    mixed_qkv: jax.Array,  # [>= B, C]: rows past B (a padded batch) are not read
    a: jax.Array,  # [>= B, Hv]
    b: jax.Array,  # [>= B, Hv]
    conv_weight: jax.Array,  # [K, C]
    A_log: jax.Array,  # [Hv] fp32
    dt_bias: jax.Array,  # [Hv]
    slot_ids: jax.Array,  # [B] int32
    positions: jax.Array,  # [B] int32
    conv_pool: jax.Array,  # [slots, K, C] ring: position t at column t mod K
    state_pool: jax.Array,  # [slots, Hv, dk, dv] fp32
    snapshot_ids: jax.Array | None = None,  # [B] int32 (0: none)
    snapshot_conv: jax.Array | None = None,  # [snapshots, >= (snapshot_layer + 1) K, C] rings
    snapshot_state: jax.Array | None = None,  # [snapshots, Hv, dk, dv] fp32
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    out_rows: int | None = None,
    snapshot_layer: int = 0,
    block_v: int | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:  # o [out_rows or B, Hv, dv] fp32, conv_pool, state_pool[, snapshot_conv, _state]
    """The GDN decode step from the raw projections, in place on both (donated) pools. o has ``out_rows`` rows
    (>= B; default B), zero past the batch, as the few-row projections downstream take them. With the
    snapshot ids and pools (donated too) a row's new ring and state are also stored at its snapshot, the ring at
    the ``snapshot_layer``-th K of its conv rows (a pool stacking several layers' rings).

    block_v: dv columns of the state tile a program owns (power of two dividing dv); None: enough programs to
    fill the GPU for this batch (`tiles.FUSED`, whose warps a None ``num_warps`` takes).
    """
    batch = slot_ids.shape[0]
    out_rows = output_rows(out_rows, batch)
    num_v_heads = a.shape[1]
    tiles = FUSED.get((num_v_heads, head_k_dim, head_v_dim), num_warps=num_warps)
    if block_v is None:
        block_v = pick_block_v(batch * num_v_heads, head_v_dim, tiles)
    _check_block_v(block_v, head_v_dim)
    snapshots = snapshot_state is not None
    kernel = functools.partial(_fused_kernel, num_k_heads=num_k_heads, head_k_dim=head_k_dim, block_v=block_v,
                               snapshots=snapshots, snapshot_ring=snapshot_layer * conv_weight.shape[0])
    pools = (conv_pool, state_pool) + ((snapshot_conv, snapshot_state) if snapshots else ())
    extra = (snapshot_ids.astype(jnp.int32), snapshot_conv, snapshot_state) if snapshots else ()
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((out_rows, num_v_heads, head_v_dim), F32),
                   *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools)),
        grid=(batch, num_v_heads, head_v_dim // block_v),
        in_specs=[pl.no_block_spec] * (10 + len(extra)),
        out_specs=(pl.no_block_spec,) * (1 + len(pools)),
        input_output_aliases={8: 1, 9: 2, 11: 3, 12: 4} if snapshots else {8: 1, 9: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        name="gdn_decode_fused",
    )(slot_ids.astype(jnp.int32), positions.astype(jnp.int32), mixed_qkv, a, b, conv_weight, A_log, dt_bias,
      conv_pool, state_pool, *extra)
