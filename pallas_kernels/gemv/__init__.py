"""A few rows times one or more weight matrices that share the input (decode-step projections): one dispatch;
the MLP's gate/up pair with the SwiGLU product fused (`gemv_swiglu`); and one projection added to the residual
stream (`gemv_add`), which can also write the next RMS norm's output with its division deferred (`NormedRows`)
for the next `gemv` / `gemv_swiglu` to finish on their products' rows: the norm needs no launch of its own.

`impl`: "auto" runs the Pallas kernel on a GPU when x has at most `MAX_ROWS` rows, for the weights that suit
it (one launch), and XLA's dots for the others (a shard's slice of a narrow projection, say); "kernel"
forces the compiled kernel for all, "interpret" the kernel in Pallas interpret mode (CPU tests), "reference"
the reference. Leading axes of x are flattened into rows.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Impl, kernel_mode
from pallas_kernels.gemv import kernel, reference
from pallas_kernels.gemv.tiles import SWIGLU, SWIGLU_MAX_ROWS

MAX_ROWS = 64  # more rows: a tensor-core GEMM streams the weights as well
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class NormedRows:
    """A zero-centred RMS norm's output h with its division deferred: ``scaled`` [..., K], the norm's input x
    times (1 + weight) rounded to the projections' dtype, and ``sums`` [J, M] fp32, partial sums of squares of
    x's M rows over J column blocks; h = scaled / rms(x), row by row. `gemv` and `gemv_swiglu` divide their
    products' rows instead (h's rounding moves before the division: bf16 rounding apart from HF's norm);
    `normalized` gives h itself."""
    scaled: jax.Array
    sums: jax.Array
    eps: float

    def row_scale(self) -> jax.Array:
        """1 / rms of each row [M, 1]."""
        return reference.rms_row_scale(self.sums, self.scaled.shape[-1], self.eps)

    def normalized(self, dtype) -> jax.Array:
        """h [..., K] in ``dtype``."""
        rows = self.scaled.reshape(-1, self.scaled.shape[-1]).astype(jnp.float32)
        return (rows * self.row_scale()).astype(dtype).reshape(self.scaled.shape)


def _split_norm(x: jax.Array | NormedRows) -> tuple[jax.Array, NormedRows | None]:
    return (x.scaled, x) if isinstance(x, NormedRows) else (x, None)


def _kernel_norm(norm: NormedRows | None) -> tuple:
    """The kernels' ``sums`` and ``eps`` arguments."""
    return () if norm is None else (norm.sums, norm.eps)


def _unsupported(rows: int, k: int, w: jax.Array, dtype) -> str | None:
    """Why the kernel can't multiply ``rows`` rows by w in a launch for ``dtype`` weights (None: it can)."""
    if rows > MAX_ROWS:
        return f"{rows} rows > {MAX_ROWS}"
    if w.ndim != 2 or w.shape[0] != k or k % 16 or w.shape[1] % 16:
        return f"w {w.shape}: need [K={k}, N] with K and N multiples of 16"
    if w.dtype != dtype or w.dtype not in _DTYPES:
        return f"weight dtype {w.dtype}: need one of {_DTYPES}, the same for every weight of a launch"
    return None


def runs_kernel(rows: int) -> bool:
    """Whether "auto" sends ``rows`` rows through the kernel here (on this backend)."""
    return kernel_mode("gemv", "auto", None if rows <= MAX_ROWS else "rows") is False


def padded_rows(rows: int) -> int:
    """Rows to hand "auto" for ``rows`` real ones so that it pads nothing: the kernel's tile rows where it runs,
    ``rows`` elsewhere. Zero rows in give zero rows out."""
    return kernel.padded_rows(rows) if runs_kernel(rows) else rows


def gemv(x: jax.Array | NormedRows, weights: tuple[jax.Array, ...], out_dtype=None, *, impl: Impl = "auto",
         **tuning) -> tuple[jax.Array, ...]:
    """x [..., K] times each w [K, N_i] -> ([..., N_i], ...) in ``out_dtype`` (default: the weight's dtype),
    accumulated in fp32. x as `NormedRows`: each product row divided by its rms (`NormedRows`)."""
    weights = tuple(weights)
    x, norm = _split_norm(x)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    reasons = [_unsupported(rows.shape[0], x.shape[-1], w, weights[0].dtype) for w in weights]
    if impl == "auto":  # the kernel for the weights that suit it
        suited = [r is None for r in reasons]
        reason = None if any(suited) else reasons[0]
    else:  # all or none: "kernel" and "interpret" raise on the first weight that does not suit
        suited = [True] * len(weights)
        reason = next((r for r in reasons if r is not None), None)
    interpret = kernel_mode("gemv", impl, reason)
    row_scale = None if norm is None else norm.row_scale()  # [M, 1]
    if interpret is None:
        ys = reference.gemv(rows, weights, out_dtype, row_scale)
    else:
        on_kernel = iter(kernel.gemv(rows, tuple(w for w, ok in zip(weights, suited, strict=True) if ok),
                                     out_dtype, *_kernel_norm(norm), interpret=interpret, **tuning))
        ys = tuple(next(on_kernel) if ok else reference.gemv(rows, (w,), out_dtype, row_scale)[0]
                   for w, ok in zip(weights, suited, strict=True))
    return tuple(y.reshape(*lead, y.shape[-1]) for y in ys)


