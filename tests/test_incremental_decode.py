"""Prefill, extend and one-token steps over the dense cache reproduce the full-sequence logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hybrid_jax


@pytest.mark.parametrize("tied", [True, False])
def test_prefill_extend_decode_matches_full_forward(tied):
    config = hybrid_jax.preset("tiny").replace(vocab_size=256, tie_word_embeddings=tied, num_hidden_layers=8)
    model = hybrid_jax.random_model(config, "float32", seed=7)
    ids = jax.random.randint(jax.random.PRNGKey(0), (2, 80), 0, 256, jnp.int32)
    full = np.asarray(nnx.jit(lambda m, ids: m(ids))(model, ids))
    forward = nnx.jit(lambda m, ids, positions, cache: m.forward(ids, positions, cache))  # a program per shape

    cache = model.init_cache(2, 80)
    pos = lambda a, b: jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (2, b - a))
    chunks = [(0, 65), (65, 70)] + [(t, t + 1) for t in range(70, 80)]  # prefill, extend, decode
    got = []
    for a, b in chunks:
        logits, cache = forward(model, ids[:, a:b], pos(a, b), cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    np.testing.assert_allclose(got, full, atol=1e-4 * np.abs(full).max(), rtol=0)


def test_gdn_output_rounds_delta_rule_output_to_model_dtype():
    """HF rounds the delta rule's output to the model dtype before the gated norm; so does GatedDeltaNet.gated
    (its prefill kernel writes bf16, its decode kernels fp32: both must normalise the same values)."""
    config = hybrid_jax.preset("tiny").replace(vocab_size=256, num_hidden_layers=1)
    gdn = hybrid_jax.random_model(config, "bfloat16", seed=3).layers[0].linear_attn
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    o = jax.random.normal(keys[0], (1, 3, gdn.num_v_heads, gdn.v_dim), jnp.float32)
    z = jax.random.normal(keys[1], o.shape, jnp.float32)
    assert o.astype(jnp.bfloat16).astype(jnp.float32).tolist() != o.tolist()  # rounding changes these values
    np.testing.assert_array_equal(np.asarray(gdn.gated(o, z), np.float32),
                                  np.asarray(gdn.gated(o.astype(jnp.bfloat16), z), np.float32))
