"""Attention over the paged KV cache: one dispatch function per op.

`impl`: "auto" runs the Pallas kernel (Triton lowering) on a GPU when the shapes and dtypes are supported
and the pure-JAX reference otherwise; "kernel" forces the compiled kernel, "interpret" the kernel in
Pallas interpret mode (CPU tests), "reference" the reference. Tuning keywords go to the kernel only.
Query head h reads KV head h // (Hq / Hkv).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Impl, is_pow2, kernel_mode
from pallas_kernels.paged_attention import kernel, reference

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _unsupported(q: jax.Array | None, k_pages: jax.Array, v_pages: jax.Array) -> str | None:
    """Why the kernels can't take these operands (None: they can)."""
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        return f"k_pages {k_pages.shape} {k_pages.dtype} / v_pages {v_pages.shape} {v_pages.dtype} differ"
    _, _, num_kv_heads, head_dim = k_pages.shape
    if k_pages.dtype not in _DTYPES:
        return f"KV dtype {k_pages.dtype} not in {_DTYPES}"
    if not (is_pow2(head_dim) and head_dim >= 16):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if q is None:
        return None if is_pow2(num_kv_heads) else f"Hkv {num_kv_heads} is not a power of two"
    if q.dtype != k_pages.dtype:
        return f"q dtype {q.dtype} != KV dtype {k_pages.dtype}"
    if q.shape[-1] != head_dim or q.shape[-2] % num_kv_heads:
        return f"q {q.shape} does not fit KV heads {num_kv_heads} x {head_dim}"
    return None


def _gate_unsupported(gate: jax.Array, q: jax.Array, out_rows: int | None) -> str | None:
    """Why the fused combine + gate can't take ``gate`` (qg) for q [B, Hq, hd] (None: it can)."""
    batch, num_q_heads, head_dim = q.shape
    if gate.ndim != 2 or gate.shape[0] < batch or gate.shape[1] != num_q_heads * 2 * head_dim:
        return f"gate {gate.shape}: need [>= {batch}, {num_q_heads * 2 * head_dim}] (per head: query, then gate)"
    if gate.dtype != q.dtype:  # the reference rounds o to q's dtype, then to the gate's; the kernel once
        return f"gate dtype {gate.dtype} != q dtype {q.dtype}"
    if out_rows is not None and out_rows < batch:
        return f"out_rows {out_rows} < batch {batch}"
    return None


def _inputs_unsupported(qg, k, v, cos, slot_mapping, k_pages, num_q_heads: int) -> str | None:
    """Why `decode_attention_inputs`' kernel can't take these projections (None: it can)."""
    batch = slot_mapping.shape[0]
    num_kv_heads, head_dim = k_pages.shape[2:]
    widths = {"qg": (qg, num_q_heads * 2 * head_dim), "k": (k, num_kv_heads * head_dim),
              "v": (v, num_kv_heads * head_dim)}
    for name, (a, width) in widths.items():
        if a.ndim != 2 or a.shape[0] < batch or a.shape[1] != width:
            return f"{name} {a.shape}: need [>= {batch}, {width}]"
    rotary = cos.shape[-1]
    if cos.shape[0] < batch or rotary % 2 or rotary > head_dim:
        return f"cos/sin {cos.shape}: need [>= {batch}, r] with r even and <= head_dim {head_dim}"
    return None


