"""Structured outputs on the host: grammars compiled with llguidance, a matcher per request, and the vocabulary
bitmasks the sampler applies (plain Python and numpy; no JAX).

`GrammarCompiler.compile` turns a request's `StructuredOutputsParams` into a matcher on the caller's thread
(never the engine's), bounded in time, with compiled grammars kept in an LRU cache (a hit costs a copy of the
cached matcher in its start state). A `GrammarState` follows one request's output: while the think block its
prompt opens is still open it constrains nothing; from the end-of-think token on, its matcher consumes every
token and `fill_masks` writes the next token's bitmask (bit ``t % 32`` of word ``t // 32``: token ``t`` is
allowed), one row per request, computed in parallel by llguidance's executor.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import numpy as np

from hybrid_jax.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from hybrid_jax.tokenizer import Tokenizer

COMPILE_TIMEOUT_S = 5.0  # a grammar that takes longer to compile is refused
CACHE_SIZE = 256  # compiled grammars kept
MAX_ERROR_CHARS = 400  # of llguidance's error message in the ValueError


class GrammarError(ValueError):
    """The grammar (schema, regex, ...) is invalid or too costly; the message names no field."""


def mask_words(vocab: int) -> int:
    """int32 words of one row's bitmask over ``vocab`` tokens."""
    return -(-vocab // 32)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``spec`` (not checked yet: `GrammarCompiler.compile` does)."""
    import llguidance

    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    try:
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if spec.regex is not None:
            return llguidance.grammar_from("regex", spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(str(e)[:MAX_ERROR_CHARS]) from e


class GrammarCompiler:
    """Compiles grammars for one tokenizer (llguidance's view of it is built on first use: about 3 s for
    Qwen3.5's vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos_token_ids: Sequence[int],
                 timeout_s: float = COMPILE_TIMEOUT_S, cache_size: int = CACHE_SIZE):
        """``vocab``: the model's (padded) vocabulary: mask rows cover it, ids past the tokenizer's never allowed."""
        self._tokenizer, self.vocab, self._eos = tokenizer, vocab, list(eos_token_ids)
        self.timeout_s, self.cache_size = timeout_s, cache_size
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="hybrid-jax-grammar")

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                import llguidance

                # An llguidance without LLTokenizer.eos_tokens (1.6.1, its newest manylinux_2_28 wheel) takes one
                # eos token: the first, which a complete output may end with; the others stay outside grammars.
                several = hasattr(llguidance.LLTokenizer, "eos_tokens")
                eos = self._eos if several or not self._eos else self._eos[0]
                self._ll = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab,
                                                  eos_token=eos)
            return self._ll

    @property
    def end_tokens(self) -> set[int]:
        """The eos tokens a complete output may end with."""
        tokenizer = self._llguidance_tokenizer()
        return set(getattr(tokenizer, "eos_tokens", [tokenizer.eos_token]))

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec``; GrammarError when the grammar is invalid or its compile takes longer
        than ``timeout_s`` (it finishes in the background, bounded by llguidance's own limits, and is cached)."""
        text = grammar_text(spec)
        self._llguidance_tokenizer()  # once, outside the compile's time bound
        with self._lock:
            cached = self._cache.get(text)
            if cached is not None:
                self._cache.move_to_end(text)
                return cached.deep_copy()
        future = self._pool.submit(self._build, text)
        try:
            matcher = future.result(timeout=self.timeout_s)
        except FutureTimeout as e:
            raise GrammarError(f"the grammar took longer than {self.timeout_s:g} s to compile") from e
        return matcher.deep_copy()

    def _build(self, text: str) -> llguidance.LLMatcher:
        import llguidance

        tokenizer = self._llguidance_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0,
                                       limits=llguidance.LLParserLimits(verbose_errors=False))
        if matcher.is_error():
            raise GrammarError(matcher.get_error()[:MAX_ERROR_CHARS])
        with self._lock:
            self._cache[text] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher


class GrammarState:
    """One request's grammar: its matcher, and whether the think block before it is still open."""

    def __init__(self, matcher: llguidance.LLMatcher, think_end: int | None = None):
        """``think_end``: the token closing the think block the prompt opens (None: the grammar starts at once)."""
        self.matcher, self.think_end = matcher, think_end

    @property
    def active(self) -> bool:
        """The next token is constrained (the think block, if any, is closed)."""
        return self.think_end is None

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar rejects it."""
        if self.think_end is not None:
            if token == self.think_end:
                self.think_end = None
            return True
        return self.matcher.consume_token(token)

    @property
    def error(self) -> str:
        return self.matcher.get_error()[:MAX_ERROR_CHARS]


_executor: llguidance.LLExecutor | None = None


def fill_masks(states: Sequence[GrammarState], out: np.ndarray, rows: Sequence[int] | None = None) -> None:
    """Write each active state's next-token bitmask into ``out`` [rows, words] int32 (C-contiguous), in
    parallel: state i into row ``rows[i]`` (default: row i)."""
    global _executor
    import llguidance
    from llguidance.numpy import fill_next_token_bitmask_par

    if not states:
        return
    if _executor is None:
        _executor = llguidance.LLExecutor()
    rows = range(len(states)) if rows is None else rows
    fill_next_token_bitmask_par(_executor, [(s.matcher, i) for s, i in zip(states, rows, strict=True)], out)
