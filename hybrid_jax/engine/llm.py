"""Offline API in vLLM's shape: ``LLM(...).generate(...)`` through the engine, ``LLM.score`` in jitted batches."""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from hybrid_jax.compilation_cache import (
    DEFAULT_EXECUTABLES_GIB,
    ExecutableDir,
    enable_compilation_cache,
    executable_dir,
)
from hybrid_jax.config import Qwen35Config, preset
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.output import RequestOutput, TextAssembler
from hybrid_jax.engine.programs import ExecutableStore, stored_value
from hybrid_jax.engine.requests import PromptLogprob
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.loader import random_model, random_weights
from hybrid_jax.model import Qwen35ForCausalLM
from hybrid_jax.sharding import TP, make_mesh
from hybrid_jax.tokenizer import Tokenizer, load_tokenizer
from hybrid_jax.weights import abstract_model, load_weights

log = logging.getLogger("hybrid_jax.engine")
DEFAULT_MODEL_NAME = "hybrid-jax/qwen3.5-tiny-random"
THINK_START, THINK_END = "<think>", "</think>"
SCORE_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SCORE_LOGIT_CHUNK = 256  # positions whose logits are materialised at once when scoring
ALLOCATION_HEAD_START_S = 0.02  # the devices' thread's lead into its first allocation over the tokenizer's parse


@dataclass
class ScoreOutput:
    token_ids: list[int]
    logprobs: list[float]  # log p(token_ids[i] | token_ids[:i]) for i >= 1

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))


class ModelSource(NamedTuple):
    """What ``LLM(model)`` names: the model's shapes now, its tokenizer and weights when loaded."""

    abstract: Qwen35ForCausalLM  # shape-only parameters
    load: Callable[[], Qwen35ForCausalLM]
    load_tokenizer: Callable[[], Tokenizer]  # a parse of the vocabulary that holds the GIL throughout (0.4-1 s)
    name: str


def model_source(model: str | None, dtype: str, seed: int = 0,
                 executable_dir: ExecutableDir | None = None) -> ModelSource:
    """A checkpoint directory, a size preset (random weights), or None: the embedded tiny random default.
    ``executable_dir``: where the random weights' program is kept across runs."""
    if model is not None and Path(model).is_dir():
        abstract = abstract_model(Qwen35Config.from_pretrained(model), jnp.dtype(dtype))
        return ModelSource(abstract, lambda: checkpoint_model(abstract, model), lambda: load_tokenizer(model),
                           Path(model).name)
    preset_name, dtype = ("tiny", "float32") if model is None else (model, dtype)
    abstract = abstract_model(preset(preset_name), jnp.dtype(dtype))
    return ModelSource(abstract, lambda: stored_random_model(abstract, seed, executable_dir), load_tokenizer,
                       DEFAULT_MODEL_NAME if model is None else f"random-{model}")


def checkpoint_model(abstract: Qwen35ForCausalLM, checkpoint: str) -> Qwen35ForCausalLM:
    """`load_pretrained` over shapes already traced: a copy of ``abstract`` (its own parameters, as the engine
    reads the original's meanwhile) filled from ``checkpoint``. Tracing the shapes again would hold the GIL beside
    the engine's construction (BENCHMARKS, "Time to ready")."""
    model = nnx.clone(abstract)
    load_weights(model, checkpoint)
    return model


def start_devices(count: int, client_up: threading.Event) -> list[jax.Device]:
    """The backend's devices, then a first allocation on each of the first ``count`` (the engine's). Both run
    outside the GIL: the backend's client (CUDA's start: 0.6 s on an H100) and, under JAX's default
    preallocation, a GPU allocator's reservation of its whole arena at its first allocation (0.7 s on an H100:
    BENCHMARKS, "Time to ready"), which would otherwise fall in the weights' first transfer or the pools' zeroing.

    ``client_up`` is set between the two, once an empty transfer (which allocates nothing) has run the
    transfer's Python path: what remains before the allocation is a fraction of a millisecond of Python."""
    try:
        devices = jax.devices()
        engine_devices = NamedSharding(make_mesh(count), PartitionSpec(TP))
        jax.device_put(np.zeros(0, np.uint8), engine_devices).block_until_ready()
    finally:
        client_up.set()
    jax.device_put(np.zeros(engine_devices.num_devices, np.uint8), engine_devices).block_until_ready()
    return devices


def stored_random_model(abstract: Qwen35ForCausalLM, seed: int,
                        executable_dir: ExecutableDir | str | os.PathLike | None) -> Qwen35ForCausalLM:
    """`random_model` at ``abstract``'s config and dtype. On the CPU, with ``executable_dir``, its initializers run
    as one program and the weights it makes are kept in the executable store there (`stored_value`): JAX's
    compilation cache is off on the CPU, so each eager initializer would compile on every start (DESIGN: why
    not on a GPU)."""
    config, dtype = abstract.config, abstract.dtype
    if executable_dir is None or jax.devices()[0].platform != "cpu":
        return random_model(config, dtype, seed)
    context = {"model": repr(config), "dtype": str(dtype)}
    store = ExecutableStore(executable_dir, jax.devices()[:1])
    weights = stored_value(store, "random weights", context, random_weights(config, dtype), (np.int32(seed),))
    return nnx.merge(nnx.graphdef(abstract), weights)


