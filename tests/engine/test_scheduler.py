"""The scheduler on fake requests, no device: FCFS admission under slot and page limits, prefill chunks, decode
calls (chaining, steps per call, buckets), finishing and cancellation."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybrid_jax.engine.cache import BlockAllocator
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.requests import QueueFullError, Request, ThinkingEnd
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.engine.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[2]


def make(slots: int = 4, pages: int = 16, decode_steps: int = 3, eos: tuple[int, ...] = (), **config) -> Scheduler:
    options = dict(max_batch=4, max_model_len=128, page_size=16, prefill_chunk=64, max_prefill_seqs=2,
                   max_waiting=8)
    options.update(config)
    return Scheduler(EngineConfig(**options), BlockAllocator(slots + 1), BlockAllocator(pages + 1), page_size=16,
                     decode_steps=decode_steps, eos_token_ids=eos)


def request(name: str, prompt_len: int, max_tokens: int, **params) -> Request:
    params = dict(dict(temperature=0, ignore_eos=True), **params)
    return Request(name, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, **params), seed=0)


def arrive(s: Scheduler, *requests: Request) -> None:
    for r in requests:
        s.put(r)
    s.take_arrivals(block=False)


def samples(tokens: list[int], tops: list[list[int]] | None = None) -> SimpleNamespace:
    """Host samples as the runner reads them (any indexable rows do); ``tops``: each row's top ids."""
    tops = tops if tops is not None else [[t, 0, 0] for t in tokens]
    return SimpleNamespace(tokens=tokens, logprob=[-0.5] * len(tokens), top_ids=tops,
                           top_logprobs=[[-0.5 - j for j in range(len(t))] for t in tops])


def decoding(s: Scheduler, *requests: Request) -> list[Request]:
    """``requests`` admitted, prefilled and given their first token (7)."""
    arrive(s, *requests)
    s.admit()
    while s.prefilling:
        done, rows = s.prefilled(s.prefill_chunks())
        s.deliver(done, samples([7] * len(requests)), rows)
    assert s.decoding == list(requests) and all(len(r.output_ids) == 1 for r in requests)
    return list(requests)


def events(r: Request) -> list:
    out = []
    while not r.events.empty():
        out.append(r.events.get())
    return out


