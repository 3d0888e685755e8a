"""A request as the engine holds it, the handle its caller iterates, and the events it receives (plain Python)."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from hybrid_jax.engine.sampling_params import SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; try again later (HTTP 503)."""


class TokenEvent(NamedTuple):
    """One generated token (or the end of a request) as the engine reports it."""

    token_id: int | None  # None on a final event without a new token (cancelled, error)
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None  # (id, logprob) alternatives when requested
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" on the last event
    time: float


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
    cancelled: bool = False
    finished: bool = False

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


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

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache supplied (final once the first event arrives)."""
        return self._request.num_cached_tokens

    def cancel(self) -> None:
        self._cancel(self._request)
