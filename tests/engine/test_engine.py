"""The engine against the plain model: greedy equality, chunked prefill, mid-flight arrivals, cancellation, leaks."""

import threading
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hybrid_jax
from hybrid_jax.engine.cache import pages_for
from hybrid_jax.engine.calls import FirstTokens, host_samples
from hybrid_jax.engine.engine import Engine, EngineConfig, QueueFullError, Request
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.generate import greedy_generate

GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden" / "causal_grouped"
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return hybrid_jax.load_pretrained(GOLDEN, "float32")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 512, n).tolist() for n in (1, 63, 64, 65, 7, 130, 20, 3)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [greedy_generate(model, jnp.asarray([p]), GREEDY.max_tokens)[0] for p in prompts]


def make_engine(model, *, eos_token_ids=(), think_token_ids=None, warmup: bool = False, **kw):
    """Without ``warmup`` each program is built when first used: only those the test runs compile."""
    options = dict(max_batch=4, max_model_len=256, page_size=16, prefill_chunk=64, max_prefill_seqs=2)
    options.update(kw)
    return Engine(model, EngineConfig(**options), eos_token_ids=eos_token_ids,
                  think_token_ids=think_token_ids).start(warmup=warmup)


def test_config_checked():
    with pytest.raises(ValueError, match="decode_sizes"):
        EngineConfig(max_batch=4, decode_sizes=(2, 8))
    for bad, key in [(dict(prefill_chunk=0), "prefill_chunk"), (dict(max_prefill_seqs=0), "max_prefill_seqs"),
                     (dict(prefill_chunk=64, prefill_sizes=(16, 128)), "prefill_sizes")]:
        with pytest.raises(ValueError, match=key):
            EngineConfig(**bad)
    assert EngineConfig(prefill_chunk=64, prefill_sizes=(16,)).prefill_buckets == (16, 64)
    with pytest.raises(ValueError, match="compile_threads"):
        EngineConfig(compile_threads=0)
    with pytest.raises(ValueError, match="snapshot_stride"):
        EngineConfig(snapshot_stride=0)
    for share in (0.0, 1.0):
        with pytest.raises(ValueError, match="snapshot_share"):
            EngineConfig(snapshot_share=share)


def tokens(handle):
    return [e.token_id for e in handle if e.token_id is not None]


