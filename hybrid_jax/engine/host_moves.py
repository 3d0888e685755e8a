"""The host tier's copies (see `host_tier`): one block's KV pages and one snapshot read out of the pools into host
memory (pinned), and blocks written back, by four small programs. Each program does its own transfer (its
outputs or inputs live in host memory), so a copy is one queued call: the host never waits for it."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from hybrid_jax.engine.host_tier import Move
from hybrid_jax.engine.placement import Placement
from hybrid_jax.engine.programs import ProgramSpec

HOST_MEMORY = "pinned_host"
WRITE_GROUP = 16  # blocks a write program brings back per call (a hit's are grouped; the rest is padding)


def read_pages(pools: dict, page_ids: jax.Array) -> list[dict]:
    """page_ids [P] i32 -> each layer's {"k", "v"} [P, page_size, Hkv, hd] (attention) or {} (GDN)."""
    return [{k: layer[k][page_ids] for k in ("k", "v")} if "k" in layer else {} for layer in pools["layers"]]


def write_pages(pools: dict, page_ids: jax.Array, blocks: list[list[dict]]) -> dict:
    """The pools with ``blocks`` (G blocks' pages as `read_pages` returns them) written at page_ids [G * P]."""
    layers = []
    for index, layer in enumerate(pools["layers"]):
        if "k" in layer:
            layer = {k: layer[k].at[page_ids].set(jax.numpy.concatenate([b[index][k] for b in blocks]))
                     for k in layer}
        layers.append(layer)
    return {**pools, "layers": layers}


def read_snapshot(snapshots: dict, snapshot_ids: jax.Array) -> dict:
    """snapshot_ids [1] i32 -> the snapshot pool's rows there (every leaf [1, ...])."""
    return jax.tree.map(lambda pool: pool[snapshot_ids], snapshots)


def write_snapshot(snapshots: dict, snapshot_ids: jax.Array, rows: dict) -> dict:
    return jax.tree.map(lambda pool, row: pool.at[snapshot_ids].set(row), snapshots, rows)


def _moved(fn, memory_kind, shardings):
    """``fn`` whose outputs are moved (inside the program) to ``shardings`` in ``memory_kind``."""
    def moved(*args):
        return jax.device_put(fn(*args), jax.tree.map(lambda s: s.with_memory_kind(memory_kind), shardings))
    return moved


def _after_moving(fn, count, shardings):
    """``fn`` whose last ``count`` arguments (in host memory) are first moved to ``shardings`` on the device."""
    def moved(*args):
        return fn(*args[:-count], *jax.device_put(args[-count:], shardings))
    return moved


