"""Split Qwen3.5 output into reasoning and answer at </think> (the behaviour of vLLM's `qwen3` parser).

With thinking on, the prompt already ends with "<think>\\n", so the output starts with the reasoning. Reasoning is
stripped of surrounding whitespace and the answer of leading whitespace; empty parts are reported as None.
"""

from __future__ import annotations

import re

THINK_START = "<think>"
THINK_END = "</think>"

_EMPTY_THINK = re.compile(r"\s*<think>\s*</think>")


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a complete output."""
    if not thinking:
        match = _EMPTY_THINK.match(text)
        content = text[match.end() :].lstrip() if match else text
        return None, content or None
    if text.lstrip().startswith(THINK_START):
        text = text.lstrip()[len(THINK_START) :]
    reasoning, found, content = text.partition(THINK_END)
    return reasoning.strip() or None, (content.lstrip() if found else "") or None


def _could_open_with(text: str, tags: tuple[str, ...]) -> bool:
    """Whether more text could make `text` start with the tags (each after optional whitespace)."""
    for tag in tags:
        text = text.lstrip()
        if len(text) <= len(tag):
            return tag.startswith(text)
        if not text.startswith(tag):
            return False
        text = text[len(tag) :]
    return True


def _held_back(text: str) -> int:
    """Length of the suffix that may be a partial </think> or whitespace before one."""
    partial = next((n for n in range(len(THINK_END) - 1, 0, -1) if text.endswith(THINK_END[:n])), 0)
    body = text[: len(text) - partial]
    return partial + len(body) - len(body.rstrip())


class ReasoningStreamer:
    """Incremental split_reasoning: the deltas concatenate to its result and never show a partial tag."""

    def __init__(self, thinking: bool):
        self._thinking = thinking
        self._buffer = ""
        self._state = "start"  # start -> reasoning -> content (or start -> content)
        self._strip_lead = thinking  # strip leading whitespace of the current part until text arrives

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning_delta, content_delta) for the next piece of generated text."""
        self._buffer += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of generation."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        if self._state == "start" and not self._leave_start(final):
            return "", ""
        reasoning = self._take_reasoning(final) if self._state == "reasoning" else ""
        content = self._take(len(self._buffer)) if self._state == "content" else ""
        return reasoning, content

    def _leave_start(self, final: bool) -> bool:
        """Drop an opening <think> (thinking) or empty think block (no thinking) once it can be decided."""
        if self._thinking:
            stripped = self._buffer.lstrip()
            if stripped.startswith(THINK_START):
                self._buffer = stripped[len(THINK_START) :]
            elif not final and _could_open_with(self._buffer, (THINK_START,)):
                return False
            self._state = "reasoning"
            return True
        match = _EMPTY_THINK.match(self._buffer)
        if match:
            self._buffer = self._buffer[match.end() :]
            self._strip_lead = True
        elif not final and _could_open_with(self._buffer, (THINK_START, THINK_END)):
            return False
        self._state = "content"
        return True

    def _take_reasoning(self, final: bool) -> str:
        end = self._buffer.find(THINK_END)
        if end >= 0:
            reasoning = self._take(end).rstrip()
            self._buffer = self._buffer[len(THINK_END) :]
            self._state, self._strip_lead = "content", True
            return reasoning
        if final:
            return self._take(len(self._buffer)).rstrip()
        return self._take(len(self._buffer) - _held_back(self._buffer))

    def _take(self, n: int) -> str:
        """Remove and return the first n buffered characters, dropping leading whitespace if pending."""
        text, self._buffer = self._buffer[:n], self._buffer[n:]
        if self._strip_lead:
            text = text.lstrip()
            self._strip_lead = not text
        return text