def settled(engine, timeout_s: float = 30) -> dict:
    """The engine's stats once no slot is held: a finished request may leave a fill (prefix caching) that runs
    when the engine idles."""
    deadline = time.monotonic() + timeout_s
    while engine.stats()["slots_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats()


def decode_calls(engine) -> Counter:
    """Decode calls the engine has run while serving, by steps per call."""
    calls = Counter()
    for key, n in engine.runner.runs.items():
        if key[0] == "decode":
            calls[key[2]] += n
    return calls


@pytest.mark.parametrize("chunk, steps", [(32, 1), (256, 3)], ids=["chunked-prefill", "whole-prompts-multistep"])
def test_greedy_matches_plain_model(model, prompts, reference, chunk, steps):
    engine = make_engine(model, prefill_chunk=chunk, max_prefill_seqs=3, decode_steps=steps)
    try:
        handles = [engine.submit(p, GREEDY) for p in prompts]
        assert [tokens(h) for h in handles] == reference
        stats = settled(engine)
        assert stats["pages_used"] == 0 and stats["slots_used"] == 0
    finally:
        engine.shutdown()


def test_padded_residual_stream_matches_plain_model(model, prompts, reference, monkeypatch):
    """On a GPU the steps pad their rows to the few-row kernel's 16 (zero rows that attention and the
    recurrences never see; the GDN decode's o comes back padded to them); the same padding here must leave
    every token as it was."""
    import hybrid_jax.caches.paged as paged

    monkeypatch.setattr(paged, "padded_rows", lambda n: max(n, 16))
    engine = make_engine(model, decode_steps=2)
    try:
        assert [tokens(engine.submit(p, GREEDY)) for p in prompts[:4]] == reference[:4]
    finally:
        engine.shutdown()


def test_mid_flight_arrivals_and_cancellation(model, prompts, reference):
    engine = make_engine(model)
    try:
        first = [engine.submit(p, GREEDY) for p in prompts[:3]]
        it = iter(first[0])
        got0 = [next(it).token_id for _ in range(3)]  # the first request is decoding now
        late = [engine.submit(p, GREEDY) for p in prompts[3:6]]
        doomed = engine.submit(prompts[6], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        next(iter(doomed))
        doomed.cancel()
        got0 += [e.token_id for e in it]
        assert got0 == reference[0]
        assert [tokens(h) for h in first[1:]] == reference[1:3]
        assert [tokens(h) for h in late] == reference[3:6]
        events = list(doomed)
        assert events[-1].finish_reason == "abort"
        stats = settled(engine)
        assert stats["pages_used"] == 0 and stats["slots_used"] == 0 and stats["running"] == 0
    finally:
        engine.shutdown()


def test_seeded_sampling_is_reproducible(model, prompts):
    engine = make_engine(model)
    try:
        params = dict(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
        runs = [tokens(engine.submit(prompts[5], SamplingParams(seed=s, **params))) for s in (1, 1, 2)]
        assert runs[0] == runs[1]
        assert runs[0] != runs[2]
        # The same seed in a different batch mix gives the same tokens.
        others = [engine.submit(p, SamplingParams(seed=9, **params)) for p in prompts[:3]]
        again = tokens(engine.submit(prompts[5], SamplingParams(seed=1, **params)))
        [tokens(h) for h in others]
        assert again == runs[0]
    finally:
        engine.shutdown()


def test_multistep_decode_keeps_seeded_samples(model, prompts):
    params = SamplingParams(max_tokens=11, temperature=0.8, top_k=20, seed=4, ignore_eos=True)
    results = []
    for steps in (1, 4):
        engine = make_engine(model, decode_steps=steps)
        try:
            results.append([tokens(engine.submit(p, params)) for p in prompts[:2]])
        finally:
            engine.shutdown()
    assert results[0] == results[1]


def test_pipelined_calls_across_endings_and_variant_changes(model, prompts, reference):
    """Calls chained on the device run past requests' ends and switch variant (logprobs, then greedy multi-step)."""
    engine = make_engine(model, decode_steps=3)
    try:
        long = engine.submit(prompts[0], GREEDY)
        short = engine.submit(prompts[2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        scored = engine.submit(prompts[3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2))
        assert tokens(short) == reference[2][:4]
        events = [e for e in scored if e.token_id is not None]
        assert [e.token_id for e in events] == reference[3][:5]
        assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0][0] == e.token_id for e in events)
        assert tokens(long) == reference[0]
        assert engine.stats()["pages_used"] == 0
    finally:
        engine.shutdown()


def test_chained_call_inputs_match_the_host_built_batch(model, prompts):
    """A chained call's inputs, made on the device by the call before it, are the batch the host would build
    once it has read that call's samples: last tokens, positions, sampling steps and output histories advanced,
    the rest kept."""
    engine = Engine(model, EngineConfig(max_batch=4, max_model_len=256, page_size=16, decode_steps=3))
    requests = []
    for i, p in enumerate(prompts[1:4]):
        params = SamplingParams(max_tokens=20, temperature=0.5 * i, top_k=5 * i, seed=i, ignore_eos=True,
                                bad_words_token_ids=[[9, 9]] if i == 2 else [])  # its output history is kept
        r = Request(f"r{i}", p, params, seed=i, output_ids=[p[-1]])
        r.slot = engine.slots.allocate(1)[0]
        r.pages = engine.pages.allocate(pages_for(r.total_len, 16))
        requests.append(r)
    call = engine.launch_decode(requests, (False, 1))
    second = engine.launch_decode(requests, (False, 1), after=call)
    for c in (call, second):
        for sampled in engine.runner.read(c):
            engine.scheduler.deliver(c.requests, sampled)
    assert all(len(r.output_ids) == 3 for r in requests)
    host = engine.runner.decode_batch(requests, 4)
    for name, want, got in zip(host._fields, host, second.next_batch, strict=True):
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_first_call_inputs_take_prefills_samples_on_the_device(model, prompts):
    """The first decode call after a prefill takes the prompts' first tokens from prefill's output on the
    device: its batch is the one the host builds once it has read them (tokens, positions, sampling steps)."""
    engine = Engine(model, EngineConfig(max_batch=4, max_model_len=256, page_size=16, decode_steps=3,
                                        enable_prefix_caching=False))  # each prompt in one chunk
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.5 * i, seed=i, ignore_eos=True),
                        seed=i) for i, p in enumerate(prompts[4:7])]
    scheduler, runner = engine.scheduler, engine.runner
    for r in requests:
        scheduler.put(r)
    scheduler.take_arrivals(block=False)
    scheduler.admit()
    chunks = scheduler.prefill_chunks()
    sampled = runner.prefill(chunks, scheduler.prefill_buckets(chunks))
    first = FirstTokens(*scheduler.prefilled(chunks), sampled)
    assert [r.request_id for r in first.requests] == ["r0", "r1", "r2"]
    assert not any(r.output_ids for r in requests)  # nothing read yet
    order = [requests[2], requests[0], requests[1]]  # rows in another order than prefill's
    device_made = runner.decode_batch(order, 4, first)
    assert runner.runs[("first_tokens", 4)] == 1
    scheduler.deliver(first.requests, host_samples(first.sampled, first.requests), first.rows)
    assert all(len(r.output_ids) == 1 for r in requests)
    host = runner.decode_batch(order, 4)
    for name, want, got in zip(host._fields, host, device_made, strict=True):
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_first_decode_call_is_queued_before_prefills_tokens_are_read(model, prompts):
    """After the prefill that finishes a prompt, the engine queues the first decode call before it reads
    prefill's token: that call takes the token from prefill's output on the device (the first-tokens program
    runs), and the output is unchanged."""
    want = greedy_generate(model, jnp.asarray([prompts[1]]), 8)[0]
    engine = make_engine(model, decode_steps=3)
    try:
        assert tokens(engine.submit(prompts[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))) == want
    finally:
        engine.shutdown()
    assert engine.runner.runs[("first_tokens", 1)] == 1
    assert decode_calls(engine) == Counter({3: 2, 1: 1})  # 7 tokens after prefill's


