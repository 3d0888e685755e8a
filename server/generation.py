"""The engine requests behind one API request: submission, merged token events, stop strings, cancellation, metrics.

Each choice (one sample of one prompt) is one engine request. Events of several choices are merged through
one queue by a forwarding thread per choice; each thread ends with its request's final event, which a
cancel always brings within one engine step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hybrid_jax.engine.engine import QueueFullError, RequestHandle, TokenEvent
from hybrid_jax.engine.output import CompletionOutput, TextAssembler
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.tokenizer import Tokenizer
from server.errors import from_value_error, unavailable
from server.metrics import ServerMetrics


@dataclass
class Choice:
    """One sample: its engine request, its text so far, and the token events it kept (for logprobs)."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    handle: RequestHandle
    assembler: TextAssembler
    tokens: list[TokenEvent] = field(default_factory=list)
    last_token_at: float | None = None

    @property
    def output(self) -> CompletionOutput:
        return self.assembler.output

    @property
    def finished(self) -> bool:
        return self.assembler.finished


class Generation:
    """Submit every (prompt ids, params) pair; iterate ``events()``; ``cancel()`` whatever is unfinished."""

    def __init__(self, engine, tokenizer: Tokenizer, metrics: ServerMetrics, prompts: list[list[int]], n: int,
                 params_for: Callable[[int], SamplingParams], cache_salt: str | None = None):
        """Choice ``i * n + j`` is sample j (params ``params_for(j)``) of prompt i; ``cache_salt``: the prefix
        cache salt of every choice."""
        self.metrics = metrics
        self.prompts = prompts
        self.arrival = time.monotonic()
        self.choices: list[Choice] = []
        self.abandoned = False
        try:
            for prompt_ids in prompts:
                for sample in range(n):
                    params = params_for(sample)
                    handle = engine.submit(prompt_ids, params, cache_salt=cache_salt)
                    index = len(self.choices)
                    self.choices.append(Choice(index, prompt_ids, params, handle,
                                               TextAssembler(tokenizer, params, index)))
        except QueueFullError as e:
            self.cancel()
            raise unavailable(f"the server is overloaded, try again later ({e})", 1) from e
        except ValueError as e:
            self.cancel()
            raise from_value_error(e) from e
        except BaseException:
            self.cancel()
            raise

    def events(self) -> Iterator[tuple[Choice, TokenEvent, str]]:
        """(choice, event, text delta) as the engine produces them, until every choice has finished."""
        pending = len(self.choices)
        for index, event in self._merged():
            if self.abandoned:  # nobody reads the rest: leave it to the engine's cancellation
                return
            choice = self.choices[index]
            if choice.finished:  # the rest of a request stopped by a stop string
                continue
            delta = self._add(choice, event)
            yield choice, event, delta
            if choice.finished:
                pending -= 1
                if not pending:
                    return

    def cancel(self) -> None:
        """Cancel every unfinished choice (the engine frees its slot and pages within one step)."""
        for choice in self.choices:
            if not choice.finished:
                choice.handle.cancel()
                choice.output.finish_reason = "abort"
                self.metrics.finished("abort", time.monotonic() - self.arrival)

    def abandon(self) -> None:
        """Cancel the engine requests from another thread; ``events()`` then ends at its next event."""
        self.abandoned = True
        for choice in self.choices:
            choice.handle.cancel()

    def _merged(self) -> Iterator[tuple[int, TokenEvent]]:
        if len(self.choices) == 1:
            return ((0, event) for event in self.choices[0].handle)
        merged: queue.SimpleQueue = queue.SimpleQueue()

        def forward(index: int, handle: RequestHandle) -> None:
            for event in handle:
                merged.put((index, event))

        for choice in self.choices:
            threading.Thread(target=forward, args=(choice.index, choice.handle), daemon=True).start()
        return iter(merged.get, None)

    def _add(self, choice: Choice, event: TokenEvent) -> str:
        if event.token_id is not None:
            choice.tokens.append(event)
            if choice.last_token_at is None:
                self.metrics.first_token(event.time - self.arrival)
            else:
                self.metrics.next_token(event.time - choice.last_token_at)
            choice.last_token_at = event.time
        delta = choice.assembler.add(event)
        if choice.assembler.stopped_by_string:
            choice.handle.cancel()
        if choice.finished:
            self.metrics.finished(choice.output.finish_reason, time.monotonic() - self.arrival)
        return delta

    @property
    def failed(self) -> bool:
        return any(c.output.finish_reason == "error" for c in self.choices)

    @staticmethod
    def choice_usage(choice: Choice) -> dict[str, int]:
        """One choice's usage so far (a stream's continuous usage stats)."""
        prompt, completion = len(choice.prompt_ids), len(choice.output.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage(self) -> dict[str, int]:
        """OpenAI usage: each prompt counted once (however many samples), every sample's tokens; the prompt
        tokens the prefix cache supplied, counted once per prompt (its first sample's)."""
        prompt = sum(len(ids) for ids in self.prompts)
        completion = sum(len(c.output.token_ids) for c in self.choices)
        n = len(self.choices) // max(len(self.prompts), 1)
        cached = sum(c.handle.num_cached_tokens for c in self.choices[::n]) if n else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}
