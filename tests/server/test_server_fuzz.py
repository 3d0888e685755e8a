"""Fuzzed request bodies against the real server: every answer a 200 or a 4xx with an OpenAI error body."""

from __future__ import annotations

import json

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_server_concurrency import ENGINE_GAUGES
from tests.server.test_server_hostile_inputs import idle_engine

EXAMPLES = 200
FIELDS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "stop",
          "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "top_logprobs", "echo", "tools",
          "tool_choice", "chat_template_kwargs", "response_format", "stop_token_ids", "ignore_eos", "model",
          "skip_special_tokens", "include_stop_str_in_output", "add_generation_prompt", "parallel_tool_calls",
          "repetition_penalty", "presence_penalty", "logit_bias", "suffix", "tokens")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")

text = st.text(alphabet=st.characters(codec=None), max_size=40) | st.sampled_from(
    ["", "<|im_start|>", "<|im_end|>system", "</think>", "<tool_call>", "\ud800", "a\udfffb", "\x00"])
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | text)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                      max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]) | text},
                                optional={"content": values, "tool_calls": values, "reasoning_content": values})
tool = st.fixed_dictionaries({"type": st.just("function") | text},
                             optional={"function": st.fixed_dictionaries({"name": text | values},
                                                                         optional={"parameters": values,
                                                                                   "description": values})})
prompt = text | st.lists(st.integers(-5, 300_000), max_size=4) | st.lists(text | values, max_size=3) | values
special = {"messages": st.lists(message, max_size=3) | values, "tools": st.lists(tool, max_size=2) | values,
           "max_tokens": st.integers(-2, 3) | values, "n": st.integers(-1, 3) | values, "prompt": prompt,
           "stop": text | st.lists(text, max_size=3) | values, "tokens": st.lists(st.integers(-5, 300_000)) | values}
# Mostly the endpoint's own field (a prompt, messages or tokens) plus a few others; sometimes anything at all.
extra = st.dictionaries(st.sampled_from(FIELDS), values, max_size=5)
MAIN_FIELDS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/tokenize": "prompt",
               "/detokenize": "tokens"}


def bodies(endpoint: str) -> st.SearchStrategy:
    return st.dictionaries(st.sampled_from(FIELDS), values, max_size=5).flatmap(lambda fields: st.fixed_dictionaries(
        {k: special.get(k, st.just(v)) for k, v in {MAIN_FIELDS[endpoint]: None, **fields}.items()}))


def answer_is_sound(response: requests.Response) -> None:
    if response.status_code == 200:
        if response.headers["Content-Type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]")
        else:
            response.json()
        return
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_bodies_get_200_or_4xx(server, data):
    endpoint = data.draw(st.sampled_from(ENDPOINTS))
    body = data.draw(bodies(endpoint) | values)
    if isinstance(body, dict) and not isinstance(body.get("max_tokens"), int | float):
        body.setdefault("max_tokens", 2)  # keep generations short; junk max_tokens values stay
    raw = json.dumps(body).encode()  # lone surrogates leave as \\ud800 escapes: valid JSON
    response = server.post(endpoint, data=raw, headers={**server.headers, "Content-Type": "application/json"})
    answer_is_sound(response)


def test_server_healthy_after_fuzzing(server, client):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    out = client.completions.create(model=server.model, prompt="after fuzzing", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
    assert idle_engine(server) == dict.fromkeys(ENGINE_GAUGES, 0.0)
