"""Grammar rows in the engine: each decode step's forward is queued before the host computes the masks, chained
after the call in flight, and the sample applies masks the host wrote after reading the previous token (a row
whose think block closed in the call before is masked from its next step on, though the chained batch was
built before)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax import SamplingParams, StructuredOutputsParams
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.llm import think_token_ids
from hybrid_jax.generate import greedy_generate
from hybrid_jax.loader import random_model
from hybrid_jax.tokenizer import load_tokenizer

PATTERN = r"[a-c]{6}-[0-9]{3}"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model():
    return random_model("tiny", "float32")


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    engine = Engine(model, EngineConfig(max_batch=4, max_model_len=128, page_size=16, prefill_chunk=32,
                                        max_prefill_seqs=2, decode_sizes=(4,), background_compile=False),
                    eos_token_ids=tuple(tokenizer.eos_token_ids), think_token_ids=think_token_ids(tokenizer),
                    tokenizer=tokenizer)
    yield engine.start(warmup=False)  # builds only the programs the tests run
    engine.shutdown()


def tokens(handle) -> list[int]:
    return [e.token_id for e in handle if e.token_id is not None]


def test_grammar_rows_decode_beside_plain_rows(engine, model, tokenizer):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 240_000, n).tolist() for n in (9, 17, 5)]
    start, end = engine.think_token_ids
    regex = SamplingParams(max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(regex=PATTERN))
    thinking = SamplingParams(max_tokens=16, temperature=0, thinking_token_budget=3,
                              structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    handles = [engine.submit(prompts[0], regex), engine.submit(prompts[1] + [start], thinking),
               engine.submit(prompts[2], plain)]
    matched, thought, free = map(tokens, handles)

    assert re.fullmatch(PATTERN, tokenizer.decode(matched[:-1])) and matched[-1] in tokenizer.eos_token_ids
    assert thought[3] == end and tokenizer.decode(thought[4:-1]) in ("yes", "no")
    assert thought[-1] in tokenizer.eos_token_ids
    reference = greedy_generate(model, jnp.asarray([prompts[2]]), plain.max_tokens)[0]
    assert free == list(reference)
    runs = engine.runner.runs
    assert runs["decode_sample", 4] > 0 and runs["decode_logits", 4] == runs["decode_sample", 4]
