"""The engine's scheduling, decided from request state alone (plain Python: no JAX, no device).

- Scoring: a request that wants its prompt's logprobs waits in ``scoring`` (FCFS) until the engine has them,
  then waits for admission (or, with max_tokens 0, ends).
- Admission: FCFS; the first waiting request is admitted when a state slot and KV pages for its whole lifetime
  (prompt + max_tokens) are free, less the pages of its prompt's cached prefix (the prefix cache evicts unused
  blocks to free pages). A request that can never fit is rejected at submit.
- Prefix cache (`prefix_cache`): a request admitted on a hit holds the cached blocks and starts its prefill at
  their end, its first prefill step reading the slot's state from their snapshot (``restore_from``); each full
  prompt block it prefills is cached after the step that completes it, with the snapshot that step wrote at
  its end where the cache wants one.
- Prefill: one packed step over the prompts being prefilled, in admission order: at most ``max_prefill_seqs``
  chunks under the ``prefill_chunk`` token budget, at the smallest token bucket that holds them. With the
  prefix cache a chunk that does not finish its prompt ends on a block boundary where it can, and the step
  writes the GDN state at the boundaries in it that the cache wants into snapshots reserved before it
  (``snapshot_plan``).
- Decode: every decoding request in one call, at the smallest batch bucket that holds them; a call chains
  after the one in flight while the requests stay the same; several steps per call only for a greedy batch
  (no top logprobs, no token constraints) with nothing waiting for prefill, and only while some request still
  wants that many tokens.
- Structured outputs: a request with a grammar ends at eos even with ignore_eos (its grammar allows eos only
  where the output is complete), and with "error" on a token its grammar rejects.
- Finishing: a token ends its request at eos, a stop token or max_tokens; a cancelled request is reaped
  before the next step; either frees its slot and the pages the cache does not own, and drops its blocks.
- Output blocks (with the prefix cache): a decode step that crosses a block boundary writes a snapshot there,
  and the request's blocks up to it are cached once the host has read their tokens (`output_snapshots`), so a
  chat's next turn resumes after the answer. Where no decode snapshot was taken (a grammar batch, no free
  snapshot), a request that ends at eos, a stop or max_tokens after its output crossed a block boundary
  leaves a fill: a prefill-only request over its prompt + output up to the last boundary, which caches those
  blocks with the state at their end; it starts once the engine has idled a moment (`fills`).

The engine hands the scheduler host copies of the samples; the runner's device work is not seen here.
"""

from __future__ import annotations

import bisect
import logging
import queue
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.fills import DELAY_S, Fills
from hybrid_jax.engine.host_tier import HostBlock
from hybrid_jax.engine.output_snapshots import OutputSnapshots
from hybrid_jax.engine.prefix_cache import GDN_CHUNK, ROOT, PrefixCache
from hybrid_jax.engine.requests import PromptLogprob, QueueFullError, Request, TokenEvent

if TYPE_CHECKING:
    from hybrid_jax.engine.cache import BlockAllocator
    from hybrid_jax.engine.sampler import Sampled

log = logging.getLogger("hybrid_jax.engine")

Variant = tuple[bool, int]  # a decode program's (greedy_only, steps per call)