class LLM:
    """Generate and score offline. ``LLM()`` runs the embedded tiny random model on the CPU."""

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", *, max_batch: int = 64,
                 max_model_len: int = 4096, seed: int = 0, warmup: bool = True,
                 compilation_cache_dir: str | None = None, executable_cache_size: float = DEFAULT_EXECUTABLES_GIB,
                 **engine_options):
        """``compilation_cache_dir``: keep compiled programs there across runs: the engine's serialized
        executables (`programs.ExecutableStore`), at most ``executable_cache_size`` GiB of them (0: no limit),
        and, except on the CPU, JAX's compilation cache (`enable_compilation_cache`; XLA:CPU cannot serialize
        again an executable that cache returned)."""
        start = time.perf_counter()
        executables = executable_dir(compilation_cache_dir, executable_cache_size) if compilation_cache_dir else None
        engine_config = EngineConfig(max_batch=max_batch, max_model_len=max_model_len, **engine_options)
        # The devices start beside the model's shapes and then the tokenizer's parse. The parse holds the GIL
        # throughout, so it begins once the devices' thread has its client and a head start into the first
        # allocation, which it then overlaps; a parse begun first would hold that allocation back by its own length.
        client_up = threading.Event()
        with ThreadPoolExecutor(1, thread_name_prefix="hybrid-jax-devices") as pool:
            devices = pool.submit(start_devices, engine_config.tensor_parallel_size, client_up)
            source = model_source(model, dtype, seed, executables)
            client_up.wait()
            time.sleep(ALLOCATION_HEAD_START_S)
            tokenizer = source.load_tokenizer()
            platform = devices.result()[0].platform
        if compilation_cache_dir and platform != "cpu":
            enable_compilation_cache(compilation_cache_dir)
        log.info("start-up: devices, model shapes and tokenizer read in %.1f s", time.perf_counter() - start)
        self.tokenizer, self.model_name = tokenizer, source.name
        self.config: Qwen35Config = source.abstract.config
        valid_vocab = min(self.tokenizer.vocab_size, self.config.vocab_size)
        eos = self.config.eos_token_ids if model is not None and Path(model).is_dir() else self.tokenizer.eos_token_ids
        engine_kw = dict(eos_token_ids=eos, valid_vocab=valid_vocab, think_token_ids=think_token_ids(self.tokenizer),
                         tokenizer=self.tokenizer,
                         executable_dir=executables)
        tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="hybrid-jax-tokenizer")
        tables = tokenizer_pool.submit(self.tokenizer.prepare)  # beside the weights and the programs
        if engine_config.tensor_parallel_size == 1 and warmup:
            # The weights load in a thread while the engine is built over the model's shapes and its start
            # programs load from the store (then its pools are allocated), or else are traced and lowered until
            # the weights are in. XLA's compiles, and then the pools, wait for the weights: the autotuner's
            # scratch beside weights still loading fragments device memory (27B ran out of memory at its first
            # step).
            with ThreadPoolExecutor(1, thread_name_prefix="hybrid-jax-weights") as pool:
                loading = pool.submit(self._load, source)
                self.engine = Engine(source.abstract, engine_config, **engine_kw)
                if self.engine.load_stored_programs():
                    self.engine.prepare_programs()
                else:
                    self.engine.lower_start_programs(until=loading.done)
                self.model = loading.result()
            self.engine.attach(self.model)
        else:
            self.model = self._load(source)
            self.engine = Engine(self.model, engine_config, **engine_kw)
        self.engine.start(warmup=warmup)
        tables.result()
        tokenizer_pool.shutdown()
        graphdef, self._score_weights = nnx.split(self.model)
        self._score_fn = jax.jit(partial(_token_logprobs, graphdef))  # compiles per (batch, length) on first use

    @staticmethod
    def _load(source: ModelSource) -> Qwen35ForCausalLM:
        start = time.perf_counter()
        model = source.load()
        log.info("start-up: weights of %s (%s) ready in %.1f s", source.name, model.dtype,
                 time.perf_counter() - start)
        return model

    def close(self) -> None:
        self.engine.shutdown()

    def generate(self, prompts: str | dict | list[str | dict] | None = None, sampling_params=None, *,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt through the engine; results in prompt order. A prompt is a string or, as vLLM's,
        ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``, either with an optional ``"cache_salt"``."""
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("prompts: give either prompts or prompt_token_ids, not both")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        parsed = ([self._prompt(p) for p in prompts] if prompts is not None
                  else [(None, list(p), None) for p in prompt_token_ids or []])
        texts, ids, salts = (list(column) for column in zip(*parsed, strict=True)) if parsed else ([], [], [])
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(ids)
        if len(params) != len(ids):
            raise ValueError("sampling_params: the list must have one entry per prompt")
        for p in params:
            if p.bad_words and not p.bad_words_token_ids:
                p.update_from_tokenizer(self.tokenizer)
        handles = [self.engine.submit(p_ids, p, cache_salt=salt) for p_ids, p, salt in zip(ids, params, salts,
                                                                                            strict=True)]
        results = []
        for text, p_ids, p, handle in tqdm(list(zip(texts, ids, params, handles, strict=True)),
                                           disable=not use_tqdm, desc="generate"):
            assembler = TextAssembler(self.tokenizer, p)
            for event in handle:
                assembler.add(event)
                if assembler.stopped_by_string:
                    handle.cancel()
                    break
            results.append(RequestOutput(handle.request_id, text, list(p_ids), [assembler.output],
                                         prompt_logprobs=prompt_logprob_dicts(p_ids, handle.prompt_logprobs()),
                                         num_cached_tokens=handle.num_cached_tokens))
        return results

    def _prompt(self, prompt: str | dict) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt) of one prompt of `generate`."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt), None
        if not isinstance(prompt, dict):
            raise ValueError("prompts: each must be a string or a dict")
        if unknown := sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}):
            raise ValueError(f"prompts: unknown key {unknown[0]!r}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("prompts: a dict prompt has one of 'prompt' and 'prompt_token_ids'")
        text = prompt.get("prompt")
        ids = self.tokenizer.encode(text) if text is not None else list(prompt["prompt_token_ids"])
        return text, ids, prompt.get("cache_salt")

    def score(self, texts: list[str] | None = None, *, prompt_token_ids: list[list[int]] | None = None,
              batch_size: int = 8) -> list[ScoreOutput]:
        """Per-token log-probabilities of each text under the model, in jit-compiled padded batches."""
        ids = prompt_token_ids or [self.tokenizer.encode(t) for t in texts or []]
        if any(len(x) < 1 for x in ids):
            raise ValueError("texts: every text must have at least one token")
        results: list[ScoreOutput | None] = [None] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch
        for start in range(0, len(order), batch_size):
            group = order[start: start + batch_size]
            longest = max(len(ids[i]) for i in group)
            length = SCORE_LENGTHS[min(bisect.bisect_left(SCORE_LENGTHS, longest), len(SCORE_LENGTHS) - 1)]
            if longest > length:
                raise ValueError(f"texts: {longest} tokens is over the scoring limit of {length}")
            batch = np.zeros((batch_size, length), np.int32)
            for row, i in enumerate(group):
                batch[row, : len(ids[i])] = ids[i]
            logprobs = np.asarray(self._score_fn(self._score_weights, jnp.asarray(batch)))
            for row, i in enumerate(group):
                results[i] = ScoreOutput(list(ids[i]), logprobs[row, : len(ids[i]) - 1].tolist())
        return results


def think_token_ids(tokenizer: Tokenizer) -> tuple[int, int] | None:
    """The ids of <think> and </think> (None unless the tokenizer has both as tokens of their own)."""
    start, end = tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)
    return None if start is None or end is None else (start, end)


def prompt_logprob_dicts(prompt_ids: list[int], logprobs: list[PromptLogprob | None] | None
                         ) -> list[dict[int, float] | None] | None:
    """vLLM's prompt_logprobs: per prompt token {id: logprob} (the token first, then the alternatives); None for
    the first."""
    if logprobs is None:
        return None
    return [None if entry is None else {token: entry.logprob, **{i: lp for i, lp in entry.top if i != token}}
            for token, entry in zip(prompt_ids, logprobs, strict=True)]


def _token_logprobs(graphdef, weights, ids):
    """ids [B, T] -> log p(ids[:, t+1] | ids[:, :t+1]) [B, T-1], logits computed a chunk of positions at a time."""
    model = nnx.merge(graphdef, weights)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    hidden, _ = model.hidden_states(ids, positions)  # [B, T, D]
    hidden, targets = hidden[:, :-1], ids[:, 1:]
    t = hidden.shape[1]
    chunk = min(SCORE_LOGIT_CHUNK, t)
    pad = -t % chunk
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))

    def one(h, y):  # h [B, c, D], y [B, c]
        logp = jax.nn.log_softmax(model.logits(h)[0], axis=-1)
        return jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]

    hs = hidden.reshape(hidden.shape[0], -1, chunk, hidden.shape[-1]).swapaxes(0, 1)
    ys = targets.reshape(targets.shape[0], -1, chunk).swapaxes(0, 1)
    out = jax.lax.map(lambda xy: one(*xy), (hs, ys))  # [n, B, c]
    return out.swapaxes(0, 1).reshape(ids.shape[0], -1)[:, :t]
