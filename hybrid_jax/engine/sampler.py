"""On-device sampling for one step: token constraints, penalties, temperature, top-k, top-p, min-p, seeded draws,
logprobs.

Every row carries its own settings as arrays, so one compiled function serves any mix of requests.
Filtering follows vLLM's order: token constraints (allowed tokens, bad words, min_tokens, logit_bias) on the raw
logits, then penalties, then temperature, then top-k / top-p / min-p, then a draw. Logprobs are those of the raw
model distribution (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Sharding

from hybrid_jax.engine.constraints import NO_TOKEN, TokenConstraints
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
    constraints: TokenConstraints  # [B, ...] logit_bias, allowed tokens, bans, the thinking budget's end token


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


def grammar_allowed(words, vocab: int):
    """[B, V] bool from grammar bitmasks words [B, ceil(V/32)] i32: bit t % 32 of word t // 32 allows token t."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(jnp.bool_)


def apply_constraints(logits, rows: SamplingRows, output_counts, grammar_masks: Callable[[], jax.Array] | None = None):
    """logits [B, V] with the rows' token constraints applied: logit_bias added, and -inf outside the allowed
    tokens, on banned ones (a bad word's last token where the output ends with the rest of it; eos and stop
    tokens before min_tokens) and, in rows with a grammar, outside its bitmask; a row due to close its thinking
    keeps only the end token. Rows of padding come back unchanged. output_counts [B, V] i32: whether the end
    token is out already. ``grammar_masks``: returns the rows' bitmasks [B, ceil(V/32)] i32 (read only here)."""
    c = rows.constraints
    size, vocab = logits.shape
    row = jnp.arange(size)[:, None]
    bias = jnp.zeros_like(logits).at[row, c.bias_ids].add(c.bias_values, mode="drop")
    allowed = jnp.zeros(logits.shape, jnp.bool_).at[row, c.allowed_ids].set(True, mode="drop")
    restricted = jnp.any(c.allowed_ids < vocab, axis=-1, keepdims=True)  # [B, 1]
    follows = jnp.all((c.ban_prefix < 0) | (c.ban_prefix == c.recent[:, None, :]), axis=-1)  # [B, bans]
    banning = follows & (rows.step[:, None] < c.ban_until)
    banned = jnp.zeros(logits.shape, jnp.bool_).at[row, jnp.where(banning, c.ban_token, NO_TOKEN)].set(
        True, mode="drop")
    out = jnp.where(banned | (restricted & ~allowed), -jnp.inf, logits + bias)
    if grammar_masks is not None:
        out = jnp.where(c.grammar[:, None] & ~grammar_allowed(grammar_masks(), vocab), -jnp.inf, out)
    end_count = jnp.take_along_axis(output_counts, jnp.minimum(c.force_token, vocab - 1)[:, None], axis=-1)[:, 0]
    forced = (c.force_token < vocab) & (rows.step >= c.force_at) & (end_count == 0)  # [B]
    only_end = jnp.where(jnp.arange(vocab) == c.force_token[:, None], 0.0, -jnp.inf)
    return jnp.where(forced[:, None], only_end, out)


def filter_logits(logits, rows: SamplingRows, replicated: Sharding | None = None):
    """Temperature-scaled logits with top-k, top-p and min-p applied (-inf outside). logits [B, V]. ``replicated``
    (under a mesh, where the vocabulary is split): the sorted logits are made whole on every device first, as a
    cumulative sum along a split axis partitions into a window as wide as the vocabulary on each device (seconds
    a call on the CPU)."""
    scaled = logits / jnp.maximum(rows.temperature, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    if replicated is not None:
        sorted_desc = jax.lax.with_sharding_constraint(sorted_desc, replicated)
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
           greedy_only: bool = False, branch_free: bool = False,
           grammar_masks: Callable[[], jax.Array] | None = None, replicated: Sharding | None = None) -> Sampled:
    """logits [B, V] -> sampled ids and raw logprobs; the top-``MAX_LOGPROBS`` alternatives only when ``want_top``.

    Ids >= valid_vocab (the padding rows of the embedding) never come out. ``greedy_only`` (static): every row
    is greedy, none wants top logprobs and none has token constraints, so the step has no data-dependent
    branch. Each such branch (lax.cond) makes the host wait for the device mid-call, which stops the next call
    from being queued behind this one (at 0.8B the branches about double a decode call's time back to back:
    docs/DESIGN.md). Otherwise one three-way branch picks the tokens: greedy, random draws, or (some row has
    token constraints) both over the constrained logits; a batch without constraints runs what it ran before
    they existed. ``branch_free`` (static): no branch at all, every row through the constrained path, the filters
    and the top logprobs (the same tokens: constraints and filters leave the rows without them unchanged); for
    few rows (prefill's), where computing everything costs less than the host's wait. ``grammar_masks`` (see
    `apply_constraints`) is read in the constrained branch only. ``replicated``: see `filter_logits`.
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

    random_rows = rows.temperature > 0

    def draw(scores):
        # Each row filtered only when it asks for top-k/top-p/min-p; the full-vocabulary sort behind them runs only
        # when some row does (always when branch_free).
        filters = (rows.top_k > 0) | (rows.top_p < 1.0) | (rows.min_p > 0.0)  # [B]
        scaled = scores / jnp.maximum(rows.temperature, 1e-6)[:, None]
        some_filtered = lambda: jnp.where(filters[:, None], filter_logits(scores, rows, replicated), scaled)
        filtered = some_filtered() if branch_free else jax.lax.cond(jnp.any(filters), some_filtered, lambda: scaled)
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(rows.seed, rows.step)
        drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, filtered)
        return jnp.where(random_rows, drawn, jnp.argmax(scores, axis=-1)).astype(jnp.int32)

    def constrained():
        # vLLM's order: the constraints on the raw logits, then the penalties.
        constrained_logits = apply_constraints(logits, rows, output_counts, grammar_masks)
        return draw(apply_penalties(constrained_logits, rows, output_counts, prompt_mask))

    if branch_free:
        tokens = constrained()
    else:
        branch = jnp.where(jnp.any(rows.constraints.constrained), 2, jnp.where(jnp.any(random_rows), 1, 0))
        tokens = jax.lax.switch(branch, [lambda: greedy_ids.astype(jnp.int32), lambda: draw(penalized), constrained])
    logprob = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    short = max(MAX_LOGPROBS - logits.shape[-1], 0)  # tiny test vocabularies
    ranked = jnp.pad(raw_logprobs, ((0, 0), (0, short)), constant_values=-jnp.inf)
    top = lambda: tuple(jax.lax.top_k(ranked, MAX_LOGPROBS))
    top_logprobs, top_ids = top() if branch_free else jax.lax.cond(want_top, top, lambda: no_top)
    return Sampled(tokens, logprob, top_ids.astype(jnp.int32), top_logprobs)
