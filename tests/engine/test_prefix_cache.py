"""Prefix caching in the engine: greedy tokens and logprobs identical to the cache off, for shared prefixes of
several lengths and chunkings, concurrent hits, eviction under memory pressure, the reset, tensor parallelism."""

import time
from pathlib import Path

import jax
import numpy as np
import pytest

import hybrid_jax
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.sampling_params import SamplingParams

GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden" / "causal_grouped"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BASE = np.random.default_rng(0).integers(0, 512, 300).tolist()
OTHER = np.random.default_rng(1).integers(0, 512, 300).tolist()
# Shared prefixes inside a block (100), on a boundary (128, 129), past several chunks (257), diverging mid-block.
PROMPTS = [BASE[:200], BASE[:64] + [5, 6, 7], BASE[:128], BASE[:129], BASE[:100] + [1, 2], BASE[:257],
           BASE[:150] + [(t + 1) % 512 for t in BASE[150:190]], BASE[:200] + [9]]


@pytest.fixture(scope="module")
def model():
    return hybrid_jax.load_pretrained(GOLDEN, "float32")


def make_engine(model, warmup: bool = False, **kw):
    """Without ``warmup`` each program is built when first used: only those the test runs compile."""
    options = dict(max_batch=4, max_model_len=512, page_size=16, prefill_chunk=64, max_prefill_seqs=2,
                   enable_prefix_caching=True)
    options.update(kw)
    return Engine(model, EngineConfig(**options)).start(warmup=warmup)


def result(handle):
    events = list(handle)
    assert events[-1].finish_reason == "length"
    return [e.token_id for e in events], [e.logprob for e in events]


def serve(engine, prompts, *, together=False):
    """Each prompt's (tokens, logprobs) and cached prompt tokens; one at a time unless ``together``."""
    try:
        if together:
            handles = [engine.submit(p, GREEDY) for p in prompts]
            return [result(h) for h in handles], [h.num_cached_tokens for h in handles]
        out, cached = [], []
        for p in prompts:
            handle = engine.submit(p, GREEDY)
            out.append(result(handle))
            cached.append(handle.num_cached_tokens)
        return out, cached
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def references(model):
    """The cache off's outputs at a prefill chunk size, each computed once."""
    computed = {}

    def at(chunk: int = 64):
        if chunk not in computed:
            engine = make_engine(model, prefill_chunk=chunk, enable_prefix_caching=False)
            computed[chunk] = serve(engine, PROMPTS + [OTHER[:150]])[0]
        return computed[chunk]
    return at


@pytest.fixture(scope="module")
def reference(references):
    return references(64)


@pytest.mark.parametrize("chunk, stride, hits", [
    (64, 1, [0, 64, 64, 128, 64, 192, 128, 192]),
    (32, 1, [0, 64, 64, 128, 64, 192, 128, 192]),  # every other chunk ends on a block boundary
    # The last block boundary before a prompt's last token gets a snapshot (and its end, on a boundary): the first
    # prompt's at 192, the second's at 64, the third's at 128.
    (128, 4, [0, 0, 64, 128, 64, 192, 128, 192]),
], ids=["chunk64-every-block", "chunk32-every-block", "chunk128-stride4"])
def test_outputs_identical_to_the_cache_off(model, references, chunk, stride, hits):
    """With chunks of a block or less every hit resumes where a chunk of the cache off starts, from the state that
    chunk starts from: tokens and logprobs bit-identical. Longer chunks resume mid-chunk (the same GDN chunks of
    64 tokens and states, other matmul shapes): greedy tokens identical, logprobs to float32 rounding."""
    out, cached = serve(make_engine(model, prefill_chunk=chunk, snapshot_stride=stride), PROMPTS)
    assert cached == hits
    if chunk <= 64:
        assert out == references(chunk)[: len(PROMPTS)]
    else:
        assert_close(out, references(chunk)[: len(PROMPTS)])


def assert_close(out, expected):
    """Greedy tokens identical, logprobs within float32 rounding: other chunk cuts or packings than the
    reference's (as any change of prefill chunking gives, with or without the cache)."""
    assert [tokens for tokens, _ in out] == [tokens for tokens, _ in expected]
    np.testing.assert_allclose([lp for _, lp in out], [lp for _, lp in expected], rtol=0, atol=1e-5)


def test_snapshots_inside_long_chunks(model, references):
    """Chunks of 256 tokens with snapshots written inside them (every other block)."""
    out, cached = serve(make_engine(model, prefill_chunk=256, snapshot_stride=2), PROMPTS)
    assert cached == [0, 0, 64, 128, 64, 192, 128, 192]
    assert_close(out, references(256)[: len(PROMPTS)])


