"""The offline API: LLM.generate (text, ids, stop strings, order, prompt logprobs) and LLM.score against the model's
logits."""

import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import LLM, SamplingParams, load_pretrained
from hybrid_jax.engine.llm import model_source
from hybrid_jax.generate import greedy_generate

GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden" / "causal_grouped"


@pytest.fixture(scope="module")
def llm():
    # The golden checkpoint has no tokenizer.json: the bundled Qwen3.5 vocabulary is used for text; its
    # ids above the checkpoint's 512-row vocabulary are not used by these tests.
    engine = LLM(str(GOLDEN), dtype="float32", max_batch=4, max_model_len=256, page_size=16, prefill_chunk=64,
                 prefill_sizes=(64,), decode_sizes=(4,))  # one bucket each: fewer programs to build
    yield engine
    engine.close()


def test_generate_token_ids_in_prompt_order(llm):
    prompts = [[1, 2, 3], list(range(10, 80)), [5]]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=5, temperature=0,
                                                                                 ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompts
    for o in outs:
        assert o.outputs[0].token_ids == greedy_generate(llm.model, jnp.asarray([o.prompt_token_ids]), 5)[0]
        assert o.outputs[0].finish_reason == "length"


def test_dict_prompts_with_a_cache_salt(llm):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompt = list(range(100, 240))  # two full blocks of 64 and some
    llm.engine.reset_prefix_cache()
    outs = [llm.generate([{"prompt_token_ids": prompt, "cache_salt": salt}], params)[0]
            for salt in ("a", "b", "a")]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 128]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    text = llm.generate({"prompt": "a b", "cache_salt": "a"}, params)[0]  # ids below the checkpoint's 512
    assert text.prompt == "a b" and text.prompt_token_ids == llm.tokenizer.encode("a b")
    for bad, why in (({"prompt": "x", "prompt_token_ids": [1]}, "one of"), ({"text": "x"}, "unknown key"),
                     ({"prompt": "x", "cache_salt": ""}, "cache_salt"), (5, "string or a dict")):
        with pytest.raises(ValueError, match=why):
            llm.generate([bad], params)


def test_stop_string_cuts_text(llm):
    params = dict(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    full = llm.generate(prompt_token_ids=[[40, 41, 42]], sampling_params=SamplingParams(**params))[0].outputs[0]
    visible = [i for i, ch in enumerate(full.text) if i > 0 and not ch.isspace()]
    assert visible, f"the tiny vocabulary decodes to visible text: {full.text!r}"
    stop = full.text[visible[len(visible) // 2]]
    cut = llm.generate(prompt_token_ids=[[40, 41, 42]], sampling_params=SamplingParams(stop=[stop], **params))
    out = cut[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_score_matches_log_softmax_of_logits(llm):
    seqs = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(100, 400)), [7, 7]]
    scores = llm.score(prompt_token_ids=seqs, batch_size=2)
    forward = nnx.jit(lambda model, ids: model(ids))
    for seq, score in zip(seqs, scores, strict=True):
        logp = jax.nn.log_softmax(forward(llm.model, jnp.asarray([seq]))[0], axis=-1)
        expected = np.asarray(logp[jnp.arange(len(seq) - 1), jnp.asarray(seq[1:])])
        np.testing.assert_allclose(score.logprobs, expected, atol=2e-4)
        assert score.token_ids == seq


def test_generate_returns_prompt_logprobs_as_score_has_them(llm):
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    [out] = llm.generate(prompt_token_ids=[seq], sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert out.prompt_logprobs[0] is None and all(len(e) in (2, 3) for e in out.prompt_logprobs[1:])
    np.testing.assert_allclose([e[t] for t, e in zip(seq[1:], out.prompt_logprobs[1:], strict=True)],
                               llm.score(prompt_token_ids=[seq])[0].logprobs, atol=2e-4)


def test_checkpoint_model_fills_a_copy_of_the_shapes():
    source = model_source(str(GOLDEN), "float32")
    model = source.load()
    reference = load_pretrained(GOLDEN, dtype="float32")
    ids = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    np.testing.assert_array_equal(model(ids), reference(ids))
    shapes = nnx.state(source.abstract, nnx.Param)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(shapes))  # the engine's, untouched


def test_start_devices_allocates_first_on_the_engines_devices_only(monkeypatch):
    from hybrid_jax.engine import llm as llm_module

    puts = []
    device_put = jax.device_put
    client_up = threading.Event()

    def recording_device_put(x, sharding):
        puts.append((x.nbytes, sharding.device_set, client_up.is_set()))
        return device_put(x, sharding)

    monkeypatch.setattr(llm_module.jax, "device_put", recording_device_put)
    assert llm_module.start_devices(2, client_up) == jax.devices()
    engine_devices = set(jax.devices()[:2])
    # an empty transfer while the parse waits, then the first allocation, which the parse may overlap
    assert puts == [(0, engine_devices, False), (2, engine_devices, True)]


def test_start_devices_releases_the_waiting_parse_when_the_backend_fails(monkeypatch):
    from hybrid_jax.engine import llm as llm_module

    def no_backend():
        raise RuntimeError("no backend")

    monkeypatch.setattr(llm_module.jax, "devices", no_backend)
    client_up = threading.Event()
    with pytest.raises(RuntimeError, match="no backend"):
        llm_module.start_devices(1, client_up)
    assert client_up.is_set()
