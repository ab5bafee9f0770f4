"""The streaming detokenizer: each committed target token's piece of the output text. No mlx.

A speculative cycle commits several tokens at once; each becomes a `Token` carrying its own piece of text
(mlx-lm's streaming detokenizer, so a multi-byte character split over tokens lands on the token that ends
it) and whether it came from an accepted draft. A stop token gets no text.

    pieces = Pieces(target.tokenizer, target.eos_ids)
    tokens = pieces([412, 7, 2], accepted=2)   # two accepted drafts and the target's own token
    tail = pieces.flush()                      # what the detokenizer still held at the end
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from uag.core.records import Token


class Pieces:
    """Streaming detokenizer: each committed target token gets its piece of the output text (a stop token none)."""

    def __init__(self, tokenizer: Any, eos: Collection[int]):
        self._detokenizer = tokenizer.detokenizer
        self._eos = eos

    def __call__(self, ids: Sequence[int], accepted: int) -> tuple[Token, ...]:
        tokens = []
        for i, token_id in enumerate(ids):
            text = ""
            if token_id not in self._eos:
                self._detokenizer.add_token(token_id)
                text = self._detokenizer.last_segment
            tokens.append(Token(token_id, text, i < accepted))
        return tuple(tokens)

    def flush(self) -> str:
        self._detokenizer.finalize()
        return self._detokenizer.last_segment
