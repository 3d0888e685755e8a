"""Chunked gated-delta-rule prefill over a packed ragged batch: one dispatch function.

`impl`: "auto" runs the Pallas kernel (Triton lowering) on a GPU when the shapes and dtypes are supported
and the pure-JAX reference otherwise; "kernel" forces the compiled kernel, "interpret" the kernel in
Pallas interpret mode (CPU tests), "reference" the reference. Tuning keywords go to the kernel only.
Value head j reads key head j // (Hv / Hk).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Impl, gdn_unsupported, kernel_mode
from pallas_kernels.gdn_chunk import kernel, reference

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _unsupported(q: jax.Array, k: jax.Array, v: jax.Array, state_pool: jax.Array) -> str | None:
    """Why the kernel can't take these operands (None: it can)."""
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _DTYPES):
        return f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}: need one of {_DTYPES}"
    return gdn_unsupported(q.shape[1], v.shape[1], q.shape[-1], v.shape[-1], state_pool)


def gdn_chunk(
    q: jax.Array,  # [T, Hk, dk], L2-normalised and scaled by dk^-0.5
    k: jax.Array,  # [T, Hk, dk], L2-normalised
    v: jax.Array,  # [T, Hv, dv]
    g: jax.Array,  # [T, Hv] fp32 log-decay (<= 0)
    beta: jax.Array,  # [T, Hv] fp32
    cu_seqlens: jax.Array,  # [S + 1] int32, cu_seqlens[0] == 0; tokens past cu_seqlens[S] are padding
    slot_ids: jax.Array,  # [S] int32, distinct for non-empty sequences
    state_pool: jax.Array,  # [slots, Hv, dk, dv] fp32
    snapshot_ids: jax.Array | None = None,  # [S, ceil(T / 64)] int32
    snapshot_pool: jax.Array | None = None,  # [snapshots, Hv, dk, dv] fp32
    *,
    impl: Impl = "auto",
    **tuning,
) -> tuple[jax.Array, ...]:  # o [T, Hv, dv] in q's dtype (0 on padding), state_pool (, snapshot_pool)
    """Sequence s runs from state_pool[slot_ids[s]] and stores its final state there (empty ones: untouched).
    With ``snapshot_ids`` and ``snapshot_pool`` its state after its first (c + 1) * 64 tokens also goes to
    ``snapshot_pool[snapshot_ids[s, c]]`` where that id is > 0, and the snapshot pool comes back third.

    o comes in q's dtype: with bf16 inputs it is rounded to bf16, as HF rounds the delta rule's output before the
    gated norm. k of the tokens after a sequence's end (the next sequence's, padding) must be finite: the state
    pass multiplies them by the zero rows of V' that mask them."""
    interpret = kernel_mode("gdn_chunk", impl, _unsupported(q, k, v, state_pool))
    pools = (state_pool,) if snapshot_pool is None else (state_pool, snapshot_ids, snapshot_pool)
    if interpret is None:
        o, *pools = reference.gdn_chunk(q, k, v, g, beta, cu_seqlens, slot_ids, *pools)
        return o.astype(q.dtype), *pools
    return kernel.gdn_chunk(q, k, v, g, beta, cu_seqlens, slot_ids, *pools, interpret=interpret, **tuning)


__all__ = ["Impl", "gdn_chunk"]
