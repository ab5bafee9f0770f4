"""Where every draft went: why proposed target tokens were not accepted. Pure Python, no mlx.

A cycle proposes target tokens; the target accepts a prefix and writes its own next token (the
correction). Every proposed position after the accepted prefix is lost to the cause of the *first*
rejection (the target never looks past it), which is one of:

- ``disagree`` (a): the drafter's text differs from the target's — the models disagree.
- ``split`` (b): the drafter's text covers the target's next token exactly, but translation proposed
  other tokens for that text (translation loss).
- ``absorbed`` (d): as ``split``, inside the part of the proposal that had to be encoded on its own
  because a token merged across the committed boundary (absorption), or on a fallback.
- ``short``: the draft ended before the target's split was decided: inside the target's next token
  (" Kra" proposed, " Kraków" written), or inside a word whose split changes once it goes on (" ma"
  proposed as "▁ma"; the target writes " małopolskie" as "▁m", "ał", …). No translation of that text
  could know; counted apart, and not as translation loss.

Positions that never became proposals are counted too:

- ``held`` (c): target tokens the translator left out (a control token and what follows it) although
  the target then wrote exactly them: they would have been accepted. What the token budget cuts at
  the end of a run is no loss: the run stops there whatever is proposed. Drafts held back because they
  end inside a UTF-8 character are like ``short``: that character is part of the target's next token.

Translation loss is split + held + absorbed; with a drafter that drafts exactly the target's text it
should be ≈ 0 (tests/core/test_anatomy.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from uag.core.translate import longest_common_prefix
from uag.models.vocab import Vocab

REPLACEMENT = "\ufffd"
CONTEXT = 8  # committed tokens decoded in front of a cycle's tokens, so their leading spaces survive


@dataclass(frozen=True, slots=True)
class Loss:
    """Lost target positions by cause, for one cycle or summed over a run (`a + b`)."""

    disagree: int = 0
    split: int = 0
    held: int = 0
    absorbed: int = 0
    short: int = 0

    def __add__(self, other: Loss) -> Loss:
        return Loss(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Loss)))

    @property
    def translation(self) -> int:
        """Positions lost to translation, not to the models: split + held + absorbed."""
        return self.split + self.held + self.absorbed

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


def classify(
    draft: str,
    proposed: Sequence[str],
    accepted: int,
    written: Sequence[str],
    *,
    anchored: int = 0,
    dropped: Sequence[str] = (),
) -> Loss:
    """The loss of one cycle, from texts after the committed boundary.

    `draft`: the drafter's text the proposal came from; `proposed`: the text of each proposed target
    token; `written`: the text of each token the target wrote from the boundary on (the accepted ones,
    the correction, and any later ones known); `anchored`: leading proposed tokens encoded on their own
    (absorption or fallback); `dropped`: texts of target tokens left out after the proposal.

    Example: draft ' Kraków ma', proposed [' Kra', 'ków', ' ma'], accepted 0, written [' Kraków', ' jest']
             -> Loss(split=3)   (the text was right; ' Kraków' is one target token)
             draft ' Kra', proposed [' Kra'], written [' Kraków'] -> Loss(short=1)
             draft ' Kraków', proposed [' Kraków'], accepted 1, written [' Kraków', ' ma'],
             dropped [' ma'] -> Loss(held=1)
    """
    lost = len(proposed) - accepted
    if lost <= 0:
        held = 0
        for left_out, wrote in zip(dropped, written[accepted:]):
            if not left_out or left_out != wrote:  # a control token has no text to compare
                break
            held += 1
        return Loss(held=held)
    done = len("".join(proposed[:accepted]))
    rest, after = draft[done:], "".join(written[accepted:])
    correction = written[accepted] if accepted < len(written) else ""
    agreed = longest_common_prefix(rest, after)
    span = max(len(correction), len(proposed[accepted]))  # the rejected token and the target's own
    if not correction or agreed < min(span, len(rest)):  # the texts part inside one of them
        return Loss(disagree=lost)
    if agreed == len(rest) and (len(correction) > len(rest) or _unfinished_word(rest, after[len(rest) :]) == 0):
        return Loss(short=lost)  # the draft ended inside the target's token, or inside the word it starts
    return Loss(absorbed=lost) if accepted < anchored else Loss(split=lost)


def _unfinished_word(text: str, following: str) -> int | None:
    """Where the last word of `text` starts (with its leading space) when `text` ends inside it; None
    when it ends at a word's end. `following`: the text known to come next ("" if none is known).

    Example: ' Wrocławi', 'u i' -> 0;  'zt: ma', '' -> 3;  ' ma', ' kota' -> None
    """
    if not text or not text[-1].isalnum() or (following and not following[0].isalnum()):
        return None
    start = len(text)
    while start > 0 and text[start - 1].isalnum():
        start -= 1
    return start - 1 if start > 0 and text[start - 1] == " " else start


def token_texts(vocab: Vocab, context: Sequence[int], ids: Sequence[int]) -> list[str]:
    """Each token's text after `context`; a token inside a multi-byte character gets "" and the token
    completing it the whole character.

    Example (SentencePiece): context ['▁Ala'], ids ['▁ma', '▁k', 'ota'] -> [' ma', ' k', 'ota']
    """
    head = vocab.decode(context)
    texts, done = [], ""
    for n in range(1, len(ids) + 1):
        full = vocab.decode([*context, *ids[:n]])
        text = full[len(head) :] if full.startswith(head) else full
        text = text.rstrip(REPLACEMENT) if n < len(ids) else text
        texts.append(text[len(done) :] if text.startswith(done) else "")
        done = text if text.startswith(done) else done
    return texts


def of_ids(
    vocab: Vocab,
    context: Sequence[int],
    proposed: Sequence[int],
    accepted: int,
    written: Sequence[int],
    *,
    draft: str | None = None,
    anchored: int = 0,
    dropped: Sequence[int] = (),
) -> Loss:
    """The loss of one cycle from target ids: `context` (committed ids just before the boundary, for
    the leading spaces), the `proposed` ids, how many were `accepted`, the ids the target `written` from
    the boundary on. `draft`: the drafts' text, when the proposal came from text (None: the proposal's
    own text, as for prompt lookup or TLI, whose drafts are target tokens already)."""
    if accepted >= len(proposed) and not dropped:  # the common case needs no text
        return Loss()
    texts = token_texts(vocab, context, [*proposed, *dropped])
    n = len(proposed)
    text = "".join(texts) if draft is None else draft
    return classify(
        text, texts[:n], accepted, token_texts(vocab, context, written), anchored=anchored, dropped=texts[n:]
    )


def of_cycle(translator, proposal, proposed: Sequence[int], accepted: int, written: Sequence[int]) -> Loss:
    """The loss of one cycle of a text translator (uag.core.translate.TextTranslator and its subclasses);
    call it after verification and *before* `translator.commit`.

    `proposal`: what `translator.propose` returned; `proposed`: the ids verified (the proposal, cut to
    the token budget; a budget cut is no loss: the run ends there); `written`: the target ids the
    cycle committed from the boundary on (the accepted ones and the correction; later ones too, when
    known, sharpen the verdict).
    """
    stable = translator.target_stable
    context = translator.target_ids[max(0, stable - max(translator.window, CONTEXT)) : stable]
    held = translator.target_ids[stable:]  # committed, waiting for a character's end: part of the text
    return of_ids(
        translator.target,
        context,
        [*held, *proposed],
        len(held) + accepted,
        [*held, *written],
        draft=proposal.text or None,
        anchored=len(held) + proposal.anchored,
        dropped=proposal.dropped,
    )
