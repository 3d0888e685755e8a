"""Stop strings found in text fed piece by piece, in time linear in the text (one KMP automaton per string)."""

from __future__ import annotations

from collections.abc import Sequence


def prefix_function(pattern: str) -> list[int]:
    """KMP failure table: entry i is the length of the longest proper prefix of pattern[:i+1] that ends it."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Tracks, for every stop string, how much of it the text fed so far ends with.

    ``feed`` costs O(len(text) * len(stops)) amortised, whatever the stop strings' lengths; building costs
    O(total stop length).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._fail = [prefix_function(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: length of its longest prefix the text ends with

    @property
    def partial(self) -> int:
        """Characters at the end of the text that could still grow into a stop string."""
        return max(self._matched, default=0)

    def feed(self, text: str) -> tuple[int, str] | None:
        """Append ``text``; (end of the match in ``text``, stop) for the first stop string completed, else None.

        The first match is the one that ends earliest; of those ending at the same character, the longest.
        """
        for end, char in enumerate(text, 1):
            found = None
            for j, stop in enumerate(self.stops):
                k, fail = self._matched[j], self._fail[j]
                while k and stop[k] != char:
                    k = fail[k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    if found is None or len(stop) > len(found):
                        found = stop
                    k = fail[k - 1]
                self._matched[j] = k
            if found is not None:
                return end, found
        return None
