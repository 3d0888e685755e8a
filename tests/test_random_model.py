"""`random_model` initializes as HF's `_init_weights` does for Qwen3.5, so its logits have a realistic spread."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybrid_jax
from hybrid_jax.config import Qwen35Config
from hybrid_jax.generate import greedy_generate

CONFIG = hybrid_jax.preset("tiny").replace(vocab_size=4096, tie_word_embeddings=False, initializer_range=0.05)


@pytest.fixture(scope="module")
def model():
    return hybrid_jax.random_model(CONFIG, "float32", seed=0)


def test_parameters_follow_hf_init(model):
    std = CONFIG.initializer_range
    gdn, attn = model.layers[0].linear_attn, model.layers[3].self_attn
    for w in (model.embed_tokens.weight, model.lm_head.kernel, gdn.in_proj_qkv.kernel, gdn.conv1d.weight,
              attn.o_proj.kernel, model.layers[1].mlp.down_proj.kernel):
        assert np.std(np.asarray(w[...])) == pytest.approx(std, rel=0.1)
    for norm in (model.norm, model.layers[0].input_layernorm, attn.q_norm):
        assert not np.asarray(norm.weight[...]).any()  # zero-centred: a gain of 1
    assert (np.asarray(gdn.norm.weight[...]) == 1).all() and (np.asarray(gdn.dt_bias[...]) == 1).all()
    decay_rate = np.exp(np.asarray(gdn.A_log[...]))
    assert ((decay_rate >= 0.01) & (decay_rate <= 16)).all()


def test_logits_have_a_realistic_spread(model):
    prompt = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (1, 12)).astype(np.int32)
    logits = np.asarray(model(jnp.asarray(prompt)))[0]  # [T, V]
    # Unit-rms final hidden states through a normal(0, std) head: logits of std ~ std * sqrt(hidden).
    assert logits.std() == pytest.approx(CONFIG.initializer_range * CONFIG.hidden_size**0.5, rel=0.25)
    top_logprob = np.asarray(jax.nn.log_softmax(logits, axis=-1)).max(-1)  # [T]
    assert (top_logprob < -4).all()  # uniform over 4096 tokens is -8.3; a model sure of one token, ~0
    tokens = greedy_generate(model, prompt, 16)[0]
    assert len(set(tokens)) > 8


def test_initializer_range_round_trips_through_config_json():
    assert Qwen35Config.from_hf_dict(CONFIG.to_hf_dict()).initializer_range == 0.05


def test_embedded_default_does_not_repeat_one_token():
    model = hybrid_jax.random_model("tiny", "float32")
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, (1, 12)).astype(np.int32)
    tokens = greedy_generate(model, prompt, 16)[0]
    assert len(set(tokens)) > 8 and tokens[0] != prompt[0, -1]
