"""Chat and completions response building on crafted model outputs (no engine): reasoning, tool calls, streams."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hybrid_jax.engine.engine import TokenEvent
from hybrid_jax.engine.output import CompletionOutput
from hybrid_jax.engine.requests import PromptLogprob
from hybrid_jax.engine.sampling_params import SamplingParams
from server.chat import ChatWriter, ChoiceParser
from server.completions import CompletionWriter
from server.errors import APIError
from server.protocol import parse_chat, parse_completion

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALLS = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
OUTPUT = "Let me think.</think>\n\nI will check.\n" + CALLS


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


class FakeGeneration:
    """A Generation whose one choice 'generates' ``pieces`` (one token each), then finishes with ``reason``."""

    def __init__(self, pieces: list[str], reason: str = "stop", stop_reason=None):
        self.pieces, self.reason, self.stop_reason = pieces, reason, stop_reason
        prompt_logprobs = [None, PromptLogprob(-1.0, 2, [(7, -0.25), (2, -1.0)])]
        self.choice = SimpleNamespace(index=0, prompt_ids=[1, 2], output=CompletionOutput(0), tokens=[],
                                      finished=False, handle=SimpleNamespace(prompt_logprobs=lambda: prompt_logprobs))
        self.choices = [self.choice]

    @property
    def failed(self) -> bool:
        return self.choice.output.finish_reason == "error"

    def events(self):
        out = self.choice.output
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            event = TokenEvent(100 + i, -0.5, [(100 + i, -0.5), (7, -1.5)], self.reason if last else None, 0.0)
            out.text += piece
            out.token_ids.append(event.token_id)
            self.choice.tokens.append(event)
            if last:
                out.finish_reason, out.stop_reason, self.choice.finished = self.reason, self.stop_reason, True
            yield self.choice, event, piece

    def usage(self):
        return {"prompt_tokens": 2, "completion_tokens": len(self.pieces), "total_tokens": 2 + len(self.pieces)}


def chat_request(**body):
    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, {})


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i: i + size] for i in range(0, len(text), size)]


def test_message_with_reasoning_and_parallel_tool_calls():
    message = ChoiceParser(thinking=True, tools=[WEATHER, TIME], parse_tools=True, parallel_tool_calls=True) \
        .message(OUTPUT)
    assert message["reasoning"] == message["reasoning_content"] == "Let me think."
    assert message["content"] == "I will check.\n"
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]


def test_chat_response_finish_reason_tool_calls():
    request = chat_request(tools=[WEATHER, TIME], chat_template_kwargs={"enable_thinking": True})
    body = ChatWriter(request, FakeGeneration([OUTPUT]), True, FakeTokenizer(), "m").response()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 2
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}


def test_parallel_tool_calls_false_keeps_the_first_call():
    request = chat_request(tools=[WEATHER, TIME], parallel_tool_calls=False)
    message = ChatWriter(request, FakeGeneration([CALLS]), False, FakeTokenizer(), "m").response()["choices"][0]
    assert [c["function"]["name"] for c in message["message"]["tool_calls"]] == ["get_weather"]


def test_tool_choice_none_parses_nothing():
    request = chat_request(tools=[WEATHER], tool_choice="none")
    choice = ChatWriter(request, FakeGeneration([CALLS]), False, FakeTokenizer(), "m").response()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CALLS, "tool_calls": []}
    assert choice["finish_reason"] == "stop"


def test_thinking_off_has_no_reasoning_field():
    request = chat_request()
    text = "<think>\n\n</think>\n\nHello there"
    message = ChatWriter(request, FakeGeneration([text]), False, FakeTokenizer(), "m").response()["choices"][0]
    assert message["message"] == {"role": "assistant", "content": "Hello there", "tool_calls": []}


def stream_deltas(request, thinking: bool, text: str, **generation):
    chunks = list(ChatWriter(request, FakeGeneration(pieces(text), **generation), thinking, FakeTokenizer(),
                             "m").chunks())
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    return chunks


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_tool_calls_match_the_whole_response(parallel):
    request = chat_request(tools=[WEATHER, TIME], parallel_tool_calls=parallel)
    chunks = stream_deltas(request, True, OUTPUT)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think."
    assert "".join(d.get("content", "") for d in deltas) == "I will check.\n"
    calls: dict[int, dict] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += call.get("function", {}).get("arguments", "")
    whole = ChoiceParser(True, [WEATHER, TIME], True, parallel).message(OUTPUT)["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    assert chunks[-1]["choices"][0]["delta"] == {}


def test_stream_logprobs_and_usage():
    request = chat_request(logprobs=True, top_logprobs=1, stream=True, stream_options={"include_usage": True})
    chunks = stream_deltas(request, False, "abcdef", reason="stop", stop_reason="</s>")
    token_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in token_chunks] == ["<100>", "<101>"]
    assert token_chunks[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == \
        [{"token": "<100>", "logprob": -0.5, "bytes": list(b"<100>")}]
    final = chunks[-2]["choices"][0]
    assert final["finish_reason"] == "stop" and final["stop_reason"] == "</s>"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_stream_logprobs_wait_for_their_text():
    """Text the reasoning parser holds back ("<th" may open a think block) holds its token's logprobs back too."""
    request = chat_request(logprobs=True, stream=True)
    chunks = stream_deltas(request, False, "<thxyz", reason="length")
    sent = [(c["choices"][0]["delta"], [e["token"] for e in c["choices"][0]["logprobs"]["content"]])
            for c in chunks if c["choices"][0]["logprobs"]]
    assert sent == [({"content": "<thxyz"}, ["<100>", "<101>"])]


