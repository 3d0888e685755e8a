"""The host tier's copies (see `host_tier`): blocks' KV pages read out of the pools into host memory (pinned) and
written back, `GROUP` blocks a call, and snapshots, one a call, by four small programs. A call's fixed cost is
most of a block's copy, hence the groups (BENCHMARKS, host-tier copies); in host memory a block is one array
and a snapshot three, since each array is a copy of its own. Going out, a device-only program gathers
the pages or the snapshot's rows into buffers of their own (later writes to the pools cannot reach them) and a
copy thread moves those to host memory by `jax.device_put` once they are computed (`to_host`): a copy to host
memory, by `device_put` or by a program whose outputs live there, returns only once the device has reached it,
which would hold the engine thread behind the device's queue. Coming back, pages are written by a program whose
inputs live in host memory, a snapshot by `device_put` to the device beside a device-only scatter (BENCHMARKS).
Device calls are queued in the order of the moves."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybrid_jax.engine.host_tier import Move
from hybrid_jax.engine.placement import Placement
from hybrid_jax.engine.programs import ProgramSpec

HOST_MEMORY = "pinned_host"
GROUP = 16  # blocks a page program copies per call (the moves' blocks, then padding at the null page 0)


def read_pages(pools: dict, page_ids: jax.Array, group: int) -> list[jax.Array]:
    """page_ids [G * P] i32 -> per block, its pages of every attention layer in one array [2 A, P, page_size,
    Hkv, hd] (layer i's k at 2 i, its v at 2 i + 1): one copy to host memory a block."""
    pages = [layer[k][page_ids] for layer in pools["layers"] if "k" in layer for k in ("k", "v")]  # [G P, ...]
    stacked = jnp.stack(pages)  # [2 A, G P, page_size, Hkv, hd]
    return jnp.split(stacked, group, axis=1)


def write_pages(pools: dict, page_ids: jax.Array, blocks: list[jax.Array]) -> dict:
    """The pools with ``blocks`` (G blocks as `read_pages` returns them) written at page_ids [G * P]."""
    stacked = jnp.concatenate(blocks, axis=1)  # [2 A, G P, ...]
    layers, index = [], 0
    for layer in pools["layers"]:
        if "k" in layer:
            layer = {k: layer[k].at[page_ids].set(stacked[index + i]) for i, k in enumerate(("k", "v"))}
            index += 2
        layers.append(layer)
    return {**pools, "layers": layers}


def read_snapshot(snapshots: dict, snapshot_ids: jax.Array) -> dict:
    """snapshot_ids [1] i32 -> the snapshot pool's rows there as a few arrays: {"conv": [1, L K, C], "state":
    [L, 1, Hv, dk, dv] (the L GDN layers'), "prompt_mask": [1, V]}."""
    gdn = [layer for layer in snapshots["layers"] if layer]
    return {"conv": snapshots["conv"][snapshot_ids],
            "state": jnp.stack([layer["state"][snapshot_ids] for layer in gdn]),
            "prompt_mask": snapshots["prompt_mask"][snapshot_ids]}


def write_snapshot(snapshots: dict, snapshot_ids: jax.Array, rows: dict) -> dict:
    """The snapshot pool with ``rows`` (as `read_snapshot` returns them) written at snapshot_ids [1]."""
    layers, index = [], 0
    for layer in snapshots["layers"]:
        if layer:
            layer = {"state": layer["state"].at[snapshot_ids].set(rows["state"][index])}
            index += 1
        layers.append(layer)
    return {"layers": layers, **{k: snapshots[k].at[snapshot_ids].set(rows[k]) for k in ("conv", "prompt_mask")}}


def stacked(sharding):
    """The sharding of an array stacking arrays of ``sharding`` along a new leading axis."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return sharding


def to_host(tree, shardings):
    """``tree`` copied to host memory (the copy thread's job): once the device has computed it, so that the copy's
    call, which returns only when the device reaches it, does not wait behind the device's queue."""
    return jax.device_put(jax.block_until_ready(tree), shardings)


class GroupPart(NamedTuple):
    """Block ``index`` of a group of pages on its way to host memory (the copy thread's future of the group)."""

    group: Future
    index: int

    def result(self) -> jax.Array:
        return self.group.result()[self.index]


class HostMoves:
    """The four programs' specs for the engine's `Programs`, and the copies of a queue of moves."""

    def __init__(self, placement: Placement, pages_per_block: int):
        self.pages_per_block = pages_per_block
        self._copies = ThreadPoolExecutor(1, thread_name_prefix="hybrid-jax-host-copies")  # the copies out, in order
        # Program keys: (name, rows copied).
        self.keys = (("host_read_pages", pages_per_block * GROUP), ("host_write_pages", pages_per_block * GROUP),
                     ("host_read_snapshot", 1), ("host_write_snapshot", 1))
        self.pool_shapes, self.snapshot_shapes = placement.pool_shapes, placement.snapshot_shapes
        if placement.mesh is not None:  # the copies keep the pools' shardings, leading axis whole
            pools, snapshots, batch = placement.pools, placement.snapshots, placement.batch
        else:
            # Every array whole on the one device.
            one = NamedSharding(Mesh(np.array(placement.devices[:1]), ("one",)), PartitionSpec())
            pools, snapshots, batch = (jax.tree.map(lambda _: one, self.pool_shapes),
                                       jax.tree.map(lambda _: one, self.snapshot_shapes), one)
        host = lambda tree: jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), tree)
        rows = lambda n: jax.ShapeDtypeStruct((n,), np.int32, sharding=batch)
        self.group_ids, self.snapshot_ids = rows(pages_per_block * GROUP), rows(1)
        # A block's pages and a snapshot's rows as `read_pages` and `read_snapshot` give them.
        kv = next(i for i, layer in enumerate(self.pool_shapes["layers"]) if "k" in layer)
        kv_shape, kv_sharding = self.pool_shapes["layers"][kv]["k"], stacked(pools["layers"][kv]["k"])
        attention = sum("k" in layer for layer in self.pool_shapes["layers"])
        block = host(kv_sharding)
        self.page_shapes = jax.ShapeDtypeStruct((2 * attention, pages_per_block, *kv_shape.shape[1:]),
                                                kv_shape.dtype, sharding=block)  # one block's, in host memory
        gdn = next(i for i, layer in enumerate(self.snapshot_shapes["layers"]) if layer)
        num_gdn = sum(bool(layer) for layer in self.snapshot_shapes["layers"])
        self.device_rows = {"conv": snapshots["conv"], "state": stacked(snapshots["layers"][gdn]["state"]),
                            "prompt_mask": snapshots["prompt_mask"]}
        row_shape = lambda s, n, h: jax.ShapeDtypeStruct((*n, 1, *s.shape[1:]), s.dtype, sharding=h)
        self.row_shapes = {  # a snapshot's, on the device
            "state": row_shape(self.snapshot_shapes["layers"][gdn]["state"], (num_gdn,), self.device_rows["state"]),
            **{k: row_shape(self.snapshot_shapes[k], (), self.device_rows[k]) for k in ("conv", "prompt_mask")}}
        self.host_rows = host(self.device_rows)
        group = [kv_sharding] * GROUP
        self.host_group = [block] * GROUP

        def read_group(pools, page_ids):
            return read_pages(pools, page_ids, GROUP)

        def write_group(pools, page_ids, blocks):
            return write_pages(pools, page_ids, jax.device_put(blocks, group))

        self.jitted = dict(zip(self.keys, (
            jax.jit(read_group, in_shardings=(pools, batch), out_shardings=group),
            jax.jit(write_group, donate_argnums=0, in_shardings=(pools, batch, self.host_group), out_shardings=pools),
            jax.jit(read_snapshot, in_shardings=(snapshots, batch), out_shardings=self.device_rows),
            jax.jit(write_snapshot, donate_argnums=0, in_shardings=(snapshots, batch, self.device_rows),
                    out_shardings=snapshots),
        ), strict=True))

    def specs(self, placed) -> dict[tuple, ProgramSpec]:
        """``placed``: a ShapeDtypeStruct as the engine's other programs take it (its sharding or none)."""
        pools = jax.tree.map(placed, self.pool_shapes)
        snapshots = jax.tree.map(placed, self.snapshot_shapes)
        args = ((pools, self.group_ids), (pools, self.group_ids, [self.page_shapes] * GROUP),
                (snapshots, self.snapshot_ids), (snapshots, self.snapshot_ids, self.row_shapes))
        names = (f"host tier: read {GROUP} blocks", f"host tier: write {GROUP} blocks", "host tier: read a snapshot",
                 "host tier: write a snapshot")
        return {key: ProgramSpec(name, self.jitted[key], a, essential=True)
                for key, name, a in zip(self.keys, names, args, strict=True)}

    def round_trip(self, program, pools: dict, snapshots: dict) -> tuple[dict, dict]:
        """Run the four programs once (the warm-up): the null page and snapshot out and back, unchanged."""
        read_pages_key, write_pages_key, read_snapshot_key, write_snapshot_key = self.keys
        page_ids, snapshot_ids = np.zeros(read_pages_key[1], np.int32), np.zeros(1, np.int32)
        blocks = jax.device_put(program(read_pages_key)(pools, page_ids), self.host_group)
        rows = jax.device_put(program(read_snapshot_key)(snapshots, snapshot_ids), self.host_rows)
        pools = program(write_pages_key)(pools, page_ids, blocks)
        rows = jax.device_put(rows, self.device_rows)
        return pools, program(write_snapshot_key)(snapshots, snapshot_ids, rows)

    @staticmethod
    def host_data(block) -> tuple:
        """A host block's (pages, snapshot rows or None) in host memory, once its copies out are done (waits)."""
        return tuple(None if part is None else part.result() for part in block.data)

    def run(self, moves: list[Move], program, pools: dict, snapshots: dict) -> tuple[dict, dict]:
        """Queue ``moves``' copies in order (``program(key)``: the built program); returns the new pools and
        snapshots. A copy out leaves its data on the block (``block.data``: the copy thread's futures of its pages
        and of its snapshot's rows, or None: `host_data`); copies in read it from there.
        Pages move `GROUP` blocks a call: a group of one direction is flushed before a move of the other, so no
        copy passes one that reads or writes the same pages."""
        read_pages_key, write_pages_key, read_snapshot_key, write_snapshot_key = self.keys
        group: list[tuple[Move, object]] = []  # (move, the future of its snapshot's rows, or None)

        def page_ids() -> np.ndarray:
            ids = np.zeros((GROUP, self.pages_per_block), np.int32)
            ids[: len(group)] = [m.pages for m, _ in group]
            return ids.reshape(-1)

        def flush(pools: dict) -> dict:
            if group and group[0][0].direction == "out":
                gathered = program(read_pages_key)(pools, page_ids())[: len(group)]
                copied = self._copies.submit(to_host, gathered, self.host_group[: len(group)])
                for index, (move, rows) in enumerate(group):
                    move.block.data = GroupPart(copied, index), rows
            elif group:
                blocks = [self.host_data(m.block)[0] for m, _ in group]
                pools = program(write_pages_key)(pools, page_ids(), blocks + blocks[:1] * (GROUP - len(blocks)))
            group.clear()
            return pools

        for move in moves:
            if group and group[0][0].direction != move.direction:
                pools = flush(pools)
            rows = None
            if move.direction == "out" and move.snapshot:
                gathered = program(read_snapshot_key)(snapshots, np.asarray([move.snapshot], np.int32))
                rows = self._copies.submit(to_host, gathered, self.host_rows)
            elif move.snapshot:
                snapshots = program(write_snapshot_key)(snapshots, np.asarray([move.snapshot], np.int32),
                                                        jax.device_put(self.host_data(move.block)[1],
                                                                       self.device_rows))
            group.append((move, rows))
            if len(group) == GROUP:
                pools = flush(pools)
        return flush(pools), snapshots
