"""Fills (plain Python): prefill-only requests that cache a finished request's prompt + output up to its last
block boundary, with the state there, so a chat's next turn resumes after the answer.

A fill starts only once the engine has had nothing to wait for or run for ``delay_s``: a client that sends its
next request at once never waits behind one, and a request arriving during one waits a prefill step. Only
the newest few are kept; the newest starts first.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from hybrid_jax.engine.requests import Request
from hybrid_jax.engine.sampling_params import SamplingParams

MAX_PENDING = 4  # fills kept while the engine is busy (older ones are dropped)
DELAY_S = 0.05  # the engine idles this long before a fill starts


class Fills:
    def __init__(self, block_size: int, delay_s: float = DELAY_S):
        self.block_size, self.delay_s = block_size, delay_s
        self.pending: deque[Request] = deque(maxlen=MAX_PENDING)
        self._idle_since = 0.0  # when the engine's last request ended (every way to idle goes through an end)

    def plan(self, r: Request, cached: Callable[[list[int], str | None], bool]) -> None:
        """Keep a fill of finished ``r``'s tokens up to their last block boundary when its output crossed one that
        is not ``cached`` yet (decode's snapshots cache most)."""
        tokens, b = r.prompt_ids + r.output_ids, self.block_size
        end = len(tokens) // b * b
        if end > len(r.prompt_ids) // b * b and not cached(tokens[:end], r.cache_salt):
            self.pending.append(Request(f"{r.request_id}-fill", tokens[:end], SamplingParams(max_tokens=1), 0,
                                        fill=True, cache_salt=r.cache_salt))

    def request_ended(self) -> None:
        """A request (or fill) ended now: should the engine be idle, its idle time starts here."""
        self._idle_since = time.monotonic()

    def wait(self) -> float | None:
        """Seconds until the newest fill may start (None: none is pending)."""
        if not self.pending:
            return None
        return max(0.0, self._idle_since + self.delay_s - time.monotonic())

    def take(self) -> Request | None:
        """The newest fill, when it may start now."""
        return self.pending.pop() if self.wait() == 0 else None
