"""Per-request sampling settings, with vLLM's names and defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_LOGPROBS = 20
# The token constraints travel to the device as fixed-shape rows (see `constraints`): these bound each request.
MAX_LOGIT_BIAS = 128  # logit_bias entries
MAX_ALLOWED_TOKEN_IDS = 128
MAX_BAD_WORDS = 16  # token sequences of bad_words (a word and its space-prefixed form may both count)
MAX_BAD_WORD_TOKENS = 8  # tokens in one bad word's sequence
MAX_MIN_TOKENS_STOPS = 16  # eos and stop_token_ids held back until min_tokens
LOGIT_BIAS_RANGE = (-100.0, 100.0)


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's `StructuredOutputsParams`): exactly one of a JSON schema (``json``, a
    dict or its text), any JSON object (``json_object``), a regular expression, a choice of strings, or a grammar
    (Lark, or GBNF/EBNF, as llguidance reads them). ``disable_any_whitespace``: JSON without free whitespace."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        self.validate()

    @property
    def kind(self) -> str:
        """The one constraint given: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))

    def validate(self) -> None:
        """Raise ValueError (on ``structured_outputs``) unless exactly one well-typed constraint is given."""
        given = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar or json_object must "
                             f"be given, got {len(given)}{' (' + ', '.join(given) + ')' if given else ''}")
        types = {"json": (str, dict), "regex": str, "grammar": str, "json_object": bool}
        kind = given[0]
        if kind == "choice":
            if not (isinstance(self.choice, list) and self.choice and all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs: choice must be a non-empty list of strings")
        elif not isinstance(getattr(self, kind), types[kind]):
            raise ValueError(f"structured_outputs: {kind} has the wrong type")
        if kind in ("regex", "grammar") and not getattr(self, kind):
            raise ValueError(f"structured_outputs: {kind} must not be empty")


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    """How to sample one completion. ``temperature == 0`` is greedy; ``top_k`` <= 0 means no top-k.

    Token constraints (vLLM's): ``logit_bias`` adds to the given tokens' logits; ``allowed_token_ids`` restricts
    sampling to those tokens; ``bad_words`` are never generated (each word's token sequences, from
    `update_from_tokenizer`, in ``bad_words_token_ids``: the last token of a sequence is banned where the output
    ends with the ones before it); eos and stop tokens are held back until ``min_tokens`` tokens are out.
    ``thinking_token_budget``: where the prompt leaves a think block open, its end token is forced after that
    many output tokens. ``structured_outputs``: the output matches a grammar (after the think block the prompt
    opens, if any; see `grammar`). ``prompt_logprobs``: the prompt's per-token logprobs with that many alternatives
    (``max_tokens`` may then be 0: the prompt is scored, nothing generated).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each sampled token
    prompt_logprobs: int | None = None  # number of top alternatives to return with each prompt token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    thinking_token_budget: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        def check(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"{name}: {why}")

        def integer(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        scoring = self.prompt_logprobs is not None
        check(integer(self.max_tokens) and self.max_tokens >= (0 if scoring else 1), "max_tokens",
              "must be an integer >= 1 (0 only with prompt_logprobs)")
        check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive integer")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(integer(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (integer(value) and 0 <= value <= MAX_LOGPROBS), name,
                  f"must be an integer in [0, {MAX_LOGPROBS}]")
        check(integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be an integer in [0, max_tokens={self.max_tokens}]")
        low, high = LOGIT_BIAS_RANGE
        bias = self.logit_bias or {}
        check(isinstance(bias, dict) and all(integer(t) and t >= 0 for t in bias), "logit_bias",
              "must map token ids (non-negative integers) to biases")
        check(all(isinstance(b, int | float) and not isinstance(b, bool) and low <= b <= high for b in bias.values()),
              "logit_bias", f"biases must be numbers in [{low:g}, {high:g}]")
        check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        allowed = self.allowed_token_ids
        check(allowed is None or (isinstance(allowed, list) and 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS
                                  and all(integer(t) and t >= 0 for t in allowed)), "allowed_token_ids",
              f"must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} token ids (non-negative integers)")
        check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
              "must be non-blank strings")
        sequences = self.bad_words_token_ids
        check(len(sequences) <= MAX_BAD_WORDS, "bad_words",
              f"at most {MAX_BAD_WORDS} token sequences (a word and its space-prefixed form may both count), "
              f"got {len(sequences)}")
        check(all(0 < len(s) <= MAX_BAD_WORD_TOKENS and all(integer(t) and t >= 0 for t in s) for s in sequences),
              "bad_words", f"each word must be 1 to {MAX_BAD_WORD_TOKENS} tokens long")
        check(self.thinking_token_budget is None or (integer(self.thinking_token_budget)
                                                     and self.thinking_token_budget >= 0),
              "thinking_token_budget", "must be an integer >= 0")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    def update_from_tokenizer(self, tokenizer: Encoder) -> None:
        """Fill ``bad_words_token_ids`` from ``bad_words`` as vLLM does: each word's tokens, and those of the word
        after a space where that form is a different token sequence of the same length."""
        self.bad_words_token_ids = bad_words_token_ids(tokenizer, self.bad_words)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def bad_words_token_ids(tokenizer: Encoder, words: Sequence[str]) -> list[list[int]]:
    """The token sequences ``words`` ban (vLLM's `SamplingParams.update_from_tokenizer`)."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip())
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences
