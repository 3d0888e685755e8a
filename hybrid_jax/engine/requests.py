"""A request as the engine holds it, the handle its caller iterates, and the events it receives (plain Python)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from hybrid_jax.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybrid_jax.engine.grammar import GrammarState


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; try again later (HTTP 503)."""


class TokenEvent(NamedTuple):
    """One generated token (or the end of a request) as the engine reports it."""

    token_id: int | None  # None on a final event without a new token (cancelled, error)
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None  # (id, logprob) alternatives when requested
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" on the last event
    time: float  # time.monotonic() when the engine handed it out


class PromptLogprob(NamedTuple):
    """One prompt token's log-probability given the tokens before it."""

    logprob: float
    rank: int  # 1 + the tokens more likely than it
    top: list[tuple[int, float]]  # (id, logprob) of the most likely tokens there, most likely first


class ThinkingEnd(NamedTuple):
    """The thinking budget of a request whose prompt leaves a think block open."""

    token_id: int  # the block's end token, forced ...
    after: int  # ... once this many tokens are out, unless generated before


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    output_ids: list[int] = field(default_factory=list)
    slot: int = 0
    pages: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    blocks: list = field(default_factory=list)  # the prefix cache's blocks of the prompt it holds, in order
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not prefilled)
    snapshot_plan: list = field(default_factory=list)  # (boundary, snapshot id) the next prefill step writes
    restore_from: int = 0  # a hit's snapshot, the slot's state at its first prefill step (0: none, or read)
    cancelled: bool = False
    fill: bool = False  # made by the scheduler to cache another request's tokens: prefilled, never sampled
    cache_salt: str | None = None  # prefix cache blocks are shared only with requests of the same salt
    finished: bool = False
    min_tokens_stops: tuple[int, ...] = ()  # the eos and stop tokens held back until min_tokens
    thinking_end: ThinkingEnd | None = None  # cleared once the end token is out
    grammar: GrammarState | None = None  # params.structured_outputs' matcher; dropped when the request ends
    # Prompt logprobs (with params.prompt_logprobs): None for the first token; set before any event is queued.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    scored: threading.Event = field(default_factory=threading.Event)  # set once prompt_logprobs is final

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def constrained(self) -> bool:
        """Whether the request's next tokens need the general sampler's token constraints."""
        p = self.params
        return bool(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids or self.thinking_end is not None
                    or len(self.output_ids) < p.min_tokens or self.grammar_active)

    @property
    def grammar_active(self) -> bool:
        """The request's next token is masked by its grammar."""
        return self.grammar is not None and self.grammar.active


class RequestHandle:
    """What ``submit`` returns: iterate to receive TokenEvents; ``cancel`` to stop early and free the cache."""

    def __init__(self, request: Request, cancel: Callable[[Request], None]):
        self._request, self._cancel = request, cancel
        self.request_id = request.request_id

    def __iter__(self):
        while True:
            event = self._request.events.get()
            yield event
            if event.finish_reason is not None:
                return

    def prompt_logprobs(self) -> list[PromptLogprob | None] | None:
        """The prompt's logprobs (None unless the params ask for them, or the request ended before they were
        computed); waits until the engine has them."""
        if self._request.params.prompt_logprobs is None:
            return None
        self._request.scored.wait()
        return self._request.prompt_logprobs

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache supplied (final once the first event arrives)."""
        return self._request.num_cached_tokens

    def cancel(self) -> None:
        self._cancel(self._request)