def test_a_one_token_request_queues_no_decode_call(model, prompts, reference):
    """max_tokens=1: prefill's token is the whole output, so no decode call is queued for it (its first token is
    still unread when the engine decides), and the next request is served as usual."""
    engine = make_engine(model, decode_steps=3)
    try:
        events = list(engine.submit(prompts[1], SamplingParams(max_tokens=1, temperature=0)))
        assert [e.token_id for e in events] == reference[1][:1] and events[-1].finish_reason == "length"
        assert decode_calls(engine) == Counter()
        assert tokens(engine.submit(prompts[2], SamplingParams(max_tokens=4, temperature=0))) == reference[2][:4]
        assert decode_calls(engine) == Counter({3: 1})  # its 3 tokens after prefill's in one call
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("max_tokens", "calls"), [(10, {3: 3}), (12, {3: 3, 1: 2})],
                         ids=["exact-multiple", "single-step-tail"])
def test_no_step_runs_past_max_tokens(model, prompts, max_tokens, calls):
    """Prefill gives token 1, decode calls of 3 steps the rest. Once the call in flight reaches a request's
    max_tokens nothing more is queued for it (a later request's prefill would wait behind discarded rows), and
    its last tokens, fewer than a call's 3, take a step per call rather than a call that computes past its end:
    the calls' steps add up to the tokens wanted."""
    want = greedy_generate(model, jnp.asarray([prompts[1]]), max_tokens)[0]
    engine = make_engine(model, decode_steps=3)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        assert tokens(engine.submit(prompts[1], params)) == want
        assert decode_calls(engine) == Counter(calls)
        assert sum(steps * n for steps, n in calls.items()) == max_tokens - 1
    finally:
        engine.shutdown()


