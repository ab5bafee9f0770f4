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
OCCURRENCES = 4  # earlier occurrences kept per n-gram: `continuations` offers what followed each, where it differs
BRANCHES = 3  # the most other continuations verified beside a proposal in one tree pass (`NgramIndex.branches`)
BRANCH_NODES = 8  # the most nodes they add to that pass
MATCH_BANDS = (4, 8, 16, 32, 64)  # match lengths where a band ends: 2-3, 4-7, 8-15, 16-31, 32-63, 64 and more
MATCH_CAP = MATCH_BANDS[-1]  # how far back a match is followed: past the last band's start, all alike
# The least acceptance per position a band's match is assumed to have until its own evidence says otherwise
# (auto, uag.core.policy): a match of 8 or more tokens is a copy, whatever shorter matches did before it (nearly
# all such proposals held at their first token in the replay above); without a floor, two failed 2-token guesses
# kept auto from trying a 30-token copy for a whole turn. The longer a copy has run, the less often its next
# token breaks it (the replay's tokens kept per token tried, per band: docs/results.md), so a copy's proposal
# grows as it goes on.
BAND_FLOORS = (0.0, 0.0, 0.8, 0.9, 0.95, 0.97)
# The most one lookup proposal holds under auto, whatever k (k bounds a model's drafts): as far as the verify
# curve says a pass pays, up to the width where, on the CPU, a pass costs about three target steps.
LOOKUP_REACH = 64
# How far past k a proposal reaches under auto, as a multiple of how far its match runs back (uag.core.policy
# AdaptiveK.copy_reach): a copy's proposals double as it goes on, and a guess stays within k.
COPY_GROWTH = 2


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share. Example: [5, 6, 7], [5, 6, 9] -> 2"""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_back(text: list[int], start: int, context: list[int], n: int, cap: int) -> int:
    """How far the end of `context` matches `text` before position `start`, where their last n tokens match: at
    least n, at most `cap`. Example: text [5, 1, 2, 3, 9], start 4, context [7, 1, 2, 3], n 2 -> 3"""
    length = n
    while length < cap and start - length > 0 and len(context) - length > 0:
        if text[start - length - 1] != context[-length - 1]:
            break
        length += 1
    return length


def match_band(length: int) -> int:
    """Which of the `MATCH_BANDS` a match of `length` tokens falls in, 0 (shortest) to len(MATCH_BANDS).

    Example: match_band(2) -> 0, match_band(8) -> 2, match_band(40) -> 3
    """
    return sum(length >= edge for edge in MATCH_BANDS)


class NgramIndex:
    """Committed target tokens and, per n-gram, the position right after its latest occurrence (and after the few
    before it, for `continuations`)."""

    def __init__(self, ngrams: Iterable[int] = NGRAMS):
        self.ngrams = tuple(sorted(set(ngrams), reverse=True))
        if not self.ngrams or self.ngrams[-1] < 1:
            raise ValueError(f"n-gram sizes must be >= 1 (got {self.ngrams})")
        self.ids: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> index right after its latest occurrence
        self._earlier: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the same for its earlier ones, oldest first
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
                if earlier is not None:
                    if match is None:
                        match = (n, earlier)
                    before = self._earlier.setdefault(key, [])
                    before.append(earlier)
                    if len(before) > OCCURRENCES:
                        del before[0]
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
        return run_back(self.ids, start, self.ids, n, cap)

    def propose(self, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the sequence's suffix; none without one.

        Where that continuation reaches the end of the sequence (text repeating itself with period p),
        the repetition is carried on: the proposal repeats its own last p tokens.
        Example: ids [7, 8, 5, 7, 8], k 3 -> [5, 7, 8]  (the 2-gram 7 8 occurred at the start)
                 ids [5, 6, 5, 6], k 3 -> [5, 6, 5]     (period 2)
        """
        if self._match is None or k < 1:
            return []
        return self._continuation(self._match[1], k)

    def continuations(self, k: int, most: int) -> list[list[int]]:
        """Up to `most` distinct k-token continuations of the matched n-gram's latest occurrences (at most
        `OCCURRENCES`), latest first: the first is `propose(k)`, the others what followed it elsewhere.

        Example: ids [1, 2, 3, 1, 2, 4, 1, 2], k 2, most 3 -> [[4, 1], [3, 1]]
        """
        if self._match is None or k < 1 or most < 1:
            return []
        n, start = self._match
        starts = [start, *reversed(self._earlier.get(tuple(self.ids[len(self.ids) - n :]), [])[:-1])]
        out: list[list[int]] = []
        for s in starts:
            continuation = self._continuation(s, k)
            if continuation not in out:
                out.append(continuation)
            if len(out) == most:
                break
        return out

    def _continuation(self, start: int, k: int) -> list[int]:
        """k tokens from `start`, the repetition carried on where they reach the end (`propose`)."""
        period = len(self.ids) - start
        out = self.ids[start : start + k]
        while len(out) < k:
            out.append(out[-period])
        return out

    def branching(self) -> bool:
        """Whether a proposal from the match now comes with other continuations (`branches`): a match shorter
        than 8 tokens whose n-gram occurred before followed otherwise (within `LOOKUP_REACH` tokens).

        Example: ids [1, 2, 3, 1, 2, 4, 1, 2] -> True;  ids [1, 2, 3, 1, 2] -> False
        """
        return match_band(self.match_length()) < 2 and len(self.continuations(LOOKUP_REACH, 2)) > 1

    def branches(self, k: int) -> list[list[int]]:
        """The other continuations worth verifying beside `propose(k)` in the same pass, as a tree (uag.core.verify),
        cut so that they add at most max(1, k // 2) nodes (`BRANCH_NODES` at most), shared evenly; [] for a match of
        8 tokens or more. Only a short match's proposal fails at its first token often (about half the time, the
        module's replay), and only then can another continuation pay; the extra rows are paid on every such pass,
        so they are held to half the proposal's: the pass reads at most 1.5 times the rows it would.

        Example: ids [1, 2, 3, 1, 2, 4, 1, 2], k 4 -> [[3, 1]]  (propose(4) is [4, 1, 2, 4]; room for 2 nodes)
        """
        if match_band(self.match_length()) >= 2:
            return []
        main, *others = self.continuations(k, 1 + BRANCHES) or [[]]
        room, kept = branch_room(k), []
        for i, other in enumerate(others):
            shared = max(_common_prefix(other, p) for p in [main, *kept])
            new = min(len(other) - shared, -(-room // (len(others) - i)))  # an even share of the room left
            if new > 0:
                kept.append(other[: shared + new])
                room -= new
        return kept


class SharedIndex:
    """Earlier requests' target tokens (their prompts and replies) as documents, and per n-gram the place right
    after its latest occurrence in them: a lookup draft source across requests (SuffixDecoding's idea). At most
    `max_tokens` tokens are held, the oldest documents dropped first. A document that a new one starts with (a
    conversation re-sends its history each turn) is replaced by it.

    Example: index = SharedIndex(100); index.add([1, 2, 3, 4, 5, 6])
             index.find([9, 2, 3], k=2) -> (2, [4, 5])   (the 2-gram "2 3" ran back 2 tokens, followed by 4 5)
    """

    def __init__(self, max_tokens: int, ngrams: Iterable[int] = NGRAMS):
        self.ngrams = tuple(sorted(set(ngrams), reverse=True))
        if not self.ngrams or self.ngrams[-1] < 1 or max_tokens < 1:
            raise ValueError(f"n-gram sizes and max_tokens must be >= 1 (got {self.ngrams}, {max_tokens})")
        self.max_tokens = max_tokens
        self.documents: dict[int, list[int]] = {}  # serial -> target ids, oldest first
        self.tokens = 0  # over all documents
        self.rebuilds = 0
        self._serial = 0
        # hash of an n-gram -> serial << 32 | the offset after its latest occurrence that a token follows; entries
        # of dropped documents linger (harmless: a later occurrence would have replaced them) until `_rebuild`
        self._after: dict[int, int] = {}
        self._dropped = 0  # tokens dropped since the table was built

    def __len__(self) -> int:
        return self.tokens

    def add(self, ids: Iterable[int]) -> None:
        """Hold `ids` as the newest document (its last `max_tokens` where longer), replacing any it starts with.
        Where the newest document is one of those (a conversation's next turn, no other request's in between), it
        is extended in place, and only the n-grams its new tokens end are indexed: the rest are its already."""
        ids = list(ids)[-self.max_tokens :]
        if len(ids) <= self.ngrams[-1]:
            return  # no n-gram with a token after it
        newest, extended = next(reversed(self.documents), None), False
        for serial, doc in list(self.documents.items()):
            if len(doc) <= len(ids) and doc[0] == ids[0] and ids[: len(doc)] == doc:
                if serial == newest:
                    self.documents[serial], self.tokens = ids, self.tokens + len(ids) - len(doc)
                    self._note(serial, ids, start=len(doc))
                    extended = True
                else:
                    self._drop(serial, stale=False)  # its n-grams all recur in `ids`, at the same offsets
        if not extended:
            serial, self._serial = self._serial, self._serial + 1
            self.documents[serial] = ids
            self.tokens += len(ids)
            self._note(serial, ids)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self.documents)), stale=True)
        if self._dropped > self.tokens:  # amortised: the table is rebuilt after as many tokens went as it holds
            self._rebuild()

    def find(self, context: list[int], k: int, cap: int = MATCH_CAP) -> tuple[int, list[int]]:
        """For the longest n-gram ending `context` that a document holds with a token after it: how far the match
        runs back (as `NgramIndex.match_length`: at least n, at most `cap`) and up to k tokens that followed its
        latest occurrence; (0, []) without one.

        Example: documents [[5, 1, 2, 3, 4]], context [5, 1, 2, 3], k 3 -> (4, [4])
        """
        for n in self.ngrams:
            if len(context) < n:
                continue
            gram = context[len(context) - n :]
            found = self._after.get(hash(tuple(gram)))
            doc = None if found is None else self.documents.get(found >> 32)
            if doc is None:
                continue
            start = found & 0xFFFFFFFF
            if doc[start - n : start] != gram:
                continue  # another n-gram's hash
            return run_back(doc, start, context, n, cap), doc[start : start + k]
        return 0, []

    def _note(self, serial: int, ids: list[int], start: int = 0) -> None:
        """Index every n-gram of a document that a token follows (later documents override earlier ones); from
        `start`, those that end at or after it."""
        after, high = self._after, serial << 32
        for end in range(max(start, self.ngrams[-1]), len(ids)):
            for n in self.ngrams:
                if end >= n:
                    after[hash(tuple(ids[end - n : end]))] = high | end

    def _drop(self, serial: int, *, stale: bool) -> None:
        doc = self.documents.pop(serial)
        self.tokens -= len(doc)
        self._dropped += len(doc) if stale else 0

    def _rebuild(self) -> None:
        self._after, self._dropped = {}, 0
        self.rebuilds += 1
        for serial, doc in self.documents.items():
            self._note(serial, doc)


