"""The prefix cache's decisions on fake requests, no device: hits, shared pages, chunks on block boundaries with
their snapshot plans, nothing partial cached, eviction, and exact page / slot / snapshot accounting."""

import random
import threading

import pytest

from hybrid_jax.engine.cache import BlockAllocator
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.host_tier import HostTier
from hybrid_jax.engine.prefix_cache import ROOT, PrefixCache
from hybrid_jax.engine.requests import Request
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.engine.scheduler import Scheduler

BLOCK = 64


def make(pages: int = 64, slots: int = 4, snapshots: int = 16, stride: int = 1, fill_delay_s: float = 0.0,
         host_blocks: int = 0, **config) -> Scheduler:
    """``host_blocks``: a host tier of that many blocks' bytes (a block 1 unit, a snapshot 2)."""
    options = dict(max_batch=slots, max_model_len=512, page_size=16, prefill_chunk=128, max_prefill_seqs=2)
    options.update(config)
    page_ids = BlockAllocator(pages + 1)
    host = HostTier(host_blocks, 1, 2) if host_blocks else None
    prefix = PrefixCache(BLOCK, 16, page_ids, BlockAllocator(snapshots + 1), stride, host=host)
    return Scheduler(EngineConfig(**options), BlockAllocator(slots + 1), page_ids, page_size=16, decode_steps=1,
                     prefix=prefix, fill_delay_s=fill_delay_s)


def request(name: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(name, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), seed=0)


