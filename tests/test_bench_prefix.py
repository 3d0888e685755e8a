"""scripts/bench_prefix.py without a server: chunk parsing, usage, length caps, summaries and a stream read from a
stand-in for aiohttp's session (the script's own client; no network)."""

import argparse
import asyncio
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_prefix.py"
spec = importlib.util.spec_from_file_location("bench_prefix", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize("chunk, expected", [
    ({"choices": [{"text": "Hi", "finish_reason": None}]}, ("Hi", True)),
    ({"choices": [{"text": "", "finish_reason": "length"}]}, ("", True)),  # the only token held back to the end
    ({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}, ("", False)),
    ({"choices": [{"delta": {"content": "yes"}, "finish_reason": None}]}, ("yes", True)),
    ({"choices": [{"delta": {"reasoning": "hmm"}, "finish_reason": None}]}, ("", True)),
    ({"choices": [{"delta": {"reasoning_content": "hmm"}, "finish_reason": None}]}, ("", True)),
    ({"choices": [{"delta": {"tool_calls": [{"index": 0}]}, "finish_reason": None}]}, ("", True)),
    ({"choices": [], "usage": {"prompt_tokens": 3}}, ("", False)),
])
def test_chunk_output(chunk, expected):
    assert bench.chunk_output(chunk) == expected


def test_usage_figures_null_where_the_server_gives_none():
    usage = {"prompt_tokens": 300, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 256}}
    assert bench.usage_figures(usage) == {"prompt_tokens": 300, "completion_tokens": 1, "cached_tokens": 256}
    assert bench.usage_figures({"prompt_tokens": 300, "completion_tokens": 1})["cached_tokens"] is None
    assert bench.usage_figures({"prompt_tokens_details": None})["cached_tokens"] is None
    assert bench.usage_figures(None) == {"prompt_tokens": None, "completion_tokens": None, "cached_tokens": None}


def test_lengths_capped_to_fit_the_model():
    assert bench.fitted([256, 1024, 4096, 8192], 4096, 65) == [256, 1024, 4031]
    assert bench.fitted([8192, 4096, 8192], 32768, 65) == [4096, 8192]
    assert bench.fitted([300, 100], None, 65) == [100, 300]


def test_summarize_shared():
    ok = lambda ttft, cached: {"ttft": ttft, "completion_tokens": 4, "cached_tokens": cached}
    results = [ok(0.1, 256), ok(0.2, 256), ok(0.3, 0), {"error": "HTTP 503: busy"}]
    summary = bench.summarize_shared(results, wall=2.0)
    assert summary["requests"] == 4 and summary["errors"] == 1 and summary["hits"] == 2
    assert summary["ttft_p50_ms"] == pytest.approx(200.0) and summary["ttft_p99_ms"] == pytest.approx(298.0)
    assert summary["req_s"] == 1.5 and summary["output_tok_s"] == 6.0
    assert summary["mean_cached_tokens"] == pytest.approx(512 / 3)
    no_details = bench.summarize_shared([ok(0.1, None)], wall=1.0)
    assert no_details["mean_cached_tokens"] is None and no_details["hits"] is None


def test_markdown_table():
    table = bench.markdown_table([{"a": 1, "b": 2.345}, {"a": "x"}], ("a", "b"))
    assert table.splitlines() == ["| a | b |", "| --- | --- |", "| 1 | 2.3 |", "| x | null |"]


class FakeResponse:
    def __init__(self, status: int, lines: list[str]):
        self.status, self.lines = status, lines

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def text(self):
        return "\n".join(self.lines)

    @property
    def content(self):
        async def lines():
            for line in self.lines:
                yield (line + "\n").encode()
        return lines()


class FakeSession:
    def __init__(self, response: FakeResponse):
        self.response, self.posted = response, []

    def post(self, url, json=None):
        self.posted.append((url, json))
        return self.response


def sse(*chunks) -> list[str]:
    return [line for c in chunks for line in (f"data: {json.dumps(c)}", "")] + ["data: [DONE]"]


