"""The app in-process (Flask test client): 503 while loading, after a failed load, and when the queue is full;
request parsing defaults; settings from the environment."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.loader import random_model
from hybrid_jax.tokenizer import load_tokenizer
from server.app import create_app
from server.backend import WORKER_BOOT_ERROR, Backend
from server.errors import APIError
from server.protocol import parse_chat, parse_completion
from server.settings import Settings

SETTINGS = Settings(max_model_len=64, max_waiting=1)
PROMPT = {"prompt": "hi", "max_tokens": 4}


def app_with(make_llm):
    backend = Backend(SETTINGS, make_llm)
    return create_app(SETTINGS, backend).test_client(), backend


def test_503_until_loaded_then_200():
    release = threading.Event()
    stub = SimpleNamespace(engine=SimpleNamespace(stats=dict, shutdown=lambda: None),
                           tokenizer=SimpleNamespace(max_token_chars=1, special_tokens=()))
    client, backend = app_with(lambda settings: release.wait() and stub)
    response = client.get("/health")
    assert response.status_code == 503 and response.json["error"]["type"] == "ServiceUnavailableError"
    assert client.post("/v1/completions", json=PROMPT).status_code == 503
    assert client.get("/metrics").status_code == 200  # always open
    release.set()
    assert backend.ready.wait(10)
    assert client.get("/health").status_code == 200


def test_failed_load_stays_503_with_the_reason():
    def broken(settings):
        raise FileNotFoundError("no checkpoint at /nowhere")

    client, backend = app_with(broken)
    threading.Event().wait(0.2)
    response = client.get("/health")
    assert response.status_code == 503 and "no checkpoint at /nowhere" in response.json["error"]["message"]


def test_failed_load_under_the_launcher_exits_the_worker(monkeypatch):
    exits = []
    monkeypatch.setattr("server.backend.os._exit", exits.append)

    def broken(settings):
        raise FileNotFoundError("no checkpoint at /nowhere")

    backend = Backend(replace(SETTINGS, exit_on_load_failure=True), broken)
    backend._load()
    assert exits == [WORKER_BOOT_ERROR] and "no checkpoint" in backend.error


def test_queue_full_is_503_and_a_closed_stream_cancels():
    """A real engine, not started yet: submitted requests stay queued, so the queue fills deterministically."""
    engine = Engine(random_model("tiny", "float32"), EngineConfig(max_batch=1, max_model_len=64, max_waiting=1))
    client, backend = app_with(lambda settings: SimpleNamespace(engine=engine, tokenizer=load_tokenizer()))
    assert backend.ready.wait(30)
    # echo: the stream's first chunk needs no token (the test client reads one chunk before returning)
    first = client.post("/v1/completions", json={**PROMPT, "stream": True, "echo": True}, buffered=False)
    assert first.status_code == 200
    second = client.post("/v1/completions", json=PROMPT)
    assert second.status_code == 503 and "overloaded" in second.json["error"]["message"]
    first.close()  # the client goes away before any token was generated
    aborted = [s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples
               if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "abort"]
    assert aborted == [1.0]
    engine.start(warmup=False)  # the cancelled request is dropped before it is ever prefilled
    try:
        deadline = time.monotonic() + 30
        while (engine.stats()["waiting"] or engine.stats()["running"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = engine.stats()
        assert stats["waiting"] == stats["running"] == stats["prompt_tokens"] == stats["pages_used"] == 0
    finally:
        engine.shutdown()


def test_parse_defaults():
    completion = parse_completion({"prompt": "x"}, {"temperature": 0.6, "top_k": 20})
    assert completion.max_tokens == 16 and completion.n == 1 and not completion.stream
    assert completion.params.temperature == 0.6 and completion.params.top_k == 20  # the model's defaults
    assert parse_completion({"prompt": "x", "temperature": 0}, {"temperature": 0.6}).params.temperature == 0
    assert parse_completion({"prompt": "x", "max_tokens": 5.0}, {}).max_tokens == 5  # pydantic's lax integers
    streamed = parse_completion({"prompt": "x", "stream": True, "stream_options": {}}, {})
    assert streamed.include_usage  # vLLM's default once stream_options is given
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 7},
                      {})
    assert chat.max_tokens == 7 and chat.params.logprobs is None and chat.tools is None and not chat.parse_tools
    tools = [{"type": "function", "function": {"name": "f"}}]
    auto = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": tools}, {})
    assert auto.tools == tools and auto.parse_tools
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": "x", "stream_options": {"include_usage": True}}, {})
    assert e.value.param == "stream_options"


def test_settings_from_env_round_trip():
    settings = Settings(model_path="/m", max_batch=4, api_key="k", decode_sizes=(1, 4), background_compile=False,
                        default_chat_template_kwargs={"enable_thinking": 0})
    assert Settings.from_env(settings.to_env()) == settings
    assert Settings.from_env({}) == Settings()
    with pytest.raises(ValueError, match="HYBRID_JAX_MAX_BATCH"):
        Settings.from_env({"HYBRID_JAX_MAX_BATCH": "many"})


def test_executable_cache_size_reaches_the_engine(monkeypatch):
    import hybrid_jax.engine.llm
    import server.cli
    from hybrid_jax.cli import parser
    from server.backend import default_llm

    served = []
    monkeypatch.setattr(server.cli, "serve", lambda settings, *where: served.append(settings))
    args = parser(server.cli.add_serve).parse_args(["serve", "--executable-cache-size", "2.5"])
    args.run(args)
    assert served[0].executable_cache_size == 2.5
    monkeypatch.setattr(hybrid_jax.engine.llm, "LLM", lambda *args, **options: options)
    assert default_llm(served[0])["executable_cache_size"] == 2.5
    assert Settings.from_env({"HYBRID_JAX_EXECUTABLE_CACHE_SIZE": "0"}).executable_cache_size == 0
    with pytest.raises(SystemExit):
        parser(server.cli.add_serve).parse_args(["serve", "--executable-cache-size", "-1"])