def test_concurrent_requests_on_one_prefix(model, reference, compile_log):
    engine = make_engine(model, warmup=True, snapshot_stride=1, prefill_sizes=(64,), decode_sizes=(4,))
    compile_log.clear()
    result(engine.submit(BASE[:200], GREEDY))  # caches BASE's first three blocks
    out, cached = serve(engine, PROMPTS[1:] + [OTHER[:150], OTHER[:150]], together=True)
    assert_close(out, reference[1:] + reference[-1:])
    assert cached[: len(PROMPTS) - 1] == [64, 64, 128, 64, 192, 128, 192]
    assert compile_log.messages() == []


def test_eviction_under_memory_pressure_never_fails_a_request(model, reference):
    # 24 pages: a request takes up to 18, so cached blocks are evicted for almost every admission.
    engine = make_engine(model, num_pages=25, max_model_len=288, snapshot_stride=1, num_snapshots=3)
    prompts = PROMPTS[:6] + PROMPTS[:6]
    out, cached = serve(engine, prompts)
    assert out == reference[:6] * 2
    assert sum(cached) > 0
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0


THREE = [BASE[:200], OTHER[:200], np.random.default_rng(2).integers(0, 512, 200).tolist()]


@pytest.fixture(scope="module")
def three_off(model):
    return serve(make_engine(model, enable_prefix_caching=False), THREE)[0]


@pytest.mark.parametrize("tp", [1, 2], ids=["one-device", "tp2"])
def test_evicted_blocks_come_back_from_the_host_tier(three_off, tp):
    """Room on the device for about one prompt's blocks, three prompts in turn: each evicts the one before to the
    host tier, and the second round brings every one back (its KV pages into fresh pages, its snapshot into a
    fresh snapshot); outputs identical to the cache off."""
    model = hybrid_jax.load_pretrained(GOLDEN, "float32")  # tp=2 shards it in place
    engine = make_engine(model, num_pages=25, max_model_len=288, snapshot_stride=4, num_snapshots=3,
                         kv_offloading_size=0.01, tensor_parallel_size=tp)
    out, cached = serve(engine, THREE * 2)
    if tp == 1:
        assert out == three_off * 2
    else:
        assert_close(out, three_off * 2)
    assert cached == [0, 0, 0, 192, 192, 192]
    assert engine.scheduler.counters["prefix_cache_host_hits"] == 3 * 192
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0 and stats["host_blocks"] > 0
    kept = [leaf for block in engine.scheduler.prefix.host.blocks.values()
            for leaf in jax.tree.leaves(engine.runner.host_moves.host_data(block))]
    assert kept and {leaf.sharding.memory_kind for leaf in kept} == {"pinned_host"}
    runner = engine.runner  # the GPU warm-up's run of the copies: the null page and snapshot out and back
    before = jax.device_get((runner.pools, runner.snapshots))
    after = jax.device_get(runner.host_moves.round_trip(runner.program, runner.pools, runner.snapshots))
    jax.tree.map(np.testing.assert_array_equal, after, before)


def test_a_cache_salt_shares_blocks_only_with_its_own(model, reference):
    engine = make_engine(model)
    try:
        outputs, cached = [], []
        for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
            handle = engine.submit(BASE[:200], GREEDY, cache_salt=salt)
            outputs.append(result(handle))
            cached.append(handle.num_cached_tokens)
        with pytest.raises(ValueError, match="cache_salt"):
            engine.submit(BASE[:200], GREEDY, cache_salt="")
    finally:
        engine.shutdown()
    assert cached == [0, 0, 0, 192]
    assert all(out == reference[0] for out in outputs)


