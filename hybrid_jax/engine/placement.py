"""Where the engine's arrays live: the mesh of tensor-parallel devices (the model sharded over it), the cache
pools' and the snapshot pool's shapes and shardings, and the batches' sharding (replicated). Without a mesh
every sharding is None: the arrays are uncommitted, on the default device."""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybrid_jax.caches.pools import is_pool_spec, pool_specs, snapshot_specs
from hybrid_jax.engine.cache import CacheLayout, allocate_pools
from hybrid_jax.engine.programs import ExecutableStore
from hybrid_jax.model import Qwen35ForCausalLM
from hybrid_jax.sharding import make_mesh, shard_model, stored_kv_heads


def place_model(model: Qwen35ForCausalLM, tp: int, weights_loaded: bool) -> Mesh | None:
    """The mesh of ``tp`` devices (None for one) with ``model`` sharded over it."""
    if tp == 1:
        return None
    if not weights_loaded:
        raise ValueError("tensor_parallel_size: an engine over a mesh needs its weights loaded first")
    mesh = make_mesh(tp)
    shard_model(model, mesh)
    return mesh


class Placement:
    """The pools' and snapshots' shapes and shardings for one cache layout over ``mesh`` (None: one device)."""

    def __init__(self, model: Qwen35ForCausalLM, layout: CacheLayout, mesh: Mesh | None, tp: int):
        config, dtype, vocab = model.config, model.dtype, model.config.vocab_size
        self.mesh = mesh
        specs = pool_specs(config, num_pages=layout.num_pages, page_size=layout.page_size, num_slots=layout.num_slots,
                           dtype=dtype, vocab=vocab, kv_heads=stored_kv_heads(config, tp))
        self.pool_shapes, self.pools = self._shapes(specs), self._shardings(specs)
        self.batch = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
        self.snapshot_shapes = self.snapshots = None
        if layout.num_snapshots:
            specs = snapshot_specs(config, num_snapshots=layout.num_snapshots, dtype=dtype, vocab=vocab)
            self.snapshot_shapes, self.snapshots = self._shapes(specs), self._shardings(specs)
        self.devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]

    @staticmethod
    def _shapes(specs) -> dict:
        return jax.tree.map(lambda p: p.struct(), specs, is_leaf=is_pool_spec)

    def _shardings(self, specs) -> dict | None:
        if self.mesh is None:
            return None
        return jax.tree.map(lambda p: NamedSharding(self.mesh, p.partition), specs, is_leaf=is_pool_spec)

    def pool_structs(self) -> dict:
        """The pools as the programs take them: shapes, dtypes and (under a mesh) shardings."""
        return _placed(self.pool_shapes, self.pools)

    def snapshot_structs(self) -> dict | None:
        """The snapshot pool as the programs take it (None without one)."""
        return None if self.snapshot_shapes is None else _placed(self.snapshot_shapes, self.snapshots)

    def allocate_pools(self, store: ExecutableStore | None = None) -> dict:
        """The cache pools, zeroed (the program that zeroes them kept in ``store``)."""
        return allocate_pools(self.pool_shapes, self.pools, store)

    def allocate_snapshots(self, store: ExecutableStore | None = None) -> dict | None:
        """The snapshot pool, zeroed (None without one)."""
        return None if self.snapshot_shapes is None else allocate_pools(self.snapshot_shapes, self.snapshots,
                                                                          store, "snapshots")


def _placed(shapes: dict, shardings: dict | None) -> dict:
    if shardings is None:
        return shapes
    return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes,
                        shardings)
