"""Prefill, extend and one-token steps over the dense cache reproduce the full-sequence logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybrid_jax


@pytest.mark.parametrize("tied", [True, False])
def test_prefill_extend_decode_matches_full_forward(tied):
    config = hybrid_jax.preset("tiny").replace(vocab_size=256, tie_word_embeddings=tied, num_hidden_layers=8)
    model = hybrid_jax.random_model(config, "float32", seed=7)
    ids = jax.random.randint(jax.random.PRNGKey(0), (2, 80), 0, 256, jnp.int32)
    full = np.asarray(model(ids))

    cache = model.init_cache(2, 80)
    pos = lambda a, b: jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (2, b - a))
    chunks = [(0, 65), (65, 70)] + [(t, t + 1) for t in range(70, 80)]  # prefill, extend, decode
    got = []
    for a, b in chunks:
        logits, cache = model.forward(ids[:, a:b], pos(a, b), cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    np.testing.assert_allclose(got, full, atol=1e-4 * np.abs(full).max(), rtol=0)
