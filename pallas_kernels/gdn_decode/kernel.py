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
- `gdn_decode_fused`: grid (row, key head). A program owns every channel of one key head's group, which
  makes the in-place conv-state shift race-free: its q and k channels and the v channels of the `group`
  value heads that read them. It loads the conv window (K-1 cached raw columns + the new one), applies the
  depthwise conv + SiLU in fp32, L2-normalises q and k (q also scaled by dk^-1/2), writes the shifted raw
  window back, computes g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), then runs the state
  update of each of its value heads, dv block by dv block. State traffic: one read and one write.

Why the Triton lowering (to be confirmed by measurement on the H200): the work is elementwise products and
reductions over [dk, block_v] tiles with no matmul worth a tensor core (one key per step), so wgmma and TMA,
Mosaic GPU's strengths, buy little; what matters is enough programs / loads in flight to saturate HBM,
which plain vectorised loads under Triton give, with no barrier or pipeline bookkeeping.

Within a program, Triton does not order a thread's global store after another thread's load of the same
address: the fused kernel puts a CTA barrier between reading the old conv window and writing the shifted
one (the state needs none: each stored element depends, through the reduction S^T k, on every loaded
element of its column).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hybrid_jax.layers.gdn import l2_normalize

F32 = jnp.float32
_TARGET_PROGRAMS = 264  # ~2 waves over the H200's 132 SMs


def _update_state(
    state_view,  # ref view [dk, bv] fp32, read and written in place
    q: jax.Array,  # [dk] fp32
    k: jax.Array,  # [dk] fp32
    v: jax.Array,  # [bv] fp32
    g: jax.Array,  # scalar fp32
    beta: jax.Array,  # scalar fp32
) -> jax.Array:  # o [bv] fp32
    """One delta-rule step of a block of state columns."""
    s = state_view[...] * jnp.exp(g)  # [dk, bv]
    delta = beta * (v - jnp.sum(s * k[:, None], axis=0))  # [bv]
    s = s + k[:, None] * delta[None, :]
    state_view[...] = s
    return jnp.sum(s * q[:, None], axis=0)


def _decode_kernel(
    slot_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_in_ref, o_ref, state_ref, *, group: int, block_v: int
):
    """Program (row b, value head h, dv block): one step of state_pool[slot_ids[b], h, :, block]."""
    del state_in_ref  # the same buffer as state_ref (aliased)
    b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    cols = pl.ds(vb * block_v, block_v)
    slot = slot_ref[b]

    @pl.when(slot != 0)
    def _real_row():
        o_ref[b, h, cols] = _update_state(
            state_ref.at[slot, h, :, cols],
            q_ref[b, hk, :].astype(F32),
            k_ref[b, hk, :].astype(F32),
            v_ref[b, h, cols].astype(F32),
            g_ref[b, h].astype(F32),
            beta_ref[b, h].astype(F32),
        )

    @pl.when(slot == 0)
    def _padding_row():
        o_ref[b, h, cols] = jnp.zeros((block_v,), F32)


def _check_block_v(block_v: int, dv: int) -> None:
    if block_v < 16 or block_v & (block_v - 1) or dv % block_v:
        raise ValueError(f"block_v must be a power of two >= 16 dividing dv = {dv}, got {block_v}")