def test_reset_empties_the_cache(model):
    engine = make_engine(model)
    try:
        result(engine.submit(BASE[:200], GREEDY))
        assert engine.stats()["prefix_blocks"] == 3
        engine.reset_prefix_cache()
        deadline = time.monotonic() + 10
        while engine.stats()["prefix_blocks"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = engine.stats()
        assert stats["prefix_blocks"] == 0 and stats["snapshots_used"] == 0
        assert engine.pages.num_used == 0
        handle = engine.submit(BASE[:201], GREEDY)
        result(handle)
        assert handle.num_cached_tokens == 0
    finally:
        engine.shutdown()


def test_hits_under_tensor_parallelism(reference):
    """Prompt hits and a chat turn on the answer's decode snapshot (the unfused decode's), on two fake devices:
    the tokens of one device, and the same outputs as the cache off at tp=2."""
    model = hybrid_jax.load_pretrained(GOLDEN, "float32")  # sharded in place by the engine: not the shared one
    answer = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    def prompts_then_chat(engine):
        """PROMPTS[:4] one at a time, then (the cache emptied) a chat turn after a 40-token answer: the prompts'
        outputs and cached tokens, the turn's output and cached tokens."""
        if engine.scheduler.fills is not None:
            engine.scheduler.fills.delay_s = 1e9  # the turn's hit must come from decode
        try:
            out, cached = [], []
            for p in PROMPTS[:4]:
                handle = engine.submit(p, GREEDY)
                out.append(result(handle))
                cached.append(handle.num_cached_tokens)
            engine.reset_prefix_cache()
            first = [e.token_id for e in engine.submit(BASE[:100], answer)]
            handle = engine.submit(BASE[:100] + first + OTHER[:30], GREEDY)
            return out, cached, result(handle), handle.num_cached_tokens
        finally:
            engine.shutdown()
    out, cached, turn, turn_cached = prompts_then_chat(make_engine(model, tensor_parallel_size=2, snapshot_stride=1))
    assert cached == [0, 64, 64, 128] and turn_cached == 128
    assert [tokens for tokens, _ in out] == [tokens for tokens, _ in reference[:4]]
    off, _, off_turn, _ = prompts_then_chat(make_engine(model, tensor_parallel_size=2, enable_prefix_caching=False))
    assert out == off
    assert_close([turn], [off_turn])


def test_a_chat_turn_resumes_after_the_previous_answer_by_a_fill(model):
    """An answer whose last block ends on its last token (no decode step runs after it, so none snapshots it):
    turn two hits that boundary once the fill turn one left has run while the engine idled; its tokens and
    logprobs are the cache off's."""
    answer = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)  # 100 + 28 = 128 tokens
    engine = make_engine(model, snapshot_stride=4)
    try:
        first = [e.token_id for e in engine.submit(BASE[:100], answer)]
        assert engine.stats()["prefix_blocks"] == 1  # the prompt's block; the answer's waits for the fill
        deadline = time.monotonic() + 30
        while engine.stats()["prefix_blocks"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        turn = BASE[:100] + first + OTHER[:30]
        handle = engine.submit(turn, GREEDY)
        out = result(handle)
        assert handle.num_cached_tokens == 128
    finally:
        engine.shutdown()
    assert_close([out], serve(make_engine(model, enable_prefix_caching=False), [turn])[0])


def test_chat_turns_sent_at_once_resume_after_the_previous_answers(model):
    """Decode's snapshots: two chats decoding side by side (several steps a call), each next turn sent as soon as
    the answer ends with no fill allowed to run, hit the answers' last block boundaries; tokens and logprobs are
    the cache off's."""
    answer = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine = make_engine(model, snapshot_stride=4, decode_steps=4)
    engine.scheduler.fills.delay_s = 1e9  # never idle long enough
    try:
        prompts = [BASE[:100], OTHER[:90]]
        answers = [[e.token_id for e in h] for h in [engine.submit(p, answer) for p in prompts]]
        turns = [p + a + extra for p, a, extra in zip(prompts, answers, [OTHER[:30], BASE[:20]], strict=True)]
        handles = [engine.submit(t, GREEDY) for t in turns]
        out = [result(h) for h in handles]
        assert [h.num_cached_tokens for h in handles] == [128, 128]
    finally:
        engine.shutdown()
    assert_close(out, serve(make_engine(model, enable_prefix_caching=False), turns)[0])


def test_a_long_answer_keeps_its_stride_snapshots_and_its_latest(model):
    """Every output boundary is snapshotted; a superseded one is freed unless the stride keeps it: an answer
    crossing 64, 128, 192 and 256 with stride 2 leaves the snapshots at 128 and 256, and a prompt sharing its
    first 200 tokens resumes at 128."""
    engine = make_engine(model, snapshot_stride=2, decode_steps=4)
    engine.scheduler.fills.delay_s = 1e9
    try:
        long = [e.token_id for e in engine.submit(BASE[:10], SamplingParams(max_tokens=250, temperature=0,
                                                                               ignore_eos=True))]
        assert engine.stats()["snapshots_used"] == 2
        tokens = BASE[:10] + long
        handle = engine.submit(tokens[:200] + [3, 4], GREEDY)
        result(handle)
        assert handle.num_cached_tokens == 128
        handle = engine.submit(tokens[:258], GREEDY)
        result(handle)
        assert handle.num_cached_tokens == 256
    finally:
        engine.shutdown()
