"""Token constraints as the sampler's fixed-shape rows, built on the host (plain Python and numpy).

One row per request: its ``logit_bias`` as (token, bias) pairs, its ``allowed_token_ids``, a table of bans (each
bad word's last token with the tokens that must precede it, and the eos and stop tokens held back until
``min_tokens``), its last output tokens (what a ban's prefix is matched against), the thinking budget's forced
end token, and whether its grammar's bitmask (kept in the pools, see `grammar`) applies. Unused entries hold
``NO_TOKEN``, an id past any vocabulary that the device's scatters drop, so a row without constraints is all
padding and costs the sampler nothing (`sampler.sample` skips the constraints unless some row of the batch has
them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hybrid_jax.engine.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_MIN_TOKENS_STOPS,
)

if TYPE_CHECKING:
    from hybrid_jax.engine.requests import Request

NO_TOKEN = 1 << 30  # an id past any vocabulary: an unused entry (scattered nowhere)
NO_OUTPUT = -1  # in ``recent``: before the first output token; in ``ban_prefix``: no token required there
FOREVER = 2**31 - 1  # a ban's ``until`` that never passes
BAN_ROWS = MAX_BAD_WORDS + MAX_MIN_TOKENS_STOPS  # bad words first, then the min_tokens stops
HISTORY = MAX_BAD_WORD_TOKENS - 1  # output tokens a ban's prefix can span


class TokenConstraints(NamedTuple):
    """The constraints of B rows (a field of `sampler.SamplingRows`)."""

    constrained: np.ndarray  # [B] bool the row has any of the constraints below
    bias_ids: np.ndarray  # [B, MAX_LOGIT_BIAS] i32 logit_bias tokens
    bias_values: np.ndarray  # [B, MAX_LOGIT_BIAS] f32 added to those tokens' logits
    allowed_ids: np.ndarray  # [B, MAX_ALLOWED_TOKEN_IDS] i32 the only tokens the row may sample (all NO_TOKEN: any)
    ban_prefix: np.ndarray  # [B, BAN_ROWS, HISTORY] i32 the tokens that must precede a ban's token, right-aligned
    ban_token: np.ndarray  # [B, BAN_ROWS] i32 the banned token
    ban_until: np.ndarray  # [B, BAN_ROWS] i32 the ban holds while the row has sampled fewer tokens than this
    recent: np.ndarray  # [B, HISTORY] i32 the output tokens before the row's input token, right-aligned
    force_token: np.ndarray  # [B] i32 sampled once ``force_at`` tokens are out, unless already generated
    force_at: np.ndarray  # [B] i32
    grammar: np.ndarray  # [B] bool the row's grammar bitmask (the pools' grammar_mask at its slot) applies


def no_constraints(size: int) -> TokenConstraints:
    """Rows of padding: nothing constrained."""
    full = lambda shape, value: np.full(shape, value, np.int32)
    return TokenConstraints(
        constrained=np.zeros(size, np.bool_), bias_ids=full((size, MAX_LOGIT_BIAS), NO_TOKEN),
        bias_values=np.zeros((size, MAX_LOGIT_BIAS), np.float32),
        allowed_ids=full((size, MAX_ALLOWED_TOKEN_IDS), NO_TOKEN),
        ban_prefix=full((size, BAN_ROWS, HISTORY), NO_OUTPUT), ban_token=full((size, BAN_ROWS), NO_TOKEN),
        ban_until=full((size, BAN_ROWS), FOREVER), recent=full((size, HISTORY), NO_OUTPUT),
        force_token=full(size, NO_TOKEN), force_at=full(size, FOREVER), grammar=np.zeros(size, np.bool_))


def constraint_rows(requests: Sequence[Request], size: int, input_known: Sequence[bool] | None = None
                    ) -> TokenConstraints:
    """The constraints of ``requests`` padded to ``size`` rows. ``input_known`` [len(requests)]: whether the
    host has the request's input token (its last output, in a decode batch); None: a prefill batch."""
    rows = no_constraints(size)
    for i, r in enumerate(requests):
        if not r.constrained:
            continue
        p = r.params
        rows.constrained[i] = True
        bias = p.logit_bias or {}
        rows.bias_ids[i, : len(bias)] = list(bias)
        rows.bias_values[i, : len(bias)] = list(bias.values())
        allowed = p.allowed_token_ids or []
        rows.allowed_ids[i, : len(allowed)] = allowed
        for w, sequence in enumerate(p.bad_words_token_ids):
            prefix = sequence[:-1]
            rows.ban_token[i, w] = sequence[-1]
            rows.ban_prefix[i, w, HISTORY - len(prefix):] = prefix
        if len(r.output_ids) < p.min_tokens:
            stops = slice(MAX_BAD_WORDS, MAX_BAD_WORDS + len(r.min_tokens_stops))
            rows.ban_token[i, stops] = r.min_tokens_stops
            rows.ban_until[i, stops] = p.min_tokens
        before_input = r.output_ids[:-1] if input_known is not None and input_known[i] else r.output_ids
        history = before_input[-HISTORY:]
        rows.recent[i, HISTORY - len(history):] = history
        if r.thinking_end is not None:
            rows.force_token[i], rows.force_at[i] = r.thinking_end
        rows.grammar[i] = r.grammar_active
    return rows
