"""The Flask app factory of the OpenAI-compatible server (run it under gunicorn's gthread worker, one process).

    gunicorn -k gthread -w 1 --threads 64 'server.app:create_app()'    # settings from HYBRID_JAX_* variables

The factory runs inside the worker process: it creates the backend there, which loads the model and warms
up the engine in the background; /health says 200 once that is done.
"""

from __future__ import annotations

import atexit
import hmac
import logging
import time
from typing import Any

from flask import Flask, Response, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST

from hybrid_jax.tokenizer import Tokenizer
from server.backend import Backend
from server.chat import ChatWriter, chat_prompt
from server.completions import CompletionWriter
from server.disconnect import DisconnectWatch
from server.errors import APIError, bad_request, register_error_handlers
from server.generation import Generation
from server.metrics import ServerMetrics
from server.protocol import Reader, check_model, parse_chat, parse_completion
from server.settings import Settings
from server.streaming import sse_response


def fit_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, prompt_field: str) -> int:
    """max_tokens checked against the context (vLLM's messages); None takes the rest of the context."""
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your request "
                          f"has {prompt_len} input tokens. Please reduce the length of the input.", prompt_field)
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
                          f"completion). Please reduce the length of the messages or completion.", "max_tokens")
    return max_tokens


def check_token_ids(ids: list[int], tokenizer: Tokenizer, field: str) -> list[int]:
    if not all(0 <= t < tokenizer.vocab_size for t in ids):
        raise bad_request(f"{field}: token ids must be in [0, {tokenizer.vocab_size})", field)
    return ids


def _json_body() -> Any:
    body = request.get_json(force=True, silent=True)
    if body is None:
        raise bad_request("the request body is not valid JSON")
    return body


def _respond(writer, generation: Generation, stream: bool) -> Response:
    """The stream, or the whole body; either way the engine requests end if the client goes away."""
    if stream:
        return sse_response(writer.chunks(), generation.cancel)
    try:
        with DisconnectWatch(request.environ.get("gunicorn.socket"), generation.abandon):
            return jsonify(writer.response())
    finally:
        generation.cancel()  # a no-op unless building the response failed half-way


def create_app(settings: Settings | None = None, backend: Backend | None = None) -> Flask:
    """The app; ``backend`` (default: one loading the model of ``settings``) is started here."""
    settings = settings or Settings.from_env()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    backend = backend or Backend(settings)
    metrics = ServerMetrics(backend.stats, backend.model_name)
    app = Flask("hybrid_jax.server")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.ensure_ascii = False
    app.json.sort_keys = False
    register_error_handlers(app)

    @app.before_request
    def authenticate():
        """Like vLLM, the API key guards /v1 only (/health, /metrics, /tokenize stay open)."""
        if settings.api_key and request.path.startswith("/v1") and request.method != "OPTIONS":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {settings.api_key}".encode()):
                raise APIError(401, "Unauthorized: a valid API key is required (Authorization: Bearer ...)")

    @app.get("/health")
    def health():
        backend.require()
        return Response(status=200)

    @app.get("/metrics")
    def prometheus():
        return Response(metrics.render(), mimetype=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models():
        backend.require()
        card = {"id": backend.model_name, "object": "model", "created": int(time.time()), "owned_by": "hybrid-jax",
                "root": settings.model_path or backend.model_name, "parent": None,
                "max_model_len": backend.max_model_len, "permission": []}
        return jsonify({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    def completions():
        backend.require()
        req = parse_completion(_json_body(), backend.default_sampling)
        check_model(req.model, backend.model_name)
        tokenizer = backend.tokenizer
        prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else check_token_ids(p, tokenizer, "prompt")
                      for p in req.prompts]
        for ids in prompt_ids:
            fit_max_tokens(len(ids), req.max_tokens, backend.max_model_len, "prompt")
        texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in req.prompts] if req.echo else []
        generation = Generation(backend.engine, tokenizer, metrics, prompt_ids, req.n,
                                lambda sample: req.params_for(sample, req.max_tokens))
        writer = CompletionWriter(req, generation, texts, tokenizer, backend.model_name)
        return _respond(writer, generation, req.stream)

    @app.post("/v1/chat/completions")
    def chat_completions():
        backend.require()
        req = parse_chat(_json_body(), backend.default_sampling)
        check_model(req.model, backend.model_name)
        prompt_ids, thinking = chat_prompt(req, backend.template, backend.tokenizer,
                                           settings.default_chat_template_kwargs)
        max_tokens = fit_max_tokens(len(prompt_ids), req.max_tokens, backend.max_model_len, "messages")
        generation = Generation(backend.engine, backend.tokenizer, metrics, [prompt_ids], req.n,
                                lambda sample: req.params_for(sample, max_tokens))
        writer = ChatWriter(req, generation, thinking, backend.tokenizer, backend.model_name)
        return _respond(writer, generation, req.stream)

    @app.post("/tokenize")
    def tokenize():
        backend.require()
        reader = Reader(_json_body())
        check_model(reader.string("model"), backend.model_name)
        if "messages" in reader.body:
            ids, _ = chat_prompt(parse_chat(reader.body, {}), backend.template, backend.tokenizer,
                                 settings.default_chat_template_kwargs)
        elif (prompt := reader.string("prompt")) is not None:
            ids = backend.tokenizer.encode(prompt)
        else:
            raise bad_request("prompt: field required (or messages)", "prompt")
        return jsonify({"count": len(ids), "max_model_len": backend.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    def detokenize():
        backend.require()
        reader = Reader(_json_body())
        check_model(reader.string("model"), backend.model_name)
        tokens = check_token_ids(reader.integers("tokens"), backend.tokenizer, "tokens")
        return jsonify({"prompt": backend.tokenizer.decode(tokens)})

    backend.start()
    atexit.register(backend.shutdown)
    return app
