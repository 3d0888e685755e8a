"""The engine's steps jitted once over its model and placement: prefill, decode by variant, the decode forward
and sample apart, the grammar-mask write and the first-token take. Each takes the weights
as one flat tuple and donates the pools (and a decode call its batch: the next call's inputs, made on the
device, come back in its buffers)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.caches.paged import PagedKernels
from hybrid_jax.config import Qwen35Config
from hybrid_jax.engine.calls import take_first_tokens
from hybrid_jax.engine.packing import Packed, unpack
from hybrid_jax.engine.placement import Placement
from hybrid_jax.engine.sampler import Sampled
from hybrid_jax.engine.steps import (
    DecodeBatch,
    decode_logits,
    decode_sample,
    decode_step,
    multi_decode_step,
    prefill_step,
    write_grammar_masks,
)


def with_history(batch: DecodeBatch) -> DecodeBatch:
    """``batch`` with its input tokens appended to the constrained rows' output history (what bad words are matched
    against), on the device: the host may not have them (only constrained rows keep one)."""
    constraints = batch.rows.constraints
    shifted = jnp.concatenate([constraints.recent[:, 1:], batch.tokens[:, None]], axis=1)  # [B, HISTORY]
    recent = jnp.where(constraints.constrained[:, None], shifted, constraints.recent)
    return batch._replace(rows=batch.rows._replace(constraints=constraints._replace(recent=recent)))


def next_batch(batch: DecodeBatch, sampled: Sampled) -> DecodeBatch:
    """The inputs of the next call over the same requests, made on the device (its tokens the last samples
    [steps, B], positions and sampling steps advanced): a chained call needs no host-side array op and no
    host-to-device copy."""
    real = batch.slot_ids > 0  # [B] padding rows stay as the host pads them
    advance = lambda x: jnp.where(real, x + sampled.tokens.shape[0], x)
    return batch._replace(tokens=jnp.where(real, sampled.tokens[-1], 0), positions=advance(batch.positions),
                          rows=batch.rows._replace(step=advance(batch.rows.step)))


class JittedSteps:
    """The jitted steps of one engine (not compiled: `Programs` compiles them per shape bucket)."""

    def __init__(self, config: Qwen35Config, graphdef, weights_def, weights: tuple[jax.Array, ...],
                 placement: Placement, *, page_size: int, valid_vocab: int, decode_steps: int):
        self._graphdef, self._weights_def, self.valid_vocab = graphdef, weights_def, valid_vocab
        mesh, pools, snapshots, batch = placement.mesh, placement.pools, placement.snapshots, placement.batch
        step_kw = dict(kernels=PagedKernels(config, mesh), page_size=page_size, valid_vocab=valid_vocab)
        prefill_kw = dict(donate_argnums=(1, 2))  # the pools and the snapshots
        decode_kw = dict(donate_argnums=(1, 2, 3))  # the pools, the snapshots and the batch
        mask_kw = dict(donate_argnums=0)
        if mesh is not None:
            # Every program's inputs and outputs pinned: the batch and the samples replicated, the pools as planned,
            # so a chained decode call's batch (the previous call's output) has the sharding the warm-up compiled
            # for (and the runner places the host's batch the same way: the same input type).
            weight_shardings = tuple(w.sharding for w in weights)
            prefill_kw = dict(prefill_kw, in_shardings=(weight_shardings, pools, snapshots, batch),
                              out_shardings=(batch, pools, snapshots))
            decode_kw = dict(decode_kw, in_shardings=(weight_shardings, pools, snapshots, batch, batch),
                             out_shardings=(batch, batch, pools, snapshots))
            mask_kw = dict(mask_kw, in_shardings=(pools, batch, batch), out_shardings=pools)
        # By greedy_only: a step whose rows all sample greedily skips the filters' sort and the top logprobs.
        self.prefill = {greedy: jax.jit(partial(self._run_prefill, greedy_only=greedy, **step_kw), **prefill_kw)
                        for greedy in (False, True)}
        # By variant (greedy_only, steps per call); several steps per call only for greedy batches.
        self.decode = {(greedy, 1): jax.jit(partial(self._run_decode_step, decode_step, greedy_only=greedy,
                                                    **step_kw), **decode_kw) for greedy in (False, True)}
        if decode_steps > 1:
            self.decode[True, decode_steps] = jax.jit(
                partial(self._run_decode_step, multi_decode_step, num_steps=decode_steps, greedy_only=True,
                        **step_kw), **decode_kw)
        # The decode forward and its sample apart, for grammar rows (the host computes their masks while the
        # forward runs); none under a mesh, where grammar rows take the whole decode step.
        self.split_decode = None
        if mesh is None:
            forward = jax.jit(partial(self._run_forward, kernels=step_kw["kernels"], page_size=page_size),
                              donate_argnums=1)
            self.split_decode = forward, jax.jit(self._run_sample, donate_argnums=(0, 2))
        self.write_masks = jax.jit(write_grammar_masks, **mask_kw)
        self.take_first_tokens = jax.jit(take_first_tokens)

    def _run(self, step, weights: tuple[jax.Array, ...], *args, **kw):
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._weights_def, weights))
        return step(model, *args, **kw)

    def _run_prefill(self, weights: tuple[jax.Array, ...], pools, snapshots, batch: Packed, **kw):
        """A prefill call over its packed batch (`batches.prefill_batch`)."""
        return self._run(prefill_step, weights, pools, snapshots, unpack(batch), **kw)

    def _run_decode_step(self, step, weights: tuple[jax.Array, ...], pools, snapshots, batch: DecodeBatch,
                         snapshot_ids, **kw):
        """A decode call: samples with a leading [steps] axis, the inputs of the next call over the same requests
        (`next_batch`), the pools and the snapshots (those snapshot_ids [steps, B] names written; None without
        a snapshot pool)."""
        batch = with_history(batch)
        if step is decode_step and snapshot_ids is not None:
            snapshot_ids = snapshot_ids[0]
        sampled, pools, snapshots = self._run(step, weights, pools, snapshots, batch, snapshot_ids, **kw)
        if sampled.tokens.ndim == 1:
            sampled = jax.tree.map(lambda x: x[None], sampled)
        return sampled, next_batch(batch, sampled), pools, snapshots

    def _run_forward(self, weights: tuple[jax.Array, ...], pools, batch: DecodeBatch, **kw):
        """The decode forward (no snapshots): logits and the pools."""
        logits, pools, _ = self._run(decode_logits, weights, pools, batch, **kw)
        return logits, pools

    def _run_sample(self, pools, logits: jax.Array, batch: DecodeBatch, masks: jax.Array, masked: jax.Array):
        """`decode_sample` over logits [B, V] with the host's grammar bitmasks masks [B, W] i32 applied in the rows
        ``masked`` [B] bool (they override the batch's grammar flags: a chained batch's may be a step old); the
        samples, the next call's inputs and the pools, as `_run_decode_step`."""
        c = batch.rows.constraints
        constraints = c._replace(grammar=masked, constrained=c.constrained | masked)
        batch = with_history(batch._replace(rows=batch.rows._replace(constraints=constraints)))
        sampled, pools = decode_sample(pools, logits, batch, lambda: masks, valid_vocab=self.valid_vocab)
        sampled = jax.tree.map(lambda x: x[None], sampled)
        return sampled, next_batch(batch, sampled), pools
