"""The engine's cache pools, described once: each pool's shape, dtype and how tensor parallelism splits it.

Full-attention layers: a paged KV pool per layer, ``[num_pages, page_size, Hkv, hd]``. GDN layers: a
state-slot pool per layer, conv ``[num_slots, K, C]`` (model dtype; a ring of the last raw columns,
position t at column t mod K) and recurrent ``[num_slots, Hv, dk, dv]`` fp32. Page 0 and slot 0 are null:
padded rows of a fixed-shape batch read and write there. The slots also hold each request's token statistics
for the sampling penalties and its grammar's next-token bitmask (structured outputs). The prefix cache's
snapshot pool holds copies of a slot's GDN state and prompt mask (snapshot 0 null too), the rings of every
GDN layer stacked in one array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hybrid_jax.config import FULL_ATTENTION, Qwen35Config
from hybrid_jax.sharding import TP

KV_PAGES = P(None, None, TP, None)  # [pages, page_size, kv heads, hd]: split by KV head
CONV_RING = P(None, None, TP)  # [slots, K, C]: split by channel
STATE = P(None, TP, None, None)  # [slots, Hv, dk, dv]: split by value head
WHOLE = P()


@dataclass(frozen=True)
class PoolSpec:
    shape: tuple[int, ...]
    dtype: Any
    partition: P  # over the mesh's ``tp`` axis

    def struct(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype)


def pool_specs(config: Qwen35Config, *, num_pages: int, page_size: int, num_slots: int, dtype, vocab: int,
               kv_heads: int | None = None) -> dict:
    """{"layers": per-layer {"k", "v"} or {"conv", "state"}, "output_counts": [slots, V] i32, "prompt_mask":
    [slots, V] bool, "grammar_mask": [slots, ceil(V/32)] i32}, each a `PoolSpec`. ``kv_heads``: the KV heads
    the pool stores (more than the model's when tensor parallelism gives each shard its own copy)."""
    c = config
    layers = []
    for t in c.layer_types:
        if t == FULL_ATTENTION:
            kv = PoolSpec((num_pages, page_size, kv_heads or c.num_key_value_heads, c.head_dim), dtype, KV_PAGES)
            layers.append({"k": kv, "v": kv})
        else:
            layers.append({
                "conv": PoolSpec((num_slots, c.linear_conv_kernel_dim, c.conv_dim), dtype, CONV_RING),
                "state": PoolSpec((num_slots, c.linear_num_value_heads, c.linear_key_head_dim,
                                   c.linear_value_head_dim), jnp.float32, STATE),
            })
    return {"layers": layers,
            "output_counts": PoolSpec((num_slots, vocab), jnp.int32, WHOLE),
            "prompt_mask": PoolSpec((num_slots, vocab), jnp.bool_, WHOLE),
            "grammar_mask": PoolSpec((num_slots, -(-vocab // 32)), jnp.int32, WHOLE)}


def snapshot_specs(config: Qwen35Config, *, num_snapshots: int, dtype, vocab: int) -> dict:
    """The snapshot pool: {"layers": per-layer {"state"} (GDN layers) or {} (attention), "conv": [snapshots,
    L K, C], every GDN layer's ring (the g-th GDN layer's at rows g K .. g K + K - 1, so that a prefill step
    writes them all with one scatter), "prompt_mask": [snapshots, V] bool}, each a `PoolSpec` shaped as the slot
    pool's with ``num_snapshots`` rows."""
    slots = pool_specs(config, num_pages=1, page_size=1, num_slots=num_snapshots, dtype=dtype, vocab=vocab)
    layers = [{} if t == FULL_ATTENTION else {"state": layer["state"]}
              for t, layer in zip(config.layer_types, slots["layers"], strict=True)]
    num_gdn = sum(bool(layer) for layer in layers)
    conv = PoolSpec((num_snapshots, num_gdn * config.linear_conv_kernel_dim, config.conv_dim), dtype, CONV_RING)
    return {"layers": layers, "conv": conv, "prompt_mask": slots["prompt_mask"]}


def gdn_ordinals(snapshot_layers: list[dict]) -> dict[int, int]:
    """Layer index -> its rank among the GDN layers (which ring of the snapshot pool's "conv" is its own)."""
    gdn = [index for index, layer in enumerate(snapshot_layers) if layer]
    return {index: rank for rank, index in enumerate(gdn)}


def is_pool_spec(x) -> bool:
    return isinstance(x, PoolSpec)