class HostMoves:
    """The four programs' specs for the engine's `Programs`, and the copies of a queue of moves."""

    def __init__(self, placement: Placement, pages_per_block: int):
        self.pages_per_block = pages_per_block
        # Program keys: (name, rows copied).
        self.keys = (("host_read_pages", pages_per_block), ("host_write_pages", pages_per_block * WRITE_GROUP),
                     ("host_read_snapshot", 1), ("host_write_snapshot", 1))
        self.pool_shapes, self.snapshot_shapes = placement.pool_shapes, placement.snapshot_shapes
        if placement.mesh is not None:  # the copies keep the pools' shardings, leading axis whole
            pools, snapshots, batch = placement.pools, placement.snapshots, placement.batch
        else:
            one = SingleDeviceSharding(placement.devices[0])
            pools, snapshots, batch = (jax.tree.map(lambda _: one, self.pool_shapes),
                                       jax.tree.map(lambda _: one, self.snapshot_shapes), one)
        pages = [layer if "k" in layer else {} for layer in pools["layers"]]
        host = lambda tree: jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), tree)
        rows = lambda n: jax.ShapeDtypeStruct((n,), np.int32, sharding=batch)
        self.page_ids, self.group_ids, self.snapshot_ids = (rows(pages_per_block),
                                                            rows(pages_per_block * WRITE_GROUP), rows(1))
        shape = lambda tree, n, sh: jax.tree.map(
            lambda s, h: jax.ShapeDtypeStruct((n, *s.shape[1:]), s.dtype, sharding=h), tree, sh)
        block_shapes = [layer if "k" in layer else {} for layer in self.pool_shapes["layers"]]
        self.page_shapes = shape(block_shapes, pages_per_block, host(pages))  # one block's, in host memory
        self.row_shapes = shape(self.snapshot_shapes, 1, host(snapshots))
        group = [pages] * WRITE_GROUP
        self.jitted = dict(zip(self.keys, (
            jax.jit(_moved(read_pages, HOST_MEMORY, pages), in_shardings=(pools, batch), out_shardings=host(pages)),
            jax.jit(_after_moving(write_pages, 1, (group,)), donate_argnums=0,
                    in_shardings=(pools, batch, host(group)), out_shardings=pools),
            jax.jit(_moved(read_snapshot, HOST_MEMORY, snapshots), in_shardings=(snapshots, batch),
                    out_shardings=host(snapshots)),
            jax.jit(_after_moving(write_snapshot, 1, (snapshots,)), donate_argnums=0,
                    in_shardings=(snapshots, batch, host(snapshots)), out_shardings=snapshots),
        ), strict=True))

    def specs(self, placed) -> dict[tuple, ProgramSpec]:
        """``placed``: a ShapeDtypeStruct as the engine's other programs take it (its sharding or none)."""
        pools = jax.tree.map(placed, self.pool_shapes)
        snapshots = jax.tree.map(placed, self.snapshot_shapes)
        args = ((pools, self.page_ids), (pools, self.group_ids, [self.page_shapes] * WRITE_GROUP),
                (snapshots, self.snapshot_ids), (snapshots, self.snapshot_ids, self.row_shapes))
        names = ("host tier: read a block", f"host tier: write {WRITE_GROUP} blocks", "host tier: read a snapshot",
                 "host tier: write a snapshot")
        return {key: ProgramSpec(name, self.jitted[key], a, essential=True)
                for key, name, a in zip(self.keys, names, args, strict=True)}

    def round_trip(self, program, pools: dict, snapshots: dict) -> tuple[dict, dict]:
        """Run the four programs once (the warm-up): the null page and snapshot out and back, unchanged."""
        read_pages_key, write_pages_key, read_snapshot_key, write_snapshot_key = self.keys
        page_ids, snapshot_ids = np.zeros(self.pages_per_block, np.int32), np.zeros(1, np.int32)
        pages = program(read_pages_key)(pools, page_ids)
        rows = program(read_snapshot_key)(snapshots, snapshot_ids)
        pools = program(write_pages_key)(pools, np.zeros(write_pages_key[1], np.int32), [pages] * WRITE_GROUP)
        return pools, program(write_snapshot_key)(snapshots, snapshot_ids, rows)

    def run(self, moves: list[Move], program, pools: dict, snapshots: dict) -> tuple[dict, dict]:
        """Queue ``moves``' copies in order (``program(key)``: the built program); returns the new pools and
        snapshots. A copy out leaves its data in host memory on the block; copies in read it from there, up to
        `WRITE_GROUP` blocks a call (the padding rewrites the null page)."""
        read_pages_key, write_pages_key, read_snapshot_key, write_snapshot_key = self.keys
        group: list[Move] = []

        def write_group():
            page_ids = np.zeros((WRITE_GROUP, self.pages_per_block), np.int32)
            page_ids[: len(group)] = [m.pages for m in group]
            blocks = [m.block.data[0] for m in group]
            return program(write_pages_key)(pools, page_ids.reshape(-1), blocks + blocks[:1] * (WRITE_GROUP -
                                                                                                len(blocks)))
        for move in moves:
            if move.direction == "out":
                if group:
                    pools, group = write_group(), []
                pages = program(read_pages_key)(pools, np.asarray(move.pages, np.int32))
                rows = (program(read_snapshot_key)(snapshots, np.asarray([move.snapshot], np.int32))
                        if move.snapshot else None)
                move.block.data = pages, rows
            else:
                group.append(move)
                if move.snapshot:
                    snapshots = program(write_snapshot_key)(snapshots, np.asarray([move.snapshot], np.int32),
                                                            move.block.data[1])
                if len(group) == WRITE_GROUP:
                    pools, group = write_group(), []
        if group:
            pools = write_group()
        return pools, snapshots
