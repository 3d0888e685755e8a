"""Bias-free linear layer with the kernel stored ``[in, out]`` (HF stores ``[out, in]``), and `project`: one
input through several linear layers, as one Pallas launch inside `few_row_kernel()`."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from flax import nnx

from pallas_kernels.gemv import gemv
from pallas_kernels.gemv.reference import gemv as xla_gemv

_FEW_ROW_KERNEL = contextvars.ContextVar("few_row_kernel", default=False)


@contextlib.contextmanager
def few_row_kernel(enabled: bool = True) -> Iterator[None]:
    """While tracing inside, `project` (and every Linear) runs through the Pallas few-row kernel (on a GPU, for
    at most its row limit; XLA otherwise). The engine's single-device steps trace inside it; the model's own
    forward keeps XLA's dot, which GSPMD shards and autodiff differentiates."""
    token = _FEW_ROW_KERNEL.set(enabled)
    try:
        yield
    finally:
        _FEW_ROW_KERNEL.reset(token)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, dtype, *, rngs: nnx.Rngs):
        std = in_features**-0.5
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (in_features, out_features), dtype) * std)

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        """x [..., in] -> [..., out] in ``out_dtype`` (default: the kernel's dtype); fp32 accumulation."""
        return project(x, (self,), out_dtype)[0]


def project(x: jax.Array, layers: Sequence[Linear], out_dtype=None) -> tuple[jax.Array, ...]:
    """x [..., in] through each of ``layers`` (same input width) -> ([..., out_i], ...), fp32 accumulation."""
    weights = tuple(layer.kernel[...] for layer in layers)
    return (gemv if _FEW_ROW_KERNEL.get() else xla_gemv)(x, weights, out_dtype)