class SharedIndexes:
    """One `SharedIndex` per owner (the server's: an API key's digest and the target's name, so never across keys
    or tokenizers), at most `max_tokens` tokens over all of them: the least recently used owner's goes first."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
        self.max_tokens = max_tokens
        self._held: dict[object, SharedIndex] = {}  # least recently used first

    def __len__(self) -> int:
        return sum(len(index) for index in self._held.values())

    def get(self, owner: object) -> SharedIndex | None:
        """The owner's index (now its most recently used), or None before anything of its was added."""
        index = self._held.pop(owner, None)
        if index is not None:
            self._held[owner] = index
        return index

    def add(self, owner: object, ids: Iterable[int]) -> None:
        """Add a document to the owner's index, then drop other owners' indexes, least recently used first, while
        all of them hold more than `max_tokens` tokens."""
        index = self.get(owner)
        if index is None:
            index = self._held[owner] = SharedIndex(self.max_tokens)
        index.add(ids)
        while len(self) > self.max_tokens and len(self._held) > 1:
            del self._held[next(iter(self._held))]


def branch_room(k: int) -> int:
    """The most nodes other continuations add to a proposal of k tokens: max(1, k // 2), `BRANCH_NODES` at most."""
    return min(max(1, k // 2), BRANCH_NODES)


def own_match(index: NgramIndex, views: SharedIndex | None, k: int) -> tuple[list[int], int, bool]:
    """The request's own continuation of up to k tokens, how far its match runs back, and whether it came from
    `views` (its prompt in the forms a reply copies it in, uag.core.copy_forms) rather than from the text as read:
    the views propose only where their match runs back further.

    Example: index [5, 1, 2, 3, 1, 2], views [[7, 3, 1, 2, 8, 9]], k 2 -> ([8, 9], 3, True)  (its own: 2)
    """
    own, mine = index.propose(k), index.match_length()
    found, written = (0, []) if views is None else views.find(index.ids[-MATCH_CAP:], k)
    return (written, found, True) if found > mine else (own, mine, False)


def proposal(
    index: NgramIndex, shared: SharedIndex | None, k: int, views: SharedIndex | None = None
) -> tuple[list[int], int, list[list[int]], bool]:
    """One lookup proposal of up to k tokens: (the tokens, how far their match runs back, other continuations to
    verify beside them as a tree, whether they came from `shared`). The request's own continuation (`own_match`:
    its text, or its `views`) and `shared`'s compete: the one whose match runs back further proposes (the request's
    own on a tie); where the other matches as well and continues differently (an earlier request's reply against the
    file the prompt holds), its continuation is a branch, cut to `branch_room`; otherwise a short match's other
    continuations are (`NgramIndex.branches`).

    Example: own [1, 2, 3, 9, 1, 2], shared [[1, 2, 7, 7]], k 2 -> ([3, 9], 2, [[7]], False)
    """
    own, mine, viewed = own_match(index, views, k)
    found, theirs = (0, []) if shared is None else shared.find(index.ids[-MATCH_CAP:], k)
    if found > mine:
        main, match, rival, recalled = theirs, found, own, True
    else:
        main, match, rival, recalled = own, mine, theirs if found and found == mine else [], False
    common = _common_prefix(rival, main)
    if rival and common < min(len(rival), len(main)):
        return main, match, [rival[: common + branch_room(k)]], recalled
    return main, match, [] if recalled or viewed else index.branches(k), recalled


def recall(shared: SharedIndex | None, index: NgramIndex, k: int, mine: int | None = None) -> tuple[int, list[int]]:
    """`shared`'s (match length, up to k tokens) for the end of `index`'s sequence where that match runs back further
    than the request's own (`mine`, as `own_match` found it; None: `index`'s), else (0, []): a run drafts from earlier
    requests only where they hold the longer copy.

    Example: shared holds [9, 1, 2, 3, 4], index [7, 2, 3, 9, 1, 2, 3], k 2 -> (4, [4])  (its own, "2 3": 2)
    """
    found = (0, []) if shared is None else shared.find(index.ids[-MATCH_CAP:], k)
    return found if found[0] > (index.match_length() if mine is None else mine) else (0, [])
