"""Pallas kernel: the residual add and the zero-centred RMSNorm after it, in one launch.

Same signature and semantics as `reference.py` (plus ``interpret``). Written for Pallas' Triton lowering.

At decode the decoder's norms are launch-bound, not bandwidth-bound: XLA runs the add, the sum of squares
and the scaling as three kernels of ~1.5 us each on a few rows, twice per layer. Here a program owns one
row: it adds ``delta`` to the residual chunk by chunk (power-of-two chunks dividing D, held in registers),
stores the sum, accumulates the sum of squares, then scales the held chunks and stores the normed row. The
normed row is written from the registers that hold the sum, never read back from memory (Triton does not
order one thread's store before another thread's load of the same address).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

F32 = jnp.float32
MAX_CHUNK = 1024  # columns per register chunk


def chunk_width(d: int) -> int:
    """The largest power of two <= MAX_CHUNK dividing d."""
    c = 1
    while c * 2 <= MAX_CHUNK and d % (c * 2) == 0:
        c *= 2
    return c


def _kernel(*refs, eps: float, chunk: int, has_delta: bool):
    # refs: x [M, D] fp32, (delta [M, D],) weight [D]; outputs sum [M, D] fp32, normed [M, D].
    if has_delta:
        x_ref, delta_ref, w_ref, sum_ref, y_ref = refs
    else:
        (x_ref, w_ref, sum_ref, y_ref), delta_ref = refs, None
    row = pl.program_id(0)
    starts = range(0, x_ref.shape[1], chunk)
    held = []
    for c in starts:
        s = x_ref[row, pl.ds(c, chunk)].astype(F32)  # [chunk]
        if has_delta:
            s = s + delta_ref[row, pl.ds(c, chunk)].astype(F32)
        sum_ref[row, pl.ds(c, chunk)] = s
        held.append(s)
    squares = sum(jnp.sum(s * s) for s in held)
    inv_rms = jax.lax.rsqrt(squares / x_ref.shape[1] + eps)
    for c, s in zip(starts, held, strict=True):
        y_ref[row, pl.ds(c, chunk)] = (s * inv_rms * (1.0 + w_ref[pl.ds(c, chunk)].astype(F32))).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "interpret"))
def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float, out_dtype, *,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [..., D] fp32, delta [..., D] or None, weight [D] -> (x + delta fp32, normed in ``out_dtype``)."""
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d).astype(F32)  # [M, D]
    operands = (rows,) if delta is None else (rows, delta.reshape(-1, d))
    kernel = functools.partial(_kernel, eps=eps, chunk=chunk_width(d), has_delta=delta is not None)
    total, normed = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(rows.shape, F32), jax.ShapeDtypeStruct(rows.shape, out_dtype)),
        grid=(rows.shape[0],),
        in_specs=[pl.no_block_spec] * (len(operands) + 1),
        out_specs=(pl.no_block_spec, pl.no_block_spec),
        interpret=interpret,
        name="add_rms_norm",
    )(*operands, weight)
    return total.reshape(*lead, d), normed.reshape(*lead, d)
