"""From engine token events to completions: UTF-8-safe incremental text, stop strings, result records."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid_jax.engine.engine import TokenEvent
from hybrid_jax.engine.sampling_params import SamplingParams
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


class TextAssembler:
    """Turns one request's token events into text deltas, applying stop strings as vLLM does.

    Text that could still grow into a stop string is held back, so no delta ever has to be retracted;
    on a match the completion ends before the stop string (or after it, with include_stop_str_in_output).
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, index: int = 0):
        self.params = params
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.output = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self._held = ""
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
            delta = self._apply_stop(self._held + self.detok.add(event.token_id))
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

    def _apply_stop(self, text: str) -> str:
        stops = self.params.stop
        if not stops:
            self._held = ""
            return text
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            at, stop = min(hits)
            self.stopped_by_string = True
            self.output.finish_reason = "stop"
            self.output.stop_reason = stop
            self._held = ""
            return text[: at + len(stop)] if self.params.include_stop_str_in_output else text[:at]
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]
