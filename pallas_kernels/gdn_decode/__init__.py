"""One-token gated-delta-rule decode over state slots, in place: one dispatch function per op.

`impl`: "auto" runs the Pallas kernel (Triton lowering) on a GPU when the shapes and dtypes are supported
and the pure-JAX reference otherwise; "kernel" forces the compiled kernel, "interpret" the kernel in
Pallas interpret mode (CPU tests), "reference" the reference. Tuning keywords go to the kernel only.
Value head j reads key head j // (Hv / Hk). Row b uses slot slot_ids[b]; padded rows use the null slot 0.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Impl, gdn_unsupported, kernel_mode
from pallas_kernels.gdn_decode import kernel, reference

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


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
    *,
    impl: Impl = "auto",
    **tuning,
) -> tuple[jax.Array, ...]:  # o [B, Hv, dv] fp32, state_pool[, snapshot_pool]
    """One recurrent step per row; the state pool is updated in place when the caller donates it. With a
    snapshot pool (donated too), a row whose snapshot id is > 0 also stores its new state there."""
    reason = gdn_unsupported(q.shape[1], v.shape[1], q.shape[2], v.shape[2], state_pool)
    if reason is None and not all(x.dtype in _DTYPES for x in (q, k, v)):
        reason = f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} not in {_DTYPES}"
    interpret = kernel_mode("gdn_decode", impl, reason)
    if interpret is None:
        return reference.gdn_decode(q, k, v, g, beta, slot_ids, state_pool, snapshot_ids, snapshot_pool)
    return kernel.gdn_decode(q, k, v, g, beta, slot_ids, state_pool, snapshot_ids, snapshot_pool,
                             interpret=interpret, **tuning)


def gdn_decode_fused(
    mixed_qkv: jax.Array,  # [>= B, C] raw in_proj_qkv output (q | k | v channels); rows past B are not read
    a: jax.Array,  # [>= B, Hv] raw decay projection
    b: jax.Array,  # [>= B, Hv] raw beta projection
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
    impl: Impl = "auto",
    **tuning,
) -> tuple[jax.Array, ...]:  # o [out_rows or B, Hv, dv] fp32, conv_pool, state_pool[, snapshot_conv, _state]
    """Conv over the ring + SiLU, the token's column into the ring, L2 norms, gates and the state update of the
    GDN decode step, in place on both pools when the caller donates them. o comes with ``out_rows`` rows (>= B,
    default B), zero past the batch: the padded rows the few-row projections take. With the snapshot ids and
    pools (donated too) a row whose id is > 0 also stores its ring (the K raw columns up to its token) and new
    state at that snapshot: the state right after the token, as a prefill ending there leaves it. The ring goes to
    the ``snapshot_layer``-th K of the snapshot's conv rows (a pool stacking several layers' rings)."""
    num_v_heads = a.shape[1]
    channels = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    reason = gdn_unsupported(num_k_heads, num_v_heads, head_k_dim, head_v_dim, state_pool)
    if reason is None and (
        mixed_qkv.shape[1] != channels
        or conv_weight.shape[1] != channels
        or conv_pool.shape[1:] != (conv_weight.shape[0], channels)
    ):
        reason = (
            f"mixed_qkv {mixed_qkv.shape} / conv_weight {conv_weight.shape} / conv_pool {conv_pool.shape}: "
            f"need C = {channels} channels and a ring of K columns"
        )
    if reason is None and mixed_qkv.dtype not in _DTYPES:
        reason = f"mixed_qkv dtype {mixed_qkv.dtype} not in {_DTYPES}"
    interpret = kernel_mode("gdn_decode", impl, reason)
    heads = dict(num_k_heads=num_k_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim, out_rows=out_rows,
                 snapshot_layer=snapshot_layer)
    args = (mixed_qkv, a, b, conv_weight, A_log, dt_bias, slot_ids, positions, conv_pool, state_pool)
    if snapshot_state is not None:
        args += (snapshot_ids, snapshot_conv, snapshot_state)
    if interpret is None:
        return reference.gdn_decode_fused(*args, **heads)
    return kernel.gdn_decode_fused(*args, **heads, interpret=interpret, **tuning)


__all__ = ["Impl", "gdn_decode", "gdn_decode_fused"]