def gemv_add(x: jax.Array, w: jax.Array, residual: jax.Array, arrivals: jax.Array, *,
             norm: tuple[jax.Array, float] | None = None, real_rows: int | None = None, impl: Impl = "auto",
             **tuning) -> tuple[jax.Array, NormedRows | None, jax.Array]:
    """residual + x w (the product rounded to w's dtype): x [..., K], w [K, N], residual [..., N] -> (out [..., N]
    fp32, normed, arrivals), in one launch on the kernel (`kernel.gemv_add`). ``norm`` = (weight [N], eps) of the
    zero-centred RMS norm that reads out next: where the kernel runs, ``normed`` is its output as `NormedRows`
    (None elsewhere: there XLA fuses the norm with the add, and the caller applies it).
    ``arrivals``: int32 zeros, at least N / 16, which the kernel counts K-splits in and leaves zeroed; thread
    them from call to call (the references pass them on). ``real_rows``: the kernel computes only the first rows
    of x's flattened rows (the others come out zero)."""
    lead = x.shape[:-1]
    k, n = w.shape
    rows = x.reshape(-1, k)  # [M, K]
    norm_weight, eps = norm or (None, None)
    reason = _unsupported(rows.shape[0], k, w, w.dtype)
    if reason is None and arrivals.shape[0] < n // 16:
        reason = f"arrivals: {arrivals.shape[0]} counters, need {n // 16}"
    interpret = kernel_mode("gemv_add", impl, reason)
    if interpret is None:
        return reference.gemv_add(rows, w, residual.reshape(-1, n))[0].reshape(*lead, n), None, arrivals
    y, scaled, sums, arrivals = kernel.gemv_add(rows, w, residual.reshape(-1, n), arrivals, norm_weight, real_rows,
                                                interpret=interpret, **tuning)
    normed = None if norm is None else NormedRows(scaled.reshape(*lead, n), sums, eps)
    return y.reshape(*lead, n), normed, arrivals


def gemv_swiglu(x: jax.Array | NormedRows, w_gate: jax.Array, w_up: jax.Array, *, impl: Impl = "auto",
                **tuning) -> jax.Array:
    """silu(x w_gate) * (x w_up): x [..., K] (or `NormedRows`, as `gemv`'s: both projections divided), w_gate /
    w_up [K, N] -> [..., N] in the weights' dtype, each projection rounded to that dtype before the product
    (`reference.swiglu_product`).

    "auto" fuses on a GPU only for shapes with tiles measured on the device (`tiles.SWIGLU`) and at most
    `tiles.SWIGLU_MAX_ROWS` rows; otherwise it runs `gemv` ("auto") and the product."""
    given = x
    x, norm = _split_norm(x)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    k, n = w_gate.shape
    reason = next((r for w in (w_gate, w_up) if (r := _unsupported(rows.shape[0], k, w, w_gate.dtype))), None)
    if reason is None and w_up.shape != w_gate.shape:
        reason = f"gate {w_gate.shape} and up {w_up.shape} differ"
    if reason is None and impl == "auto" and (k, n) not in SWIGLU.on():
        reason = f"no measured tuning for (K, N) = {(k, n)}"
    if reason is None and impl == "auto" and rows.shape[0] > SWIGLU_MAX_ROWS:
        reason = f"{rows.shape[0]} rows > {SWIGLU_MAX_ROWS}"
    interpret = kernel_mode("gemv_swiglu", impl, reason)
    if interpret is None:
        y = reference.swiglu_product(*gemv(given, (w_gate, w_up), impl=impl))
    else:
        y = kernel.gemv_swiglu(rows, w_gate, w_up, *_kernel_norm(norm), interpret=interpret, **tuning)
    return y.reshape(*lead, n)


__all__ = ["Impl", "MAX_ROWS", "NormedRows", "gemv", "gemv_add", "gemv_swiglu", "padded_rows", "runs_kernel"]
