"""Token log-probabilities in the two OpenAI formats: completions ({tokens, token_logprobs, top_logprobs,
text_offset}) and chat ({"content": [{token, logprob, bytes, top_logprobs}]})."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from hybrid_jax.engine.engine import TokenEvent
from hybrid_jax.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # what vLLM reports for -inf (JSON has no infinity)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


TokenNamer = Callable[[int], str]


def token_namer(tokenizer: Tokenizer, as_ids: bool) -> TokenNamer:
    """How tokens are written: their text (special tokens included, a partial UTF-8 character as U+FFFD), or
    "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


def completion_logprobs(name: TokenNamer, events: Sequence[TokenEvent], offset: int = 0,
                        prompt_ids: Sequence[int] = ()) -> dict:
    """Completions logprobs of ``events`` starting at text ``offset``; echoed prompt tokens come first
    with null logprobs (prompt logprobs are not computed). top_logprobs includes the sampled token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        nonlocal offset
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)

    for token_id in prompt_ids:
        add(name(token_id), None, None)
    for event in events:
        text = name(event.token_id)
        top = {text: _finite(event.logprob)}  # the sampled token first, then the alternatives by rank
        for token_id, logprob in event.top_logprobs or []:
            top.setdefault(name(token_id), _finite(logprob))
        add(text, _finite(event.logprob), top)
    return out


def _chat_entry(name: TokenNamer, token_id: int, logprob: float) -> dict:
    text = name(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(name: TokenNamer, events: Sequence[TokenEvent], top_n: int) -> dict:
    """Chat logprobs of ``events`` with the ``top_n`` most likely alternatives of each token."""
    return {"content": [
        {**_chat_entry(name, e.token_id, e.logprob),
         "top_logprobs": [_chat_entry(name, i, lp) for i, lp in (e.top_logprobs or [])[:top_n]]}
        for e in events
    ]}
