"""How a forward runs its linear projections; the forward's cache hands it one (`caches.base.Cache.proj`).

- `XlaProjections`: XLA's dots, the model's own (GSPMD shards them, autodiff differentiates them).
- `FewRowProjections`: the few-row Pallas kernels of the engine's single-device steps (XLA's dots where the
  kernel does not run): each projection set one launch, the MLP's gate/up fused with its product, and each
  output/down projection added to the residual stream in its launch, which can also write the next RMS norm
  with its division deferred (`NormedRows`) to the projections that read it.
- `ShardedProjections`: the few-row kernel per shard inside shard_map (GSPMD cannot split a Pallas call),
  column-parallel weights giving their slice of the columns, row-parallel ones adding their partial sums over
  the shards; which weight splits which way comes from `sharding.linear_splits`.

All take x [..., in] (or `NormedRows`) and accumulate in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.norm import RMSNorm
from hybrid_jax.sharding import TP
from pallas_kernels.gemv import NormedRows, gemv, gemv_add, gemv_swiglu
from pallas_kernels.gemv.reference import gemv as xla_gemv
from pallas_kernels.gemv.reference import swiglu_product

F32 = jnp.float32


class XlaProjections:
    """XLA's dots; the residual adds and norms apart."""

    def project(self, x: jax.Array | NormedRows, layers: Sequence[Linear], out_dtype=None) -> tuple[jax.Array, ...]:
        """x through each of ``layers`` (same input width) -> ([..., out_i], ...) in ``out_dtype`` (default:
        the weights')."""
        weights = tuple(layer.kernel[...] for layer in layers)
        if isinstance(x, NormedRows):
            x = x.normalized(weights[0].dtype)
        return xla_gemv(x, weights, out_dtype)

    def swiglu(self, x: jax.Array | NormedRows, gate: Linear, up: Linear) -> jax.Array:
        """silu(gate(x)) * up(x) [..., N], rounded as HF's MLP rounds it."""
        return swiglu_product(*self.project(x, (gate, up)))

    def add_projection(self, residual: jax.Array, x: jax.Array, layer: Linear, *, next_norm: RMSNorm | None = None,
                       real_rows: int | None = None) -> tuple[jax.Array, NormedRows | None]:
        """residual [M, out] fp32 + layer(x) (rounded to the layer's dtype first) -> (that sum, ``next_norm`` of it
        as `NormedRows` where the launch writes it, else None: the caller applies the norm)."""
        return residual + self.project(x, (layer,))[0].astype(F32), None


class FewRowProjections(XlaProjections):
    """The few-row kernels, on one device. ``defer_norms``: the adds also write the norm that follows them.

    The adds' launches share arrival counters (zeroed again by each launch), threaded from call to call: make
    one of these per traced step."""

    def __init__(self, defer_norms: bool = False):
        self.defer_norms = defer_norms
        self._arrivals: jax.Array | None = None  # [out / 16] i32

    def project(self, x, layers, out_dtype=None):
        return gemv(x, tuple(layer.kernel[...] for layer in layers), out_dtype)

    def swiglu(self, x, gate, up):
        return gemv_swiglu(x, gate.kernel[...], up.kernel[...])

    def add_projection(self, residual, x, layer, *, next_norm=None, real_rows=None):
        """One `gemv_add` launch, which also sums its K-splits; rows past ``real_rows`` (padding) may come out
        zero."""
        if self._arrivals is None:
            self._arrivals = jnp.zeros(residual.shape[-1] // 16, jnp.int32)
        norm = None if next_norm is None or not self.defer_norms else (next_norm.weight[...], next_norm.eps)
        out, normed, self._arrivals = gemv_add(x, layer.kernel[...], residual, self._arrivals, norm=norm,
                                               real_rows=real_rows)
        return out, normed


class ShardedProjections(XlaProjections):
    """The few-row kernel on each shard's slice of the weights. ``splits``: each Linear's split ("out":
    column-parallel, "in": row-parallel, None: whole), by the Linear's id in the traced model."""

    def __init__(self, mesh: Mesh, splits: dict[int, str | None]):
        self.mesh, self.splits = mesh, splits

    def project(self, x, layers, out_dtype=None):
        weights = tuple(layer.kernel[...] for layer in layers)
        if isinstance(x, NormedRows):
            x = x.normalized(weights[0].dtype)
        splits = tuple(self.splits[id(layer)] for layer in layers)
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        if "in" in splits:
            if set(splits) != {"in"}:
                raise ValueError(f"project: row-parallel weights cannot share a call with others, got {splits}")

            def per_shard(x_part, *w_parts):  # x_part [M, K / tp], w_parts [K / tp, N]
                ys = gemv(x_part, w_parts, F32)
                return tuple(jax.lax.psum(y, TP).astype(out_dtype or w.dtype)
                             for y, w in zip(ys, w_parts, strict=True))

            in_specs = (P(None, TP), *[P(TP, None)] * len(weights))
            out_specs = (P(),) * len(weights)
        else:
            def per_shard(x_whole, *w_parts):  # x_whole [M, K], w_parts [K, N / tp] or [K, N]
                return gemv(x_whole, w_parts, out_dtype)

            in_specs = (P(), *[P(None, TP) if s == "out" else P() for s in splits])
            out_specs = tuple(P(None, TP) if s == "out" else P() for s in splits)
        ys = jax.shard_map(per_shard, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)(rows, *weights)
        return tuple(y.reshape(*lead, y.shape[-1]) for y in ys)
