"""Clients that go away (64 concurrent streams, half dropped; a non-streaming request given up): no cache leaks."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

STREAMS = 64
ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "hybrid_jax:kv_pages_used",
                 "hybrid_jax:state_slots_used")


def engine_gauges(server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in ENGINE_GAUGES}


def stream(server, index: int) -> str:
    """Even streams read to the end; odd ones close the connection after their first chunk."""
    drop = index % 2 == 1
    body = {"model": server.model, "prompt": f"stream number {index}", "stream": True, "temperature": 0.0,
            "ignore_eos": True, "max_tokens": 100 if drop else 6}
    with requests.post(server.url + "/v1/completions", json=body, headers=server.headers, stream=True,
                       timeout=120) as response:
        assert response.status_code == 200
        events = []
        for line in response.iter_lines():
            if not line:
                continue
            events.append(line.decode())
            if drop:
                return "dropped"
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        return last["choices"][0]["finish_reason"]


def test_dropped_streams_free_their_cache(server):
    with ThreadPoolExecutor(STREAMS) as pool:
        results = list(pool.map(lambda i: stream(server, i), range(STREAMS)))
    assert results == ["length", "dropped"] * (STREAMS // 2)
    deadline = time.monotonic() + 15
    while (gauges := engine_gauges(server)) and any(gauges.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gauges == dict.fromkeys(ENGINE_GAUGES, 0.0)


def generated_tokens(server) -> float:
    text = requests.get(server.url + "/metrics", timeout=30).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "vllm:generation_tokens_total")


def test_dropped_non_streaming_request_is_cancelled(server):
    max_tokens = server.max_model_len - 8
    body = {"model": server.model, "prompt": "long", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    before = generated_tokens(server)
    with pytest.raises(requests.ReadTimeout):  # the client gives up and closes the connection
        requests.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=1.0)
    deadline = time.monotonic() + 15
    while any(engine_gauges(server).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine_gauges(server) == dict.fromkeys(ENGINE_GAUGES, 0.0)
    assert generated_tokens(server) - before < max_tokens


def test_metrics_after_traffic(server):
    families = {f.name: f for f in text_string_to_metric_families(requests.get(server.url + "/metrics").text)}
    for name in ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds"):
        count = next(s.value for s in families[name].samples if s.name.endswith("_count"))
        assert count > 0, name
    assert next(iter(families["vllm:prompt_tokens"].samples)).value > 0
    assert next(iter(families["vllm:generation_tokens"].samples)).value > 0
    reasons = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert reasons.get("length", 0) > 0 and reasons.get("abort", 0) > 0
    totals = {s.name: s.value for f in families.values() for s in f.samples}
    assert totals["hybrid_jax:kv_pages_total"] > 0 and totals["hybrid_jax:state_slots_total"] == server.max_batch
    assert totals["hybrid_jax:programs_first_runs_pending"] == 0  # the CPU makes no first runs