def step(s: Scheduler) -> list:
    """One loop turn without a device: admission, one prefill step, one decode step (its output snapshots planned,
    then cached before its tokens are emitted); a hit's snapshot must survive until its first chunk reads it.
    Returns the (boundary, snapshot) plans of the step's chunks and of the decode step."""
    s.admit()
    plans = []
    chunks = s.prefill_chunks()
    if chunks:
        plans = [entry for r, _ in chunks for entry in r.snapshot_plan]
        for r, _ in chunks:  # its own plan may take the row: the step reads it before writing it
            if r.restore_from:
                hit_end = r.blocks[r.num_cached_tokens // s.prefix.block_size - 1]
                own = [snapshot for _, snapshot in r.snapshot_plan]
                assert hit_end.snapshot == r.restore_from or r.restore_from in own
                assert all(r.restore_from not in [x for _, x in q.snapshot_plan] for q, _ in chunks if q is not r)
        done, _ = s.prefilled(chunks)
        s.cache_prefilled(chunks)
        for r in done:
            s.emit(r, 7, -0.5, None)
    decoding = [r for r in s.decoding if r not in [c for c, _ in chunks]]
    planned, _ = s.output_snapshots.plan(decoding, s.decode_positions(decoding), 1, max(len(decoding), 1))
    s.output_snapshots.cache(planned)
    for r in decoding:
        s.emit(r, 7, -0.5, None)
    return plans + [(p.boundary, p.snapshot) for p in planned]


def run(s: Scheduler, *requests: Request) -> None:
    for r in requests:
        s.put(r)
    s.take_arrivals(block=False)
    while not s.idle:
        s.reap_cancelled()
        step(s)


def prompt(n: int, seed: int = 0) -> list[int]:
    return random.Random(seed).choices(range(500), k=n)


def test_a_hit_ends_at_a_snapshot_and_leaves_the_last_token():
    s = make(stride=2)
    base = prompt(300)
    run(s, request("a", base[:256]))
    # Snapshots every second block, before the last token and at the prompt's end: after 128, 192 and 256 tokens.
    assert [b.snapshot > 0 for b in s.prefix.match(base[:256])] == [False, True, True, True]
    assert len(s.prefix.hit(base[:256])) == 3  # the whole prompt cached: its last token is computed again
    assert len(s.prefix.hit(base[:257])) == 4
    assert len(s.prefix.hit(base[:200])) == 3
    assert s.prefix.hit(base[:100]) == []  # the first block has no snapshot
    assert s.prefix.hit(prompt(300, seed=1)) == []


def chunk_plan(s: Scheduler, r: Request) -> list[tuple[int, list[int]]]:
    """Prefill ``r`` alone: each step's (tokens, snapshot boundaries)."""
    s.put(r)
    s.take_arrivals(block=False)
    s.admit()
    steps = []
    while s.prefilling:
        chunks = s.prefill_chunks()
        steps.append((chunks[0][1], [boundary for boundary, _ in r.snapshot_plan]))
        s.prefilled(chunks)
        s.cache_prefilled(chunks)
    return steps


def test_snapshots_come_from_inside_chunks():
    """A chunk is not cut at snapshot boundaries: the step writes the states at the boundaries inside it."""
    s = make(stride=2, prefill_chunk=256)
    assert chunk_plan(s, request("a", prompt(300))) == [(256, [128, 256]), (44, [])]


def test_chunks_that_do_not_finish_a_prompt_end_on_a_block_boundary():
    s = make(stride=4, prefill_chunk=100)
    assert chunk_plan(s, request("a", prompt(200))) == [(64, []), (64, []), (72, [192])]  # 192: before the last token


def test_a_hit_shares_pages_restores_a_snapshot_and_prefills_the_rest():
    s = make()
    base = prompt(200)
    a = request("a", base[:150])
    run(s, a)
    b = request("b", base[:140] + [1, 2, 3])
    s.put(b)
    s.take_arrivals(block=False)
    s.admit()
    assert b.restore_from == s.prefix.match(base)[1].snapshot
    assert b.num_prefilled == b.num_cached_tokens == 128
    assert b.pages[:8] == [p for block in s.prefix.match(base) for p in block.pages]
    assert s.prefill_chunks() == [(b, 143 - 128)]
    assert s.counters["prefix_cache_hits"] == 128 and s.counters["prefix_cache_queries"] == 150 + 143


def test_requests_share_blocks_only_with_the_same_cache_salt():
    s = make()
    base = prompt(200)
    salted = request("a", base[:150])
    salted.cache_salt = "tenant-a"
    run(s, salted)
    hits = {}
    for name, salt in (("none", None), ("other", "tenant-b"), ("same", "tenant-a")):
        r = request(name, base[:150])
        r.cache_salt = salt
        run(s, r)
        hits[name] = r.num_cached_tokens
    assert hits == {"none": 0, "other": 0, "same": 128}
    assert s.prefix.match(base[:128], "tenant-a")[0] is not s.prefix.match(base[:128])[0]
    assert len(s.prefix.match(base[:128], "tenant-b")) == 2  # cached by its own request since


def test_divergence_mid_block_reuses_the_blocks_before_it():
    s = make()
    base = prompt(200)
    run(s, request("a", base[:192]))
    other = base[:100] + [(t + 1) % 500 for t in base[100:192]]
    b = request("b", other)
    run(s, b)
    assert b.num_cached_tokens == 64
    chain_a, chain_b = s.prefix.match(base[:192]), s.prefix.match(other)
    assert chain_a[0] is chain_b[0] and chain_a[1] is not chain_b[1]


def test_a_request_cancelled_mid_prefill_leaves_only_complete_blocks():
    s = make(prefill_chunk=96)
    r = request("a", prompt(300))
    s.put(r)
    s.take_arrivals(block=False)
    s.admit()
    for _ in range(2):  # 64 + 64 tokens (96 rounded down to a block)
        chunks = s.prefill_chunks()
        s.prefilled(chunks)
        s.cache_prefilled(chunks)
    assert r.num_prefilled == 128
    s.prefill_chunks()  # the next step's snapshot, reserved; the request is cancelled before that step runs
    assert s.prefix.snapshots.num_used == 3
    s.cancel(r)
    s.reap_cancelled()
    assert len(s.prefix.blocks) == 2
    assert all(b.refs == 0 and b.snapshot and len(b.pages) == 4 for b in s.prefix.blocks.values())
    assert s.pages.num_used == 8 and s.slots.num_used == 0 and s.prefix.snapshots.num_used == 2
    assert s.stats()["pages_used"] == 0  # evictable pages count as free
    assert s.reset_prefix_cache() and s.pages.num_used == 0 and s.prefix.snapshots.num_used == 0


def test_eviction_makes_room_and_never_fails_a_request():
    s = make(pages=12)  # 192 tokens: one request of 129 + 4 at a time, each leaving two blocks cached
    requests = [request(f"r{i}", prompt(129, seed=i)) for i in range(6)]
    run(s, *requests)
    assert all(len(r.output_ids) == 4 for r in requests)
    assert len(s.prefix.blocks) == 2 and s.pages.num_used == 8


def test_blocks_held_by_a_request_are_not_evicted():
    s = make(pages=18)
    base = prompt(200)
    a = request("a", base[:129], max_tokens=64)  # 13 pages over its lifetime, 8 of them cached blocks
    s.put(a)
    s.take_arrivals(block=False)
    while a.num_prefilled < 129:
        step(s)
    b = request("b", prompt(129, seed=5))  # needs 9 pages: only 5 free, and a's blocks are held
    s.put(b)
    s.take_arrivals(block=False)
    s.admit()
    assert b in s.waiting and len(s.prefix.blocks) == 2


def test_snapshots_run_short_and_evict_unused_blocks():
    s = make(snapshots=2)
    for i in range(4):
        run(s, request(f"r{i}", prompt(130, seed=i)))
    assert s.prefix.snapshots.num_used == 2
    assert sum(1 for b in s.prefix.blocks.values() if b.snapshot) == 2


def test_a_prompt_with_more_boundaries_than_snapshots_keeps_its_deepest():
    """Six boundaries, two snapshots: the prompt's later states supersede its earlier ones, so the prompt sent
    again resumes at its last boundary; a snapshot another request holds is never dropped."""
    s = make(snapshots=2, max_model_len=512)
    base = prompt(400)
    run(s, request("a", base))
    assert [b.snapshot > 0 for b in s.prefix.match(base)] == [False] * 4 + [True, True]
    assert len(s.prefix.hit(base)) == 6  # resumes at 384 of 400
    s = make(snapshots=3, max_model_len=512)
    shared = request("shared", base[:130], max_tokens=8)  # holds two blocks and their snapshots while b prefills
    s.put(shared)
    s.take_arrivals(block=False)
    step(s)
    b = request("b", base[:128] + prompt(272, seed=3))
    run(s, b)
    assert all(block.snapshot for block in s.prefix.match(base[:128]))  # held by "shared": kept
    assert sum(1 for block in s.prefix.blocks.values() if block.snapshot) == 3
    assert len(s.prefix.hit(b.prompt_ids)) == 6


def test_evicted_blocks_move_to_the_host_tier_and_come_back_on_a_hit():
    s = make(pages=20, slots=1, snapshots=4, stride=2, host_blocks=100)
    a, b = request("a", prompt(256)), request("b", prompt(256, seed=1))
    run(s, a)
    a_blocks = [blk.block_id for blk in s.prefix.match(a.prompt_ids)]
    run(s, b)  # 20 pages: a's blocks are evicted for b's, to the host
    host = s.prefix.host
    assert [blk.block_id for blk in s.prefix.match(a.prompt_ids)] == a_blocks
    assert all(i in host.blocks for i in a_blocks) and not any(i in s.prefix.blocks for i in a_blocks)
    outs = [m for m in host.moves if m.direction == "out"]
    assert {m.block.block_id for m in outs} >= set(a_blocks) and all(len(m.pages) == 4 for m in outs)
    moved_snapshots = {m.block.block_id for m in outs if m.snapshot}
    assert moved_snapshots & set(a_blocks) == set(a_blocks[-2:])  # the chain's end (and the boundary before it)
    host.moves.clear()
    again = request("a2", a.prompt_ids + [1, 2, 3])
    run(s, again)
    assert again.num_cached_tokens == 256 and s.counters["prefix_cache_host_hits"] == 256
    ins = [m for m in host.moves if m.direction == "in"]
    assert [m.block.block_id for m in ins] == a_blocks  # root first, into the pages the request then held
    assert [m.snapshot > 0 for m in ins] == [False, False, False, True]  # only the last block's snapshot
    assert not any(i in host.blocks for i in a_blocks)


def test_a_prompt_evicted_to_the_host_tier_and_resent_whole_resumes_before_its_last_block():
    s = make(pages=20, slots=1, snapshots=4, stride=4, host_blocks=100)
    a = request("a", prompt(256))
    run(s, a)
    run(s, request("b", prompt(256, seed=1)))  # evicts a's blocks to the host
    again = request("a2", list(a.prompt_ids))
    run(s, again)
    assert again.num_cached_tokens == 192 and s.counters["prefix_cache_host_hits"] == 192


def test_a_host_tier_too_small_for_a_block_keeps_nothing():
    s = make(pages=20, slots=1, snapshots=4, host_blocks=2)  # a block with its snapshot takes 3
    a = request("a", prompt(256))
    run(s, a)
    run(s, request("b", prompt(256, seed=1)))
    assert s.prefix.host.used <= 2 and not s.prefix.host.children.get(0)
    assert all(not m.snapshot for m in s.prefix.host.moves)


@pytest.mark.parametrize(("host_blocks", "snapshots"), [(0, 6), (12, 6), (0, 2)],
                         ids=["device", "with-host-tier", "few-snapshots"])
def test_random_requests_with_shared_prefixes_and_cancellations_leave_everything_accounted_for(host_blocks,
                                                                                               snapshots):
    rng, salts = random.Random(0), random.Random(1)
    s = make(pages=40, slots=4, snapshots=snapshots, stride=2, prefill_chunk=96, host_blocks=host_blocks)
    bases = [prompt(400, seed=i) for i in range(4)]
    pending, output_cached = [], False
    for i in range(1000):
        base = rng.choice(bases)
        n = rng.randrange(1, 300)
        tail = [rng.randrange(500) for _ in range(rng.randrange(0, 40))]
        pending.append(request(f"r{i}", base[:n] + tail, max_tokens=rng.randrange(1, 48)))
        pending[-1].cache_salt = salts.choice((None, None, "tenant"))
    while pending or not s.idle:
        for _ in range(rng.randrange(0, 3)):
            if pending and len(s.waiting) < 8:  # arrivals about as fast as requests finish
                s.put(pending.pop())
        s.take_arrivals(block=False)
        for r in [*s.waiting, *s.prefilling, *s.decoding]:
            if rng.random() < 0.005:
                s.cancel(r)
        s.reap_cancelled()
        plans = step(s)
        held = {id(r): r for r in s.prefilling + s.decoding}
        # Every page is free, a running request's own, or a cached block's: never two of these.
        cached = [p for b in s.prefix.blocks.values() for p in b.pages]
        own = [p for r in held.values() for p in r.pages if p not in {q for b in r.blocks for q in b.pages}]
        assert len(set(cached)) == len(cached) and not set(cached) & set(own)
        assert s.pages.num_used == len(cached) + len(own)
        assert s.slots.num_used == len(held)
        assert s.prefix.snapshots.num_used == sum(1 for b in s.prefix.blocks.values() if b.snapshot)
        for block in s.prefix.blocks.values():
            assert block.refs == sum(block in r.blocks for r in held.values())
        # The unused blocks (and those of them holding a snapshot, the snapshot victims) in one LRU order.
        unused = [i for i in s.prefix.unused]
        assert sorted(unused) == sorted(i for i, b in s.prefix.blocks.items() if not b.refs)
        assert list(s.prefix.unused_snapshots) == [i for i in unused if s.prefix.blocks[i].snapshot]
        assert all(snapshot for _, snapshot in plans)
        if host_blocks:
            check_host_tier(s.prefix)
        output_cached = output_cached or any(b.key[1][-1] == 7 for b in s.prefix.blocks.values())
    assert s.counters["prefix_cache_hits"] > 0
    if host_blocks:
        assert s.counters["prefix_cache_host_hits"] > 0
    assert output_cached  # blocks ending in output were cached
    assert s.pages.num_used == sum(len(b.pages) for b in s.prefix.blocks.values())
    assert s.reset_prefix_cache()
    assert s.pages.num_used == 0 and s.slots.num_used == 0 and s.prefix.snapshots.num_used == 0
    if host_blocks:
        assert not s.prefix.host.blocks and not s.prefix.host.children and s.prefix.host.used == 0


def check_host_tier(prefix: PrefixCache) -> None:
    """The host tier within its budget, its blocks apart from the device's, each under a block of either tier (or
    the root), and its parent links both ways."""
    host = prefix.host
    assert host.used == sum(b.nbytes for b in host.blocks.values()) <= host.budget
    assert not set(host.blocks) & set(prefix.blocks)
    assert list(host.lru) and sorted(host.lru) == sorted(host.blocks) or not host.blocks
    for block in host.blocks.values():
        parent = block.key[0]
        assert parent == 0 or parent in host.blocks or parent in prefix.blocks
        siblings = host.blocks[parent].children if parent in host.blocks else host.children[parent]
        assert block.block_id in siblings and host.by_key[block.key] == block.block_id
    listed = [c for b in host.blocks.values() for c in b.children] + [c for cs in host.children.values() for c in cs]
    assert sorted(listed) == sorted(host.blocks)
    assert all(parent == 0 or parent in prefix.blocks for parent in host.children)


def test_chunks_shorter_than_a_block_still_snapshot_where_they_end_on_one():
    """With a budget under a block, every other chunk ends on a boundary: its last GDN chunk ends there too."""
    s = make(stride=1, prefill_chunk=32)
    assert chunk_plan(s, request("a", prompt(100))) == [(32, []), (32, [64]), (32, []), (4, [])]


def test_a_finished_request_leaves_a_fill_of_its_output_run_once_the_engine_idles():
    """A request whose output crossed a block boundary that no decode step snapshotted (here: its last token ends
    the block, and no step runs after it) leaves a prefill-only fill of its tokens up to there (prompt + output: a
    chat's next turn resumes there); it waits while anything else runs, samples nothing and counts in no request
    metric."""
    s = make(stride=4)
    a, c = request("a", prompt(100), max_tokens=28), request("c", prompt(30, seed=1), max_tokens=60)
    for r in (a, c):
        s.put(r)
    s.take_arrivals(block=False)
    while not a.finished:
        step(s)
    assert [f.prompt_ids for f in s.fills.pending] == [(a.prompt_ids + a.output_ids)[:128]]
    while not c.finished:
        step(s)
        assert not any(r.fill for r in s.prefilling)  # c still decodes
    while not s.idle or s.fills.pending:
        step(s)
    tokens = a.prompt_ids + a.output_ids
    assert s.prefix.cached(tokens[:128]) and s.slots.num_used == 0
    assert s.counters["requests_finished"] == 2 and s.counters["prompt_tokens"] == 130
    nxt = request("b", tokens + [1, 2, 3])
    run(s, nxt)
    assert nxt.num_cached_tokens == 128


def test_a_fill_waits_for_the_engine_to_idle_a_moment():
    s = make(stride=4, fill_delay_s=30.0)
    a = request("a", prompt(100), max_tokens=28)
    run(s, a)
    step(s)
    assert len(s.fills.pending) == 1 and 29 < s.fills.wait() <= 30 and not s.prefilling


def test_a_fill_waits_from_the_moment_the_last_request_finished(monkeypatch):
    """The engine's idle time counts from its last request's end, not from the admission before its last step: a
    closed-loop client that resends at once must not find a fill's prefill step ahead of it."""
    clock = [0.0]
    monkeypatch.setattr("hybrid_jax.engine.fills.time.monotonic", lambda: clock[0])
    s = make(stride=4, fill_delay_s=0.05)
    emit = s.emit

    def slow_emit(*args):  # a step's device work, between its admission and its tokens, outlasts the delay
        clock[0] += 1.0
        return emit(*args)

    monkeypatch.setattr(s, "emit", slow_emit)
    a = request("a", prompt(100), max_tokens=28)
    s.put(a)
    s.take_arrivals(block=False)
    while not a.finished:
        step(s)
    assert len(s.fills.pending) == 1 and s.fills.wait() == pytest.approx(0.05)
    s.admit()
    assert not s.prefilling and len(s.fills.pending) == 1


def test_output_blocks_are_cached_at_the_boundaries_decode_crosses():
    """A decode step crossing a block boundary has a snapshot planned there; once its tokens are out, the blocks up
    to it are cached with it (the request's earlier output snapshot freed unless the stride keeps it), and a
    prompt continuing the answer hits there."""
    s = make(snapshots=8, stride=4)
    r = request("r", prompt(100), max_tokens=100)
    run(s, r)
    tokens = r.prompt_ids + r.output_ids  # 200 tokens: output boundaries 128 and 192
    assert s.prefix.cached(tokens[:192]) and not s.prefix.cached(tokens[:128])  # 128 superseded by 192
    assert s.prefix.snapshots.num_used == 2  # the prompt's last boundary (64) and 192
    assert [len(b.pages) * 16 for b in [s.prefix.hit(tokens[:192] + [1])[-1]]] == [64]
    assert len(s.prefix.hit(tokens[:192] + [1])) == 3


def test_with_the_pool_full_an_output_boundary_takes_the_requests_shallowest_snapshot():
    """Its prompt's snapshots fill the pool and nothing is unused: the decode step crossing 192 takes the id of the
    request's shallowest one (64), as a prompt's chunk would, so its answer's boundary is cached without a fill."""
    s = make(snapshots=2, stride=1, fill_delay_s=1e9)
    r = request("r", prompt(130), max_tokens=70)
    run(s, r)
    tokens = r.prompt_ids + r.output_ids
    assert [b.snapshot > 0 for b in s.prefix.match(tokens[:192])] == [False, True, True]
    assert len(s.prefix.hit(tokens[:192] + [1])) == 3 and not s.fills.pending


def test_a_planned_output_snapshot_whose_tokens_never_come_is_freed():
    """Planned for a step whose request ends (or is cancelled) before the host reads it, or whose call fails:
    the reserved snapshot goes back."""
    s = make(snapshots=4)
    r = request("r", prompt(60), max_tokens=20)
    s.put(r)
    s.take_arrivals(block=False)
    while len(r.output_ids) < 3:
        step(s)
    planned, ids = s.output_snapshots.plan([r], s.decode_positions([r]) + 1, 4, 2)  # crosses 64 at its step 0
    assert [p.boundary for p in planned] == [64] and ids[0, 0] == planned[0].snapshot
    used = s.prefix.snapshots.num_used
    s.cancel(r)
    s.reap_cancelled()
    s.output_snapshots.cache(planned)
    assert s.prefix.snapshots.num_used == used - 1
    r2 = request("r2", prompt(60, seed=1), max_tokens=20)
    run(s, r2)
    planned, _ = s.output_snapshots.plan([r2], [62], 1, 1)
    s.fail_running(RuntimeError("step failed"))
    assert s.prefix.snapshots.num_used == sum(1 for b in s.prefix.blocks.values() if b.snapshot)


def test_stats_read_on_another_thread_while_blocks_come_and_go():
    """/metrics reads the cache's stats on a request thread while the engine thread caches and evicts blocks: the
    read never fails, and what it reports adds up once the engine thread stops."""
    pages = BlockAllocator(4 * 2000 + 1)
    prefix = PrefixCache(BLOCK, 16, pages, BlockAllocator(9), 1)
    stop, errors = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            try:
                prefix.stats()
                _ = prefix.evictable_pages
            except Exception as e:  # noqa: BLE001 (what the test looks for)
                errors.append(e)
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for round_ in range(5):
            for i in range(2000):
                block, _ = prefix.add(ROOT, [round_, i] + [0] * (BLOCK - 2), 0, pages.allocate(4))
                prefix.release([block])
            assert prefix.make_room(pages.capacity)
    finally:
        stop.set()
        reader.join()
    assert not errors, errors[0]
    block, _ = prefix.add(ROOT, prompt(BLOCK), 0, pages.allocate(4))
    assert prefix.stats()["prefix_pages"] == 4 and prefix.evictable_pages == 0
    prefix.release([block])
    assert prefix.evictable_pages == 4