def test_importing_the_scheduler_imports_no_jax():
    """The scheduler and everything it imports are plain Python (the package inits, which do import JAX for
    the public API, are stood in for by empty packages)."""
    code = (
        "import sys, types\n"
        "for name in ('hybrid_jax', 'hybrid_jax.engine'):\n"
        "    package = types.ModuleType(name)\n"
        "    package.__path__ = [sys.argv[1] + '/' + name.replace('.', '/')]\n"
        "    sys.modules[name] = package\n"
        "import hybrid_jax.engine.scheduler\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_admission_is_first_come_first_served_while_a_slot_and_pages_fit():
    s = make(slots=2, pages=6)
    a, b, c = request("a", 40, 24), request("b", 60, 20), request("c", 1, 1)  # 4, 5 and 1 pages
    arrive(s, a, b, c)
    s.admit()
    assert s.prefilling == [a] and list(s.waiting) == [b, c]  # b needs 5 of the 2 free pages; c waits behind it
    assert a.slot > 0 and len(a.pages) == 4 and s.pages.num_free == 2
    s.finish(a, None, "abort")
    s.admit()
    assert s.prefilling == [b, c] and not s.waiting and s.pages.num_free == 0
    d = request("d", 1, 1)
    arrive(s, d)
    s.admit()
    assert list(s.waiting) == [d]  # no page free
    s.finish(c, None, "abort")
    s.admit()
    assert not s.waiting and s.prefilling == [b, d] and d.pages == [6]


def test_a_request_waits_for_a_free_slot():
    s = make(slots=1, pages=16)
    a, b = request("a", 3, 3), request("b", 3, 3)
    arrive(s, a, b)
    s.admit()
    assert s.prefilling == [a] and list(s.waiting) == [b]
    s.finish(a, 9, "length")
    s.admit()
    assert s.prefilling == [b] and b.slot == 1


def test_what_can_never_fit_is_rejected_and_a_full_queue_refuses():
    s = make(pages=4, max_model_len=128, max_waiting=2)
    with pytest.raises(ValueError, match="context of 128"):
        s.check(100, 29)
    with pytest.raises(ValueError, match="more KV pages than the cache has"):
        s.check(60, 10)  # 70 tokens: 5 pages of 16
    s.check(60, 4)
    s.put(request("a", 1, 1))
    s.put(request("b", 1, 1))
    with pytest.raises(QueueFullError):
        s.check(1, 1)


def test_prefill_packs_chunks_under_the_token_budget_and_the_sequence_limit():
    s = make(prefill_chunk=64, max_prefill_seqs=2)
    a, b, c = request("a", 50, 4), request("b", 30, 4), request("c", 10, 4)
    arrive(s, a, b, c)
    s.admit()
    chunks = s.prefill_chunks()
    assert [(r.request_id, n) for r, n in chunks] == [("a", 50), ("b", 14)]
    assert s.prefill_buckets(chunks) == [64]
    assert s.prefilled(chunks) == ([a], [0])
    assert b.num_prefilled == 14 and s.decoding == [a] and s.prefilling == [b, c]
    chunks = s.prefill_chunks()
    assert [(r.request_id, n) for r, n in chunks] == [("b", 16), ("c", 10)]
    assert s.prefill_buckets(chunks) == [32, 64]
    assert s.prefilled(chunks) == ([b, c], [0, 1])
    assert s.decoding == [a, b, c] and not s.prefilling and s.counters["prompt_tokens"] == 90


def test_steps_per_call_several_only_for_greedy_batches_with_nothing_to_prefill():
    s = make(decode_steps=3)
    assert s.steps_per_call(True, 3) == 3
    assert s.steps_per_call(True, 2) == 1  # the last tokens take a step each
    assert s.steps_per_call(False, 10) == 1
    late = request("late", 3, 3)
    s.put(late)
    assert s.steps_per_call(True, 10) == 1  # in the inbox
    s.take_arrivals(block=False)
    assert s.steps_per_call(True, 10) == 1  # waiting
    s.admit()
    assert s.steps_per_call(True, 10) == 1  # prefilling
    s.prefilled(s.prefill_chunks())
    assert s.steps_per_call(True, 10) == 3
    assert make(decode_steps=1).steps_per_call(True, 10) == 1


def test_greedy_programs_wait_until_token_constraints_lapse():
    s = make()
    plain, held, thinking = decoding(s, request("plain", 4, 10), request("held", 4, 10, min_tokens=3),
                                     request("thinking", 4, 10))
    thinking.thinking_end = ThinkingEnd(9, after=5)
    assert [r.constrained for r in (plain, held, thinking)] == [False, True, True] and not s.greedy_only(s.decoding)
    s.deliver([plain, held, thinking], samples([7, 7, 9]))  # the think block closes
    assert thinking.thinking_end is None and held.constrained
    s.deliver([plain, held, thinking], samples([7, 7, 7]))  # min_tokens reached
    assert s.greedy_only(s.decoding)
    biased = request("biased", 4, 10, logit_bias={3: 1.0})
    assert biased.constrained


def test_prompt_logprob_requests_are_scored_before_admission():
    s = make()
    only, both, plain, gone = (request("only", 4, 0, prompt_logprobs=1), request("both", 4, 5, prompt_logprobs=0),
                               request("plain", 4, 5), request("gone", 4, 5, prompt_logprobs=0))
    arrive(s, only, both, plain, gone)
    assert list(s.scoring) == [only, both, gone] and list(s.waiting) == [plain]
    assert s.stats()["waiting"] == 4
    s.scored(only, [None, None, None, None])
    assert only.finished and only.scored.is_set() and [e.finish_reason for e in events(only)] == ["length"]
    s.scored(both, [None] * 4)
    assert list(s.waiting) == [plain, both] and both.prompt_logprobs == [None] * 4
    s.cancel(gone)
    s.reap_cancelled()
    assert gone.finished and gone.scored.is_set() and gone.prompt_logprobs is None and not s.scoring


def test_a_call_chains_while_the_requests_stay_and_none_reaches_max_tokens():
    s = make(decode_steps=3)
    a, b = decoding(s, request("a", 4, 10), request("b", 4, 5))
    assert s.greedy_only(s.decoding)
    assert s.chained([a, b], 3, True) == ([a, b], (True, 3))  # 6 left beyond the call in flight
    assert s.chained([a, b], 1, True) == ([a, b], (True, 3))
    assert s.chained([a, b], 4, True) is None  # b reaches max_tokens in the call in flight
    assert s.chained([b, a], 1, True) is None and s.chained([a], 1, True) is None  # other requests
    assert s.chained([a, b], 1, False) == ([a, b], (False, 1))
    c = request("c", 4, 4)
    arrive(s, c)
    assert s.chained([a, b], 1, True) == ([a, b], (True, 1))  # c waits for its prefill


def test_an_unchained_call_leaves_out_requests_with_nothing_left():
    s = make(decode_steps=3)
    a, b = decoding(s, request("a", 4, 10, logprobs=1), request("b", 4, 2))
    assert not s.greedy_only(s.decoding)  # a wants logprobs
    assert s.unchained(False) == ([a, b], (False, 1))
    assert s.unchained(True, unread=[b]) == ([a], (True, 3))  # b's last token is sampled, not read yet
    assert s.unchained(True, unread=[a]) == ([a, b], (True, 3))  # 8 left for a
    one = make()
    (c,) = decoding(one, request("c", 4, 2))
    assert one.unchained(True, unread=[c]) is None


def test_decode_choices_smallest_bucket_first_then_plainer_variants():
    s = make(max_batch=4)
    assert s.config.decode_buckets == (1, 2, 4)
    assert s.decode_choices((True, 3), 3) == [((True, 3), 4), ((True, 1), 4), ((False, 1), 4)]
    assert s.decode_choices((False, 1), 2) == [((False, 1), 2), ((False, 1), 4)]
    assert s.decode_choices((True, 1), 1, size=2) == [((True, 1), 2), ((False, 1), 2)]


def test_a_token_ends_its_request_at_eos_a_stop_token_or_max_tokens():
    s = make(eos=(5,))
    eos, ignored, stop, short = decoding(s, request("eos", 2, 9, ignore_eos=False), request("ignored", 2, 9),
                                         request("stop", 2, 9, stop_token_ids=[6]), request("short", 2, 3))
    s.deliver([eos, ignored, stop, short], samples([5, 5, 6, 1]))
    reasons = {r.request_id: [e.finish_reason for e in events(r)][-1] for r in (eos, ignored, stop, short)}
    assert reasons == {"eos": "stop", "ignored": None, "stop": "stop", "short": None}
    assert s.decoding == [ignored, short] and s.counters["requests_finished"] == 2
    s.deliver([ignored, short], samples([3, 4]))
    assert [e.finish_reason for e in events(short)] == ["length"] and short.output_ids == [7, 1, 4]
    assert s.decoding == [ignored] and s.stats()["running"] == 1
    assert s.counters["generation_tokens"] == 4 + 4 + 2


def test_rows_past_a_requests_end_are_discarded_and_logprobs_read_when_asked():
    s = make()
    done, scored = decoding(s, request("done", 2, 2), request("scored", 2, 9, logprobs=2))
    s.deliver([done, scored], samples([1, 2], tops=[[1, 4, 8], [2, 3, 9]]))
    assert done.finished and [e.top_logprobs for e in events(scored)][-1] == [(2, -0.5), (3, -1.5)]
    s.deliver([done, scored], samples([5, 6], tops=[[5, 1, 1], [6, 1, 1]]))  # a call that ran past done's end
    assert done.output_ids == [7, 1] and scored.output_ids == [7, 2, 6]
    s.deliver([scored], samples([0, 8], tops=[[0, 0, 0], [8, 1, 1]]), rows=[1])
    assert scored.output_ids[-1] == 8


def test_cancelled_requests_end_with_abort_and_free_their_slot_and_pages():
    s = make(slots=2, pages=8)
    running, admitted, waiting = request("running", 20, 4), request("admitted", 20, 4), request("waiting", 20, 4)
    decoding(s, running)
    arrive(s, admitted, waiting)
    s.admit()
    assert s.prefilling == [admitted] and list(s.waiting) == [waiting]
    for r in (running, admitted, waiting):
        s.cancel(r)
    s.take_arrivals(block=False)  # the wake-ups
    s.reap_cancelled()
    for r in (running, admitted, waiting):
        last = events(r)[-1]
        assert (last.token_id, last.finish_reason) == (None, "abort") and r.finished
    assert s.idle and s.stats() == {"running": 0, "waiting": 0, "pages_used": 0, "pages_total": 8, "slots_used": 0,
                                    "slots_total": 2}
    assert s.counters["requests_finished"] == 3
    s.finish(running, None, "abort")  # a second end changes nothing
    assert s.counters["requests_finished"] == 3 and events(running) == []


def test_a_failed_step_ends_every_admitted_request_with_error():
    s = make(slots=2)
    a, b, c = request("a", 3, 3), request("b", 3, 3), request("c", 3, 3)
    decoding(s, a)
    arrive(s, b, c)
    s.admit()
    s.fail_running(RuntimeError("device lost"))
    assert [events(r)[-1].finish_reason for r in (a, b)] == ["error", "error"]
    assert list(s.waiting) == [c] and s.stats()["slots_used"] == 0


def test_held_events_reach_the_callers_in_order_once_sent():
    """While holding, a delivered token and the end it causes stay with the scheduler until `send_held` (the
    engine sends them once its next call is queued) or the hold's end; outside a hold they go at once."""
    s = make()
    a, b = decoding(s, request("a", 16, 3), request("b", 16, 2))
    assert [e.token_id for e in events(a)] == [7] and [e.token_id for e in events(b)] == [7]
    with s.holding_events():
        s.deliver([a, b], samples([8, 9]))
        assert events(a) == [] and events(b) == []
        s.send_held()
        assert [(e.token_id, e.finish_reason) for e in events(b)] == [(9, "length")]
        assert [(e.token_id, e.finish_reason) for e in events(a)] == [(8, None)]
        s.deliver([a], samples([10]))
        assert b.finished and events(a) == []
    assert [(e.token_id, e.finish_reason) for e in events(a)] == [(10, "length")]
    c = decoding(s, request("c", 16, 3))[0]
    assert [e.token_id for e in events(c)] == [7]


def test_held_events_go_out_in_order_even_when_the_turn_fails():
    """A token and the final event a cancellation adds after it stay in order, and a hold that ends in an
    exception still hands out what it held."""
    s = make()
    a, b = decoding(s, request("a", 16, 8), request("b", 16, 8))
    events(a), events(b)
    with pytest.raises(RuntimeError), s.holding_events():
        s.deliver([a, b], samples([8, 9]))
        s.cancel(a)
        s.reap_cancelled()
        raise RuntimeError("a step failed")
    assert [(e.token_id, e.finish_reason) for e in events(a)] == [(8, None), (None, "abort")]
    assert [(e.token_id, e.finish_reason) for e in events(b)] == [(9, None)]
    with s.holding_events(), pytest.raises(AssertionError), s.holding_events():
        pass