def paged_decode_attention(
    q: jax.Array,  # [B, Hq, hd]
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    page_tables: jax.Array,  # [B, max_pages] int32
    context_lens: jax.Array,  # [B] int32, 0 for padded rows (their output is 0)
    *,
    scale: float,
    gate: jax.Array | None = None,
    out_rows: int | None = None,
    impl: Impl = "auto",
    **tuning,
) -> jax.Array:  # [B, Hq, hd]; with gate, [out_rows, Hq * hd]
    """One query token per sequence over the first context_lens[b] tokens of its pages. ``gate``: qg
    [>= B, Hq * 2 hd] (per head query, then gate); the output is then gated by it, flattened and padded with
    zero rows to ``out_rows`` (default B) for the output projection (`reference.decode_attention_output`)."""
    reason = _unsupported(q, k_pages, v_pages)
    if reason is None and gate is not None:
        reason = _gate_unsupported(gate, q, out_rows)
    interpret = kernel_mode("paged attention", impl, reason)
    if interpret is None:
        return reference.paged_decode_attention(q, k_pages, v_pages, page_tables, context_lens, scale=scale,
                                                gate=gate, out_rows=out_rows)
    return kernel.paged_decode_attention(
        q, k_pages, v_pages, page_tables, context_lens, scale=scale, gate=gate, out_rows=out_rows,
        interpret=interpret, **tuning
    )


def decode_attention_inputs(
    qg: jax.Array,  # [>= B, Hq * 2 hd] per head: query, then gate
    k: jax.Array,  # [>= B, Hkv * hd]
    v: jax.Array,  # [>= B, Hkv * hd]
    cos: jax.Array,  # [>= B, r] in qg's dtype
    sin: jax.Array,  # [>= B, r]
    q_norm: jax.Array,  # [hd]
    k_norm: jax.Array,  # [hd]
    slot_mapping: jax.Array,  # [B] int32
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    *,
    num_q_heads: int,
    eps: float,
    impl: Impl = "auto",
    **tuning,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [B, Hq, hd] in the pages' dtype, k_pages, v_pages
    """A decode step's q (normalised, rotated) from the raw projections, and its new K/V written to the pages
    (in place when the caller donates them). Rows past B are not read."""
    reason = _unsupported(None, k_pages, v_pages) or _inputs_unsupported(qg, k, v, cos, slot_mapping, k_pages,
                                                                         num_q_heads)
    interpret = kernel_mode("decode attention inputs", impl, reason)
    fn = reference.decode_attention_inputs if interpret is None else functools.partial(
        kernel.decode_attention_inputs, interpret=interpret, **tuning)
    return fn(qg, k, v, cos, sin, q_norm, k_norm, slot_mapping, k_pages, v_pages, num_q_heads=num_q_heads, eps=eps)


def paged_prefill_attention(
    q: jax.Array,  # [T, Hq, hd], packed new tokens, then padding rows (output 0)
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    page_tables: jax.Array,  # [S, max_pages] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    context_lens: jax.Array,  # [S] int32, cached prefix + new tokens
    *,
    scale: float,
    impl: Impl = "auto",
    **tuning,
) -> jax.Array:  # [T, Hq, hd]
    """Causal prefill / extend: the new tokens are the last q_len positions of each sequence's context."""
    interpret = kernel_mode("paged attention", impl, _unsupported(q, k_pages, v_pages))
    if interpret is None:
        return reference.paged_prefill_attention(q, k_pages, v_pages, page_tables, cu_q_lens, context_lens, scale=scale)
    return kernel.paged_prefill_attention(
        q, k_pages, v_pages, page_tables, cu_q_lens, context_lens, scale=scale, interpret=interpret, **tuning
    )


def write_kv(
    k_pages: jax.Array,  # [P, page_size, Hkv, hd]
    v_pages: jax.Array,  # [P, page_size, Hkv, hd]
    k_new: jax.Array,  # [T, Hkv, hd]
    v_new: jax.Array,  # [T, Hkv, hd]
    slot_mapping: jax.Array,  # [T] int32, page * page_size + offset; padding: a slot of page 0
    *,
    impl: Impl = "auto",
    **tuning,
) -> tuple[jax.Array, jax.Array]:
    """Writes new K/V rows into the pools (in place when the caller donates them)."""
    interpret = kernel_mode("paged attention", impl, _unsupported(None, k_pages, v_pages))
    if interpret is None:
        return reference.write_kv(k_pages, v_pages, k_new, v_new, slot_mapping)
    return kernel.write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, interpret=interpret, **tuning)


__all__ = ["Impl", "decode_attention_inputs", "paged_decode_attention", "paged_prefill_attention", "write_kv"]
