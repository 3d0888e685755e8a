"""Pure-JAX reference for the chunked gated-delta-rule prefill over a packed ragged batch (the kernel's oracle
and its fallback).

Sequence s owns tokens ``cu_seqlens[s]:cu_seqlens[s+1]`` (``cu_seqlens[0] == 0``), starts from
``state_pool[slot_ids[s]]`` and writes its final state back there. The slots of non-empty sequences must be
distinct; empty sequences (padded rows of a fixed-shape batch, usually pointing at the null slot 0) touch
nothing. Tokens past ``cu_seqlens[S]`` are padding: their output is 0.

Each sequence is gathered into a row of a ``[S, T_pad]`` layout (``T_pad`` = T rounded up to the chunk size,
the longest a sequence can be), run through ``gated_delta_chunked`` and scattered back. Clear, jit-able with
static shapes, and S times the work of one packed pass: a reference, not a fast path.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.math.gated_delta import CHUNK_SIZE, gated_delta_chunked


def gdn_chunk(
    q: jax.Array,  # [T, Hk, dk], L2-normalised and scaled by dk^-0.5
    k: jax.Array,  # [T, Hk, dk], L2-normalised
    v: jax.Array,  # [T, Hv, dv]
    g: jax.Array,  # [T, Hv] fp32 log-decay (<= 0)
    beta: jax.Array,  # [T, Hv] fp32 write strength in (0, 1)
    cu_seqlens: jax.Array,  # [S + 1] int32
    slot_ids: jax.Array,  # [S] int32
    state_pool: jax.Array,  # [slots, Hv, dk, dv] fp32
    snapshot_ids: jax.Array | None = None,  # [S, ceil(T / 64)] int32
    snapshot_pool: jax.Array | None = None,  # [snapshots, Hv, dk, dv] fp32
) -> tuple[jax.Array, ...]:  # o [T, Hv, dv] fp32, state_pool (, snapshot_pool)
    """Chunked gated delta rule (chunks of 64 within each sequence) over a packed batch of sequences; with
    ``snapshot_ids`` and ``snapshot_pool``, sequence s's state after its first (c + 1) * 64 tokens also goes to
    snapshot ``snapshot_ids[s, c]`` where that is > 0."""
    num_tokens = q.shape[0]
    num_slots = state_pool.shape[0]
    cu = cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]  # [S]
    t_pad = -(-num_tokens // CHUNK_SIZE) * CHUNK_SIZE
    pos = jnp.arange(t_pad, dtype=jnp.int32)  # [T_pad]
    valid = pos[None, :] < lens[:, None]  # [S, T_pad]
    tok = jnp.where(valid, cu[:-1, None] + pos[None, :], 0)  # [S, T_pad]

    def gather(x):  # [T, ...] -> [S, T_pad, ...], zeros past each sequence's end (g = beta = k = 0: no update)
        rows = x[tok]
        return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), rows, jnp.zeros((), x.dtype))

    snapshots = snapshot_pool is not None
    o, final, *states = gated_delta_chunked(
        gather(q), gather(k), gather(v), gather(g), gather(beta), state_pool[slot_ids], chunk_states=snapshots
    )  # [S, T_pad, Hv, dv], [S, Hv, dk, dv] (, [S, T_pad / 64, Hv, dk, dv])

    t = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    seq = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, cu.shape[0] - 2)  # [T], last s with cu[s] <= t
    o = o[seq, jnp.clip(t - cu[seq], 0, t_pad - 1)]  # [T, Hv, dv]
    o = jnp.where((t < cu[-1])[:, None, None], o, 0.0)
    target = jnp.where(lens > 0, slot_ids, num_slots)  # [S]; empty sequences: out of range, dropped
    state_pool = state_pool.at[target].set(final.astype(state_pool.dtype), mode="drop")
    if not snapshots:
        return o, state_pool
    ids = snapshot_ids[:, : states[0].shape[1]]  # [S, N]
    ids = jnp.where(ids > 0, ids, snapshot_pool.shape[0])  # none: out of range, dropped
    snapshot_pool = snapshot_pool.at[ids].set(states[0].astype(snapshot_pool.dtype), mode="drop")
    return o, state_pool, snapshot_pool
