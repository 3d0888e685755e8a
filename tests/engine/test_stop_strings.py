"""Stop-string matching: the same answers as a direct search, in time linear in the text."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_jax.engine.output import TextAssembler
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.engine.stop_strings import StopMatcher, prefix_function


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Reference: the stop ending earliest in ``text`` (the longest of those ending there), by brute force."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def longest_partial(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(stops=st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=3),
       pieces=st.lists(st.text("abc", max_size=5), max_size=8))
def test_matcher_agrees_with_brute_force(stops, pieces):
    matcher = StopMatcher(stops)
    fed = ""
    for piece in pieces:
        hit = matcher.feed(piece)
        expected = first_stop(fed + piece, stops)
        if expected is not None:
            end, stop = expected
            assert hit == (end - len(fed), stop)
            return
        assert hit is None
        fed += piece
        assert matcher.partial == longest_partial(fed, stops)


class _Chars:
    """A tokenizer whose token i is the character chr(i) (enough for the assembler's detokenizer)."""

    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def test_assembler_holds_back_and_cuts_at_the_stop():
    assembler = TextAssembler(_Chars(), SamplingParams(max_tokens=50, stop=["cab", "bcd"]))
    deltas = [assembler.add(SimpleNamespace(token_id=ord(c), logprob=0.0, top_logprobs=None, finish_reason=None))
              for c in "xxcabcd"]
    assert "".join(deltas) == "xx" and assembler.output.stop_reason == "cab"
    assert deltas[:3] == ["x", "x", ""]  # "c" could begin "cab": held back, never retracted


def test_no_stop_string_ends_a_completion_before_min_tokens():
    """As vLLM: stop strings count once more than min_tokens tokens are out (the earlier matches pass)."""
    assembler = TextAssembler(_Chars(), SamplingParams(max_tokens=50, stop=["ab"], min_tokens=3))
    for c in "abxab":
        assembler.add(SimpleNamespace(token_id=ord(c), logprob=0.0, top_logprobs=None, finish_reason=None))
    assert assembler.output.text == "abx" and assembler.output.stop_reason == "ab"


def test_long_stop_strings_cost_linear_time():
    stop = "a" * 200_000 + "b"
    start = time.monotonic()
    matcher = StopMatcher([stop, "a" * 100_000 + "c"])
    for _ in range(400):
        assert matcher.feed("a" * 500) is None
    assert matcher.partial == 200_000  # all of the text, a prefix of the first stop
    assert matcher.feed("b") == (1, stop)
    assert time.monotonic() - start < 10  # quadratic hold-back checks took hours at this size
    assert prefix_function("abab") == [0, 0, 1, 2]
