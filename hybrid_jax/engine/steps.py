"""The engine's fixed-shape steps over the cache pools: packed chunked prefill (a prefix cache hit's first chunk
starting from its snapshot) and batched decode (both writing the prefix cache's state snapshots where the
batch names them; decode whole, or as a forward and a sample apart, for grammar masks the host computes between
the two).

Both are pure functions of (weights, pools, batch) that the engine jits once per shape bucket with the
pools donated, so every cache update is in place. Each runs the model's decoder over a cache of
`caches.paged` (on one device, the fused decode cache) and samples from its logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Sharding

from hybrid_jax.caches.paged import (
    UNNAMED,
    DecodeCache,
    FusedDecodeCache,
    PagedKernels,
    PrefillCache,
    snapshot_entries,
    start_rows,
)
from hybrid_jax.engine.prefix_cache import DECODE_SNAPSHOTS
from hybrid_jax.engine.sampler import Sampled, SamplingRows, sample
from hybrid_jax.model import Qwen35ForCausalLM

F32 = jnp.float32


class PrefillBatch(NamedTuple):
    """T packed new tokens of up to S sequences (chunks of their prompts); padding at the end."""

    tokens: jax.Array  # [T] i32
    positions: jax.Array  # [T] i32 position of each token in its sequence
    seq_index: jax.Array  # [T] i32 which of the S sequences the token belongs to (padding: 0)
    valid: jax.Array  # [T] bool real token (not padding)
    cu_seqlens: jax.Array  # [S + 1] i32 token offsets; unused sequences have 0 tokens
    slot_ids: jax.Array  # [S] i32 state slot (unused: 0)
    page_tables: jax.Array  # [S, max_pages] i32
    context_lens: jax.Array  # [S] i32 tokens in the cache after this chunk
    is_first: jax.Array  # [S] bool this chunk starts the sequence: its slot is reset
    is_last: jax.Array  # [S] bool the prompt ends in this chunk: the sample is the first output token
    snapshot_ids: jax.Array  # [S, ceil(T / 64)] i32 snapshot of sequence s's state after its first (c + 1) * 64
    # tokens, where > 0 (read only with a snapshot pool)
    restore_ids: jax.Array  # [S] i32 snapshot the sequence's slot starts from (a hit's first chunk), where > 0
    rows: SamplingRows  # [S] settings; a sequence whose prompt ends in this chunk samples its first token
    want_top: jax.Array  # [] bool some row wants top logprobs


class DecodeBatch(NamedTuple):
    """One new token for each of B rows (padding rows: slot 0, page 0, context 0)."""

    tokens: jax.Array  # [B] i32
    positions: jax.Array  # [B] i32
    slot_ids: jax.Array  # [B] i32
    page_tables: jax.Array  # [B, max_pages] i32
    rows: SamplingRows  # [B]
    want_top: jax.Array  # [] bool


def prefill_step(model: Qwen35ForCausalLM, pools: dict, snapshots: dict | None, batch: PrefillBatch, *,
                 kernels: PagedKernels, page_size: int, valid_vocab: int,
                 greedy_only: bool = False) -> tuple[Sampled, dict, dict | None]:
    """Run one packed prefill chunk; returns a sample for every sequence's last token, the new pools and, with a
    snapshot pool, the new snapshots (each GDN state and prompt mask at the batch's snapshot boundaries).
    ``greedy_only``: every row samples greedily without logprobs or token constraints (see `sample`); otherwise
    every row takes every sampling path (no branch for the host to wait on)."""
    cache = PrefillCache(pools["layers"], kernels, kernels.projections(model), page_size=page_size,
                         positions=batch.positions, seq_index=batch.seq_index, valid=batch.valid,
                         cu_seqlens=batch.cu_seqlens, slot_ids=batch.slot_ids, page_tables=batch.page_tables,
                         context_lens=batch.context_lens, is_first=batch.is_first,
                         snapshots=snapshots, snapshot_ids=batch.snapshot_ids, restore_ids=batch.restore_ids)
    x = model.decoder(model.embed_tokens(batch.tokens).astype(F32), batch.positions, cache)  # [T, D]
    last = jnp.maximum(batch.cu_seqlens[1:] - 1, 0)  # [S]
    logits, _ = model.logits(model.norm(x[last], model.dtype))  # [S, V]

    counts = start_rows(pools["output_counts"], batch.slot_ids, batch.is_first | (batch.restore_ids > 0))
    prompt_mask = start_rows(pools["prompt_mask"], batch.slot_ids, batch.is_first,
                             None if snapshots is None else snapshots["prompt_mask"], batch.restore_ids)
    if snapshots is not None:
        masks = _prompt_mask_snapshots(snapshots["prompt_mask"], prompt_mask, batch)
        # The snapshots read prompt_mask rows before the scatter below writes it: ordering the two lets XLA
        # update the [slots, V] mask in place rather than copy it.
        masks, prompt_mask = jax.lax.optimization_barrier((masks, prompt_mask))
        snapshots = {**cache.updated_snapshots(), "prompt_mask": masks}
    token_slots = jnp.where(batch.valid, batch.slot_ids[batch.seq_index], 0)
    prompt_mask = prompt_mask.at[token_slots, batch.tokens].set(True)
    sampled = sample(logits, batch.rows, counts[batch.slot_ids], prompt_mask[batch.slot_ids], batch.want_top,
                     valid_vocab, greedy_only=greedy_only, branch_free=True,
                     grammar_masks=lambda: pools["grammar_mask"][batch.slot_ids], replicated=kernels.replicated)
    counts = counts.at[batch.slot_ids, sampled.tokens].add(batch.is_last.astype(jnp.int32))
    return sampled, {**pools, "layers": cache.updated, "output_counts": counts, "prompt_mask": prompt_mask}, snapshots


def _prompt_mask_snapshots(snapshot_masks, prompt_mask, batch: PrefillBatch):
    """snapshot_masks [snapshots, V] with each snapshot's prompt mask written: its slot's mask before this chunk
    (``prompt_mask`` [slots, V]) and the chunk's tokens before the boundary."""
    seq, tokens, snapshot = snapshot_entries(batch.snapshot_ids, batch.cu_seqlens)  # [M] each
    offsets = jnp.arange(batch.tokens.shape[0]) - batch.cu_seqlens[batch.seq_index]  # [T] within the chunk
    before = (batch.seq_index[None, :] == seq[:, None]) & (offsets[None, :] < tokens[:, None]) & batch.valid  # [M, T]
    entries = jnp.arange(seq.shape[0])[:, None]
    masks = prompt_mask[batch.slot_ids[seq]].at[entries, jnp.where(before, batch.tokens, UNNAMED)].set(
        True, mode="drop")  # [M, V]
    return snapshot_masks.at[snapshot].set(masks, mode="drop", unique_indices=True)


def decode_logits(model: Qwen35ForCausalLM, pools: dict, batch: DecodeBatch, *, kernels: PagedKernels,
                  page_size: int, snapshots: dict | None = None,
                  snapshot_ids: jax.Array | None = None) -> tuple[jax.Array, dict, dict | None]:
    """The model's forward for one token of each row: logits [B, V] f32, the new pools (caches written) and, with
    a snapshot pool and snapshot_ids [B] i32 (0: none), the new snapshots: a named row's GDN state after its
    token and its tokens so far (prompt mask | output counts), as a prefill ending there leaves them."""
    fused = kernels.mesh is None  # under a mesh the KV heads may be copied per shard and the conv channels
    # split by position, not by head: unfused there
    kind = FusedDecodeCache if fused else DecodeCache
    cache = kind(pools["layers"], kernels, kernels.projections(model, defer_norms=fused), page_size=page_size,
                 positions=batch.positions, slot_ids=batch.slot_ids, page_tables=batch.page_tables,
                 snapshots=snapshots, snapshot_ids=snapshot_ids)
    x = model.decoder(model.embed_tokens(batch.tokens).astype(F32), batch.positions, cache)  # [B, D]
    logits, _ = model.logits(model.norm(x, model.dtype))  # [B, V]
    if snapshots is not None:
        # The rows naming a snapshot (at most DECODE_SNAPSHOTS: the planner's bound), so that the [rows, V] masks
        # read and written stay a few rows whatever the batch.
        (rows,) = jnp.nonzero(snapshot_ids > 0, size=DECODE_SNAPSHOTS, fill_value=0)  # [M]
        slots = batch.slot_ids[rows]
        seen = pools["prompt_mask"][slots] | (pools["output_counts"][slots] > 0)  # [M, V]
        seen, counts = jax.lax.optimization_barrier((seen, pools["output_counts"]))  # read before the sample's
        # in-place update of the counts, which XLA's CPU backend otherwise copies whole each step
        pools = {**pools, "output_counts": counts}
        masks = snapshots["prompt_mask"]
        for ids, mask in zip(snapshot_ids[rows], seen, strict=True):  # id 0 (none): the null snapshot's garbage
            masks = jax.lax.dynamic_update_slice(masks, mask[None], (ids, 0))  # in place, one row each
        snapshots = {**cache.updated_snapshots(), "prompt_mask": masks}
    return logits, {**pools, "layers": cache.updated}, snapshots


def decode_sample(pools: dict, logits: jax.Array, batch: DecodeBatch, grammar_masks: Callable[[], jax.Array], *,
                  valid_vocab: int, greedy_only: bool = False,
                  replicated: Sharding | None = None) -> tuple[Sampled, dict]:
    """A token for each row from its logits [B, V]; returns the samples and the pools with the output counts
    advanced. ``grammar_masks``: the rows' grammar bitmasks [B, ceil(V/32)] i32; ``replicated``: see
    `sampler.sample`."""
    counts = pools["output_counts"]
    sampled = sample(logits, batch.rows, counts[batch.slot_ids], pools["prompt_mask"][batch.slot_ids],
                     batch.want_top, valid_vocab, greedy_only=greedy_only, grammar_masks=grammar_masks,
                     replicated=replicated)
    counts = counts.at[batch.slot_ids, sampled.tokens].add(1)
    return sampled, {**pools, "output_counts": counts}


def decode_step(model: Qwen35ForCausalLM, pools: dict, snapshots: dict | None, batch: DecodeBatch,
                snapshot_ids: jax.Array | None, *, kernels: PagedKernels, page_size: int, valid_vocab: int,
                greedy_only: bool = False) -> tuple[Sampled, dict, dict | None]:
    """One token for each row, its grammar bitmask read from the pools; returns the samples, the new pools and
    the new snapshots (see `decode_logits`). ``greedy_only``: see `sample`."""
    logits, pools, snapshots = decode_logits(model, pools, batch, kernels=kernels, page_size=page_size,
                                             snapshots=snapshots, snapshot_ids=snapshot_ids)
    sampled, pools = decode_sample(pools, logits, batch, lambda: pools["grammar_mask"][batch.slot_ids],
                                   valid_vocab=valid_vocab, greedy_only=greedy_only, replicated=kernels.replicated)
    return sampled, pools, snapshots


def multi_decode_step(model: Qwen35ForCausalLM, pools: dict, snapshots: dict | None, batch: DecodeBatch,
                      snapshot_ids: jax.Array | None, *, num_steps: int, **kw) -> tuple[Sampled, dict, dict | None]:
    """``num_steps`` decode steps in one call, each feeding its samples to the next (no host round trip); step i
    writes the snapshots ``snapshot_ids[i]`` names ([num_steps, B], with a snapshot pool).

    Returns samples with a leading [num_steps] axis. Rows that finish early (eos, max_tokens) keep running
    on garbage that the engine discards; positions past their pages map to the null page.
    """
    def body(carry, ids):
        pools, snapshots, tokens, positions, step = carry
        sub = batch._replace(tokens=tokens, positions=positions, rows=batch.rows._replace(step=step))
        sampled, pools, snapshots = decode_step(model, pools, snapshots, sub, ids, **kw)
        return (pools, snapshots, sampled.tokens, positions + 1, step + 1), sampled

    carry = (pools, snapshots, batch.tokens, batch.positions, batch.rows.step)
    (pools, snapshots, *_), sampled = jax.lax.scan(body, carry, snapshot_ids, length=num_steps)
    return sampled, pools, snapshots


def write_grammar_masks(pools: dict, slot_ids: jax.Array, masks: jax.Array) -> dict:
    """Set the grammar bitmask of each slot: slot_ids [G] i32 (padding: 0, the null slot), masks [G, W] i32;
    returns the new pools."""
    return {**pools, "grammar_mask": pools["grammar_mask"].at[slot_ids].set(masks)}