def test_stream_reads_a_chat_answer_and_its_cached_tokens():
    usage = {"prompt_tokens": 200, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 128}}
    lines = sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"delta": {"content": "Hel"}}]}, {"choices": [{"delta": {"content": "lo"}}]},
                {"choices": [{"delta": {}, "finish_reason": "length"}]}, {"choices": [], "usage": usage})
    session = FakeSession(FakeResponse(200, lines))
    server = bench.Server(session, "http://h:1/", "m")
    result = asyncio.run(server.chat([{"role": "user", "content": "hi"}], 2))
    assert result["text"] == "Hello" and result["cached_tokens"] == 128 and result["prompt_tokens"] == 200
    assert 0 < result["ttft"] <= result["latency"]
    url, payload = session.posted[0]
    assert url == "http://h:1/v1/chat/completions"
    assert payload["model"] == "m" and payload["stream"] and payload["stream_options"] == {"include_usage": True}
    assert payload["ignore_eos"] and payload["temperature"] == 0 and payload["max_tokens"] == 2


def test_stream_errors():
    server = lambda response: bench.Server(FakeSession(response), "http://h:1", "m")
    failed = asyncio.run(server(FakeResponse(400, ['{"error": {"message": "bad"}}'])).complete([1, 2], 1))
    assert failed["error"].startswith("HTTP 400")
    mid_stream = sse({"error": {"message": "engine failed", "code": 500}})
    assert "engine failed" in asyncio.run(server(FakeResponse(200, mid_stream)).complete([1, 2], 1))["error"]
    assert asyncio.run(server(FakeResponse(200, sse({"choices": []}))).complete([1], 1)) == {"error": "no output"}


def test_chunk_token_ids_from_return_tokens_as_token_ids():
    chunk = {"choices": [{"text": "ab", "logprobs": {"tokens": ["token_id:17", "token_id:4"]}}]}
    assert bench.chunk_token_ids(chunk) == [17, 4]
    assert bench.chunk_token_ids({"choices": [{"text": "a", "logprobs": None}]}) == []
    assert bench.chunk_token_ids({"choices": [], "usage": {}}) == []


def test_histogram_totals_from_a_metrics_page():
    page = "\n".join([
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_bucket{le="0.01",model_name="m"} 3.0',
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.25',
        'vllm:time_to_first_token_seconds_count{model_name="m"} 10.0',
        'vllm:time_to_first_token_seconds_sum{model_name="other"} 0.5',
        'vllm:time_to_first_token_seconds_count{model_name="other"} 2.0',
        'vllm:e2e_request_latency_seconds_sum{model_name="m"} 9.0',
    ])
    assert bench.histogram_totals(page, "vllm:time_to_first_token_seconds") == (0.75, 12.0)
    assert bench.histogram_totals(page, "vllm:request_queue_time_seconds") is None


class RecordingServer:
    """Answers every request with 2 token ids and no cached tokens, recording (endpoint, prompt, max_tokens)."""

    def __init__(self):
        self.sent = []

    async def complete(self, prompt, max_tokens, **extra):
        self.sent.append(("completions", list(prompt), max_tokens))
        return {"ttft": 0.01, "latency": 0.02, "text": "ab", "token_ids": [7, 8], "prompt_tokens": len(prompt),
                "completion_tokens": 2, "cached_tokens": 0}

    async def chat(self, messages, max_tokens, **extra):
        self.sent.append(("chat", [dict(m) for m in messages], max_tokens))
        return {"ttft": 0.01, "latency": 0.02, "text": "ab", "token_ids": [], "prompt_tokens": 10,
                "completion_tokens": 2, "cached_tokens": 0}


@pytest.mark.parametrize("as_ids", [True, False])
def test_chat_with_its_system_prompt_seen_first(as_ids):
    args = argparse.Namespace(chat_turns=3, chat_system_words=5, chat_user_words=2, chat_max_tokens=4,
                              chat_think_s=0.0, chat_ids=as_ids, chat_system_seen=True, chat_template_kwargs=None,
                              vocab=1000)
    server = RecordingServer()
    result = asyncio.run(bench.chat(server, args, np.random.default_rng(0)))
    assert len(server.sent) == 4 and [row["turn"] for row in result["rows"]] == [1, 2, 3]  # the first is untimed
    (_, primer, primer_tokens), (_, turn1, turn1_tokens) = server.sent[:2]
    assert primer_tokens == 1 and turn1_tokens == 4
    if as_ids:
        assert primer[:5] == turn1[:5] and len(primer) == len(turn1) == 7 and primer[5:] != turn1[5:]
    else:
        assert primer[0] == turn1[0] and primer[0]["role"] == "system" and primer[1] != turn1[1]
    args.chat_system_seen = False
    server = RecordingServer()
    asyncio.run(bench.chat(server, args, np.random.default_rng(0)))
    assert len(server.sent) == 3
