"""Structured outputs on the real server (random weights): JSON schemas, choices, regexes, grammars and forced tool
calls are followed, bad ones are 400s, and plain requests beside them are unchanged."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

from tests.server.test_server_errors import assert_error
from tests.server.test_server_hostile_inputs import idle_engine

USER = [{"role": "user", "content": "Describe the weather."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "n"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}},
]


def check_schema(value) -> None:
    assert isinstance(value, dict) and set(value) == {"ok", "color", "n"}, value
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green")
    assert isinstance(value["n"], int) and not isinstance(value["n"], bool) and 0 <= value["n"] <= 9


def test_json_schema_outputs_validate(server, client):
    chat = client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=64, temperature=1.0, seed=1, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}})
    compact = client.completions.create(model=server.model, prompt="JSON:", max_tokens=32, temperature=1.0, seed=2,
                                        n=3, extra_body={"structured_outputs": {"json": SCHEMA,
                                                                                "disable_any_whitespace": True}})
    texts = [(c.message.content, c.finish_reason) for c in chat.choices] + [(c.text, c.finish_reason)
                                                                           for c in compact.choices]
    assert all(reason == "stop" for _, reason in texts[3:])  # compact: ~25 tokens, closed well within 32
    for text, reason in texts:
        if reason == "stop":
            check_schema(json.loads(text))
        else:  # cut short: a prefix of a compact document with whitespace between tokens
            assert reason == "length" and text.lstrip().startswith("{")
    anything = client.completions.create(model=server.model, prompt="{", max_tokens=24, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].text), dict)


def test_choice_regex_and_grammar(server, client):
    choices = ["alpha", "beta", "gamma"]
    picked = client.completions.create(model=server.model, prompt="Pick:", max_tokens=8, temperature=1.0, seed=3,
                                       n=4, extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in picked.choices)
    pattern = r"[a-c]{2,4}-[0-9]{2}"
    matched = client.chat.completions.create(model=server.model, messages=USER, max_tokens=12, temperature=1.0,
                                             seed=4, n=3, extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.message.content) for c in matched.choices)
    lark = 'start: "x" ("=" NUM)?\nNUM: /[1-3]/'
    grammar = client.completions.create(model=server.model, prompt="g", max_tokens=6, temperature=1.0, seed=5,
                                        extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"x(=[1-3])?", grammar.choices[0].text)
    stream = client.chat.completions.create(model=server.model, messages=USER, max_tokens=8, temperature=0,
                                            stream=True, extra_body={"guided_choice": choices})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) in choices


def test_forced_tool_calls(server, client):
    named = client.chat.completions.create(
        model=server.model, messages=USER, tools=TOOLS, max_tokens=30, temperature=1.0, seed=6, n=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    # The tools' prompt takes most of the tiny server's context: ~37 tokens are left for the call.
    required = client.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, max_tokens=40,
                                              temperature=1.0, seed=7, n=2, tool_choice="required",
                                              parallel_tool_calls=False)
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["city"] in ("Paris", "Rome") and arguments["days"] in range(1, 8)
        else:
            assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")


def test_grammar_after_thinking(server, client):
    out = client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=40, temperature=1.0, seed=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 3,
                    "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    message = out.choices[0].message
    assert message.model_extra["reasoning"] is not None  # 3 unconstrained tokens, then </think>
    assert out.choices[0].finish_reason == "stop"
    check_schema(json.loads(message.content))


def test_bad_constraints_are_400_and_the_server_keeps_serving(server, client):
    base = {"model": server.model, "messages": USER, "max_tokens": 4}
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": "low"}}}}}]
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": "a"}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"guided_grammar": "start: missing"}, "guided_grammar"),
        ({"tools": bad_tool, "tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, "tool_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ]
    for extra, field in cases:
        assert_error(server.post("/v1/chat/completions", json={**base, **extra}), 400, field)
    out = client.chat.completions.create(model=server.model, messages=USER, max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


def test_mixed_batch_keeps_plain_greedy_tokens(server, client):
    def plain():
        return client.completions.create(model=server.model, prompt="The sky is", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def constrained(seed):
        out = client.completions.create(model=server.model, prompt="JSON:", max_tokens=32, temperature=1.0,
                                        seed=seed, extra_body={"structured_outputs": {
                                            "json": SCHEMA, "disable_any_whitespace": True}})
        return out.choices[0]

    alone = plain()
    with ThreadPoolExecutor(6) as pool:
        grammars = [pool.submit(constrained, seed) for seed in range(4)]
        beside = [pool.submit(plain) for _ in range(2)]
        results = [g.result() for g in grammars]
        assert [b.result() for b in beside] == [alone, alone]
    for choice in results:
        assert choice.finish_reason == "stop"
        check_schema(json.loads(choice.text))


def test_cancelled_grammar_request_frees_its_row(server, client):
    stream = client.completions.create(model=server.model, prompt="JSON:", max_tokens=300, temperature=1.0, seed=9,
                                       stream=True, extra_body={"response_format": {"type": "json_object"}})
    next(iter(stream))
    stream.close()  # the server cancels the request: slot, pages and matcher go
    assert not any(idle_engine(server).values())
    out = client.completions.create(model=server.model, prompt="x", max_tokens=2, temperature=0,
                                    extra_body={"guided_choice": ["ok"]})
    assert out.choices[0].text == "ok"
