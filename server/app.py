"""The Flask app factory of the OpenAI-compatible server (run it under gunicorn, one worker process).

    gunicorn -k server.worker.PrereadThreadWorker -w 1 --threads 64 'server.app:create_app()'   # HYBRID_JAX_*

(``hybrid-jax serve`` does this with the worker's limits from its flags; see server/worker.py.)

The factory runs inside the worker process: it creates the backend there, which loads the model and warms
up the engine in the background; /health says 200 once that is done.
"""

from __future__ import annotations

import atexit
import hmac
import logging
import time

from flask import Flask, Response, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST

from server.backend import Backend
from server.body import json_body
from server.chat import ChatWriter, chat_prompt
from server.completions import CompletionWriter
from server.disconnect import DisconnectWatch
from server.errors import APIError, bad_request, from_value_error, register_error_handlers
from server.generation import Generation
from server.limits import check_choices, check_stops, check_text_length, check_token_ids, fit_max_tokens
from server.metrics import ServerMetrics
from server.protocol import Reader, check_model, parse_chat, parse_completion
from server.settings import Settings
from server.streaming import sse_response
from server.structured import check_grammar

CLIENT_CLOSED = "the client closed its side of the connection before the answer was ready; the request was cancelled"


def _respond(writer, generation: Generation, stream: bool) -> Response:
    """The stream, or the whole body; either way the engine requests end if the client goes away."""
    if stream:
        return sse_response(writer.chunks(), generation.cancel)
    try:
        watch = DisconnectWatch(request.environ.get("gunicorn.socket"), generation.abandon)
        with watch:
            body = writer.response()
        if watch.gone:  # never a cut-short 200 that looks complete
            raise APIError(499, CLIENT_CLOSED)
        return jsonify(body)
    finally:
        generation.cancel()  # a no-op unless building the response failed half-way


def _serve(generation: Generation, make_writer, stream: bool) -> Response:
    """Build the writer and respond; any error on the way cancels what was submitted."""
    try:
        return _respond(make_writer(generation), generation, stream)
    except BaseException:
        generation.cancel()
        raise


def create_app(settings: Settings | None = None, backend: Backend | None = None) -> Flask:
    """The app; ``backend`` (default: one loading the model of ``settings``) is started here."""
    settings = settings or Settings.from_env()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    backend = backend or Backend(settings)
    metrics = ServerMetrics(backend.stats, backend.model_name)
    app = Flask("hybrid_jax.server")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    if settings.allowed_hosts is not None and "*" not in settings.allowed_hosts:
        app.config["TRUSTED_HOSTS"] = list(settings.allowed_hosts)  # other Host headers: 400
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

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache():
        backend.require()
        backend.engine.reset_prefix_cache()
        return Response(status=200)

    @app.get("/v1/models")
    def models():
        backend.require()
        card = {"id": backend.model_name, "object": "model", "created": int(time.time()), "owned_by": "hybrid-jax",
                "root": settings.model_path or backend.model_name, "parent": None,
                "max_model_len": backend.max_model_len, "permission": []}
        return jsonify({"object": "list", "data": [card]})

    def body():
        return json_body(request, settings.max_body_bytes)

    def prompt_of(req) -> tuple[list[int], bool]:
        return chat_prompt(req, backend.template, backend.tokenizer, settings.default_chat_template_kwargs,
                           backend.max_model_len, settings.special_tokens_as_text)

    def check_request(req, prompts: int) -> None:
        """What parsing could not check alone: the model, stop strings, choices, bad words (tokenized here), the
        structured-output grammar (compiled here, on the request's thread; the engine's submit finds it cached)."""
        check_model(req.model, backend.model_name)
        check_stops(req.params.stop, backend.max_model_len, backend.tokenizer)
        check_choices(prompts * req.n, settings.max_waiting)
        if req.params.bad_words:
            try:
                req.params.update_from_tokenizer(backend.tokenizer)
            except ValueError as e:
                raise from_value_error(e) from e
        if req.params.structured_outputs is not None:
            check_grammar(backend.engine, req.params, req.structured_field)

    @app.post("/v1/completions")
    def completions():
        backend.require()
        req = parse_completion(body(), backend.default_sampling)
        check_request(req, len(req.prompts))
        tokenizer = backend.tokenizer
        for p in req.prompts:
            if isinstance(p, str):
                check_text_length(p, backend.max_model_len, tokenizer, "prompt")
            else:
                check_token_ids(p, tokenizer, "prompt")
        prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
        for ids in prompt_ids:
            fit_max_tokens(len(ids), req.max_tokens, backend.max_model_len, "prompt")
        texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in req.prompts] if req.echo else []
        generation = Generation(backend.engine, tokenizer, metrics, prompt_ids, req.n,
                                lambda sample: req.params_for(sample, req.max_tokens), req.cache_salt)
        return _serve(generation, lambda g: CompletionWriter(req, g, texts, tokenizer, backend.model_name),
                      req.stream)

    @app.post("/v1/chat/completions")
    def chat_completions():
        backend.require()
        req = parse_chat(body(), backend.default_sampling)
        check_request(req, 1)
        prompt_ids, thinking = prompt_of(req)
        max_tokens = fit_max_tokens(len(prompt_ids), req.max_tokens, backend.max_model_len, "messages")
        generation = Generation(backend.engine, backend.tokenizer, metrics, [prompt_ids], req.n,
                                lambda sample: req.params_for(sample, max_tokens), req.cache_salt)
        return _serve(generation, lambda g: ChatWriter(req, g, thinking, backend.tokenizer, backend.model_name),
                      req.stream)

    @app.post("/tokenize")
    def tokenize():
        backend.require()
        reader = Reader(body())
        check_model(reader.string("model"), backend.model_name)
        if "messages" in reader.body:
            ids, _ = prompt_of(parse_chat(reader.body, {}))
        elif (prompt := reader.string("prompt")) is not None:
            ids = backend.tokenizer.encode(check_text_length(prompt, backend.max_model_len, backend.tokenizer,
                                                             "prompt"))
        else:
            raise bad_request("prompt: field required (or messages)", "prompt")
        return jsonify({"count": len(ids), "max_model_len": backend.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    def detokenize():
        backend.require()
        reader = Reader(body())
        check_model(reader.string("model"), backend.model_name)
        tokens = check_token_ids(reader.integers("tokens"), backend.tokenizer, "tokens")
        return jsonify({"prompt": backend.tokenizer.decode(tokens)})

    backend.start()
    atexit.register(backend.shutdown)
    return app
