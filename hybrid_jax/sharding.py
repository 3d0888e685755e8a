"""Tensor parallelism over ``jax.sharding``: logical axis names, and the one table mapping them to the mesh.

Parameters are placed with NamedShardings derived from logical axis names (the cache pools by
`caches.pools`); XLA's SPMD partitioner inserts the collectives. Kernels (custom calls XLA cannot partition)
run per shard inside ``shard_map`` in the engine's caches (`caches.paged`), the projections' row-parallel sums
with an explicit psum (`layers.projections.ShardedProjections`, split by `linear_splits`). Attention
heads, GDN value heads (with their key-head groups), the MLP intermediate and the vocabulary are split over
the ``tp`` mesh axis. When there are fewer KV heads than shards, each shard keeps its own copy of the KV
head its query heads read (as vLLM does).
"""

from __future__ import annotations

import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybrid_jax.config import Qwen35Config
from hybrid_jax.layers.linear import Linear

TP = "tp"

# Logical axis -> mesh axis. The one place to change how the model is split.
LOGICAL_TO_MESH: dict[str, str | None] = {
    "vocab": TP,
    "heads": TP,  # attention query heads (q_proj columns hold [q | gate] per head)
    "kv_heads": TP,  # only when Hkv >= tp; otherwise KV heads are expanded to one per shard
    "mlp": TP,
    "gdn_channels": TP,  # in_proj_qkv / conv channels
    "gdn_v_heads": TP,
    "embed": None,
}

# Parameter path pattern -> logical axes of its dims (None: not split).
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens\.weight$", ("vocab", "embed")),
    (r"lm_head\.kernel$", ("embed", "vocab")),
    (r"self_attn\.q_proj\.kernel$", ("embed", "heads")),
    (r"self_attn\.[kv]_proj\.kernel$", ("embed", "kv_heads")),
    (r"self_attn\.o_proj\.kernel$", ("heads", "embed")),
    (r"linear_attn\.in_proj_qkv\.kernel$", ("embed", "gdn_channels")),
    (r"linear_attn\.conv1d\.weight$", (None, "gdn_channels")),
    (r"linear_attn\.in_proj_[zab]\.kernel$", ("embed", "gdn_v_heads")),
    (r"linear_attn\.(A_log|dt_bias)$", ("gdn_v_heads",)),
    (r"linear_attn\.out_proj\.kernel$", ("gdn_v_heads", "embed")),
    (r"mlp\.(gate|up)_proj\.kernel$", ("embed", "mlp")),
    (r"mlp\.down_proj\.kernel$", ("mlp", "embed")),
)


def make_mesh(tp: int) -> Mesh:
    """A 1-D ``tp`` mesh over the first ``tp`` devices."""
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} but only {len(devices)} devices are visible")
    return Mesh(np.asarray(devices[:tp]), (TP,))


def check_divisible(config: Qwen35Config, tp: int) -> None:
    """Raise ValueError naming the head count that does not split over ``tp`` shards."""
    c = config
    checks = {
        "num_attention_heads": c.num_attention_heads,
        "linear_num_key_heads": c.linear_num_key_heads,
        "linear_num_value_heads": c.linear_num_value_heads,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
    }
    if c.num_key_value_heads >= tp:
        checks["num_key_value_heads"] = c.num_key_value_heads
    elif tp % c.num_key_value_heads:
        raise ValueError(f"num_key_value_heads={c.num_key_value_heads} does not divide tensor_parallel_size={tp}")
    for name, value in checks.items():
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by tensor_parallel_size={tp}")


def kv_heads_per_shard(config: Qwen35Config, tp: int) -> int:
    return max(config.num_key_value_heads // tp, 1)


def stored_kv_heads(config: Qwen35Config, tp: int) -> int:
    """KV heads in the pool: Hkv, or one per shard when Hkv < tp."""
    return max(config.num_key_value_heads, tp)


def expand_kv_heads(x: jax.Array, config: Qwen35Config, tp: int) -> jax.Array:
    """x [..., Hkv, hd] -> [..., tp, hd] when Hkv < tp: shard s gets the KV head its query heads read."""
    if config.num_key_value_heads >= tp:
        return x
    q_per_shard = config.num_attention_heads // tp
    group = config.num_attention_heads // config.num_key_value_heads
    head_of_shard = np.arange(tp) * q_per_shard // group
    return x[..., head_of_shard, :]


def spec(axes: tuple[str | None, ...], config: Qwen35Config | None = None, tp: int = 1) -> PartitionSpec:
    mesh_axes = []
    for axis in axes:
        target = LOGICAL_TO_MESH.get(axis) if axis else None
        if axis == "kv_heads" and config is not None and config.num_key_value_heads < tp:
            target = None  # projections stay whole; heads are expanded per shard after the projection
        mesh_axes.append(target)
    return PartitionSpec(*mesh_axes)


def param_spec(path: str, ndim: int, config: Qwen35Config, tp: int) -> PartitionSpec:
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, path):
            return spec(axes, config, tp)
    return PartitionSpec(*([None] * ndim))


def shard_model(model: nnx.Module, mesh: Mesh) -> None:
    """Place every parameter of ``model`` on ``mesh`` by the table above, in place."""
    tp = mesh.shape[TP]
    check_divisible(model.config, tp)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(str(p) for p in path)
        sharding = NamedSharding(mesh, param_spec(name, var.ndim, model.config, tp))
        var.set_value(jax.device_put(var.get_value(), sharding))


def linear_splits(model: nnx.Module, tp: int) -> dict[int, str | None]:
    """How the table splits each linear layer's kernel [in, out], by the layer's id: "out" (column-parallel),
    "in" (row-parallel: partial sums added over the shards) or None (whole on every shard)."""
    splits = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear):
            name = ".".join(str(p) for p in (*path, "kernel"))
            split_in, split_out = (*param_spec(name, 2, model.config, tp), None, None)[:2]
            splits[id(module)] = "in" if split_in == TP else "out" if split_out == TP else None
    return splits