def test_nothing_compiles_while_serving(model, prompts, compile_log):
    """The warm-up compiles every program the engine runs: greedy chains, multi-step, sampling, logprobs, with
    decode programs for batches of 3 and 4 only (smaller batches pad to 3)."""
    compile_log.clear()
    engine = make_engine(model, warmup=True, decode_steps=3, decode_sizes=(3,))
    assert engine.config.decode_buckets == (3, 4)  # max_batch is always a size
    # One compile per program: the warm-up compiled against the released pools' shapes, and its run of each
    # program on the re-allocated pools used those compilations (a signature mismatch compiles them all again).
    programs = len([key for key in engine.programs.specs if key[0] in ("decode", "prefill")])
    assert len([m for m in compile_log.messages() if m.startswith("Compiling jit(_run")]) == programs
    compile_log.clear()
    try:
        handles = [engine.submit(prompts[1], GREEDY), engine.submit(prompts[5], GREEDY),
                   engine.submit(prompts[3], SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1)),
                   engine.submit(prompts[0], SamplingParams(max_tokens=4, temperature=0, logprobs=2))]
        for h in handles:
            assert tokens(h)
        assert compile_log.messages() == []
    finally:
        engine.shutdown()


def test_stop_token_ids_eos_and_logprobs(model, prompts, reference):
    engine = make_engine(model, eos_token_ids=(reference[1][4],))  # the programs other tests compiled
    try:
        events = list(engine.submit(prompts[1], SamplingParams(max_tokens=10, temperature=0, logprobs=3)))
        stop_at = reference[1].index(reference[1][4]) + 1
        assert [e.token_id for e in events] == reference[1][:stop_at]
        assert events[-1].finish_reason == "stop"
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0][0] == e.token_id for e in events)
        stop_id = reference[2][2]
        events = list(engine.submit(prompts[2], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id])))
        assert events[-1].token_id == stop_id and events[-1].finish_reason == "stop"
    finally:
        engine.shutdown()


THINK = (300, 301)  # a think block's start and end tokens


@pytest.fixture(scope="module")
def served(model, reference):
    """One engine for the tests of request features: eos is the third greedy token of prompts[2]."""
    engine = make_engine(model, eos_token_ids=(reference[2][2],), think_token_ids=THINK)
    yield engine
    engine.shutdown()


def test_token_constraints_in_chained_calls(served, prompts, reference):
    """logit_bias, a bad word (matched on the device against output the host has not read), min_tokens and the
    thinking budget, on requests decoding together call after call."""
    start, end = THINK
    greedy = dict(max_tokens=10, temperature=0)
    a, b, c = reference[1][:3]
    handles = [
        served.submit(prompts[0], SamplingParams(**greedy, ignore_eos=True, logit_bias={7: 100.0})),
        served.submit(prompts[1], SamplingParams(**greedy, ignore_eos=True, bad_words_token_ids=[[b, c]])),
        served.submit(prompts[2], SamplingParams(**greedy, min_tokens=4)),
        served.submit(prompts[3] + [start], SamplingParams(**greedy, ignore_eos=True, thinking_token_budget=2)),
    ]
    biased, banned, held, thinking = map(tokens, handles)
    assert biased == [7] * 10
    assert banned[:2] == [a, b] and banned[2] != c
    assert reference[2][2] not in held[:4] and held[:2] == reference[2][:2]
    assert thinking[2] == end and end not in thinking[:2] + thinking[3:]
    closed = tokens(served.submit(prompts[3] + [start, end], SamplingParams(**greedy, thinking_token_budget=0)))
    assert closed[0] != end
    with pytest.raises(ValueError, match="logit_bias"):
        served.submit([1], SamplingParams(logit_bias={512: 1.0}))
    with pytest.raises(ValueError, match="bad_words"):
        served.submit([1], SamplingParams(bad_words=["x"]))  # not tokenized


