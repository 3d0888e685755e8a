"""Snapshots taken while decoding (plain Python): the prefix cache's blocks of a request's output, cached as its
decode steps cross their boundaries, so the next turn of a chat resumes after the answer at any load.

A decode call is planned on the host before it is queued: each row whose step crosses a block boundary gets a
snapshot id reserved, which the step's GDN kernels and prompt-mask write fill with the state right after the
token before the boundary. Once the host has read the tokens up to the boundary (before it delivers the step's
own sample, which may end the request) the request's blocks up to there are cached, the last with the
snapshot. Every output boundary is snapshotted; a request keeps only its latest one unless the stride keeps it
(every ``snapshot_stride``-th block), so it holds at most one snapshot more than the stride gives. A planned
snapshot whose tokens never came (the request ended or was cancelled first, the call failed) is freed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hybrid_jax.engine.prefix_cache import DECODE_SNAPSHOTS, ROOT, Block, PrefixCache
from hybrid_jax.engine.requests import Request


class PlannedSnapshot(NamedTuple):
    step: int  # the call's step whose token ends the block
    request: Request
    boundary: int  # tokens before the snapshot (a block multiple)
    snapshot: int  # its reserved id


class OutputSnapshots:
    def __init__(self, prefix: PrefixCache):
        self.prefix = prefix
        self.outstanding: set[int] = set()  # reserved ids of planned snapshots not yet cached or freed
        self.latest: dict[int, Block] = {}  # id(request) -> the block of its latest output snapshot, unless kept

    def plan(self, requests: list[Request], positions: np.ndarray, steps: int,
             size: int) -> tuple[list[PlannedSnapshot], np.ndarray]:
        """The snapshots of a decode call over ``requests`` (row i's first step at position ``positions[i]``) and
        its snapshot ids [steps, size] (0: none); a boundary for which no id can be freed, or past the
        DECODE_SNAPSHOTS of its step, is skipped (the request's next boundary supersedes it). With the pool full
        and nothing unused, a boundary takes the id of the request's shallowest snapshot that no one else holds,
        as a prompt's chunk does: the deeper state serves the same prompt and its continuation."""
        ids = np.zeros((steps, size), np.int32)
        plan, b = [], self.prefix.block_size
        for i, r in enumerate(requests):
            if r.finished:
                continue
            first = int(positions[i]) + 1  # tokens in the cache after the call's first step
            for boundary in range(-(-first // b) * b, min(first + steps, r.total_len + 1), b):
                step = boundary - first
                if boundary > len(r.prompt_ids) and np.count_nonzero(ids[step]) < DECODE_SNAPSHOTS and (
                        snapshot := self.prefix.reserve_snapshot(r.blocks)):
                    ids[step, i] = snapshot
                    plan.append(PlannedSnapshot(step, r, boundary, snapshot))
                    self.outstanding.add(snapshot)
        return plan, ids

    def cache(self, planned: list[PlannedSnapshot]) -> None:
        """Cache each planned snapshot's blocks (the host has read the tokens up to its boundary, unless the
        request ended before them) or free it."""
        b, per_block = self.prefix.block_size, self.prefix.pages_per_block
        for p in planned:
            self.outstanding.discard(p.snapshot)
            r = p.request
            tokens = r.prompt_ids + r.output_ids[: p.boundary - len(r.prompt_ids)]
            if r.finished or len(tokens) < p.boundary:
                self.prefix.free_snapshots([p.snapshot])
                continue
            for index in range(len(r.blocks), p.boundary // b):
                parent = r.blocks[-1].block_id if r.blocks else ROOT
                pages = r.pages[index * per_block: (index + 1) * per_block]
                r.blocks.append(self.prefix.add(parent, tokens, index, pages, r.cache_salt)[0])
            block = r.blocks[p.boundary // b - 1]
            if not self.prefix.attach_snapshot(block, p.snapshot):
                continue
            previous = self.latest.pop(id(r), None)
            if previous is not None:  # superseded: the request's later boundary resumes further
                self.prefix.drop_snapshot(previous)
            if (p.boundary // b) % self.prefix.snapshot_stride:
                self.latest[id(r)] = block

    def finished(self, r: Request) -> None:
        """``r`` ended: its latest output snapshot stays cached."""
        self.latest.pop(id(r), None)

    def free_outstanding(self) -> None:
        """Free every planned snapshot not yet cached (the calls that would write them failed)."""
        self.prefix.free_snapshots(list(self.outstanding))
        self.outstanding.clear()