def test_completion_logprobs_and_echo():
    request = parse_completion({"prompt": "p", "logprobs": 1, "echo": True, "prompt_logprobs": 2}, {})
    assert request.params.prompt_logprobs == 2 and request.params_for(1, 5).prompt_logprobs is None
    generation = FakeGeneration(["ab", "c"], reason="length")
    body = CompletionWriter(request, generation, ["P!"], FakeTokenizer(), "m").response()
    [choice] = body["choices"]
    assert choice["text"] == "P!abc" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["<1>", "<2>", "<100>", "<101>"],
        "token_logprobs": [None, -1.0, -0.5, -0.5],
        "top_logprobs": [None, {"<2>": -1.0, "<7>": -0.25}, {"<100>": -0.5, "<7>": -1.5},
                         {"<101>": -0.5, "<7>": -1.5}],
        "text_offset": [0, 3, 6, 11],
    }
    assert choice["prompt_logprobs"] == [None, {"2": {"logprob": -1.0, "rank": 2, "decoded_token": "<2>"},
                                                "7": {"logprob": -0.25, "rank": 1, "decoded_token": "<7>"}}]


def test_completion_stream_chunks():
    request = parse_completion({"prompt": "p", "stream": True, "stream_options": {"include_usage": True}}, {})
    chunks = list(CompletionWriter(request, FakeGeneration(["x", "y"], "length"), ["p"], FakeTokenizer(), "m")
                  .chunks())
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["x", "y"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "length"]
    assert chunks[-1]["usage"]["total_tokens"] == 4


def test_engine_failure_is_a_500_or_an_error_event():
    generation = FakeGeneration(["x"], reason="error")
    request = parse_completion({"prompt": "p"}, {})
    with pytest.raises(APIError) as e:
        CompletionWriter(request, generation, [], FakeTokenizer(), "m").response()
    assert e.value.status == 500
    chunks = list(CompletionWriter(request, FakeGeneration(["x"], reason="error"), [], FakeTokenizer(), "m").chunks())
    assert chunks[-1]["error"]["code"] == 500


def test_seeded_samples_use_seed_plus_index():
    request = parse_completion({"prompt": "p", "n": 3, "seed": 10}, {})
    assert [request.params_for(i, 5).seed for i in range(3)] == [10, 11, 12]
    assert request.params_for(2, 5).max_tokens == 5
    assert isinstance(request.params_for(0, 5), SamplingParams)
