"""Token log-probabilities in the two OpenAI formats: completions ({tokens, token_logprobs, top_logprobs,
text_offset}) and chat ({"content": [{token, logprob, bytes, top_logprobs}]})."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from hybrid_jax.engine.engine import TokenEvent
from hybrid_jax.engine.requests import PromptLogprob
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
                        prompt_ids: Sequence[int] = (), prompt_logprobs: Sequence[PromptLogprob | None] | None = None,
                        top_n: int = 0) -> dict:
    """Completions logprobs of ``events`` starting at text ``offset``; echoed prompt tokens come first, with
    their ``prompt_logprobs`` (``top_n`` alternatives; the first token's are null, as are all without them).
    top_logprobs includes the sampled (or prompt) token first."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        nonlocal offset
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)

    for k, token_id in enumerate(prompt_ids):
        entry = prompt_logprobs[k] if prompt_logprobs is not None else None
        if entry is None:
            add(name(token_id), None, None)
            continue
        text = name(token_id)
        top = {text: _finite(entry.logprob)}
        for alternative, logprob in entry.top[:top_n]:
            top.setdefault(name(alternative), _finite(logprob))
        add(text, _finite(entry.logprob), top)
    for event in events:
        text = name(event.token_id)
        top = {text: _finite(event.logprob)}  # the sampled token first, then the alternatives by rank
        for token_id, logprob in event.top_logprobs or []:
            top.setdefault(name(token_id), _finite(logprob))
        add(text, _finite(event.logprob), top)
    return out


def vllm_prompt_logprobs(name: TokenNamer, prompt_ids: Sequence[int],
                         prompt_logprobs: Sequence[PromptLogprob | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token, {token id: {logprob, rank, decoded_token}} for
    the token and its alternatives (null for the first token)."""
    out: list[dict | None] = []
    for token_id, entry in zip(prompt_ids, prompt_logprobs, strict=True):
        if entry is None:
            out.append(None)
            continue
        ranked = {str(token_id): {"logprob": _finite(entry.logprob), "rank": entry.rank,
                                  "decoded_token": name(token_id)}}
        for rank, (alternative, logprob) in enumerate(entry.top, 1):
            ranked.setdefault(str(alternative), {"logprob": _finite(logprob), "rank": rank,
                                                 "decoded_token": name(alternative)})
        out.append(ranked)
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
