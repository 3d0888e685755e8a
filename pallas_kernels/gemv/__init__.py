"""A few rows times one or more weight matrices that share the input (decode-step projections): one dispatch.

`impl`: "auto" runs the Pallas kernel on a GPU when x has at most `MAX_ROWS` rows and the weights suit it,
XLA's dots otherwise; "kernel" forces the compiled kernel, "interpret" the kernel in Pallas interpret mode
(CPU tests), "reference" the reference. Leading axes of x are flattened into rows.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Impl, kernel_mode
from pallas_kernels.gemv import kernel, reference

MAX_ROWS = 64  # more rows: a tensor-core GEMM streams the weights as well
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _unsupported(rows: int, k: int, weights: tuple[jax.Array, ...]) -> str | None:
    if rows > MAX_ROWS:
        return f"{rows} rows > {MAX_ROWS}"
    for w in weights:
        if w.ndim != 2 or w.shape[0] != k or k % 16 or w.shape[1] % 16:
            return f"w {w.shape}: need [K={k}, N] with K and N multiples of 16"
        if w.dtype != weights[0].dtype or w.dtype not in _DTYPES:
            return f"weight dtypes {[str(v.dtype) for v in weights]}: need one of {_DTYPES}"
    return None


def gemv(x: jax.Array, weights: tuple[jax.Array, ...], out_dtype=None, *, impl: Impl = "auto",
         **tuning) -> tuple[jax.Array, ...]:
    """x [..., K] times each w [K, N_i] -> ([..., N_i], ...) in ``out_dtype`` (default: the weight's dtype),
    accumulated in fp32."""
    weights = tuple(weights)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    interpret = kernel_mode("gemv", impl, _unsupported(rows.shape[0], x.shape[-1], weights))
    if interpret is None:
        ys = reference.gemv(rows, weights, out_dtype)
    else:
        ys = kernel.gemv(rows, weights, out_dtype, interpret=interpret, **tuning)
    return tuple(y.reshape(*lead, y.shape[-1]) for y in ys)


__all__ = ["Impl", "MAX_ROWS", "gemv"]
