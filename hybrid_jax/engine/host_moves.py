"""The host tier's copies (see `host_tier`): one block's KV pages and one snapshot, read out of the pools into
host memory (pinned, so the copies run asynchronously) and written back, by four small programs."""

from __future__ import annotations

import jax
import numpy as np

from hybrid_jax.engine.host_tier import Move
from hybrid_jax.engine.placement import Placement
from hybrid_jax.engine.programs import ProgramSpec

HOST_MEMORY = "pinned_host"


def read_pages(pools: dict, page_ids: jax.Array) -> list[dict]:
    """page_ids [P] i32 -> each layer's {"k", "v"} [P, page_size, Hkv, hd] (attention) or {} (GDN)."""
    return [{k: layer[k][page_ids] for k in ("k", "v")} if "k" in layer else {} for layer in pools["layers"]]


def write_pages(pools: dict, page_ids: jax.Array, pages: list[dict]) -> dict:
    """The pools with ``pages`` (as `read_pages` returns them) written at page_ids [P]."""
    layers = [{k: layer[k].at[page_ids].set(block[k]) for k in layer} if block else layer
              for layer, block in zip(pools["layers"], pages, strict=True)]
    return {**pools, "layers": layers}


def read_snapshot(snapshots: dict, snapshot_ids: jax.Array) -> dict:
    """snapshot_ids [1] i32 -> the snapshot pool's rows there (every leaf [1, ...])."""
    return jax.tree.map(lambda pool: pool[snapshot_ids], snapshots)


def write_snapshot(snapshots: dict, snapshot_ids: jax.Array, rows: dict) -> dict:
    return jax.tree.map(lambda pool, row: pool.at[snapshot_ids].set(row), snapshots, rows)


def _to(memory_kind: str, tree):
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding.with_memory_kind(memory_kind)), tree)


class HostMoves:
    """The four programs' specs for the engine's `Programs`, and the copies of a queue of moves."""

    def __init__(self, placement: Placement, pages_per_block: int):
        self.pages_per_block = pages_per_block
        # Program keys: (name, rows copied).
        self.keys = (("host_read_pages", pages_per_block), ("host_write_pages", pages_per_block),
                     ("host_read_snapshot", 1), ("host_write_snapshot", 1))
        self.pool_shapes, self.snapshot_shapes = placement.pool_shapes, placement.snapshot_shapes
        rows = lambda n: jax.ShapeDtypeStruct((n,), np.int32, sharding=placement.batch)
        self.page_ids, self.snapshot_ids = rows(pages_per_block), rows(1)
        shape = lambda tree, n: jax.tree.map(lambda s: jax.ShapeDtypeStruct((n, *s.shape[1:]), s.dtype), tree)
        self.page_shapes = [layer if "k" in layer else {} for layer in shape(self.pool_shapes["layers"],
                                                                              pages_per_block)]
        self.row_shapes = shape(self.snapshot_shapes, 1)
        kw = [{}, {"donate_argnums": 0}, {}, {"donate_argnums": 0}]
        if placement.mesh is not None:  # the copies keep the pools' shardings, leading axis whole
            pools, snapshots, batch = placement.pools, placement.snapshots, placement.batch
            pages = [layer if "k" in layer else {} for layer in pools["layers"]]
            kw = [dict(in_shardings=(pools, batch), out_shardings=pages),
                  dict(kw[1], in_shardings=(pools, batch, pages), out_shardings=pools),
                  dict(in_shardings=(snapshots, batch), out_shardings=snapshots),
                  dict(kw[3], in_shardings=(snapshots, batch, snapshots), out_shardings=snapshots)]
        fns = (read_pages, write_pages, read_snapshot, write_snapshot)
        self.jitted = dict(zip(self.keys, (jax.jit(f, **k) for f, k in zip(fns, kw, strict=True)), strict=True))

    def specs(self, placed) -> dict[tuple, ProgramSpec]:
        """``placed``: a ShapeDtypeStruct as the engine's other programs take it (its sharding or none)."""
        pools = jax.tree.map(placed, self.pool_shapes)
        snapshots = jax.tree.map(placed, self.snapshot_shapes)
        args = ((pools, self.page_ids), (pools, self.page_ids, self.page_shapes), (snapshots, self.snapshot_ids),
                (snapshots, self.snapshot_ids, self.row_shapes))
        names = ("host tier: read a block", "host tier: write a block", "host tier: read a snapshot",
                 "host tier: write a snapshot")
        return {key: ProgramSpec(name, self.jitted[key], a, essential=True)
                for key, name, a in zip(self.keys, names, args, strict=True)}

    def round_trip(self, program, pools: dict, snapshots: dict) -> tuple[dict, dict]:
        """Run the four programs once (the warm-up): the null page and snapshot out and back, unchanged."""
        read_pages_key, write_pages_key, read_snapshot_key, write_snapshot_key = self.keys
        page_ids, snapshot_ids = np.zeros(self.pages_per_block, np.int32), np.zeros(1, np.int32)
        pages, rows = _to(HOST_MEMORY, (program(read_pages_key)(pools, page_ids),
                                        program(read_snapshot_key)(snapshots, snapshot_ids)))
        pages, rows = _to("device", (pages, rows))
        pools = program(write_pages_key)(pools, page_ids, pages)
        return pools, program(write_snapshot_key)(snapshots, snapshot_ids, rows)

    def run(self, moves: list[Move], program, pools: dict, snapshots: dict) -> tuple[dict, dict]:
        """Queue ``moves``' copies in order (``program(key)``: the built program); returns the new pools and
        snapshots. A copy out leaves its data in host memory on the block; a copy in reads it from there."""
        read_pages_key, write_pages_key, read_snapshot_key, write_snapshot_key = self.keys
        for move in moves:
            page_ids = np.asarray(move.pages, np.int32)
            snapshot_ids = np.asarray([move.snapshot], np.int32)
            if move.direction == "out":
                pages = program(read_pages_key)(pools, page_ids)
                rows = program(read_snapshot_key)(snapshots, snapshot_ids) if move.snapshot else None
                move.block.data = _to(HOST_MEMORY, (pages, rows))
            else:
                pages, rows = _to("device", move.block.data)
                pools = program(write_pages_key)(pools, page_ids, pages)
                if move.snapshot:
                    snapshots = program(write_snapshot_key)(snapshots, snapshot_ids, rows)
        return pools, snapshots
