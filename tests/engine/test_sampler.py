"""On-device sampling: filters, penalties, vocabulary masking, logprobs, seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.engine.sampler import SamplingRows, apply_penalties, filter_logits, sample
from hybrid_jax.engine.sampling_params import SamplingParams


def rows(n, **kw):
    base = dict(temperature=jnp.ones(n), top_k=jnp.zeros(n, jnp.int32), top_p=jnp.ones(n), min_p=jnp.zeros(n),
                presence_penalty=jnp.zeros(n), frequency_penalty=jnp.zeros(n), repetition_penalty=jnp.ones(n),
                seed=jnp.arange(n, dtype=jnp.uint32), step=jnp.zeros(n, jnp.int32))
    base.update({k: jnp.asarray(v) for k, v in kw.items()})
    return SamplingRows(**base)


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