def test_prompt_logprobs_match_the_plain_model(served, model, prompts, reference):
    ids = prompts[6]  # 20 tokens: one program (up to 32) serves both requests
    scoring = served.submit(ids, SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert [(e.token_id, e.finish_reason) for e in scoring] == [(None, "length")]
    got = scoring.prompt_logprobs()
    logits = nnx.jit(lambda m, x: m(x))(model, jnp.asarray([ids]))  # [1, T, V]
    logp = np.asarray(jax.nn.log_softmax(logits[0, :-1], axis=-1))  # [T - 1, V]
    chosen = logp[np.arange(len(ids) - 1), ids[1:]]
    assert got[0] is None and len(got) == len(ids)
    np.testing.assert_allclose([g.logprob for g in got[1:]], chosen, atol=2e-4)
    ranks = np.asarray([g.rank for g in got[1:]])  # 1 + the tokens more likely (near-ties either way)
    assert np.all((1 + (logp > chosen[:, None] + 2e-4).sum(-1) <= ranks)
                  & (ranks <= 1 + (logp > chosen[:, None] - 2e-4).sum(-1)))
    assert [[i for i, _ in g.top] for g in got[1:]] == np.argsort(-logp, axis=-1)[:, :3].tolist()
    generating = served.submit(ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=0))
    assert tokens(generating) == reference[6]
    assert [g.logprob for g in generating.prompt_logprobs()[1:]] == [g.logprob for g in got[1:]]
    assert served.stats()["slots_used"] == 0


def test_requests_that_can_never_fit_are_rejected(model):
    engine = Engine(model, EngineConfig(max_batch=2, max_model_len=128, page_size=16, max_waiting=2))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(list(range(100)), SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="prompt"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.submit([10_000], SamplingParams())
    engine.submit([1], SamplingParams())  # not started: requests wait in the inbox
    engine.submit([1], SamplingParams())
    with pytest.raises(QueueFullError):
        engine.submit([1], SamplingParams())


def test_thousand_requests_with_cancellations_leave_nothing_allocated():
    model = hybrid_jax.random_model(hybrid_jax.preset("tiny").replace(vocab_size=64), "float32", seed=3)
    engine = Engine(model, EngineConfig(max_batch=8, max_model_len=64, page_size=8, prefill_chunk=32,
                                        max_prefill_seqs=4, num_pages=40, decode_sizes=(2,))).start(warmup=False)
    rng = np.random.default_rng(1)
    try:
        handles = []
        for i in range(1000):
            prompt = rng.integers(0, 64, int(rng.integers(1, 40))).tolist()
            params = SamplingParams(max_tokens=int(rng.integers(1, 20)), temperature=float(rng.uniform(0, 1.5)),
                                    seed=i, ignore_eos=True)
            handles.append(engine.submit(prompt, params))
        cancelled = set(rng.choice(1000, 300, replace=False).tolist())
        for i in cancelled:
            handles[i].cancel()
        finished = threading.Event()

        def drain():
            for h in handles:
                list(h)
            finished.set()

        threading.Thread(target=drain, daemon=True).start()
        assert finished.wait(600)
        stats = engine.stats()
        assert (stats["pages_used"], stats["slots_used"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)
        assert engine.pages.num_free == engine.pages.capacity and engine.slots.num_free == engine.slots.capacity
        assert stats["requests_finished"] == 1000
    finally:
        engine.shutdown()


def test_greedy_prompts_prefill_without_the_general_sampler(model, prompts, reference):
    """A prefill step whose ending prompts all sample greedily (no logprobs, no constraints) runs the greedy-only
    program, one with a prompt asking for logprobs the general one; the first tokens are the plain model's either
    way, and the first token's logprob the same."""
    engine = make_engine(model, prefill_chunk=32)  # prompts[5] (130 tokens) takes 5 steps
    try:
        greedy = [e for e in engine.submit(prompts[5], GREEDY) if e.token_id is not None]
        runs = dict(engine.runner.runs)
        scored = [e for e in engine.submit(prompts[5], SamplingParams(max_tokens=10, temperature=0, logprobs=1,
                                                                        ignore_eos=True)) if e.token_id is not None]
    finally:
        engine.shutdown()
    assert [e.token_id for e in greedy] == [e.token_id for e in scored] == reference[5]
    assert greedy[0].logprob == pytest.approx(scored[0].logprob, abs=1e-5)
    prefills = lambda runs, greedy_only: sum(n for k, n in runs.items() if k[:2] == ("prefill", greedy_only))
    assert prefills(runs, True) == 5 and prefills(runs, False) == 0  # steps ending no prompt: greedy-only too
    assert prefills(engine.runner.runs, False) == 1  # the step ending the second prompt