class Scheduler:
    """The requests' queues and counters, and the cache's slot and page allocators.

    ``submit``-side methods (``check``, ``put``, ``cancel``, ``wake``) may run on any thread; the rest run on
    the engine thread."""

    def __init__(self, config: EngineConfig, slots: BlockAllocator, pages: BlockAllocator, *, page_size: int,
                 decode_steps: int, eos_token_ids: Sequence[int] = (), prefix: PrefixCache | None = None,
                 fill_delay_s: float = DELAY_S):
        """``slots``, ``pages``: allocators of the pools' state slots and KV pages; ``decode_steps``: the most
        decode steps a call may run (the runner's: 1 under a mesh); ``prefix``: the prefix cache (None: off),
        over ``pages``; ``fill_delay_s``: the idle time before a fill starts."""
        self.config, self.slots, self.pages = config, slots, pages
        self.page_size, self.decode_steps = page_size, decode_steps
        self.eos_token_ids = frozenset(eos_token_ids)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # submitted requests (None: a wake-up)
        self.scoring: deque[Request] = deque()  # waiting for their prompt logprobs, before admission
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.prefix = prefix
        self.fills = Fills(prefix.block_size, fill_delay_s) if prefix is not None else None
        self.output_snapshots = OutputSnapshots(prefix) if prefix is not None else None
        self._held: list[tuple[queue.SimpleQueue, tuple]] | None = None  # events not handed out yet (no time)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0,
                         "prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_host_hits": 0}

    def pages_for(self, tokens: int) -> int:
        """KV pages that hold ``tokens`` tokens."""
        return -(-tokens // self.page_size)

    # -- arrivals (any thread) -----------------------------------------------------------------------
    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError for a request that can never fit, QueueFullError while the queue is full."""
        total = prompt_len + max_tokens
        if total > self.config.max_model_len:
            raise ValueError(f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                             f"exceeds the model's context of {self.config.max_model_len} tokens")
        if self.pages_for(total) > self.pages.capacity:
            raise ValueError(f"max_tokens: the request needs more KV pages than the cache has ({self.pages.capacity})")
        if len(self.waiting) + len(self.scoring) + self.inbox.qsize() >= self.config.max_waiting:
            raise QueueFullError(f"{self.config.max_waiting} requests are already waiting")

    def put(self, request: Request) -> None:
        self.inbox.put(request)

    def cancel(self, request: Request) -> None:
        request.cancelled = True
        self.wake()

    def wake(self) -> None:
        """End the engine thread's wait for arrivals."""
        self.inbox.put(None)

    # -- admission and finishing ---------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No request admitted or waiting for admission (those waiting for their prompt logprobs aside)."""
        return not (self.waiting or self.prefilling or self.decoding)

    def take_arrivals(self, block: bool) -> None:
        """Move the inbox's requests to the scoring or waiting queue; ``block``: wait for the first up to 0.5 s,
        or until a pending fill may start."""
        fill = self.fills.wait() if self.fills is not None else None
        wait = 0.5 if fill is None else min(0.5, fill)
        try:
            item = self.inbox.get(timeout=wait) if block else self.inbox.get_nowait()
            while True:
                if item is not None:
                    (self.scoring if item.params.prompt_logprobs is not None else self.waiting).append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def scored(self, r: Request, logprobs: list[PromptLogprob | None]) -> None:
        """Record the prompt logprobs of the first request in ``scoring``; it then waits for admission, or ends
        (max_tokens 0: nothing to generate)."""
        self.scoring.remove(r)
        r.prompt_logprobs = logprobs
        r.scored.set()
        if r.params.max_tokens == 0:
            self.counters["prompt_tokens"] += len(r.prompt_ids)
            self.finish(r, None, "length")
        else:
            self.waiting.append(r)

    def reap_cancelled(self) -> None:
        for group in (self.scoring, self.waiting):
            for r in [r for r in group if r.cancelled]:
                group.remove(r)
                self.finish(r, None, "abort")
        for r in [r for r in self.prefilling + self.decoding if r.cancelled]:
            self.finish(r, None, "abort")

    def admit(self) -> None:
        """FCFS: admit waiting requests while a slot and pages for their whole lifetime are free (cached prefix
        pages shared, unused cached blocks evicted for room); then, once nothing else has waited or run for
        ``fill_delay_s``, the newest fill."""
        while self.waiting and self.slots.num_free and self._admit(self.waiting[0]):
            self.waiting.popleft()
        if self.fills is not None and self.idle and self.slots.num_free and (fill := self.fills.take()) is not None \
                and not self.prefix.cached(fill.prompt_ids, fill.cache_salt):
            self._admit(fill)  # no room: dropped

    def _admit(self, r: Request) -> bool:
        """Give ``r`` a slot and its pages, on its prefix's hit (its first prefill step starts from the hit's
        snapshot: ``restore_from``); False when its pages cannot be freed."""
        hit = self.prefix.hit(r.prompt_ids, r.cache_salt) if self.prefix is not None else []
        on_host = [block for block in hit if isinstance(block, HostBlock)]  # the chain's last blocks
        hit = hit[: len(hit) - len(on_host)]
        shared = [p for block in hit for p in block.pages]
        need = self.pages_for(r.total_len) - len(shared)
        snapshot = 0
        if self.prefix is not None:
            self.prefix.acquire(hit)
            if on_host:  # out of the host tier while room is made (nothing evicts them), then back on the device
                self.prefix.host.take(on_host)
                snapshot = self.prefix.reserve_snapshot()
                if not snapshot:
                    self.prefix.host.put_back(on_host)
                    on_host = []
            if not self.prefix.make_room(need):
                self.prefix.release(hit)
                self.prefix.free_snapshots([snapshot])
                if on_host:
                    self.prefix.host.put_back(on_host)
                return False
        elif self.pages.num_free < need:
            return False
        r.slot = self.slots.allocate(1)[0]
        r.pages = shared + self.pages.allocate(need)
        if on_host:
            hit = hit + self.prefix.restore(on_host, r.pages[len(shared):], snapshot)
            shared = r.pages[: len(hit) * self.prefix.pages_per_block]
            self.counters["prefix_cache_host_hits"] += len(on_host) * self.prefix.block_size
        r.blocks, r.restore_from = hit, hit[-1].snapshot if hit else 0
        r.num_prefilled = r.num_cached_tokens = len(shared) * self.page_size
        if self.prefix is not None and not r.fill:
            self.counters["prefix_cache_queries"] += len(r.prompt_ids)
            self.counters["prefix_cache_hits"] += r.num_cached_tokens
        self.prefilling.append(r)
        return True

    def finish(self, r: Request, token: int | None, reason: str, error: Exception | None = None) -> None:
        """End ``r`` and free its slot and pages; ``token`` None: send a final event without a token."""
        if r.finished:
            return
        r.finished = True
        for group in (self.prefilling, self.decoding):
            if r in group:
                group.remove(r)
        if r.slot:
            self.slots.free([r.slot])
        if r.blocks:
            cached = {p for block in r.blocks for p in block.pages}
            self.prefix.release(r.blocks)
            self.pages.free([p for p in r.pages if p not in cached])
        else:
            self.pages.free(r.pages)
        if r.snapshot_plan:  # planned for a step that it was cancelled or failed after
            self.prefix.free_snapshots([snapshot for _, snapshot in r.snapshot_plan])
        if self.output_snapshots is not None:
            self.output_snapshots.finished(r)
        r.slot, r.pages, r.blocks, r.snapshot_plan = 0, [], [], []
        r.grammar = None
        r.scored.set()  # whatever prompt logprobs it has are final
        if self.fills is not None:
            self.fills.request_ended()
        if r.fill:
            return
        self.counters["requests_finished"] += 1
        if reason in ("stop", "length") and self.fills is not None:
            self.fills.plan(r, self.prefix.cached)
        if error is not None:
            log.error("request %s failed: %s", r.request_id, error)
        if token is None:
            self._send(r, None, None, None, reason)

    def fail_running(self, error: Exception) -> None:
        """End every admitted request with "error" (a step failed)."""
        for r in self.prefilling + self.decoding:
            self.finish(r, None, "error", error=error)
        if self.output_snapshots is not None:
            self.output_snapshots.free_outstanding()

    def fail_scoring(self, r: Request, error: Exception) -> None:
        """End ``r``, the request being scored, with "error" (its scoring failed)."""
        self.scoring.remove(r)
        self.finish(r, None, "error", error=error)

    def emit(self, r: Request, token: int, logprob: float, tops) -> None:
        """Record a sampled token and decide whether the request is done; ``tops``: (ids, logprobs) rows."""
        r.output_ids.append(token)
        self.counters["generation_tokens"] += 1
        p = r.params
        if r.thinking_end is not None and token == r.thinking_end.token_id:
            r.thinking_end = None
        reason = None
        rejected = r.grammar is not None and not r.grammar.accept(token)
        if rejected:
            log.warning("request %s: its grammar rejects token %d (%s)", r.request_id, token, r.grammar.error)
            reason = "error"
        elif (token in self.eos_token_ids and (not p.ignore_eos or r.grammar is not None)) or token in p.stop_token_ids:
            reason = "stop"
        elif len(r.output_ids) >= p.max_tokens:
            reason = "length"
        top = None
        if p.logprobs:
            top = [(int(i), float(v)) for i, v in zip(tops[0][: p.logprobs], tops[1][: p.logprobs], strict=True)]
        self._send(r, token, float(logprob), top, reason)
        if reason is not None:
            self.finish(r, token, reason)

    def _send(self, r: Request, *fields) -> None:
        """Hand ``r``'s caller the event of ``fields`` (a TokenEvent's, but its time), or keep them while events
        are held (`holding_events`)."""
        if self._held is None:
            r.events.put(TokenEvent(*fields, time.monotonic()))
        else:
            self._held.append((r.events, fields))

    @contextmanager
    def holding_events(self) -> Iterator[None]:
        """Keep the events sent inside until `send_held` or the end, then hand them out in order. The engine
        holds a turn's events until it has queued the turn's device work: each event wakes its caller's thread,
        and those threads would take the GIL from the host work the device is waiting on."""
        assert self._held is None, "events are held already"
        self._held = []
        try:
            yield
        finally:
            self.send_held()
            self._held = None

    def send_held(self) -> None:
        """Hand out the events kept so far (while holding, see `holding_events`), timed now: an event's time is
        when its caller can have it."""
        if not self._held:
            return
        held, self._held, now = self._held, [], time.monotonic()
        for events, fields in held:
            events.put(TokenEvent(*fields, now))

    def deliver(self, requests: list[Request], sampled: Sampled, rows: list[int] | None = None) -> None:
        """Emit each request's token from its row of ``sampled`` (host arrays; rows 0.. unless ``rows``;
        top logprobs read only when some request wants them); a finished request's row is discarded (a call
        ran past its end)."""
        want_top = any(r.params.logprobs for r in requests)
        for i, r in zip(range(len(requests)) if rows is None else rows, requests, strict=True):
            if r.finished:
                continue
            tops = (sampled.top_ids[i], sampled.top_logprobs[i]) if want_top else None
            self.emit(r, int(sampled.tokens[i]), sampled.logprob[i], tops)

    # -- prefill -------------------------------------------------------------------------------------
    def prefill_chunks(self) -> list[tuple[Request, int]]:
        """The next prefill step's (request, tokens) chunks: the prompts in admission order, at most
        ``max_prefill_seqs`` of them, under the ``prefill_chunk`` token budget."""
        budget = self.config.prefill_chunk
        chunks: list[tuple[Request, int]] = []
        for r in self.prefilling[: self.config.max_prefill_seqs]:
            start, prompt_len = r.num_prefilled, len(r.prompt_ids)
            end = min(prompt_len, start + budget)
            if self.prefix is not None:
                end = self.prefix.chunk_end(start, start + budget, prompt_len)
                r.snapshot_plan = self._plan_snapshots(r, start, end)
            if end <= start:
                break
            chunks.append((r, end - start))
            budget -= end - start
        return chunks

    def _plan_snapshots(self, r: Request, start: int, end: int) -> list[tuple[int, int]]:
        """The (boundary, snapshot id) states a chunk of ``r`` over prompt positions [start, end) writes: the
        wanted block boundaries in (start, end] where one of the step's GDN chunks (64 tokens from ``start``)
        ends, each with a snapshot id reserved (none where no id can be freed)."""
        b, prompt_len = self.prefix.block_size, len(r.prompt_ids)
        plan = []
        for boundary in range((start // b + 1) * b, end + 1, b):
            at_chunk_end = (boundary - start) % GDN_CHUNK == 0 or boundary == end
            if at_chunk_end and self.prefix.snapshot_wanted(boundary, prompt_len) and (
                    snapshot := self.prefix.reserve_snapshot(r.blocks)):
                plan.append((boundary, snapshot))
        return plan

    def prefill_buckets(self, chunks: list[tuple[Request, int]]) -> list[int]:
        """The token buckets that hold ``chunks``, smallest first (the runner takes the first one built)."""
        buckets = self.config.prefill_buckets
        return list(buckets[bisect.bisect_left(buckets, sum(n for _, n in chunks)):])

    def prefilled(self, chunks: list[tuple[Request, int]]) -> tuple[list[Request], list[int]]:
        """Record a prefill step over ``chunks``; returns the requests whose prompts it finished (they decode
        from now on) and each one's row of the step's samples."""
        done, rows = [], []
        for s, (r, n) in enumerate(chunks):
            r.num_prefilled += n
            r.restore_from = 0
            self.counters["prompt_tokens"] += 0 if r.fill else n
            if r.num_prefilled == len(r.prompt_ids) and not r.fill:  # a fill ends in `cache_prefilled`
                self.prefilling.remove(r)
                self.decoding.append(r)
                done.append(r)
                rows.append(s)
        return done, rows

    def cache_prefilled(self, chunks: list[tuple[Request, int]]) -> None:
        """After `prefilled` over ``chunks``: cache the prompt blocks the step completed (each request holds them)
        and give the blocks at the boundaries of each chunk's snapshot plan the states the step wrote there."""
        if self.prefix is None:
            return
        block_size, per_block = self.prefix.block_size, self.prefix.pages_per_block
        for r, _ in chunks:
            plan, r.snapshot_plan = r.snapshot_plan, []
            if r.finished:
                self.prefix.free_snapshots([snapshot for _, snapshot in plan])
                continue
            for index in range(len(r.blocks), r.num_prefilled // block_size):
                parent = r.blocks[-1].block_id if r.blocks else ROOT
                pages = r.pages[index * per_block: (index + 1) * per_block]
                r.blocks.append(self.prefix.add(parent, r.prompt_ids, index, pages, r.cache_salt)[0])
            for boundary, snapshot in plan:
                self.prefix.attach_snapshot(r.blocks[boundary // block_size - 1], snapshot)
            if r.fill and r.num_prefilled == len(r.prompt_ids):
                self.finish(r, None, "fill")

    def reset_prefix_cache(self) -> bool:
        """Evict every cached block no request holds; True when the cache is empty after."""
        return self.prefix.reset() if self.prefix is not None else True

    # -- decode --------------------------------------------------------------------------------------
    @staticmethod
    def greedy_only(requests: Iterable[Request]) -> bool:
        """Whether every one of ``requests`` samples greedily without logprobs or token constraints (the
        greedy-only programs)."""
        return all(r.params.temperature == 0 and not r.params.logprobs and not r.constrained for r in requests)

    def chained(self, previous: list[Request], previous_steps: int,
                greedy: bool) -> tuple[list[Request], Variant] | None:
        """The next call chained after the one in flight over ``previous`` (``previous_steps`` steps): the
        requests and variant, or None when it cannot chain: the decoding requests changed, or one of them
        reaches max_tokens in the call in flight (chaining would queue a call of discarded rows ahead of
        whatever comes next: a new request's prefill would wait for it)."""
        requests = list(self.decoding)
        if not (len(previous) == len(requests) > 0 and all(a is b for a, b in zip(previous, requests, strict=True))):
            return None
        if not all(len(r.output_ids) + previous_steps < r.params.max_tokens for r in requests):
            return None
        left = max(r.params.max_tokens - len(r.output_ids) - previous_steps for r in requests)
        return requests, (greedy, self.steps_per_call(greedy, left))

    def unchained(self, greedy: bool, unread: Sequence[Request] = ()) -> tuple[list[Request], Variant] | None:
        """The next call built on the host: the decoding requests that still want tokens (those in ``unread``
        have one sampled that the host has not read yet) and the variant; None when none wants more."""
        unread_ids = {id(r) for r in unread}
        left = {id(r): r.params.max_tokens - len(r.output_ids) - (id(r) in unread_ids) for r in self.decoding}
        requests = [r for r in self.decoding if not r.finished and left[id(r)] > 0]
        if not requests:
            return None
        return requests, (greedy, self.steps_per_call(greedy, max(left[id(r)] for r in requests)))

    @staticmethod
    def decode_positions(requests: list[Request], unread: Sequence[Request] = ()) -> np.ndarray:
        """Each request's input position in a decode call built on the host (see `unchained`)."""
        unread_ids = {id(r) for r in unread}
        return np.array([len(r.prompt_ids) + len(r.output_ids) - 1 + (id(r) in unread_ids) for r in requests],
                        np.int64)

    def steps_per_call(self, greedy: bool, most_left: int) -> int:
        """Decode steps for the next call over requests of which the one with the most left still wants
        ``most_left`` tokens beyond those in flight.

        Several only for a greedy batch with no prompt waiting for its prefill (it would wait that much
        longer), and only while some request still wants that many tokens: a request's last few tokens
        take a step each rather than a call whose steps past every end are computed, waited for and
        discarded."""
        if not greedy or self.decode_steps == 1 or self.waiting or self.prefilling or self.inbox.qsize():
            return 1
        return self.decode_steps if most_left >= self.decode_steps else 1

    def decode_choices(self, variant: Variant, n: int, size: int | None = None) -> list[tuple[Variant, int]]:
        """(variant, bucket) for a decode call over ``n`` rows, best first (the runner takes the first one
        built): the smallest bucket (only ``size`` if given), with ``variant`` or a plainer one that gives the
        same tokens (one step per call; the general sampler)."""
        greedy, _ = variant
        variants = list(dict.fromkeys([variant, (greedy, 1), (False, 1)]))
        return [(v, bucket) for bucket in ([size] if size is not None else self.decode_buckets(n)) for v in variants]

    def decode_buckets(self, n: int) -> list[int]:
        """The batch buckets that hold ``n`` rows, smallest first."""
        return [b for b in self.config.decode_buckets if b >= n]

    def stats(self) -> dict:
        # Pages of cached blocks no request holds count as free (evicted on demand), as vLLM counts them.
        evictable = self.prefix.evictable_pages if self.prefix is not None else 0
        running = sum(not r.fill for r in self.prefilling) + len(self.decoding)
        return {"running": running, "waiting": len(self.waiting) + len(self.scoring),
                "pages_used": self.pages.num_used - evictable, "pages_total": self.pages.capacity,
                "slots_used": self.slots.num_used, "slots_total": self.slots.capacity,
                **(self.prefix.stats() if self.prefix is not None else {})}
