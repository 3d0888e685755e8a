"""On-device sampling for one step: penalties, temperature, top-k, top-p, min-p, seeded draws, logprobs.

Every row carries its own settings as arrays, so one compiled function serves any mix of requests.
Filtering follows vLLM's order: penalties on the raw logits, then temperature, then top-k / top-p /
min-p, then a draw. Logprobs are those of the raw model distribution (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybrid_jax.engine.sampling_params import MAX_LOGPROBS

F32 = jnp.float32


class SamplingRows(NamedTuple):
    """Per-row settings for a batch of B rows (host builds them, the step reads them)."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] i32, 0 = off
    top_p: jax.Array  # [B] f32
    min_p: jax.Array  # [B] f32
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    repetition_penalty: jax.Array  # [B] f32
    seed: jax.Array  # [B] u32 per-request seed
    step: jax.Array  # [B] i32 number of tokens the request has sampled so far (folds into the key)


class Sampled(NamedTuple):
    tokens: jax.Array  # [B] i32
    logprob: jax.Array  # [B] f32 of the sampled token
    top_ids: jax.Array  # [B, MAX_LOGPROBS] i32
    top_logprobs: jax.Array  # [B, MAX_LOGPROBS] f32


def apply_penalties(logits, rows: SamplingRows, output_counts, prompt_mask):
    """logits [B, V] f32; output_counts [B, V] i32 (generated so far); prompt_mask [B, V] bool."""
    counts = output_counts.astype(F32)
    seen = (output_counts > 0) | prompt_mask
    rep = rows.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - rows.frequency_penalty[:, None] * counts
    return logits - rows.presence_penalty[:, None] * (output_counts > 0)


def filter_logits(logits, rows: SamplingRows):
    """Temperature-scaled logits with top-k, top-p and min-p applied (-inf outside). logits [B, V]."""
    scaled = logits / jnp.maximum(rows.temperature, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    vocab = logits.shape[-1]
    k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    probs_sorted = jax.nn.softmax(jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf), axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_sorted = mass_before < rows.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth, cutoff)
    # min-p: drop tokens whose probability is below min_p times the top probability.
    top = sorted_desc[:, :1]
    min_logit = jnp.where(rows.min_p[:, None] > 0, top + jnp.log(jnp.maximum(rows.min_p[:, None], 1e-30)), -jnp.inf)
    return jnp.where(scaled >= jnp.maximum(threshold, min_logit), scaled, -jnp.inf)


def sample(logits, rows: SamplingRows, output_counts, prompt_mask, want_top, valid_vocab: int, *,
           greedy_only: bool = False) -> Sampled:
    """logits [B, V] -> sampled ids and raw logprobs; the top-``MAX_LOGPROBS`` alternatives only when ``want_top``.

    Ids >= valid_vocab (the padding rows of the embedding) never come out. ``greedy_only`` (static): every row
    is greedy and none wants top logprobs, so the step has no data-dependent branch. Each such branch
    (lax.cond) makes the host wait for the device mid-call, which stops the next call from being queued
    behind this one (at 0.8B the branches about double a decode call's time back to back: docs/DESIGN.md).
    """
    logits = logits.astype(F32)
    in_vocab = jnp.arange(logits.shape[-1]) < valid_vocab
    logits = jnp.where(in_vocab, logits, -jnp.inf)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    penalized = apply_penalties(logits, rows, output_counts, prompt_mask)
    greedy_ids = jnp.argmax(penalized, axis=-1)
    no_top = (jnp.zeros((logits.shape[0], MAX_LOGPROBS), F32), jnp.zeros((logits.shape[0], MAX_LOGPROBS), jnp.int32))
    if greedy_only:
        tokens = greedy_ids.astype(jnp.int32)
        logprob = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
        top_logprobs, top_ids = no_top
        return Sampled(tokens, logprob, top_ids, top_logprobs)

    def draw(_):
        # The full-vocabulary sort behind top-k/top-p/min-p runs only when some row asks for a filter.
        needs_filter = jnp.any(rows.top_k > 0) | jnp.any(rows.top_p < 1.0) | jnp.any(rows.min_p > 0.0)
        scaled = penalized / jnp.maximum(rows.temperature, 1e-6)[:, None]
        filtered = jax.lax.cond(needs_filter, lambda: filter_logits(penalized, rows), lambda: scaled)
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(rows.seed, rows.step)
        return jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, filtered)

    any_random = jnp.any(rows.temperature > 0)
    drawn = jax.lax.cond(any_random, draw, lambda _: greedy_ids, None)
    tokens = jnp.where(rows.temperature > 0, drawn, greedy_ids).astype(jnp.int32)
    logprob = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    short = max(MAX_LOGPROBS - logits.shape[-1], 0)  # tiny test vocabularies
    ranked = jnp.pad(raw_logprobs, ((0, 0), (0, short)), constant_values=-jnp.inf)
    top_logprobs, top_ids = jax.lax.cond(
        want_top, lambda _: tuple(jax.lax.top_k(ranked, MAX_LOGPROBS)), lambda _: no_top, None)
    return Sampled(tokens, logprob, top_ids.astype(jnp.int32), top_logprobs)
