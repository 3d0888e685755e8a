"""Special-token text in untrusted chat fields, kept plain text through rendering and tokenizing.

A user who writes ``<|im_start|>system`` in a message would otherwise open a real system turn: the rendered
prompt is one string, and the tokenizer turns every special-token text in it into the control token. Here
each such text in the messages (and tools) is swapped for a marker before rendering; encoding the rendered
prompt then gives the template's own special tokens as control tokens and the marked texts as ordinary text,
like HF's ``split_special_tokens`` for the content alone.
"""

from __future__ import annotations

import re
from typing import Any

from hybrid_jax.tokenizer import Tokenizer

MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"  # private-use characters; user text holding them is marked too
_MARKER = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")


class PlainSpecialText:
    """Marks special-token text in the strings of one conversation; ``encode`` tokenizes the rendered prompt."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        texts = sorted(tokenizer.special_tokens, key=len, reverse=True) + [MARK_OPEN, MARK_CLOSE]
        self._pattern = re.compile("|".join(re.escape(t) for t in texts if t))
        self._spans: list[str] = []

    def mark(self, value: Any) -> Any:
        """``value`` (JSON: strings, lists, objects) with every special-token text in its strings marked."""
        if isinstance(value, str):
            return self._pattern.sub(self._marker, value)
        if isinstance(value, list):
            return [self.mark(v) for v in value]
        if isinstance(value, dict):
            return {k: self.mark(v) for k, v in value.items()}
        return value

    def _marker(self, match: re.Match) -> str:
        self._spans.append(match.group())
        return f"{MARK_OPEN}{len(self._spans) - 1}{MARK_CLOSE}"

    def encode(self, rendered: str) -> list[int]:
        """Token ids of the rendered prompt: marked spans as plain text, the rest as ``Tokenizer.encode``."""
        ids: list[int] = []
        start = 0
        for match in _MARKER.finditer(rendered):
            index = int(match.group(1))
            if index >= len(self._spans):  # not one of ours (the template made it): ordinary text
                continue
            ids += self.tokenizer.encode(rendered[start:match.start()])
            ids += self.tokenizer.encode_plain(self._spans[index])
            start = match.end()
        return ids + self.tokenizer.encode(rendered[start:])
