"""Pure-JAX reference for the one-token gated-delta-rule decode over state slots (the kernels' oracle and their
fallback).

Row b reads and writes slot ``slot_ids[b]`` of the pools, and with snapshot pools also writes its new state at
snapshot ``snapshot_ids[b]`` where that is > 0 (the prefix cache's copy of the state after the token). Real
rows have distinct slots; padded rows of a fixed-shape batch point at the null slot 0, whose content is garbage
that must never reach a real row (when several rows write one slot, one of them wins).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.math.gated_delta import gated_delta_step
from pallas_kernels.math.gdn import causal_conv, conv_ring_columns, l2_normalize

F32 = jnp.float32


def gdn_decode(
    q: jax.Array,  # [B, Hk, dk], L2-normalised and scaled by dk^-0.5
    k: jax.Array,  # [B, Hk, dk], L2-normalised
    v: jax.Array,  # [B, Hv, dv]
    g: jax.Array,  # [B, Hv] fp32 log-decay (<= 0)
    beta: jax.Array,  # [B, Hv] fp32
    slot_ids: jax.Array,  # [B] int32
    state_pool: jax.Array,  # [slots, Hv, dk, dv] fp32
    snapshot_ids: jax.Array | None = None,  # [B] int32 (0: none)
    snapshot_pool: jax.Array | None = None,  # [snapshots, Hv, dk, dv] fp32
) -> tuple[jax.Array, ...]:  # o [B, Hv, dv] fp32, state_pool[, snapshot_pool]
    """One recurrent step per row from its slot's state; the new state goes back to the slot (and to the row's
    snapshot, with a snapshot pool)."""
    o, state = gated_delta_step(q, k, v, g, beta, state_pool[slot_ids])
    state = state.astype(state_pool.dtype)
    pools = (state_pool.at[slot_ids].set(state),)
    if snapshot_pool is not None:
        pools += (store_snapshots(snapshot_pool, snapshot_ids, state),)
    return o, *pools


def store_snapshots(pool: jax.Array, snapshot_ids: jax.Array, rows: jax.Array) -> jax.Array:
    """pool [snapshots, ...] with rows [B, ...] stored at snapshot_ids [B] where > 0 (the others dropped)."""
    return pool.at[jnp.where(snapshot_ids > 0, snapshot_ids, pool.shape[0])].set(rows.astype(pool.dtype), mode="drop")


def store_rings(pool: jax.Array, snapshot_ids: jax.Array, rings: jax.Array, layer: int) -> jax.Array:
    """pool [snapshots, L K, C] (L layers' rings) with rings [B, K, C] stored as the ``layer``-th ring of
    snapshot_ids [B] where > 0 (the others dropped)."""
    width = rings.shape[1]
    rows = jnp.where(snapshot_ids > 0, snapshot_ids, pool.shape[0])[:, None]  # [B, 1]
    columns = layer * width + jnp.arange(width)[None, :]  # [1, K]
    return pool.at[rows, columns].set(rings.astype(pool.dtype), mode="drop")


def decode_gates(
    a: jax.Array,  # [B, Hv] raw decay projection
    b: jax.Array,  # [B, Hv] raw beta projection
    A_log: jax.Array,  # [Hv] fp32
    dt_bias: jax.Array,  # [Hv]
) -> tuple[jax.Array, jax.Array]:  # g, beta [B, Hv] fp32
    """g = -exp(A_log) * softplus(a + dt_bias) (log-decay), beta = sigmoid(b), in fp32 as the layer."""
    g = -jnp.exp(A_log.astype(F32)) * jax.nn.softplus(a.astype(F32) + dt_bias.astype(F32))
    return g, jax.nn.sigmoid(b.astype(F32))


def output_rows(out_rows: int | None, batch: int) -> int:
    """Rows of the fused step's o: ``out_rows`` (>= batch), or the batch."""
    if out_rows is not None and out_rows < batch:
        raise ValueError(f"out_rows {out_rows} < batch {batch}")
    return batch if out_rows is None else out_rows


def gdn_decode_fused(
    mixed_qkv: jax.Array,  # [>= B, C] raw in_proj_qkv output (q | k | v channels); rows past B are not read
    a: jax.Array,  # [>= B, Hv]
    b: jax.Array,  # [>= B, Hv]
    conv_weight: jax.Array,  # [K, C]
    A_log: jax.Array,  # [Hv] fp32
    dt_bias: jax.Array,  # [Hv]
    slot_ids: jax.Array,  # [B] int32
    positions: jax.Array,  # [B] int32 position of each row's token
    conv_pool: jax.Array,  # [slots, K, C] raw pre-conv columns, a ring: position t at column t mod K
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
) -> tuple[jax.Array, ...]:  # o [out_rows or B, Hv, dv] fp32, conv_pool, state_pool[, snapshot_conv, _state]
    """The GDN layer's decode step from the raw projections: depthwise conv + SiLU over the ring's K-1 columns
    before the token and its own, the token's column into the ring, L2 norm and q scaling, gates, and the state
    update (as `GatedDeltaNet.project` + `gated_delta_step`). o: zero rows after the B up to ``out_rows``. With
    the snapshot pools a row's ring (its K columns up to the token) and new state also go to its snapshot, the
    ring at the ``snapshot_layer``-th K of its conv rows."""
    batch, width = slot_ids.shape[0], conv_weight.shape[0]
    mixed_qkv, a, b = mixed_qkv[:batch], a[:batch], b[:batch]
    key_dim = num_k_heads * head_k_dim
    cached = jnp.take_along_axis(conv_pool[slot_ids], conv_ring_columns(positions, width)[..., None], axis=1)
    window = jnp.concatenate([cached.astype(mixed_qkv.dtype), mixed_qkv[:, None]], axis=1)  # [B, K, C]
    mixed = jax.nn.silu(causal_conv(window, conv_weight)[:, 0])  # [B, C] fp32
    q = l2_normalize(mixed[:, :key_dim].reshape(batch, num_k_heads, head_k_dim)) * head_k_dim**-0.5
    k = l2_normalize(mixed[:, key_dim : 2 * key_dim].reshape(batch, num_k_heads, head_k_dim))
    v = mixed[:, 2 * key_dim :].reshape(batch, -1, head_v_dim)  # [B, Hv, dv]
    g, beta = decode_gates(a, b, A_log, dt_bias)
    o, *states = gdn_decode(q, k, v, g, beta, slot_ids, state_pool, snapshot_ids, snapshot_state)
    conv_pool = conv_pool.at[slot_ids, positions % width].set(mixed_qkv.astype(conv_pool.dtype))
    o = jnp.pad(o, ((0, output_rows(out_rows, batch) - batch), (0, 0), (0, 0)))
    if snapshot_state is None:
        return o, conv_pool, *states
    snapshot_conv = store_rings(snapshot_conv, snapshot_ids, ring_of_window(window, positions), snapshot_layer)
    return o, conv_pool, states[0], snapshot_conv, states[1]


def ring_of_window(window: jax.Array, positions: jax.Array) -> jax.Array:
    """window [B, K, C]: the raw columns of positions pos-K+1 .. pos -> the ring [B, K, C] holding them (position t
    at column t mod K)."""
    width = window.shape[1]
    columns = (positions[:, None] - width + 1 + jnp.arange(width)[None, :]) % width  # [B, K]
    return jnp.zeros_like(window).at[jnp.arange(window.shape[0])[:, None], columns].set(window)
