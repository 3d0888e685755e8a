"""A queued decode call and prefill's unread first tokens: what the engine loop holds between steps, and the
reads of their samples on the host."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.engine.requests import Request
from hybrid_jax.engine.sampler import Sampled
from hybrid_jax.engine.scheduler import Variant
from hybrid_jax.engine.steps import DecodeBatch

if TYPE_CHECKING:
    from hybrid_jax.engine.output_snapshots import PlannedSnapshot


class DecodeCall(NamedTuple):
    """A decode call queued on the device whose samples the host has not read yet."""

    requests: list[Request]  # rows 0.. of the batch
    variant: Variant
    sampled: Sampled  # device arrays with a leading [steps] axis
    next_batch: DecodeBatch  # on the device: the inputs of a call chained after this one (same requests)
    positions: np.ndarray | None = None  # [len(requests)] each row's input position at the first step (None:
    # not tracked, a grammar batch's sample)
    snapshots: list[PlannedSnapshot] | tuple = ()  # the output snapshots its steps write

    @property
    def steps(self) -> int:
        return self.variant[1]

    @property
    def size(self) -> int:
        """The call's batch bucket."""
        return self.next_batch.tokens.shape[0]


class PendingSample(NamedTuple):
    """A one-step decode call whose forward is queued and whose sample is not (see `Runner.launch_forward`)."""

    requests: list[Request]  # rows 0.. of the batch
    logits: jax.Array  # [B, V] f32 on the device
    batch: DecodeBatch  # the call's inputs


class FirstTokens(NamedTuple):
    """Prefill's samples for the requests whose prompts it finished, still on the device: the first decode call
    over them is queued before the host reads them."""

    requests: list[Request]
    rows: list[int]  # each request's row of ``sampled``
    sampled: Sampled  # device arrays [max_prefill_seqs]


def take_first_tokens(tokens: jax.Array, first_tokens: jax.Array, source: jax.Array) -> jax.Array:
    """``tokens`` [B] with each row whose ``source`` [B] is >= 0 replaced by ``first_tokens`` [S] at that index."""
    return jnp.where(source >= 0, first_tokens[jnp.maximum(source, 0)].astype(tokens.dtype), tokens)


def host_samples(sampled: Sampled, requests: list[Request]) -> Sampled:
    """``sampled`` copied to the host (numpy arrays); the top logprobs only when some request wants them."""
    want_top = any(r.params.logprobs for r in requests)
    return Sampled(np.asarray(sampled.tokens), np.asarray(sampled.logprob),
                   np.asarray(sampled.top_ids) if want_top else None,
                   np.asarray(sampled.top_logprobs) if want_top else None)
