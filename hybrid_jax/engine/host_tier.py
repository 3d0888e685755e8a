"""The prefix cache's host-memory tier (plain Python: the bookkeeping; the runner moves the data): blocks evicted
from the device keep their KV pages and snapshot in host memory, up to a byte budget, and come back on a hit
instead of being computed again.

A block moved here keeps its id and key, so chains run on across the tiers: the device's blocks are closed
toward the root (a block's parent is on the device or the root), so a prompt's cached chain is device blocks
then host blocks. Only blocks with a snapshot at or below them move (the rest could never end a hit), and of an
evicted chain only the snapshots at its end (`keeps_snapshot_above`): a hit on the host ends there, or where the
device's snapshots end. Each move is queued for the runner (`moves`), which copies before its next device call:
the device ids freed by an eviction are read before anything can write them, and a restored block is written
before anything reads it.
Host blocks are evicted least recently used first, with their host descendants (unreachable without them).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass
class HostBlock:
    block_id: int
    key: tuple  # (parent block id, tokens of the block), as on the device
    snapshot: bool  # whether it holds a snapshot (data[1])
    nbytes: int
    data: Any = None  # (pages, snapshot rows) set by the runner when it queues the copy out (`HostMoves.host_data`)
    children: set[int] = field(default_factory=set)  # host blocks whose parent this is


class Move(NamedTuple):
    """A copy for the runner: "out" reads ``pages`` / ``snapshot`` (device ids) into ``block.data``; "in" writes
    ``block.data`` to them (``snapshot`` 0: the block's snapshot is not brought back)."""

    direction: str  # "out" | "in"
    block: HostBlock
    pages: list[int]
    snapshot: int


class HostTier:
    def __init__(self, budget_bytes: int, block_bytes: int, snapshot_bytes: int):
        """``block_bytes``: a block's KV pages; ``snapshot_bytes``: a snapshot (GDN state and prompt mask)."""
        self.budget, self.block_bytes, self.snapshot_bytes = budget_bytes, block_bytes, snapshot_bytes
        self.blocks: dict[int, HostBlock] = {}
        self.by_key: dict[tuple, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.children: dict[int, set[int]] = {}  # device block id -> its host children
        self.used = 0
        self.moves: list[Move] = []

    def get(self, key: tuple) -> HostBlock | None:
        block_id = self.by_key.get(key)
        return None if block_id is None else self.blocks[block_id]

    def offload(self, block_id: int, key: tuple, pages: list[int], snapshot: int) -> bool:
        """Keep an evicted device block (its pages and ``snapshot`` id, 0: none) here, evicting older host blocks
        for room; False when it cannot fit."""
        nbytes = self.block_bytes + (self.snapshot_bytes if snapshot else 0)
        if nbytes > self.budget:
            return False
        while self.used + nbytes > self.budget:
            self.drop(next(iter(self.lru)))
        block = HostBlock(block_id, key, bool(snapshot), nbytes)
        block.children = self.children.pop(block_id, set())
        self._insert(block)
        self.moves.append(Move("out", block, list(pages), snapshot))
        return True

    def keeps_snapshot_above(self, children: set[int]) -> bool:
        """Whether an evicted block whose host ``children`` these are moves its snapshot: when none moved (it ends
        the chain) or they are one last block with a snapshot (a prompt ending on a block boundary is resent from
        the boundary before it, the last token's logits computed again)."""
        if not children:
            return True
        child = self.blocks[next(iter(children))]
        return len(children) == 1 and child.snapshot and not child.children

    def take(self, blocks: list[HostBlock]) -> None:
        """Remove ``blocks`` (a chain, root first) to bring them back to the device; `put_back` undoes it."""
        for block in reversed(blocks):
            self._remove(block)
            if block.children:  # stay here, now under a device block
                self.children[block.block_id] = set(block.children)

    def put_back(self, blocks: list[HostBlock]) -> None:
        """Return blocks `take` removed (root first), evicting older host blocks for room."""
        for block in blocks:
            block.children = self.children.pop(block.block_id, set())
            self._insert(block)
        while self.used > self.budget:
            self.drop(next(iter(self.lru)))

    def restore(self, block: HostBlock, pages: list[int], snapshot: int) -> None:
        """Queue the copy of taken ``block`` into device ``pages`` (and ``snapshot``, where not 0)."""
        self.moves.append(Move("in", block, list(pages), snapshot))

    def drop(self, block_id: int) -> None:
        """Evict a host block and its host descendants."""
        block = self.blocks[block_id]
        for child in list(block.children):
            self.drop(child)
        self._remove(block)

    def drop_children(self, device_block_id: int) -> None:
        """A device block was dropped for good: its host children (and theirs) can never be reached."""
        for child in list(self.children.pop(device_block_id, ())):
            self.drop(child)

    def clear(self) -> None:
        for parent in list(self.children):
            self.drop_children(parent)

    def _parent(self, block: HostBlock) -> HostBlock | None:
        return self.blocks.get(block.key[0])

    def _insert(self, block: HostBlock) -> None:
        self.blocks[block.block_id] = block
        self.by_key[block.key] = block.block_id
        self.lru[block.block_id] = None
        self.used += block.nbytes
        parent = self._parent(block)
        (parent.children if parent is not None else self.children.setdefault(block.key[0], set())).add(
            block.block_id)

    def _remove(self, block: HostBlock) -> None:
        del self.blocks[block.block_id]
        del self.by_key[block.key]
        del self.lru[block.block_id]
        self.used -= block.nbytes
        parent = self._parent(block)
        siblings = parent.children if parent is not None else self.children.get(block.key[0], set())
        siblings.discard(block.block_id)
        if parent is None and not siblings:
            self.children.pop(block.key[0], None)

    def stats(self) -> dict:
        return {"host_blocks": len(self.blocks), "host_bytes_used": self.used, "host_bytes_total": self.budget}
