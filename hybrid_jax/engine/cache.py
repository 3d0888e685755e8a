"""The cache pools' sizing and allocators (their shapes and splits: `caches.pools`): how many KV pages and
state slots fit, the free lists of page and slot ids (0 is the null page / slot), page-table rows."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.config import Qwen35Config
from hybrid_jax.engine.programs import ExecutableStore, stored_program

F32 = jnp.float32


@dataclass(frozen=True)
class CacheLayout:
    num_pages: int  # including the null page 0
    page_size: int
    num_slots: int  # including the null slot 0
    max_pages_per_seq: int
    num_snapshots: int = 0  # GDN state snapshots of the prefix cache, including the null snapshot 0 (0: none)


def slot_bytes(config: Qwen35Config, dtype, vocab: int) -> int:
    """Device bytes one request slot takes: GDN conv + recurrent state over all GDN layers, penalty counts, the
    grammar bitmask."""
    c = config
    per_layer = c.linear_conv_kernel_dim * c.conv_dim * jnp.dtype(dtype).itemsize
    per_layer += c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    return per_layer * len(c.linear_layers) + vocab * 5 + _grammar_mask_bytes(vocab)


def _grammar_mask_bytes(vocab: int) -> int:
    return -(-vocab // 32) * 4


def snapshot_bytes(config: Qwen35Config, dtype, vocab: int) -> int:
    """Device bytes one state snapshot takes: a slot's GDN conv + recurrent state and its prompt mask."""
    return slot_bytes(config, dtype, vocab) - vocab * 4 - _grammar_mask_bytes(vocab)


def page_bytes(config: Qwen35Config, dtype, page_size: int) -> int:
    """Device bytes of one KV page over all attention layers."""
    c = config
    return 2 * page_size * c.num_key_value_heads * c.head_dim * jnp.dtype(dtype).itemsize * len(c.attention_layers)


def page_device_bytes(config: Qwen35Config, dtype, page_size: int, tp: int = 1) -> float:
    """Bytes of one KV page on each of ``tp`` devices (KV heads split over them, each shard holding at least one)."""
    kv_heads = config.num_key_value_heads
    return page_bytes(config, dtype, page_size) * max(kv_heads, tp) / (kv_heads * tp)


def memory_report(layout: CacheLayout, config: Qwen35Config, dtype, vocab: int, tp: int = 1) -> str:
    """One line on the KV pool and the prefix cache's snapshot pool: their sizes in tokens, snapshots and GiB per
    device (the start-up log's)."""
    gib = lambda n: f"{n / 2**30:.2f} GiB"
    pages = layout.num_pages - 1
    kv = pages * page_device_bytes(config, dtype, layout.page_size, tp)
    where = " per device" if tp > 1 else ""
    tokens = pages * layout.page_size
    line = f"KV cache: {pages:,} pages of {layout.page_size} tokens ({tokens:,} tokens, {gib(kv)}{where})"
    if not layout.num_snapshots:
        return line
    snapshots = layout.num_snapshots - 1
    return (f"{line}, shared by running requests and cached prefix blocks; {snapshots:,} GDN state snapshots "
            f"({gib(snapshots * snapshot_bytes(config, dtype, vocab) / tp)})")


def allocate_pools(shapes: dict, shardings: dict | None = None, store: ExecutableStore | None = None,
                   name: str = "pools") -> dict:
    """Zeroed pools, each created directly with its sharding (never whole on one device first), by one program
    per layout and process (a `jnp.zeros` each compiles one per shape), kept in ``store`` across restarts."""
    leaves, tree = jax.tree.flatten(shapes)
    specs = tuple((tuple(s.shape), jnp.dtype(s.dtype)) for s in leaves)
    placed = None if shardings is None else tuple(jax.tree.leaves(shardings))
    return jax.tree.unflatten(tree, _zeros(specs, placed, store, name)())


