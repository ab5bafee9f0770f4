"""Prompt lookup: draft by finding the last few committed tokens earlier in the context. Pure Python.

The drafter keeps every committed target token (prompt and output) and, for each n in `NGRAMS`, where
each n-gram last occurred. After every token it notes, longest n first, whether the sequence's last n
tokens occurred before; if so it proposes what followed their most recent earlier occurrence. The
proposal is in target tokens (no translation) and costs a dictionary lookup per n-gram size: microseconds.

    index = NgramIndex()
    index.extend([1, 2, 3, 4, 9, 1, 2, 3])
    index.propose(4)     # -> [4, 9, 1, 2]: "1 2 3" occurred before, followed by 4 9 1 2 …
"""

from __future__ import annotations

from collections.abc import Iterable

NGRAMS = (4, 3, 2)  # n-gram sizes tried, longest first; a 1-token match is too weak to pay on average


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