def _pick_block_v(programs_per_block: int, dv: int) -> int:
    """Widest dv block in [32, 64] that still gives ~2 waves of programs (64: a [128, 64] fp32 tile is 64
    registers a thread at 4 warps)."""
    block_v = min(dv, 64)
    while block_v > 32 and programs_per_block * (dv // block_v) < _TARGET_PROGRAMS:
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
    *,
    block_v: int | None = None,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # o [B, Hv, dv] fp32, state_pool
    """One decode step per row, in place on the (donated) state pool.

    block_v: dv columns per program (power of two dividing dv); None: enough programs to fill the GPU.
    """
    batch, num_k_heads, _ = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    block_v = _pick_block_v(batch * num_v_heads, dv) if block_v is None else block_v
    _check_block_v(block_v, dv)
    return pl.pallas_call(
        functools.partial(_decode_kernel, group=num_v_heads // num_k_heads, block_v=block_v),
        out_shape=(jax.ShapeDtypeStruct(v.shape, F32), jax.ShapeDtypeStruct(state_pool.shape, F32)),
        grid=(batch, num_v_heads, dv // block_v),
        in_specs=[pl.no_block_spec] * 7,
        out_specs=(pl.no_block_spec, pl.no_block_spec),
        input_output_aliases={6: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="gdn_decode",
    )(slot_ids.astype(jnp.int32), q, k, v, g, beta, state_pool)


def _fused_kernel(
    slot_ref,
    mixed_ref,
    a_ref,
    b_ref,
    w_ref,
    a_log_ref,
    dt_bias_ref,
    conv_in_ref,
    state_in_ref,
    o_ref,
    conv_ref,
    state_ref,
    *,
    num_k_heads: int,
    head_k_dim: int,
    block_v: int,
    barrier: bool,
):
    """Program (row b, key head hk): the conv, norms, gates and state updates of hk's channels and value heads."""
    del conv_in_ref, state_in_ref  # the same buffers as conv_ref / state_ref (aliased)
    b, hk = pl.program_id(0), pl.program_id(1)
    _, num_v_heads, head_v_dim = o_ref.shape
    group = num_v_heads // num_k_heads
    key_dim = num_k_heads * head_k_dim
    width = w_ref.shape[0]  # conv kernel size K
    slot = slot_ref[b]
    heads = [hk * group + i for i in range(group)]

    # Channel ranges of this program: q and k of key head hk, then the dv blocks of its value heads, head-major.
    channels = [pl.ds(hk * head_k_dim, head_k_dim), pl.ds(key_dim + hk * head_k_dim, head_k_dim)]
    channels += [pl.ds(2 * key_dim + h * head_v_dim + c, block_v) for h in heads for c in range(0, head_v_dim, block_v)]

    def conv_silu(ch):  # -> (silu(conv) [n] fp32, the shifted raw window: K-1 columns [n])
        window = [conv_ref[slot, j, ch].astype(mixed_ref.dtype) for j in range(width - 1)]
        window.append(mixed_ref[b, ch])
        x = sum(window[j].astype(F32) * w_ref[j, ch].astype(F32) for j in range(width))
        return x * jax.nn.sigmoid(x), window[1:]

    @pl.when(slot != 0)
    def _real_row():
        convs = [conv_silu(ch) for ch in channels]
        if barrier:  # every read of the old window precedes the writes of the shifted one
            plgpu.debug_barrier()
        for ch, (_, shifted) in zip(channels, convs, strict=True):
            for j, column in enumerate(shifted):
                conv_ref[slot, j, ch] = column.astype(conv_ref.dtype)

        q = l2_normalize(convs[0][0]) * head_k_dim**-0.5  # [dk]
        k = l2_normalize(convs[1][0])  # [dk]
        v_blocks = iter(x for x, _ in convs[2:])  # [bv] each, in the order of the loops below
        for h in heads:
            g = -jnp.exp(a_log_ref[h].astype(F32)) * jax.nn.softplus(
                a_ref[b, h].astype(F32) + dt_bias_ref[h].astype(F32))
            beta = jax.nn.sigmoid(b_ref[b, h].astype(F32))
            for c in range(0, head_v_dim, block_v):
                cols = pl.ds(c, block_v)
                o_ref[b, h, cols] = _update_state(state_ref.at[slot, h, :, cols], q, k, next(v_blocks), g, beta)

    @pl.when(slot == 0)
    def _padding_row():
        for h in heads:
            o_ref[b, h, :] = jnp.zeros((head_v_dim,), F32)


@functools.partial(
    jax.jit, static_argnames=("num_k_heads", "head_k_dim", "head_v_dim", "block_v", "num_warps", "interpret")
)
def gdn_decode_fused(
    mixed_qkv: jax.Array,  # [B, C]
    a: jax.Array,  # [B, Hv]
    b: jax.Array,  # [B, Hv]
    conv_weight: jax.Array,  # [K, C]
    A_log: jax.Array,  # [Hv] fp32
    dt_bias: jax.Array,  # [Hv]
    slot_ids: jax.Array,  # [B] int32
    conv_pool: jax.Array,  # [slots, K-1, C]
    state_pool: jax.Array,  # [slots, Hv, dk, dv] fp32
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    block_v: int = 128,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # o [B, Hv, dv] fp32, conv_pool, state_pool
    """The GDN decode step from the raw projections, in place on both (donated) pools.

    block_v: dv columns of the state tile a program holds at a time (power of two dividing dv). 128 with 4
    warps was the fastest of 32/64/128 x 4/8 warps on the H200 at batch 64, 9B and 27B shapes (the 27B
    sweep stopped before 128 x 8 warps; `bench_kernels.py --decode-sweep`): 2.9-3.0 TB/s of state traffic.
    """
    batch = mixed_qkv.shape[0]
    num_v_heads = a.shape[1]
    block_v = min(block_v, head_v_dim)
    _check_block_v(block_v, head_v_dim)
    kernel = functools.partial(
        _fused_kernel, num_k_heads=num_k_heads, head_k_dim=head_k_dim, block_v=block_v, barrier=not interpret
    )
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((batch, num_v_heads, head_v_dim), F32),
            jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
            jax.ShapeDtypeStruct(state_pool.shape, F32),
        ),
        grid=(batch, num_k_heads),
        in_specs=[pl.no_block_spec] * 9,
        out_specs=(pl.no_block_spec,) * 3,
        input_output_aliases={7: 1, 8: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="gdn_decode_fused",
    )(slot_ids.astype(jnp.int32), mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_pool, state_pool)
