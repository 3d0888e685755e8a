"""Bias-free linear layer with the kernel stored ``[in, out]`` (HF stores ``[out, in]``), and `project`: one
input through several linear layers, as one Pallas launch inside `few_row_kernel()` (per shard, under a mesh);
`swiglu`: the MLP's gate/up pair and its product, fused there too where the kernel is tuned for the shape;
`add_projection`: a projection added to the residual stream, its K-splits summed in the same launch there, which
also writes the next RMS norm with its division deferred to the projections that read it (`NormedRows`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hybrid_jax.layers.norm import RMSNorm
from hybrid_jax.sharding import TP
from pallas_kernels.gemv import NormedRows, gemv, gemv_add, gemv_swiglu
from pallas_kernels.gemv.reference import gemv as xla_gemv
from pallas_kernels.gemv.reference import swiglu_product

_FEW_ROW_KERNEL: contextvars.ContextVar[tuple[bool, Mesh | None]] = contextvars.ContextVar(
    "few_row_kernel", default=(False, None))


@contextlib.contextmanager
def few_row_kernel(enabled: bool = True, mesh: Mesh | None = None) -> Iterator[None]:
    """While tracing inside, `project` (and every Linear) runs through the Pallas few-row kernel (on a GPU, for
    at most its row limit; XLA otherwise), per shard inside shard_map when the weights live on ``mesh``
    (GSPMD cannot split a Pallas call). The engine's steps trace inside it; the model's own forward keeps
    XLA's dot, which GSPMD shards and autodiff differentiates."""
    token = _FEW_ROW_KERNEL.set((enabled, mesh))
    try:
        yield
    finally:
        _FEW_ROW_KERNEL.reset(token)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, dtype, *, std: float, rngs: nnx.Rngs):
        """The kernel drawn from normal(0, std), as HF initializes nn.Linear."""
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (in_features, out_features), dtype) * std)
        # Which dimension of the kernel tensor parallelism splits: "out" (column-parallel), "in" (row-parallel,
        # partial sums added over the shards) or None (whole on every shard); set by `sharding.shard_model`.
        self.tp_split: str | None = None

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        """x [..., in] -> [..., out] in ``out_dtype`` (default: the kernel's dtype); fp32 accumulation."""
        return project(x, (self,), out_dtype)[0]


def project(x: jax.Array | NormedRows, layers: Sequence[Linear], out_dtype=None) -> tuple[jax.Array, ...]:
    """x [..., in] through each of ``layers`` (same input width) -> ([..., out_i], ...), fp32 accumulation.
    `NormedRows`: each output row divided by its rms where the kernel runs; the normed rows made first elsewhere."""
    weights = tuple(layer.kernel[...] for layer in layers)
    enabled, mesh = _FEW_ROW_KERNEL.get()
    if isinstance(x, NormedRows) and not (enabled and mesh is None):
        x = x.normalized(weights[0].dtype)
    if not enabled:
        return xla_gemv(x, weights, out_dtype)
    if mesh is None:
        return gemv(x, weights, out_dtype)
    return _sharded_gemv(x, weights, tuple(layer.tp_split for layer in layers), mesh, out_dtype)


def arrival_counters(width: int) -> jax.Array:
    """Zeroed counters for `add_projection`s whose outputs are ``width`` wide; each call leaves them zeroed, so one
    set serves a whole step, passed from call to call."""
    return jnp.zeros(width // 16, jnp.int32)


def add_projection(residual: jax.Array, x: jax.Array, layer: Linear, arrivals: jax.Array, *,
                   next_norm: RMSNorm | None = None,
                   real_rows: int | None = None) -> tuple[jax.Array, NormedRows | None, jax.Array]:
    """residual [M, out] + layer(x) in fp32 (the projection rounded to the layer's dtype first) -> (that sum,
    ``next_norm`` of it as `NormedRows` where the kernel ran (else None: apply the norm), the counters for the
    next call): inside `few_row_kernel()` (no mesh) one `gemv_add` launch, which also sums its K-splits, where the
    kernel runs; there rows past ``real_rows`` (padding) may come out zero."""
    enabled, mesh = _FEW_ROW_KERNEL.get()
    if enabled and mesh is None:
        norm = None if next_norm is None else (next_norm.weight[...], next_norm.eps)
        return gemv_add(x, layer.kernel[...], residual, arrivals, norm=norm, real_rows=real_rows)
    return residual + layer(x).astype(jnp.float32), None, arrivals


def swiglu(x: jax.Array | NormedRows, gate: Linear, up: Linear) -> jax.Array:
    """silu(gate(x)) * up(x) [..., N] rounded as HF's MLP rounds it; one fused launch inside `few_row_kernel()`
    (no mesh). x as `project`'s."""
    enabled, mesh = _FEW_ROW_KERNEL.get()
    if enabled and mesh is None:
        return gemv_swiglu(x, gate.kernel[...], up.kernel[...])
    return swiglu_product(*project(x, (gate, up)))


def _sharded_gemv(x: jax.Array, weights: tuple[jax.Array, ...], splits: tuple[str | None, ...], mesh: Mesh,
                  out_dtype) -> tuple[jax.Array, ...]:
    """`gemv` on each shard's slice of the weights: column-parallel (and whole) weights take x whole and give
    their slice of the output columns; row-parallel ones take x's matching slice and add their fp32 partial
    products over the shards."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if "in" in splits:
        if set(splits) != {"in"}:
            raise ValueError(f"project: row-parallel weights cannot share a call with others, got {splits}")

        def per_shard(x_part, *w_parts):  # x_part [M, K / tp], w_parts [K / tp, N]
            ys = gemv(x_part, w_parts, jnp.float32)
            return tuple(jax.lax.psum(y, TP).astype(out_dtype or w.dtype) for y, w in zip(ys, w_parts, strict=True))

        in_specs = (P(None, TP), *[P(TP, None)] * len(weights))
        out_specs = (P(),) * len(weights)
    else:
        def per_shard(x_whole, *w_parts):  # x_whole [M, K], w_parts [K, N / tp] or [K, N]
            return gemv(x_whole, w_parts, out_dtype)

        in_specs = (P(), *[P(None, TP) if s == "out" else P() for s in splits])
        out_specs = tuple(P(None, TP) if s == "out" else P() for s in splits)
    ys = jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(rows, *weights)
    return tuple(y.reshape(*lead, y.shape[-1]) for y in ys)
