"""Structured outputs' host side and mask: params validation, llguidance matchers (cache, errors, time bound,
think blocks) and the sampler's bit unpacking."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax import SamplingParams, StructuredOutputsParams
from hybrid_jax.engine.grammar import GrammarCompiler, GrammarError, GrammarState, fill_masks, mask_words
from hybrid_jax.engine.sampler import grammar_allowed
from hybrid_jax.tokenizer import load_tokenizer

VOCAB = 248_320  # the Qwen3.5 models' padded vocabulary


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, tokenizer.eos_token_ids)


def allowed(state: GrammarState) -> set[int]:
    masks = np.zeros((1, mask_words(VOCAB)), np.int32)
    fill_masks([state], masks)
    return set(np.flatnonzero(np.unpackbits(masks.view(np.uint8), bitorder="little")[:VOCAB]).tolist())


def test_params_need_exactly_one_constraint():
    assert StructuredOutputsParams(choice=["a"]).kind == "choice"
    for bad in ({}, {"regex": "a", "json": {}}, {"choice": []}, {"choice": [1]}, {"json": 3}, {"regex": ""}):
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_grammar_allowed_unpacks_bits():
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, (3, 4), dtype=np.int64).astype(np.int32)
    vocab = 100  # not a multiple of 32: the last word's high bits are dropped
    expected = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(3, -1)[:, :vocab].astype(bool)
    np.testing.assert_array_equal(np.asarray(grammar_allowed(jnp.asarray(words), vocab)), expected)


def test_matchers_follow_the_grammar_and_end_at_eos(compiler, tokenizer):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    first, second = GrammarState(compiler.compile(spec)), GrammarState(compiler.compile(spec))
    start = allowed(first)
    assert {tokenizer.decode([t]) for t in start} <= {"y", "ye", "yes", "n", "no"} and start
    for token in tokenizer.encode("yes"):
        assert first.accept(token)
    assert allowed(first) == compiler.end_tokens and compiler.end_tokens <= set(tokenizer.eos_token_ids)
    assert allowed(second) == start  # a cache hit is a fresh copy
    assert not first.accept(tokenizer.encode("x")[0])


def test_think_block_comes_first(compiler, tokenizer):
    end = tokenizer.token_to_id("</think>")
    state = GrammarState(compiler.compile(StructuredOutputsParams(regex="[0-9]")), think_end=end)
    assert not state.active and state.accept(tokenizer.encode("hmm")[0])
    assert state.accept(end) and state.active
    assert {tokenizer.decode([t]) for t in allowed(state)} == set("0123456789")


def test_bad_and_slow_grammars_raise(tokenizer, compiler):
    for spec in (StructuredOutputsParams(regex="a(b"), StructuredOutputsParams(json='{"type": "strin"}'),
                 StructuredOutputsParams(json="{oops"), StructuredOutputsParams(grammar="start: nowhere")):
        with pytest.raises(GrammarError):
            compiler.compile(spec)
    hasty = GrammarCompiler(tokenizer, VOCAB, tokenizer.eos_token_ids, timeout_s=1e-9)
    with pytest.raises(GrammarError, match="longer than"):
        hasty.compile(StructuredOutputsParams(json={"type": "array", "items": {"type": "string"}}))
