"""Prompt logprobs: at every prompt position the log-probability of the next prompt token, its rank and the most
likely tokens, from one dense forward over the whole prompt (the model's own forward, as `LLM.score` runs it).

One program per length bucket, built (loaded from the executable store or compiled) in a background thread the
first time a prompt of that length asks, so the engine thread, which runs them between its steps, never
compiles. The engine's prefill step has every position's hidden states too; computing the logprobs there would
save this second pass over the prompt.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.engine.programs import ExecutableStore, Programs, ProgramSpec
from hybrid_jax.engine.requests import PromptLogprob
from hybrid_jax.engine.sampling_params import MAX_LOGPROBS

log = logging.getLogger("hybrid_jax.engine")
LOGIT_CHUNK = 256  # positions whose logits are materialised at once
SHORTEST = 16  # the smallest length bucket


def score_positions(graphdef, weights_def, valid_vocab: int, weights: tuple[jax.Array, ...], ids: jax.Array):
    """ids [1, T] -> at each position t < T - 1, for token ids[0, t + 1] given ids[0, : t + 1]: its logprob
    [T - 1] f32 and rank [T - 1] i32 (1 + the tokens more likely), and the MAX_LOGPROBS most likely tokens' ids
    [T - 1, K] i32 and logprobs [T - 1, K] f32. Ids >= valid_vocab are never likely."""
    model = nnx.merge(graphdef, jax.tree.unflatten(weights_def, weights))
    length = ids.shape[1]
    hidden, _ = model.hidden_states(ids, jnp.arange(length, dtype=jnp.int32)[None])  # [1, T, D]
    hidden, targets = hidden[0, :-1], ids[0, 1:]  # [T - 1, D], [T - 1]
    chunk = min(LOGIT_CHUNK, length - 1)
    pad = -(length - 1) % chunk
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[-1])  # [n, c, D]
    targets = jnp.pad(targets, (0, pad)).reshape(-1, chunk)  # [n, c]

    def one(chunk_inputs):
        h, y = chunk_inputs  # [c, D], [c]
        logits, _ = model.logits(h)  # [c, V] f32
        vocab = logits.shape[-1]
        logp = jax.nn.log_softmax(jnp.where(jnp.arange(vocab) < valid_vocab, logits, -jnp.inf), axis=-1)
        chosen = jnp.take_along_axis(logp, y[:, None], axis=-1)  # [c, 1]
        rank = 1 + jnp.sum(logp > chosen, axis=-1, dtype=jnp.int32)
        ranked = jnp.pad(logp, ((0, 0), (0, max(MAX_LOGPROBS - vocab, 0))), constant_values=-jnp.inf)
        top_logprobs, top_ids = jax.lax.top_k(ranked, MAX_LOGPROBS)
        return chosen[:, 0], rank, top_ids.astype(jnp.int32), top_logprobs

    out = jax.lax.map(one, (hidden, targets))  # each [n, c, ...]
    return tuple(x.reshape(-1, *x.shape[2:])[: length - 1] for x in out)


def length_buckets(max_model_len: int) -> tuple[int, ...]:
    """Powers of two from SHORTEST up to the first that holds ``max_model_len`` tokens."""
    sizes = [SHORTEST]
    while sizes[-1] < max_model_len:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


class PromptScorer:
    """The prompt-logprobs programs of one model and the background thread that builds them."""

    def __init__(self, graphdef, weights_def, weights: Sequence[Any], valid_vocab: int, max_model_len: int,
                 store: ExecutableStore | None, context: dict[str, Any], ids_sharding=None):
        """``weights``: arrays or ShapeDtypeStructs (only shapes, dtypes and shardings are read); ``ids_sharding``:
        where the token ids go (None: one device)."""
        self._fn = jax.jit(partial(score_positions, graphdef, weights_def, valid_vocab))
        self._ids_sharding = ids_sharding
        self.buckets = length_buckets(max_model_len)
        shapes = tuple(jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=getattr(w, "sharding", None)
                                            if ids_sharding is not None else None) for w in weights)
        specs = {("prompt_logprobs", n): ProgramSpec(f"prompt logprobs T={n}", self._fn,
                                                     (shapes, jax.ShapeDtypeStruct((1, n), jnp.int32,
                                                                                   sharding=ids_sharding)),
                                                     essential=False)
                 for n in self.buckets}
        self.programs = Programs(specs, store, context)
        self.on_built: Callable[[], None] = lambda: None  # called from the build thread when a program is ready
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="hybrid-jax-prompt-logprobs")
        self._building: set[tuple] = set()
        self._failed: dict[tuple, Exception] = {}  # programs whose build failed: their prompts fail too
        self._lock = threading.Lock()

    def key(self, length: int) -> tuple:
        """The program for prompts of ``length`` tokens."""
        return "prompt_logprobs", next(n for n in self.buckets if n >= length)

    def ready(self, length: int) -> bool:
        return self.programs.get(self.key(length)) is not None

    def score(self, weights: tuple[jax.Array, ...], prompt_ids: Sequence[int],
              top_n: int) -> list[PromptLogprob | None] | None:
        """The logprobs of ``prompt_ids`` (None for the first token) with ``top_n`` alternatives each; None while
        the program for its length is still being built (its build is started, and ``on_built`` called when
        done). Raises RuntimeError when that program cannot be built."""
        key = self.key(len(prompt_ids))
        program = self.programs.get(key)
        if key in self._failed:
            raise RuntimeError(f"{self.programs.specs[key].name} could not be built: {self._failed[key]}")
        if program is None:
            self._build(key)
            return None
        ids = np.zeros((1, key[1]), np.int32)
        ids[0, : len(prompt_ids)] = prompt_ids
        if self._ids_sharding is not None:
            ids = jax.device_put(ids, self._ids_sharding)
        logprob, rank, top_ids, top_logprobs = jax.device_get(program(weights, ids))
        return [None] + [PromptLogprob(float(logprob[t]), int(rank[t]),
                                       list(zip(top_ids[t, :top_n].tolist(), top_logprobs[t, :top_n].tolist(),
                                                strict=True)))
                         for t in range(len(prompt_ids) - 1)]

    def _build(self, key: tuple) -> None:
        with self._lock:
            if key in self._building:
                return
            self._building.add(key)

        def build() -> None:
            try:
                self.programs.build(key)
                log.info("%s built", self.programs.specs[key].name)
            except Exception as e:
                log.exception("building %s failed", self.programs.specs[key].name)
                self._failed[key] = e
            finally:
                with self._lock:
                    self._building.discard(key)
                self.on_built()

        self._builder.submit(build)
