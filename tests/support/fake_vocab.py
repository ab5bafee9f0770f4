"""A tiny SentencePiece-like tokenizer whose merges we choose, so boundary cases are exact.

Greedy longest match over a piece list, spaces written as "▁", optional dummy prefix, and UTF-8 byte
fallback for characters it lacks, like Mistral's tokenizer, but small enough to reason about by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

SPECIALS = ("<unk>", "<s>", "</s>")
BYTES = tuple(f"<0x{b:02X}>" for b in range(256))


class FakeVocab:
    def __init__(self, pieces: Sequence[str], *, dummy_prefix: bool = True, bos: bool = True):
        self.pieces = [*SPECIALS, *BYTES, *pieces]
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.size = len(self.pieces)
        self.special_ids = frozenset(range(len(SPECIALS)))
        self.dummy_prefix = dummy_prefix
        self.bos = bos
        self.longest = max(len(p) for p in pieces)

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        shift = 1 if self.dummy_prefix and text else 0
        s = ("▁" if shift else "") + text.replace(" ", "▁")
        ids, offsets, i = [], [], 0
        while i < len(s):
            for j in range(min(len(s), i + self.longest), i, -1):
                if s[i:j] in self.ids:
                    ids.append(self.ids[s[i:j]])
                    offsets.append((max(i - shift, 0), max(j - shift, 0)))
                    i = j
                    break
            else:  # byte fallback: one token per UTF-8 byte, all with the character's offsets
                span = (max(i - shift, 0), i + 1 - shift)
                for b in s[i].encode():
                    ids.append(self.ids[f"<0x{b:02X}>"])
                    offsets.append(span)
                i += 1
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for i in ids:
            piece = self.pieces[i]
            if i in self.special_ids:
                continue
            if piece in BYTES:
                out.append(int(piece[3:5], 16))
            else:
                out.extend(piece.replace("▁", " ").encode())
        text = out.decode("utf-8", errors="replace")
        return text[1:] if self.dummy_prefix and text.startswith(" ") else text

    def encode_prompt(self, text: str) -> list[int]:
        return ([1] if self.bos else []) + self.encode(text)[0]

    def special_id(self, content: str) -> int | None:
        return self.ids.get(content) if content in SPECIALS else None

    def token_content(self, token_id: int) -> str:
        return self.pieces[token_id]

    def tokens(self, *pieces: str) -> list[int]:
        """Ids of the given pieces. Example: tokens('▁Ala', '▁ma') -> [.., ..]"""
        return [self.ids[p] for p in pieces]


# A target that knows "▁wino" as one piece and a drafter that does not: the study's "w" vs "wino".
TARGET_PIECES = [
    "▁Ala",
    "▁ma",
    "▁kota",
    "▁w",
    "▁wino",
    "ino",
    "▁i",
    "▁jest",
    "▁dobre",
    "i",
    "n",
    "o",
    "a",
    "▁",
    ".",
    "\n",
    "ł",
    "▁dzi",
    "ś",
    "▁to",
    "▁Sto",
    "lica",
    "▁Pol",
    "ski",
    "▁Warszawa",
]
DRAFTER_PIECES = [
    "Ala",
    "▁ma",
    "▁kot",
    "a",
    "▁w",
    "in",
    "o",
    "▁i",
    "▁jest",
    "▁dobre",
    "▁",
    ".",
    "\n",
    "i",
    "n",
    "▁dzi",
    "ś",
    "▁to",
    "▁Stolica",
    "▁Polski",
    "▁War",
    "sza",
    "wa",
]


def target_vocab() -> FakeVocab:
    return FakeVocab(TARGET_PIECES)


def drafter_vocab() -> FakeVocab:
    return FakeVocab(DRAFTER_PIECES, dummy_prefix=False, bos=False)