@functools.cache
def _zeros(specs: tuple, shardings: tuple | None, store: ExecutableStore | None, name: str) -> jax.stages.Compiled:
    """The program making zeroed arrays of ``specs`` ((shape, dtype) each), placed by ``shardings``."""
    fn = jax.jit(lambda: [jnp.zeros(shape, dtype) for shape, dtype in specs],
                 out_shardings=None if shardings is None else list(shardings))
    return stored_program(store, f"zeroed {name}", {"pools": repr(specs), "shardings": repr(shardings)}, fn, ())


class BlockAllocator:
    """Free list of ids 1..n-1 (id 0 is the null block and is never handed out)."""

    def __init__(self, n: int):
        self.capacity = n - 1
        self._free = list(range(n - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} blocks, {len(self._free)} free")
        taken = self._free[-count:] if count else []
        del self._free[len(self._free) - count:]
        return taken[::-1]

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


def device_memory_limit() -> int | None:
    """The bytes JAX's allocator may hold on the first device, when the backend reports it (GPUs do, CPUs do
    not). A constant of the device and the process's settings: a plan from it is the same before and after the
    weights load, so the pools' shapes (and with them the stored programs' keys) are too."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return None if limit is None else int(limit)


def weight_device_bytes(weights: list) -> int:
    """Bytes the weights take on one device: their whole size unloaded (an engine over a mesh loads first),
    the first device's shards loaded."""
    if any(isinstance(w, jax.ShapeDtypeStruct) for w in weights):
        return sum(w.size * w.dtype.itemsize for w in weights)
    device = jax.devices()[0]
    return sum(s.data.nbytes for w in weights for s in w.addressable_shards if s.device == device)


def plan_layout(config: Qwen35Config, dtype, vocab: int, *, max_batch: int, max_model_len: int, page_size: int,
                memory_utilization: float, num_pages: int | None = None, tp: int = 1,
                weight_bytes: int = 0, snapshot_share: float = 0.0,
                num_snapshots: int | None = None) -> CacheLayout:
    """Reserve slots for ``max_batch`` requests first, then give the KV pool what memory remains besides the
    weights (``weight_bytes`` per device, loaded or not), less ``snapshot_share`` of it for the prefix cache's
    state snapshots (0: no snapshot pool).

    Without a device memory figure (CPU) or with ``num_pages`` given, the KV pool holds ``num_pages``
    (default: enough for every slot to reach ``max_model_len``) and the snapshot pool ``num_snapshots``
    (default: 4 per slot).
    """
    max_pages_per_seq = -(-max_model_len // page_size)
    num_slots = max_batch + 1
    limit = device_memory_limit() if num_pages is None or num_snapshots is None else None
    if snapshot_share <= 0:
        num_snapshots = 0
    elif num_snapshots is None and (limit is None or num_pages is not None):
        num_snapshots = 4 * max_batch + 1
    if num_pages is None:
        if limit is None:
            num_pages = max_batch * max_pages_per_seq + 1
        else:
            # Per device: state slots and KV pages split over ``tp`` shards (KV heads at least one per shard).
            budget = (limit - weight_bytes) * memory_utilization - num_slots * slot_bytes(config, dtype, vocab) / tp
            per_page = page_device_bytes(config, dtype, page_size, tp)
            if num_snapshots is None:
                num_snapshots = int(budget * snapshot_share // (snapshot_bytes(config, dtype, vocab) / tp)) + 1
            budget -= (num_snapshots - 1) * snapshot_bytes(config, dtype, vocab) / tp if num_snapshots else 0
            num_pages = int(budget // per_page)
            if num_pages < max_pages_per_seq + 1:
                raise MemoryError(f"after {num_slots} state slots, memory for only {num_pages} KV pages of "
                                  f"{page_size} tokens remains; lower max_batch or max_model_len")
    return CacheLayout(num_pages=int(num_pages), page_size=page_size, num_slots=num_slots,
                       max_pages_per_seq=max_pages_per_seq, num_snapshots=int(num_snapshots))


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def page_table_row(pages: list[int], width: int) -> np.ndarray:
    row = np.zeros(width, np.int32)
    row[: len(pages)] = pages
    return row
