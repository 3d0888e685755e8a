"""The model, tokenizer, chat template and engine of the worker process, loaded and warmed up in the background.

Loading runs in a thread so the app (and gunicorn's worker) come up at once: /health answers 503 until the
engine has built the programs start needs, then 200. Under the launcher a failed load ends the server.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybrid_jax.chat import ChatTemplate
from server.errors import unavailable
from server.settings import Settings

log = logging.getLogger("hybrid_jax.server")
# generation_config.json keys that become default sampling settings, as vLLM's --generation-config auto.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
WORKER_BOOT_ERROR = 3  # a worker's exit status that makes gunicorn's arbiter stop the server


def default_llm(settings: Settings):
    """The offline LLM (model, tokenizer, started and warmed-up engine) for these settings."""
    from hybrid_jax.engine.llm import LLM  # imports JAX: only ever inside the worker process

    return LLM(settings.model_path, settings.dtype, max_batch=settings.max_batch,
               max_model_len=settings.max_model_len, prefill_chunk=settings.prefill_chunk,
               max_waiting=settings.max_waiting, tensor_parallel_size=settings.tensor_parallel_size,
               memory_utilization=settings.gpu_memory_utilization,
               decode_steps=settings.decode_steps, decode_sizes=settings.decode_sizes,
               compilation_cache_dir=settings.compilation_cache_dir,
               executable_cache_size=settings.executable_cache_size,
               background_compile=settings.background_compile,
               enable_prefix_caching=settings.enable_prefix_caching,
               kv_offloading_size=settings.kv_offloading_size, snapshot_stride=settings.snapshot_stride,
               snapshot_share=settings.snapshot_share)


def generation_defaults(model_path: str | None) -> dict[str, Any]:
    """Sampling defaults from the checkpoint's generation_config.json (empty without one)."""
    file = Path(model_path) / "generation_config.json" if model_path else None
    if file is None or not file.is_file():
        return {}
    config = json.loads(file.read_text(encoding="utf-8"))
    return {k: config[k] for k in GENERATION_DEFAULTS if isinstance(config.get(k), int | float)}


class Backend:
    """Everything the request handlers need from the model side; ``require()`` it before use."""

    def __init__(self, settings: Settings, make_llm: Callable[[Settings], Any] = default_llm):
        self.settings = settings
        self.max_model_len = settings.max_model_len
        self.model_name = settings.served_model_name or settings.model_path or _tiny_model_name()
        self.ready = threading.Event()
        self.error: str | None = None
        self.engine = self.tokenizer = None
        self.template: ChatTemplate | None = None
        self.default_sampling: dict[str, Any] = {}  # defaults of request fields (generation_config.json, flags)
        self._make_llm = make_llm

    def start(self) -> Backend:
        threading.Thread(target=self._load, name="hybrid-jax-load", daemon=True).start()
        return self

    def _load(self) -> None:
        path = self.settings.model_path
        try:
            llm = self._make_llm(self.settings)
            is_dir = path is not None and Path(path).is_dir()
            self.template = ChatTemplate.from_checkpoint(path) if is_dir else ChatTemplate.builtin()
            self.default_sampling = generation_defaults(path if is_dir else None)
            if self.settings.thinking_token_budget is not None:
                self.default_sampling["thinking_token_budget"] = self.settings.thinking_token_budget
            if self.default_sampling:
                log.info("default sampling settings from generation_config.json: %s", self.default_sampling)
            self.engine, self.tokenizer = llm.engine, llm.tokenizer
            self.ready.set()
            log.info("model %s ready", self.model_name)
        except Exception as e:
            log.exception("loading the model failed")
            self.error = f"{type(e).__name__}: {e}"
            if self.settings.exit_on_load_failure:
                os._exit(WORKER_BOOT_ERROR)

    def require(self) -> None:
        """503 (with Retry-After) until the engine is warmed up."""
        if not self.ready.is_set():
            why = f"the model failed to load: {self.error}" if self.error else "the model is still loading"
            raise unavailable(why, 5 if self.error is None else 60)

    def stats(self) -> dict[str, int] | None:
        return self.engine.stats() if self.ready.is_set() else None

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def _tiny_model_name() -> str:
    from hybrid_jax.engine.llm import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME
