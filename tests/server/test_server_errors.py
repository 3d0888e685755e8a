"""Error responses of the real server: OpenAI-style bodies, the right status, and the server stays up."""

from __future__ import annotations

import openai
import pytest
import requests


def assert_error(response: requests.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param and param in error["message"]
    return error


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", "ten"), ("temperature", "hot"), ("n", 1.5), ("stream", "yes"), ("seed", 1.5),
    ("stop", 3), ("stop_token_ids", ["a"]), ("logprobs", True), ("echo", 1), ("top_k", 2.5),
])
def test_wrong_type_is_400_naming_the_field(server, field, value):
    body = {"model": server.model, "prompt": "hi", field: value}
    error = assert_error(server.post("/v1/completions", json=body), 400, field)
    assert error["type"] == "BadRequestError" and error["code"] == 400


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("temperature", -1), ("top_p", 1.5), ("top_k", -5), ("min_p", 2),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("repetition_penalty", 0), ("logprobs", 21), ("n", 0),
])
def test_out_of_range_is_400_naming_the_field(server, field, value):
    body = {"model": server.model, "prompt": "hi", field: value}
    assert_error(server.post("/v1/completions", json=body), 400, field)


@pytest.mark.parametrize(("field", "value"), [
    ("logit_bias", {"5": 101}), ("logit_bias", {"five": 1}), ("logit_bias", {"999999999": 1}),
    ("allowed_token_ids", []), ("allowed_token_ids", [10**9]), ("bad_words", [1]), ("min_tokens", 20),
    ("best_of", 2), ("guided_json", "{not json"), ("guided_choice", []), ("guided_regex", "a(b"),
    ("guided_grammar", "start: undefined_rule"), ("structured_outputs", {"json": 1}),
    ("structured_outputs", {"regex": "a", "choice": ["a"]}), ("response_format", {"type": "structural_tag"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
    ("thinking_token_budget", -1), ("prompt_logprobs", 21),
])
def test_unsupported_or_bad_sampling_fields_are_400(server, field, value):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 16, field: value}
    assert_error(server.post("/v1/completions", json=body), 400, field)


def test_scoring_fields_errors(server):
    base = {"model": server.model, "prompt": "hi"}
    assert_error(server.post("/v1/completions", json={**base, "max_tokens": 0}), 400, "max_tokens")
    assert_error(server.post("/v1/completions", json={**base, "prompt_logprobs": 1, "stream": True}), 400,
                 "prompt_logprobs")
    assert_error(server.post("/v1/chat/completions", json={"model": server.model, "prompt_logprobs": 1,
                                                           "messages": [{"role": "user", "content": "hi"}]}),
                 400, "prompt_logprobs")


def test_chat_field_errors(server):
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]}, "messages"),
        ({"messages": user, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": user, "tool_choice": "required"}, "tool_choice"),
        ({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"messages": user, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": user, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": user, "max_completion_tokens": -1}, "max_completion_tokens"),
    ]
    for body, param in cases:
        assert_error(server.post("/v1/chat/completions", json={"model": server.model, **body}), 400, param)


def test_prompt_and_body_errors(server):
    url = "/v1/completions"
    assert_error(server.post(url, data=b"{not json", headers={**server.headers, "Content-Type": "application/json"}),
                 400)
    assert_error(server.post(url, json=["a list"]), 400)
    assert_error(server.post(url, json={"model": server.model}), 400, "prompt")
    assert_error(server.post(url, json={"prompt": [1, "mixed"]}), 400, "prompt")
    assert_error(server.post(url, json={"prompt": [-1, 5]}), 400, "prompt")  # token id out of the vocabulary
    assert_error(server.post(url, json={"prompt": ""}), 400, "prompt")
    assert_error(server.post(url, json={"prompt": "x", "suffix": "unsupported"}), 400, "suffix")


def test_too_long_prompt_is_400(server, client):
    long_prompt = "word " * (server.max_model_len + 10)
    # vLLM's wording, which names no field; param does.
    error = assert_error(server.post("/v1/completions", json={"prompt": long_prompt}), 400)
    assert "maximum context length" in error["message"] and error["param"] == "prompt"
    error = assert_error(server.post("/v1/completions", json={"prompt": "hi", "max_tokens": server.max_model_len}),
                         400)
    assert "maximum context length" in error["message"] and error["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": long_prompt}])


def test_api_key(server):
    body = {"prompt": "hi", "max_tokens": 1}
    assert_error(server.post("/v1/completions", json=body, headers={}), 401)
    assert_error(server.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(server.get("/v1/models", headers={}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert requests.get(server.url + "/health").status_code == 200
    assert requests.get(server.url + "/metrics").status_code == 200


def test_unknown_model_is_404(server, client):
    error = assert_error(server.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi"}), 404, "model")
    assert error["code"] == "model_not_found" and error["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])


def test_unknown_route_and_method(server):
    assert_error(server.get("/v1/nothing-here"), 404)
    assert_error(server.post("/nothing"), 404)
    response = server.get("/v1/completions")
    assert_error(response, 405)
    assert "POST" in response.headers["Allow"]


def test_body_over_the_limit_is_413(server):
    body = b'{"prompt": "' + b"x" * (server.max_body_bytes + 1000) + b'"}'
    response = server.post("/v1/completions", data=body, headers={**server.headers,
                                                                   "Content-Type": "application/json"})
    assert_error(response, 413)


def test_server_still_serves_after_errors(server, client):
    assert requests.get(server.url + "/health").status_code == 200
    out = client.completions.create(model=server.model, prompt="still here", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
