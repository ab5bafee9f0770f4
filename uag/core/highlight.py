"""Which parts of the output came from the drafter: spans for the app, ANSI colour for the terminal."""

from __future__ import annotations

from collections.abc import Iterable

from uag.core.records import Token

DRAFT = "accepted draft"
TARGET = "target"


def spans(tokens: Iterable[Token]) -> list[tuple[str, str | None]]:
    """Runs of text with the same origin, as `gr.HighlightedText` takes them.

    Tokens produced by the target itself get no label (None); accepted draft tokens get `DRAFT`.
    Example: [('Ala', draft), (' ma', draft), (' kota', target)] -> [('Ala ma', DRAFT), (' kota', None)]
    """
    out: list[tuple[str, str | None]] = []
    for token in tokens:
        if not token.text:
            continue
        label = DRAFT if token.from_draft else None
        if out and out[-1][1] == label:
            out[-1] = (out[-1][0] + token.text, label)
        else:
            out.append((token.text, label))
    return out


def ansi(tokens: Iterable[Token], *, colour: bool = True) -> str:
    """The text with accepted draft spans in green (plain text when `colour` is off)."""
    if not colour:
        return "".join(t.text for t in tokens)
    return "".join(f"\x1b[32m{text}\x1b[0m" if label else text for text, label in spans(tokens))
