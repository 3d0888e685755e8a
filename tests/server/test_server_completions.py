"""/v1/completions, /v1/models, /tokenize and /detokenize on the real server (official client and raw HTTP)."""

from __future__ import annotations

import json

GREEDY = {"temperature": 0.0}


def test_models_lists_the_served_model(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert models[0].object == "model"
    assert models[0].model_extra["max_model_len"] == server.max_model_len


def test_text_prompt(server, client):
    out = client.completions.create(model=server.model, prompt="Hello, world", max_tokens=5, **GREEDY)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.created > 0
    assert out.model == server.model
    [choice] = out.choices
    assert choice.index == 0 and isinstance(choice.text, str) and choice.finish_reason == "length"
    prompt_tokens = server.post("/tokenize", json={"prompt": "Hello, world"}).json()["count"]
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == prompt_tokens + 5


def test_default_max_tokens_is_16(server, client):
    out = client.completions.create(model=server.model, prompt="Hi", extra_body={"ignore_eos": True}, **GREEDY)
    assert out.usage.completion_tokens == 16


def test_token_id_prompt_matches_text_prompt(server, client):
    ids = server.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    by_text = client.completions.create(model=server.model, prompt="The quick brown fox", max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_batch_and_n(server, client):
    out = client.completions.create(model=server.model, prompt=["one", "two three"], n=2, max_tokens=3, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy samples of one prompt agree
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == sum(server.post("/tokenize", json={"prompt": p}).json()["count"]
                                          for p in ("one", "two three"))
    token_batch = client.completions.create(model=server.model, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, **GREEDY)
    assert len(token_batch.choices) == 2 and token_batch.usage.prompt_tokens == 5


def test_echo_and_logprobs(server, client):
    prompt = "Echo this"
    prompt_ids = server.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, echo=True, logprobs=2, **GREEDY)
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == len(prompt_ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    values = lp.token_logprobs[1:]
    assert all(isinstance(v, float) and v <= 0 for v in values)
    for top, token, value in zip(lp.top_logprobs[1:], lp.tokens[1:], values, strict=True):
        assert 1 <= len(top) <= 3 and top[token] == value  # the token plus up to 2 alternatives
    for top, value in zip(lp.top_logprobs[len(prompt_ids):], lp.token_logprobs[len(prompt_ids):], strict=True):
        assert value == max(top.values())  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_loglikelihood_requests(server, client):
    """lm-eval's local-completions loglikelihood: token-id prompts, echo, logprobs=1, max_tokens 1 (or 0, the
    scoring idiom); the prompt's logprobs are the same either way, and vLLM's prompt_logprobs field agrees."""
    context = server.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    prompts = [context + [12095], context + [7, 8, 9]]
    one = client.completions.create(model=server.model, prompt=prompts, max_tokens=1, logprobs=1, echo=True,
                                    seed=1234, temperature=0.0)
    none = client.completions.create(model=server.model, prompt=prompts, max_tokens=0, logprobs=1, echo=True,
                                     temperature=0.0, extra_body={"prompt_logprobs": 2})
    for full, scored, ids in zip(one.choices, none.choices, prompts, strict=True):
        continuation = full.logprobs.token_logprobs[len(context):-1]
        assert len(continuation) == len(ids) - len(context) and all(v <= 0 for v in continuation)
        assert scored.logprobs.token_logprobs == full.logprobs.token_logprobs[:-1]
        assert scored.finish_reason == "length" and scored.text == server.post(
            "/detokenize", json={"tokens": ids}).json()["prompt"]
        prompt_logprobs = scored.model_extra["prompt_logprobs"]
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
        for token, value, entry in zip(ids[1:], scored.logprobs.token_logprobs[1:], prompt_logprobs[1:], strict=True):
            assert entry[str(token)]["logprob"] == value and entry[str(token)]["rank"] >= 1
            assert len(entry) in (2, 3) and sorted(e["rank"] for e in entry.values())[0] == 1
    assert none.usage.completion_tokens == 0 and one.usage.completion_tokens == 2


def test_token_constraints(server, client):
    """logit_bias, allowed_token_ids, bad_words and min_tokens, as vLLM takes them."""
    eos = server.post("/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    word, other = (server.post("/tokenize", json={"prompt": w}).json()["tokens"][0] for w in ("hello", "world"))

    def ids(max_tokens: int, temperature: float, **fields) -> list[int]:
        out = client.completions.create(model=server.model, prompt="Constraints", max_tokens=max_tokens,
                                        temperature=temperature, logprobs=0,
                                        extra_body={"return_tokens_as_token_ids": True, **fields})
        return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

    for temperature in (0.0, 1.0):
        assert ids(3, temperature, logit_bias={str(other): 100}) == [other] * 3
    assert ids(4, 1.0, allowed_token_ids=[word, other], bad_words=["hello"]) == [other] * 4
    assert ids(8, 0.0, logit_bias={str(eos[0]): 100}, allowed_token_ids=[eos[0], other], min_tokens=3) \
        == [other] * 3 + eos


def test_streaming_echo_logprobs_and_continuous_usage(server, client):
    stream = client.completions.create(model=server.model, prompt="Stream usage", max_tokens=4, echo=True,
                                       logprobs=1, stream=True, **GREEDY,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    echo, usage_chunk = chunks[0], chunks[-1]
    assert echo.choices[0].text == "Stream usage" and echo.usage.completion_tokens == 0
    values = echo.choices[0].logprobs.token_logprobs
    assert values[0] is None and all(isinstance(v, float) for v in values[1:])
    assert [c.usage.completion_tokens for c in chunks[1:-1]] == [1, 2, 3, 4]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 4


def test_stop_string(server, client):
    base = client.completions.create(model=server.model, prompt="Stop test", max_tokens=12,
                                     extra_body={"ignore_eos": True}, **GREEDY).choices[0].text
    stop = base[4:7]
    expected = base[: base.find(stop)]
    out = client.completions.create(model=server.model, prompt="Stop test", max_tokens=12, stop=[stop], **GREEDY)
    choice = out.choices[0]
    assert choice.text == expected and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    kept = client.completions.create(model=server.model, prompt="Stop test", max_tokens=12, stop=stop,
                                     extra_body={"include_stop_str_in_output": True}, **GREEDY)
    assert kept.choices[0].text == expected + stop


def test_stop_token_ids(server, client):
    first = client.completions.create(model=server.model, prompt="Stop ids", max_tokens=6, logprobs=0,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **GREEDY)
    ids = [int(t.removeprefix("token_id:")) for t in first.choices[0].logprobs.tokens]
    stop_id = ids[2]
    out = client.completions.create(model=server.model, prompt="Stop ids", max_tokens=6,
                                    extra_body={"stop_token_ids": [stop_id]}, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id
    assert out.usage.completion_tokens == ids.index(stop_id) + 1


def test_same_seed_same_text(server, client):
    def sample(seed: int) -> str:
        return client.completions.create(model=server.model, prompt="Seeded", max_tokens=8, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    two = client.completions.create(model=server.model, prompt="Seeded", max_tokens=4, n=2, temperature=1.0, seed=7)
    assert len(two.choices) == 2


def test_streaming_completion_with_usage(server, client):
    stream = client.completions.create(model=server.model, prompt="Stream me", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 6
    whole = client.completions.create(model=server.model, prompt="Stream me", max_tokens=6, **GREEDY)
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text


def test_raw_sse_framing(server):
    body = {"model": server.model, "prompt": "Raw", "max_tokens": 3, "stream": True, "echo": True, **GREEDY}
    response = server.post("/v1/completions", json=body, stream=True)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["text"] == "Raw"  # echo comes first


def test_tokenize_detokenize_round_trip(server):
    text = "Hello wörld 你好 <|im_end|>"
    tokens = server.post("/tokenize", json={"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == server.max_model_len
    assert server.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
