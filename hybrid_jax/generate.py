"""Greedy generation over the model's dense cache: a simple demo path (the serving engine is ``engine/``)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.model import Qwen35ForCausalLM


@partial(jax.jit, static_argnums=0, donate_argnums=3)
def _prefill(graphdef, state, ids, cache):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    logits, cache = model.forward(ids, positions, cache)
    return logits[:, -1], cache


@partial(jax.jit, static_argnums=0, donate_argnums=3)
def _decode(graphdef, state, tokens, cache, position):
    model = nnx.merge(graphdef, state)
    positions = jnp.full((tokens.shape[0], 1), position, jnp.int32)
    logits, cache = model.forward(tokens[:, None], positions, cache)
    return logits[:, 0], cache


def greedy_generate(model: Qwen35ForCausalLM, prompt_ids, max_new_tokens: int,
                    eos_token_ids=()) -> list[list[int]]:
    """prompt_ids [B, T] (equal lengths) -> up to ``max_new_tokens`` greedy ids per row, cut after an eos id."""
    ids = jnp.asarray(prompt_ids, jnp.int32)
    batch, length = ids.shape
    graphdef, state = nnx.split(model)
    cache = model.init_cache(batch, length + max_new_tokens)
    logits, cache = _prefill(graphdef, state, ids, cache)
    out = []
    for step in range(max_new_tokens):
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(tokens)
        if step + 1 < max_new_tokens:
            logits, cache = _decode(graphdef, state, tokens, cache, length + step)
    rows = np.asarray(jnp.stack(out, axis=1)).tolist()
    eos = set(eos_token_ids)
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]
