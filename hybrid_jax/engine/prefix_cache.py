"""Exact prefix caching (plain Python: no JAX, no device): which prompt blocks' KV pages and GDN state
snapshots are cached, who holds them, and what is evicted when the pools run short.

A block is ``block_size`` prompt tokens at a multiple of ``block_size``; it is keyed by its parent block and
its own tokens, so a key names every token up to the block's end and a lookup compares tokens, never a hash
alone. A request's cache salt (vLLM's ``cache_salt``) goes into its first block's key, so only requests with
the same salt share blocks. A block owns the KV pages that cover it (read-only while cached: a request writes
KV only at positions past the blocks it holds) and, at some boundaries, a snapshot (the GDN conv ring,
recurrent state and prompt mask of a slot right after the block's last token). Requests hold the blocks of
their prompt (refcounts); blocks no request holds stay cached in LRU order and are evicted, descendants with
them, when pages or snapshots run short. With a host tier (`host_tier.HostTier`) evicted blocks move to host
memory instead, and a hit brings them back (`restore`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybrid_jax.engine.host_tier import HostBlock, HostTier

if TYPE_CHECKING:
    from hybrid_jax.engine.cache import BlockAllocator

ROOT = 0  # the parent id of a prompt's first block
GDN_CHUNK = 64  # tokens of the prefill kernel's chunks: a step writes GDN states only where one ends
DECODE_SNAPSHOTS = 4  # output snapshots a decode step writes at most (its prompt-mask copy is this many rows)


@dataclass
class Block:
    block_id: int
    key: tuple  # (parent block id, tokens of the block)
    pages: list[int]
    snapshot: int = 0  # snapshot id (0: none)
    refs: int = 0
    children: set[int] = field(default_factory=set)


class PrefixCache:
    """The cached blocks of the prompts seen, their page and snapshot ids taken from the engine's allocators."""

    def __init__(self, block_size: int, page_size: int, pages: BlockAllocator, snapshots: BlockAllocator,
                 snapshot_stride: int = 1, host: HostTier | None = None):
        if block_size % page_size:
            raise ValueError(f"prefix block: {block_size} tokens is not a multiple of the page size {page_size}")
        self.block_size, self.pages_per_block = block_size, block_size // page_size
        self.pages, self.snapshots, self.snapshot_stride, self.host = pages, snapshots, snapshot_stride, host
        self.blocks: dict[int, Block] = {}
        self.by_key: dict[tuple, int] = {}
        self.unused: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks, least recently used first
        self.unused_snapshots: OrderedDict[int, None] = OrderedDict()  # those of them holding a snapshot, likewise
        self._next_id = 1

    # -- lookup --------------------------------------------------------------------------------------
    def key(self, parent: int, tokens: list[int], index: int, salt: str | None = None) -> tuple:
        """(parent block id, the block's tokens), the first block's tokens after ``salt`` when there is one."""
        b = self.block_size
        block = tuple(tokens[index * b: (index + 1) * b])
        return parent, block if salt is None or parent != ROOT else (salt, *block)

    def match(self, tokens: list[int], salt: str | None = None) -> list[Block | HostBlock]:
        """The cached blocks of ``tokens``' longest cached chain of full blocks (device blocks, then host ones)."""
        chain, parent = [], ROOT
        for index in range(len(tokens) // self.block_size):
            key = self.key(parent, tokens, index, salt)
            block_id = self.by_key.get(key)
            block = self.blocks[block_id] if block_id is not None else self.host.get(key) if self.host else None
            if block is None:
                break
            chain.append(block)
            parent = block.block_id
        return chain

    def hit(self, tokens: list[int], salt: str | None = None) -> list[Block | HostBlock]:
        """The blocks a request for ``tokens`` reuses: the longest cached chain ending at a snapshot that leaves
        at least the last token to compute (its logits); its host blocks, if any, come last (see `restore`)."""
        chain = self.match(tokens[:-1], salt)
        while chain and not chain[-1].snapshot:
            chain.pop()
        return chain

    def cached(self, tokens: list[int], salt: str | None = None) -> bool:
        """Whether every block of ``tokens`` (a block multiple) is cached (on either tier), the last with its
        state."""
        chain = self.match(tokens, salt)
        return len(chain) * self.block_size == len(tokens) and bool(chain) and bool(chain[-1].snapshot)

    def snapshot_wanted(self, boundary: int, prompt_len: int) -> bool:
        """Whether the state after position ``boundary`` (a block multiple) of a prompt is snapshotted: every
        ``snapshot_stride``-th block boundary, the last one before the prompt's last token (what the same prompt
        sent again resumes from) and the prompt's end when it is one (what a continuation resumes from)."""
        b = self.block_size
        if boundary <= 0 or boundary % b or boundary > prompt_len:
            return False
        return (boundary // b) % self.snapshot_stride == 0 or boundary in ((prompt_len - 1) // b * b, prompt_len)

    def chunk_end(self, start: int, end: int, prompt_len: int) -> int:
        """Where a prefill chunk from ``start`` with room up to ``end`` stops: the prompt's end if it is within
        room, else the last block boundary within room (``end`` when there is none past ``start``), so that the
        chunks after a boundary start on one."""
        if end >= prompt_len:
            return prompt_len
        boundary = end // self.block_size * self.block_size
        return boundary if boundary > start else end

    def reserve_snapshot(self, own: list[Block] = ()) -> int:
        """A snapshot id for a state a step is about to write, or 0 when none can be freed. When none is free it
        evicts the least recently used unused block that holds one (with its descendants), else drops the
        shallowest snapshot of ``own`` (the writer's chain) that no other request holds: a prompt with more
        boundaries than the pool has snapshots keeps its deepest states (what the same prompt sent again and its
        continuation resume from). The caller attaches the id to a block (`attach_snapshot`) or frees it."""
        if self.snapshots.num_free == 0:
            if self.unused_snapshots:
                self._evict(next(iter(self.unused_snapshots)))
            elif (superseded := next((b for b in own if b.snapshot and b.refs == 1), None)) is not None:
                self.drop_snapshot(superseded)
            else:
                return 0
        return self.snapshots.allocate(1)[0]

    def attach_snapshot(self, block: Block, snapshot: int) -> bool:
        """Give ``block`` (held by the caller) the written ``snapshot``; False, freeing it, when the block has one
        already."""
        if block.snapshot:
            self.snapshots.free([snapshot])
            return False
        block.snapshot = snapshot
        return True

    def free_snapshots(self, snapshots: list[int]) -> None:
        self.snapshots.free([i for i in snapshots if i])

    def drop_snapshot(self, block: Block) -> None:
        """Free ``block``'s snapshot (a later one supersedes it); the block stays cached."""
        self.free_snapshots([block.snapshot])
        block.snapshot = 0
        self.unused_snapshots.pop(block.block_id, None)

    # -- holding -------------------------------------------------------------------------------------
    def acquire(self, blocks: list[Block]) -> None:
        for block in blocks:
            block.refs += 1
            self.unused.pop(block.block_id, None)
            self.unused_snapshots.pop(block.block_id, None)

    def release(self, blocks: list[Block]) -> None:
        """Drop a request's hold on its chain; blocks no one holds become evictable, the deepest first."""
        for block in reversed(blocks):
            block.refs -= 1
            if block.refs == 0:
                self.unused[block.block_id] = None
                if block.snapshot:
                    self.unused_snapshots[block.block_id] = None

    def add(self, parent: int, tokens: list[int], index: int, pages: list[int],
            salt: str | None = None) -> tuple[Block, bool]:
        """Cache block ``index`` of ``tokens`` (after ``parent``) over ``pages``, held once by the caller; an
        already cached block with that key is held instead. Returns the block and whether ``pages`` became
        its pages (the cache's from now on)."""
        key = self.key(parent, tokens, index, salt)
        block_id = self.by_key.get(key)
        if block_id is not None:
            block = self.blocks[block_id]
            self.acquire([block])
            return block, False
        on_host = self.host.get(key) if self.host is not None else None
        if on_host is not None:  # computed again (the hit stopped short of it): the device's now, id kept for its
            self.host.take([on_host])  # host descendants
            block_id = on_host.block_id
        else:
            block_id, self._next_id = self._next_id, self._next_id + 1
        block = Block(block_id, key, list(pages), refs=1)
        self.blocks[block.block_id] = block
        self.by_key[key] = block.block_id
        if parent != ROOT:
            self.blocks[parent].children.add(block.block_id)
        return block, True

    def restore(self, taken: list[HostBlock], pages: list[int], snapshot: int) -> list[Block]:
        """Bring ``taken`` (a hit's host blocks, taken from the host tier) back over ``pages``, the last with
        ``snapshot`` (reserved); returns them as device blocks held once by the caller."""
        restored = []
        for i, host_block in enumerate(taken):
            block_pages = pages[i * self.pages_per_block: (i + 1) * self.pages_per_block]
            last = i == len(taken) - 1
            block = Block(host_block.block_id, host_block.key, block_pages, snapshot if last else 0, refs=1)
            self.blocks[block.block_id] = block
            self.by_key[block.key] = block.block_id
            if block.key[0] != ROOT:
                self.blocks[block.key[0]].children.add(block.block_id)
            self.host.restore(host_block, block_pages, snapshot if last else 0)
            restored.append(block)
        return restored

    # -- eviction ------------------------------------------------------------------------------------
    def make_room(self, pages: int) -> bool:
        """Evict unused blocks, least recently used first, until ``pages`` pages are free; False if they cannot be."""
        while self.pages.num_free < pages and self.unused:
            self._evict(next(iter(self.unused)))
        return self.pages.num_free >= pages

    def _evict(self, block_id: int, offload: bool = True) -> bool:
        """Drop an unreferenced block and its descendants (unreferenced too: a holder of a block holds its
        ancestors), freeing their pages and snapshots; with a host tier, those with a snapshot at or below them
        move there, snapshots only at a chain's end (see `HostTier.keeps_snapshot_above`: a snapshot is ~25 blocks'
        bytes at 9B). Returns whether the block moved."""
        block = self.blocks.pop(block_id)
        moved = False
        for child in list(block.children):
            self._evict(child, offload)
        if self.host is not None:
            below = self.host.children.get(block_id, ())  # host blocks: each with a snapshot at or below it
            snapshot = block.snapshot if self.host.keeps_snapshot_above(below) else 0
            moved = bool(offload and (below or snapshot) and self.host.offload(block_id, block.key, block.pages,
                                                                                snapshot))
            if not moved:
                self.host.drop_children(block_id)
        del self.by_key[block.key]
        self.unused.pop(block_id)
        parent = block.key[0]
        if parent != ROOT and parent in self.blocks:
            self.blocks[parent].children.discard(block_id)
        self.pages.free(block.pages)
        self.drop_snapshot(block)
        return moved

    def reset(self) -> bool:
        """Evict every unused block (the host tier's too); True when the cache is empty after (no request holds a
        block)."""
        while self.unused:
            self._evict(next(iter(self.unused)), offload=False)
        if self.host is not None:
            self.host.clear()
        return not self.blocks

    # What /metrics reads on a request thread while the engine thread changes the cache: lengths only (every
    # block covers pages_per_block pages), never an iteration over a dict that may change under it.
    @property
    def evictable_pages(self) -> int:
        """Pages of the blocks no request holds."""
        return len(self.unused) * self.pages_per_block

    def stats(self) -> dict:
        return {"prefix_blocks": len(self.blocks), "prefix_blocks_unused": len(self.unused),
                "prefix_pages": len(self.blocks) * self.pages_per_block,
                "snapshots_used": self.snapshots.num_used, "snapshots_total": self.snapshots.capacity,
                **(self.host.stats() if self.host is not None else {})}
