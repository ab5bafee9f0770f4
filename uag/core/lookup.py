"""Prompt lookup: draft by finding the last few committed tokens earlier in the context. Pure Python.

The drafter keeps every committed target token (prompt and output) and, for each n in `NGRAMS`, where
each n-gram last occurred. After every token it notes, longest n first, whether the sequence's last n
tokens occurred before; if so it proposes what followed their most recent earlier occurrence. The
proposal is in target tokens (no translation) and costs a dictionary lookup per n-gram size: microseconds.

How far a match runs back says how far to trust it (`match_length`, `match_band`): a file being written
out again matches what it copies for dozens of tokens, a coincidence for two or three. Replayed over
code-editing turns, a proposal from a 2-3-token match fails at its first token about half the time, one from a
match of 16 or more almost never (benchmarks/lookup_match.py;
docs/results.md#how-far-a-lookup-match-runs-back-benchmarkslookup_matchpy).
auto keeps its acceptance evidence per band (uag.core.evidence).

    index = NgramIndex()
    index.extend([1, 2, 3, 4, 9, 1, 2, 3])
    index.propose(4)     # -> [4, 9, 1, 2]: "1 2 3" occurred before, followed by 4 9 1 2 …
    index.match_length() # -> 3
"""

from __future__ import annotations

from collections.abc import Iterable

# n-gram sizes tried, longest first: the longest finds the earlier text that shares the most context, not only
# the latest place a short n-gram occurred (fewer proposals fail at their first token with 16 and 8 added: the
# replay above); a 1-token match is too weak to pay on average
NGRAMS = (16, 8, 4, 3, 2)
MATCH_BANDS = (4, 8, 16)  # match lengths where a band ends: 2-3, 4-7, 8-15, 16 and more tokens
MATCH_CAP = MATCH_BANDS[-1]  # how far back a match is followed: past the last band's start, all alike
# The least acceptance per position a band's match is assumed to have until its own evidence says otherwise
# (auto, uag.core.policy): a match of 8 or more tokens is a copy, whatever shorter matches did before it (nearly
# all such proposals held at their first token in the replay above); without a floor, two failed 2-token guesses
# kept auto from trying a 30-token copy for a whole turn.
BAND_FLOORS = (0.0, 0.0, 0.8, 0.9)


def match_band(length: int) -> int:
    """Which of the `MATCH_BANDS` a match of `length` tokens falls in, 0 (shortest) to len(MATCH_BANDS).

    Example: match_band(2) -> 0, match_band(8) -> 2, match_band(40) -> 3
    """
    return sum(length >= edge for edge in MATCH_BANDS)


class NgramIndex:
    """Committed target tokens and, per n-gram, the position right after its latest occurrence."""

    def __init__(self, ngrams: Iterable[int] = NGRAMS):
        self.ngrams = tuple(sorted(set(ngrams), reverse=True))
        if not self.ngrams or self.ngrams[-1] < 1:
            raise ValueError(f"n-gram sizes must be >= 1 (got {self.ngrams})")
        self.ids: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> index right after its latest occurrence
        self._match: tuple[int, int] | None = None  # (n, start of the continuation) for the current suffix

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, ids: Iterable[int]) -> None:
        for token in ids:
            self.ids.append(token)
            end, match = len(self.ids), None
            for n in self.ngrams:
                if end < n:
                    continue
                key = tuple(self.ids[end - n : end])
                earlier = self._after.get(key)
                if match is None and earlier is not None:
                    match = (n, earlier)
                self._after[key] = end
            self._match = match

    @property
    def match(self) -> tuple[int, int] | None:
        """(n, continuation start) of the longest n-gram ending the sequence that occurred before."""
        return self._match

    def match_length(self, cap: int = MATCH_CAP) -> int:
        """How many tokens the current match runs back (at least its n-gram's n, at most `cap`); 0 without one:
        the length of the suffix the sequence shares with the text before the match's continuation.

        Example: ids [5, 1, 2, 3, 9, 7, 1, 2, 3] -> 3 (1 2 3 matched; 5 and 7 differ before it)
        """
        if self._match is None:
            return 0
        n, start = self._match
        ids, end = self.ids, len(self.ids)
        length = n
        while length < cap and start - length > 0 and ids[start - length - 1] == ids[end - length - 1]:
            length += 1
        return length

    def propose(self, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the sequence's suffix; none without one.

        Where that continuation reaches the end of the sequence (text repeating itself with period p),
        the repetition is carried on: the proposal repeats its own last p tokens.
        Example: ids [7, 8, 5, 7, 8], k 3 -> [5, 7, 8]  (the 2-gram 7 8 occurred at the start)
                 ids [5, 6, 5, 6], k 3 -> [5, 6, 5]     (period 2)
        """
        if self._match is None or k < 1:
            return []
        start = self._match[1]
        period = len(self.ids) - start
        out = self.ids[start : start + k]
        while len(out) < k:
            out.append(out[-period])
        return out
