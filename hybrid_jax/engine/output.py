"""From engine token events to completions: UTF-8-safe incremental text, stop strings, result records."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid_jax.engine.engine import TokenEvent
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.engine.stop_strings import StopMatcher
from hybrid_jax.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per token: {id: logprob}, sampled token first
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (None for the first)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache


class TextAssembler:
    """Turns one request's token events into text deltas, applying stop strings as vLLM does.

    Text that could still grow into a stop string is held back, so no delta ever has to be retracted;
    on a match the completion ends before the stop string (or after it, with include_stop_str_in_output).
    The first stop string to complete wins (the longest, of those completing at the same character); the
    work per delta is linear in the delta, whatever the stop strings' lengths.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, index: int = 0):
        self.params = params
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.output = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self._held = ""
        self._stops = StopMatcher(params.stop) if params.stop else None
        self.stopped_by_string = False

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None

    def add(self, event: TokenEvent) -> str:
        """Consume one event; returns the text delta to emit (possibly empty)."""
        if self.finished:
            return ""
        out = self.output
        delta = ""
        if event.token_id is not None:
            out.token_ids.append(event.token_id)
            if out.logprobs is not None:
                entry = {event.token_id: event.logprob}
                entry.update(dict(event.top_logprobs or []))
                out.logprobs.append(entry)
            delta = self._apply_stop(self.detok.add(event.token_id))
        if self.stopped_by_string:
            return self._emit(delta)
        if event.finish_reason is not None:
            out.finish_reason = event.finish_reason
            if event.finish_reason == "stop" and event.token_id is not None:
                out.stop_reason = None if event.token_id in self._eos_like() else event.token_id
            delta += self._held + self.detok.flush()
            self._held = ""
        return self._emit(delta)

    def _eos_like(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids) - set(self.params.stop_token_ids)

    def _emit(self, delta: str) -> str:
        self.output.text += delta
        return delta

    def _stop_in(self, new: str) -> tuple[int, str] | None:
        """The first stop string completed in ``new`` (its end there, the string); as vLLM, none completes
        before more than min_tokens tokens are out."""
        start = 0
        while (hit := self._stops.feed(new[start:])) is not None:
            end = start + hit[0]
            if len(self.output.token_ids) > self.params.min_tokens:
                return end, hit[1]
            start = end
        return None

    def _apply_stop(self, new: str) -> str:
        """The releasable part of the held text plus ``new``; holds back what may begin a stop string."""
        text = self._held + new
        if self._stops is None:
            self._held = ""
            return text
        hit = self._stop_in(new)
        if hit is not None:
            end, stop = hit
            end += len(self._held)  # where the match ends in ``text``
            self.stopped_by_string = True
            self.output.finish_reason = "stop"
            self.output.stop_reason = stop
            self._held = ""
            return text[:end] if self.params.include_stop_str_in_output else text[: end - len(stop)]
        hold = min(self._stops.partial, len(text))
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]
