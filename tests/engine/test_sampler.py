"""On-device sampling: filters, penalties, vocabulary masking, logprobs, seeds, token constraints."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybrid_jax.engine.constraints import constraint_rows, no_constraints
from hybrid_jax.engine.requests import Request, ThinkingEnd
from hybrid_jax.engine.sampler import SamplingRows, apply_penalties, filter_logits, sample
from hybrid_jax.engine.sampling_params import SamplingParams


def rows(n, constraints=None, **kw):
    base = dict(temperature=jnp.ones(n), top_k=jnp.zeros(n, jnp.int32), top_p=jnp.ones(n), min_p=jnp.zeros(n),
                presence_penalty=jnp.zeros(n), frequency_penalty=jnp.zeros(n), repetition_penalty=jnp.ones(n),
                seed=jnp.arange(n, dtype=jnp.uint32), step=jnp.zeros(n, jnp.int32))
    base.update({k: jnp.asarray(v) for k, v in kw.items()})
    return SamplingRows(**base, constraints=no_constraints(n) if constraints is None else constraints)


LOGITS = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))


def kept(filtered):
    return np.isfinite(np.asarray(filtered))[0].tolist()


def test_top_k_top_p_min_p():
    assert kept(filter_logits(LOGITS, rows(1, top_k=[2]))) == [True, True, False, False, False]
    assert kept(filter_logits(LOGITS, rows(1, top_p=[0.6]))) == [True, True, False, False, False]
    assert kept(filter_logits(LOGITS, rows(1, top_p=[0.5]))) == [True, False, False, False, False]
    assert kept(filter_logits(LOGITS, rows(1, min_p=[0.25]))) == [True, True, True, False, False]
    assert all(kept(filter_logits(LOGITS, rows(1))))


def test_penalties_follow_vllm():
    logits = jnp.asarray([[2.0, -2.0, 1.0, 0.5]])
    counts = jnp.asarray([[2, 1, 0, 0]], jnp.int32)
    prompt = jnp.asarray([[False, False, True, False]])
    out = apply_penalties(logits, rows(1, presence_penalty=[0.5], frequency_penalty=[0.25],
                                       repetition_penalty=[2.0]), counts, prompt)
    np.testing.assert_allclose(out, [[2.0 / 2 - 0.5 - 0.5, -2.0 * 2 - 0.25 - 0.5, 1.0 / 2, 0.5]])


def test_greedy_logprobs_and_vocab_mask():
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 50)).at[:, 45].set(100.0)
    zeros = jnp.zeros((3, 50), jnp.int32)
    out = sample(logits, rows(3, temperature=[0.0, 0.0, 0.0]), zeros, zeros > 0, jnp.bool_(True), valid_vocab=40)
    expected = jnp.argmax(logits[:, :40], axis=-1)
    np.testing.assert_array_equal(out.tokens, expected)
    logp = jax.nn.log_softmax(logits[:, :40], axis=-1)
    np.testing.assert_allclose(out.logprob, logp[jnp.arange(3), expected], rtol=1e-5)
    np.testing.assert_array_equal(out.top_ids[:, 0], expected)


def test_seeded_draws_depend_on_seed_and_step_only():
    logits = jnp.zeros((4, 1000))
    zeros = jnp.zeros((4, 1000), jnp.int32)
    draw = lambda seed, step: sample(logits, rows(4, seed=seed, step=step), zeros, zeros > 0, jnp.bool_(False),
                                     1000).tokens
    a = draw([7, 7, 8, 8], [0, 0, 0, 1])
    assert a[0] == a[1] and len({int(a[1]), int(a[2]), int(a[3])}) == 3
    assert np.array_equal(draw([7, 7, 8, 8], [0, 0, 0, 1]), a)


def test_sampled_distribution_matches_probabilities():
    logits = jnp.tile(LOGITS, (4000, 1))
    zeros = jnp.zeros((4000, 5), jnp.int32)
    out = sample(logits, rows(4000, seed=np.arange(4000, dtype=np.uint32)), zeros, zeros > 0, jnp.bool_(False), 5)
    freq = np.bincount(np.asarray(out.tokens), minlength=5) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.03)


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -5),
                                          ("min_p", 2.0), ("presence_penalty", 3.0), ("repetition_penalty", 0.0),
                                          ("logprobs", 99), ("stop", [""])])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_only_variant_matches_the_general_path():
    logits = jax.random.normal(jax.random.key(3), (3, 40)) * 3
    settings = rows(3, temperature=jnp.zeros(3), repetition_penalty=[1.0, 1.3, 1.0], frequency_penalty=[0.0, 0.0, 0.4])
    counts = jax.random.randint(jax.random.key(4), (3, 40), 0, 3)
    prompt = jax.random.bernoulli(jax.random.key(5), 0.2, (3, 40))
    general = sample(logits, settings, counts, prompt, jnp.bool_(False), valid_vocab=37)
    fast = sample(logits, settings, counts, prompt, jnp.bool_(False), valid_vocab=37, greedy_only=True)
    np.testing.assert_array_equal(fast.tokens, general.tokens)
    np.testing.assert_allclose(fast.logprob, general.logprob, rtol=1e-6)
    assert int(jnp.max(fast.tokens)) < 37


@pytest.mark.parametrize("constrained", [False, True])
def test_branch_free_sampling_matches_the_branched_path(constrained):
    """Greedy, random, filtered and (with ``constrained``) constrained rows in one batch: the same tokens, logprobs
    and top logprobs as the path with branches, which takes the random (or the constrained) branch here."""
    n, vocab = 4, 40
    logits = jax.random.normal(jax.random.key(6), (n, vocab)) * 3
    requests = [request(), request(), request(), request(allowed_token_ids=[3, 9, 27]) if constrained else request()]
    settings = rows(n, constraint_rows(requests, n), temperature=[0.0, 1.0, 0.7, 1.0], top_p=[1.0, 1.0, 0.8, 1.0],
                    top_k=[0, 0, 5, 0], repetition_penalty=[1.0, 1.2, 1.0, 1.0], step=[0, 3, 5, 1])
    counts = jax.random.randint(jax.random.key(7), (n, vocab), 0, 2)
    for seed in range(8):
        settings = settings._replace(seed=jnp.arange(n, dtype=jnp.uint32) + 10 * seed)
        args = (logits, settings, counts, counts > 0, jnp.bool_(True), 37)
        branched, free = sample(*args), sample(*args, branch_free=True)
        for a, b in zip(branched, free, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if constrained:
            assert int(free.tokens[3]) in (3, 9, 27)


def request(output_ids=(), **params):
    r = Request("r", [1], SamplingParams(max_tokens=50, **params), seed=0, output_ids=list(output_ids))
    r.min_tokens_stops = (7,) if r.params.min_tokens else ()
    return r


def constrained_sample(requests, logits, temperature=0.0, counts=None, step=None):
    """Sample one row per request from ``logits`` [n, V], each row's history all its output (as a decode step
    sees it once the runner has added the input token)."""
    n, vocab = logits.shape
    settings = rows(n, constraint_rows(requests, n), temperature=np.full(n, temperature, np.float32),
                    step=np.asarray([len(r.output_ids) for r in requests] if step is None else step, np.int32))
    counts = jnp.zeros((n, vocab), jnp.int32) if counts is None else counts
    return sample(logits, settings, counts, counts > 0, jnp.bool_(False), vocab)


def test_logit_bias_and_allowed_tokens():
    logits = jnp.tile(jnp.arange(10, dtype=jnp.float32)[None] / 10, (3, 1))  # token 9 most likely
    out = constrained_sample([request(logit_bias={2: 100.0}), request(allowed_token_ids=[1, 4, 6]),
                              request(logit_bias={9: -100.0, 8: -100.0})], logits)
    assert out.tokens.tolist() == [2, 6, 7]
    raw = jax.nn.log_softmax(logits, axis=-1)  # logprobs stay the model's (vLLM's raw_logprobs)
    np.testing.assert_allclose(out.logprob, raw[jnp.arange(3), out.tokens], rtol=1e-6)
    drawn = constrained_sample([request(allowed_token_ids=[1, 4, 6])] * 64, jnp.zeros((64, 10)), temperature=1.0)
    assert set(drawn.tokens.tolist()) <= {1, 4, 6} and len(set(drawn.tokens.tolist())) > 1


def test_bad_words_ban_their_last_token_after_the_rest():
    logits = jnp.tile(jnp.asarray([[0.0, 0.0, 0.0, 5.0, 4.0, 0.0]]), (3, 1))  # token 3 first, then 4
    words = [[3], [2, 5, 4]]  # 3 always; 4 after the output ends with 2, 5
    out = constrained_sample([request([1], bad_words_token_ids=words),
                              request([2, 5], bad_words_token_ids=words),
                              request([5, 2], bad_words_token_ids=words)], logits)
    assert out.tokens.tolist() == [4, 0, 4]


def test_min_tokens_hold_back_eos_and_stops_then_release_them():
    logits = jnp.tile(jnp.asarray([[0.0] * 7 + [9.0]]), (2, 1))  # eos (7) most likely
    early, late = request(min_tokens=3), request(min_tokens=3)
    out = constrained_sample([early, late], logits, step=[2, 3])
    assert out.tokens.tolist() == [0, 7]


def test_thinking_budget_forces_the_end_token_once():
    logits = jnp.tile(jnp.asarray([[5.0, 0.0, 0.0, -3.0]]), (3, 1))
    end = ThinkingEnd(3, 2)
    reqs = [request(), request(), request()]
    for r in reqs:
        r.thinking_end = end
    counts = jnp.zeros((3, 4), jnp.int32).at[2, 3].set(1)  # row 2 closed its thinking already
    out = constrained_sample(reqs, logits, temperature=1.0, counts=counts, step=[1, 2, 5])
    assert out.tokens.tolist()[1] == 3 and out.tokens.tolist()[0] != 3 and out.tokens.tolist()[2] != 3
    np.testing.assert_allclose(out.logprob[1], jax.nn.log_softmax(logits[1])[3], rtol=1e-6)


def test_filters_over_a_split_vocabulary_sum_whole_rows():
    """Under a mesh splitting the vocabulary over two devices, top-p's cumulative sum runs on whole rows (made
    so by ``replicated``): split, XLA partitions it into a window as wide as the vocabulary on each device
    (seconds a call on the CPU at 248K). The kept logits are those of one device."""
    vocab = 1024
    mesh = Mesh(jax.devices()[:2], ("tp",))
    logits = jax.random.normal(jax.random.key(0), (2, vocab))
    split = jax.device_put(logits, NamedSharding(mesh, PartitionSpec(None, "tp")))
    settings = rows(2, top_p=[0.9, 0.5])
    full_width = re.compile(rf"reduce-window\(.*window={{size=1x{vocab}\b")
    for replicated, expect_full_width in ((None, True), (NamedSharding(mesh, PartitionSpec()), False)):
        run = jax.jit(lambda x, r, replicated=replicated: filter_logits(x, r, replicated))
        assert bool(full_width.search(run.lower(split, settings).compile().as_text())) == expect_full_width
        np.testing.assert_array_equal(np.asarray(run(split, settings)), np.asarray(filter_logits(logits, settings)))
