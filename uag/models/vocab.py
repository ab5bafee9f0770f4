"""A tokenizer as translation sees it: text ↔ ids with character offsets, and its special tokens.

Wraps a Hugging Face tokenizer (or mlx-lm's TokenizerWrapper around one) and talks to its Rust backend
directly: transformers' Python layer costs ~10× more per call than the encode/decode itself, and the
translation budget is a fraction of a millisecond per cycle. No mlx here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cached_property
from typing import Protocol


class Vocab(Protocol):
    """What the translators need from a tokenizer. Tests implement it with a few fake pieces."""

    size: int  # ids below this are tokens of this vocabulary
    special_ids: frozenset[int]  # control tokens: never turned into text, never proposed from text

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` (no BOS/EOS added) and each token's (start, end) character offsets."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a prompt as the tokenizer itself would prepare it (BOS added where it adds one)."""
        ...

    def special_id(self, content: str) -> int | None:
        """Id of the special token spelled `content`, if this vocabulary has one."""
        ...

    def token_content(self, token_id: int) -> str:
        """The raw spelling of a token (e.g. "<|im_start|>" or "▁ma")."""
        ...


class HFVocab:
    """`Vocab` over a Hugging Face tokenizer's `tokenizers.Tokenizer` backend."""

    def __init__(self, tokenizer):
        hf = tokenizer  # an HF tokenizer, or mlx-lm's TokenizerWrapper, which forwards attributes to one
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(hf).__name__} has no fast (Rust) backend; uag needs a tokenizer.json")
        self.hf = hf
        self.backend = backend
        self.size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(
            {i for i, tok in added.items() if tok.special} | set(getattr(hf, "all_special_ids", []) or [])
        )
        self._special_by_content = {added[i].content: i for i in self.special_ids if i in added}

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def encode_prompt(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=True).ids

    def special_id(self, content: str) -> int | None:
        return self._special_by_content.get(content)

    def token_content(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    @cached_property
    def token_bytes(self) -> list[bytes | None]:
        """The bytes each id stands for (None for control tokens), whatever the tokenizer family.

        Example: Mistral '▁ma' -> b' ma', '<0xC5>' -> b'\\xc5'; Qwen 'Ġma' -> b' ma', 'Å' -> b'\\xc5'
        """
        byte_level = "ByteLevel" in str(self.backend.decoder)
        unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        out: list[bytes | None] = [None] * self.size
        for content, i in self.backend.get_vocab(with_added_tokens=True).items():
            if i in self.special_ids or i >= self.size:
                continue
            if byte_level:
                if all(c in unicode_to_byte for c in content):
                    out[i] = bytes(unicode_to_byte[c] for c in content)
            elif len(content) == 6 and content.startswith("<0x") and content.endswith(">"):
                out[i] = bytes([int(content[3:5], 16)])
            else:
                out[i] = content.replace("▁", " ").encode()
        return out

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the token → id map: equal fingerprints mean ids can pass between the two unchanged."""
        items = sorted(self.backend.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return hashlib.sha256(repr(items).encode()).hexdigest()


def same_vocabulary(a: Vocab, b: Vocab) -> bool:
    """True when both tokenizers map the same strings to the same ids (no translation needed)."""
    if a is b:
        return True
    fa, fb = getattr(a, "fingerprint", None), getattr(b, "fingerprint", None)
    return fa is not None and fa == fb


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
