"""Size checks that bound a request's cost before the expensive work (tokenizing, rendering, generating).

A token decodes to at most ``Tokenizer.max_token_chars`` characters, so a text longer than
``max_model_len * max_token_chars`` characters has more tokens than the context holds: it is rejected by its
length alone, before it is tokenized. The same bound caps a stop string (no longer one could ever match).
"""

from __future__ import annotations

from hybrid_jax.tokenizer import Tokenizer
from server.errors import bad_request

MAX_STOPS = 64  # stop strings per request (matching costs their number per generated character)


def context_error(max_model_len: int, prompt_len: int | str, field: str):
    return bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your request "
                       f"has {prompt_len} input tokens. Please reduce the length of the input.", field)


def max_text_chars(max_model_len: int, tokenizer: Tokenizer) -> int:
    return max_model_len * tokenizer.max_token_chars


def check_text_length(text: str, max_model_len: int, tokenizer: Tokenizer, field: str) -> str:
    """``text`` unless it is too long for the context whatever its tokens (checked without tokenizing)."""
    if len(text) > max_text_chars(max_model_len, tokenizer):
        raise context_error(max_model_len, f"more than {max_model_len}", field)
    return text


def check_stops(stops: list[str], max_model_len: int, tokenizer: Tokenizer) -> None:
    limit = max_text_chars(max_model_len, tokenizer)
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop: at most {MAX_STOPS} stop strings", "stop")
    if any(len(s) > limit for s in stops):
        raise bad_request(f"stop: a stop string may have at most {limit} characters (longer can never match "
                          "within the model's context)", "stop")


def fit_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, prompt_field: str) -> int:
    """max_tokens checked against the context (vLLM's messages); None takes the rest of the context."""
    if prompt_len >= max_model_len:
        raise context_error(max_model_len, prompt_len, prompt_field)
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
                          f"completion). Please reduce the length of the messages or completion.", "max_tokens")
    return max_tokens


def check_token_ids(ids: list[int], tokenizer: Tokenizer, field: str) -> list[int]:
    if ids and (min(ids) < 0 or max(ids) >= tokenizer.vocab_size):
        raise bad_request(f"{field}: token ids must be in [0, {tokenizer.vocab_size})", field)
    return ids


def check_choices(choices: int, max_waiting: int) -> None:
    """More choices than the queue holds could never be admitted: a 400, not a 503 to retry."""
    if choices > max_waiting:
        raise bad_request(f"n: the request needs {choices} engine requests (prompts x n) but the server queues at "
                          f"most {max_waiting} (--max-waiting)", "n")
