"""Translation between a drafter's and a target's vocabularies. Pure Python, no mlx.

A translator keeps two token sequences for the same text: the target's committed ids and the drafter's
ids, and maps each cycle's drafts into target ids (`propose`) and the target's committed tokens back into
drafter ids (`commit`). Strategies:

- ``identity``: both models share a vocabulary; ids pass unchanged (chosen automatically).
- ``none``: draft ids pass through as if they were target ids (a control); ids the target vocabulary
  lacks end the proposal. The drafter is still re-synced through text.
- ``naive``: decode drafts to text, re-encode with no context (the SLEM baseline; word boundaries break).
- ``context``: decode and re-encode with a window of W committed tokens in front, then strip it at the
  exact character boundary, in both directions.
- ``tli``: token-level intersection. The drafter may only draft tokens that exist, byte for byte, in
  the target's vocabulary; ids map one to one, which makes lossless rejection sampling possible.

Absorption: re-encoding ``context + text`` may merge the last context token with the first new one
("w" + "ino" → "wino"). The committed token cannot change, so the proposal must start exactly at the
committed boundary. We detect the merge from character offsets and re-encode the absorbed remainder
on its own (anchored), so the proposal always extends the committed sequence exactly and never stalls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from uag.models.vocab import Vocab

STRATEGIES = ("none", "naive", "context", "tli")
DEFAULT_WINDOW = 10
REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
# Prefixes that end a word and do not merge with what follows in the tokenizers we know; each
# candidate is checked with offsets, so a tokenizer that does merge one simply moves to the next.
ANCHORS = ("\n", "a", ".", " ")
MAX_BACKOFF = 4  # drafter tokens re-encoded at most when a merge crosses the re-sync boundary


# --- text ↔ ids at a boundary -------------------------------------------------------------------


def text_after(vocab: Vocab, context: Sequence[int], new: Sequence[int], head: str | None = None) -> str:
    """Text that `new` adds after `context`, decoded together so leading spaces survive. `head` is
    `context` already decoded, if the caller has it.

    Example (SentencePiece): context ['▁Ala'], new ['▁ma'] -> ' ma'   (alone: 'ma')
    """
    if not context:
        return vocab.decode(new)
    if head is None:
        head = vocab.decode(context)
    full = vocab.decode([*context, *new])
    if full.startswith(head):
        return full[len(head) :]
    return vocab.decode(new)  # a decoder that rewrites the joint; rare, and only costs acceptance


def stable_text(vocab: Vocab, context: Sequence[int], new: Sequence[int], head: str | None = None) -> tuple[str, int]:
    """Text of `new` after `context`, without trailing tokens that end inside a UTF-8 character.

    Returns (text, n): `text` is the text of new[:n]; new[n:] are held back until they complete.
    Example: ['▁ma', '<0xC5>'] -> (' ma', 1)
    """
    n = len(new)
    text = text_after(vocab, context, new, head)
    # A character is at most 4 bytes, so at most 4 tokens can be waiting for its end.
    while text.endswith(REPLACEMENT) and n > 0 and len(new) - n < 4:
        n -= 1
        text = text_after(vocab, context, new[:n], head)
    if text.endswith(REPLACEMENT):  # a real U+FFFD in the output, not an incomplete character
        return text_after(vocab, context, new, head), len(new)
    return text, n


@dataclass(frozen=True, slots=True)
class Encoding:
    """Ids for some text placed after a boundary, and how they were obtained."""

    ids: list[int]
    absorbed: bool = False  # a token crossed the boundary; its remainder was re-encoded on its own
    fallback: bool = False  # the whole text had to be encoded on its own
    anchored: int = 0  # leading ids encoded on their own (the absorbed remainder, or all on a fallback)


def _split_at(offsets: Sequence[tuple[int, int]], boundary: int) -> tuple[int, int | None]:
    """(first token starting at or after `boundary`, index of a token crossing it or None)."""
    for i, (start, end) in enumerate(offsets):
        if start >= boundary:
            return i, None
        if end > boundary:
            return i, i
    return len(offsets), None


def encode_anchored(vocab: Vocab, text: str) -> list[int] | None:
    """Ids of `text` as a continuation in the middle of a text: no dummy prefix, no merge backwards.

    Example (SentencePiece): 'ino' -> ['ino']   (a plain encode gives ['▁in', 'o'])
    """
    if not text:
        return []
    for anchor in ANCHORS:
        ids, offsets = vocab.encode(anchor + text)
        i, crossing = _split_at(offsets, len(anchor))
        if crossing is None:
            return ids[i:]
    return None


def encode_after(vocab: Vocab, prefix: str, text: str) -> Encoding:
    """Ids for `text` as the tokenizer splits it after `prefix`, starting exactly at the boundary.

    Example (SentencePiece): prefix 'Ala', text ' ma kota' -> ['▁ma', '▁k', 'ota']
    Absorption: prefix 'w', text 'ino' would encode as ['▁wino']; the committed 'w' cannot change, so
    the part of the crossing token after the boundary is encoded on its own: ['ino'].
    """
    if not prefix:
        return Encoding(vocab.encode(text)[0])
    ids, offsets = vocab.encode(prefix + text)
    boundary = len(prefix)
    i, crossing = _split_at(offsets, boundary)
    if crossing is None:
        return Encoding(ids[i:])
    # Tokens wholly after the crossing token keep their in-context split; the crossing token's
    # remainder is encoded on its own.
    end = offsets[crossing][1]
    rest = crossing + 1
    while rest < len(ids) and offsets[rest][0] < end:  # tokens sharing the crossing token's span
        end = max(end, offsets[rest][1])
        rest += 1
    head = encode_anchored(vocab, text[: end - boundary])
    if head is not None:
        return Encoding(head + ids[rest:], absorbed=True, anchored=len(head))
    whole = encode_anchored(vocab, text) or []
    return Encoding(whole, absorbed=True, fallback=True, anchored=len(whole))


# --- translators ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Proposal:
    """Target ids proposed for verification, from one cycle's drafts."""

    ids: list[int]
    absorbed: bool = False
    fallback: bool = False
    empty: bool = False  # there were drafts, but no target token came out of them
    text: str = ""  # the drafts' text after the committed boundary, as translated (uag.core.anatomy reads it)
    anchored: int = 0  # leading ids encoded on their own (absorption or fallback)
    dropped: list[int] = field(default_factory=list)  # target ids left out: a control token and what follows
    held_drafts: int = 0  # trailing drafts held back: they end inside a UTF-8 character


@dataclass(frozen=True, slots=True)
class Resync:
    """How the drafter's sequence changed after a commit.

    The drafter's old sequence followed by the cycle's drafts is kept up to `cut`; everything after it
    in `Translator.drafter_ids` is new and has not been seen by the drafter.
    """

    cut: int
    absorbed: bool = False  # drafter tokens before the boundary were re-encoded because of a merge


def longest_common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items `a` and `b` share: token ids or text, the one common-prefix helper.

    Example: [5, 6, 7] vs [5, 6, 9] -> 2;  "Kraków ma" vs "Kraków jest" -> 7
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Translator:
    """Both sides' token sequences for one text, plus the mapping between them.

    Subclasses decide how drafts become target ids (`propose`) and how committed target tokens become
    drafter ids (`commit`). `target_ids` and `drafter_ids` include the prompt.
    """

    name = "identity"

    def __init__(self, target: Vocab, drafter: Vocab, *, window: int = DEFAULT_WINDOW):
        if window < 0:
            raise ValueError(f"window must be >= 0 (got {window})")
        self.target = target
        self.drafter = drafter
        self.window = window
        self.target_ids: list[int] = []
        self.drafter_ids: list[int] = []

    def begin(self, prompt_ids: Sequence[int]) -> list[int]:
        """`start`, unless this translator was started on `prompt_ids` and has been given no token since: a server
        checks the drafter's room with it first (uag.core.drafters.check_drafter_fits), and the run that follows
        need not translate the prompt again (both on the batch's worker, whose time every member waits on)."""
        if self.drafter_ids and len(self.target_ids) == len(prompt_ids) and self.target_ids == list(prompt_ids):
            return list(self.drafter_ids)
        return self.start(prompt_ids)

    def start(self, prompt_ids: Sequence[int]) -> list[int]:
        """Begin a run on the target's prompt; return the drafter's prompt ids."""
        self.target_ids = list(prompt_ids)
        self.drafter_ids = list(prompt_ids)
        return list(self.drafter_ids)

    def usable(self, draft_ids: Sequence[int]) -> list[int]:
        """The drafts worth translating: all of them when ids are shared (a drafted EOS is a real guess)."""
        return list(draft_ids)

    def propose(self, draft_ids: Sequence[int]) -> Proposal:
        return Proposal(list(draft_ids))

    def commit(self, draft_ids: Sequence[int], new_ids: Sequence[int]) -> Resync:
        """Append the target's newly committed tokens; bring the drafter to the same text."""
        keep = len(self.drafter_ids) + longest_common_prefix(draft_ids, new_ids)
        self.target_ids.extend(new_ids)
        self.drafter_ids.extend(new_ids)
        return Resync(keep)


class TextTranslator(Translator):
    """Translation through text, with `window` committed tokens of context (0 = naive)."""

    name = "context"

    def __init__(self, target: Vocab, drafter: Vocab, *, window: int = DEFAULT_WINDOW):
        super().__init__(target, drafter, window=window)
        self.target_stable = 0  # target_ids[:target_stable] is text the drafter has been given
        self._heads: dict[tuple[bool, tuple[int, ...]], str] = {}

    # The drafter sees the target's prompt as text; special tokens pass only where the drafter has
    # the same control token (ChatML's <|im_start|> in both, say), otherwise they are dropped.
    def start(self, prompt_ids: Sequence[int]) -> list[int]:
        self.target_ids = list(prompt_ids)
        self.target_stable = len(self.target_ids)
        # What the target's tokenizer adds by itself (its BOS) is the drafter tokenizer's job to add.
        own = self.target.encode_prompt("")
        first = len(own) if own and list(prompt_ids[: len(own)]) == own else 0
        pieces: list[str] = []
        run_start = first
        for i, token in enumerate([*prompt_ids[first:], None], start=first):
            if token is not None and token not in self.target.special_ids:
                continue
            if run_start < i:
                context = prompt_ids[max(first, run_start - self.window) : run_start]
                pieces.append(text_after(self.target, context, prompt_ids[run_start:i]))
            if token is not None:
                content = self.target.token_content(token)
                if self.drafter.special_id(content) is not None:
                    pieces.append(content)
            run_start = i + 1
        self.drafter_ids = self.drafter.encode_prompt("".join(pieces))
        self._decode_contexts()
        return list(self.drafter_ids)

    def usable(self, draft_ids: Sequence[int]) -> list[int]:
        """Drafts up to the drafter's first control token: those never become text."""
        return _until_special(draft_ids, self.drafter.special_ids)

    def _target_context(self) -> list[int]:
        return self.target_ids[max(0, self.target_stable - self.window) : self.target_stable]

    def _drafter_context(self) -> list[int]:
        return self.drafter_ids[max(0, len(self.drafter_ids) - self.window) :] if self.window else []

    def _head(self, vocab: Vocab, context: list[int]) -> str:
        """`context` decoded, remembered: both contexts are needed again by the next propose and commit."""
        key = (vocab is self.target, tuple(context))
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= 8:
                self._heads.clear()
            head = self._heads[key] = vocab.decode(context)
        return head

    def _decode_contexts(self) -> None:
        """Decode the next cycle's contexts now, while the tokenizers are warm. Between cycles the model
        passes evict them from the CPU caches, and a cold tokenizer call costs several times a warm one."""
        if self.window:
            self._head(self.target, self._target_context())
            self._head(self.drafter, self._drafter_context())

    def _draft_text(self, draft_ids: Sequence[int]) -> tuple[str, int]:
        context = self._drafter_context()
        return stable_text(self.drafter, context, draft_ids, self._head(self.drafter, context))

    def _to_target(self, text: str) -> Encoding:
        if not self.window:
            return Encoding(self.target.encode(text)[0])
        return encode_after(self.target, self._head(self.target, self._target_context()), text)

    def propose(self, draft_ids: Sequence[int]) -> Proposal:
        text, n = self._draft_text(draft_ids)
        if not text:
            return Proposal([], empty=bool(draft_ids), held_drafts=len(draft_ids) - n)
        enc = self._to_target(text)
        ids, anchored = enc.ids, enc.anchored
        # Target tokens already committed but still waiting for the rest of a character: the
        # re-encoded text must reproduce them before it can propose anything new.
        held = self.target_ids[self.target_stable :]
        if held:
            if ids[: len(held)] != held:
                return Proposal([], absorbed=enc.absorbed, fallback=True, empty=True, text=text)
            ids, anchored = ids[len(held) :], max(0, anchored - len(held))
        kept = _until_special(ids, self.target.special_ids)
        return Proposal(
            kept,
            absorbed=enc.absorbed,
            fallback=enc.fallback,
            empty=not kept,
            text=text,
            anchored=min(anchored, len(kept)),
            dropped=ids[len(kept) :],
            held_drafts=len(draft_ids) - n,
        )

    def commit(self, draft_ids: Sequence[int], new_ids: Sequence[int]) -> Resync:
        self.target_ids.extend(new_ids)
        context = self._target_context()
        new_text, n = stable_text(
            self.target, context, self.target_ids[self.target_stable :], self._head(self.target, context)
        )
        self.target_stable += n
        base = len(self.drafter_ids)
        if not new_text:  # only part of a character so far; the drafter waits for the rest
            return Resync(base)

        # 1. Keep the drafts whose text the target committed: they are valid drafter tokens for it.
        kept, covered = self._kept_drafts(draft_ids, new_text)
        sequence = [*self.drafter_ids, *draft_ids[:kept]]
        rest = new_text[len(covered) :]

        # 2. Encode the remainder after what is kept. If the drafter's tokenizer would merge across
        #    that boundary, step back a token (the drafter re-reads it, canonically split) and retry.
        cut, absorbed = len(sequence), False
        while True:
            if not self.window:
                ids = self.drafter.encode(rest)[0]
                break
            prefix = self.drafter.decode(sequence[max(0, cut - self.window) : cut])
            enc = encode_after(self.drafter, prefix, rest)
            if not enc.absorbed:
                ids = enc.ids
                break
            step_back = self._step_back(sequence, cut, base)
            if step_back is None:
                ids, absorbed = enc.ids, True
                break
            cut, rest = cut - 1, step_back + rest
            absorbed = True
        self.drafter_ids = [*sequence[:cut], *ids]
        self._decode_contexts()
        return Resync(cut, absorbed=absorbed)

    def _kept_drafts(self, draft_ids: Sequence[int], new_text: str) -> tuple[int, str]:
        """(n, text): the first n drafts, whose text `text` the committed `new_text` starts with."""
        context = self._drafter_context()
        head = self._head(self.drafter, context)
        kept, covered = 0, ""
        for j in range(1, len(draft_ids) + 1):
            text = text_after(self.drafter, context, draft_ids[:j], head)
            if text.endswith(REPLACEMENT):  # mid-character; the next draft may complete it
                continue
            if not new_text.startswith(text):
                break
            kept, covered = j, text
        return kept, covered

    def _step_back(self, sequence: list[int], cut: int, base: int) -> str | None:
        """Text of sequence[cut-1] if the drafter may re-read it; None if it may not."""
        if cut <= 1 or cut <= base - MAX_BACKOFF:
            return None
        context = sequence[max(0, cut - 1 - self.window) : cut - 1]
        text = text_after(self.drafter, context, sequence[cut - 1 : cut])
        return None if (not text or REPLACEMENT in text) else text


class NaiveTranslator(TextTranslator):
    """Decode → re-encode with no context (SLEM). Kept as the study's control: boundaries break."""

    name = "naive"

    def __init__(self, target: Vocab, drafter: Vocab, *, window: int = 0):
        super().__init__(target, drafter, window=0)


class PassThroughTranslator(TextTranslator):
    """Draft ids go to the target unchanged (a control). The drafter is re-synced through text."""

    name = "none"

    def propose(self, draft_ids: Sequence[int]) -> Proposal:
        valid = next((n for n, i in enumerate(draft_ids) if not 0 <= i < self.target.size), len(draft_ids))
        return Proposal(list(draft_ids[:valid]), empty=bool(draft_ids) and valid == 0)


def intersection(target: Sequence[bytes | None], drafter: Sequence[bytes | None]) -> dict[int, int]:
    """Drafter id → target id for tokens that stand for the same bytes (control tokens excluded).

    Where the target has several ids for the same bytes (a piece and its byte-fallback twin), the
    first non-fallback id wins. Example: target [b' ma', b'a'], drafter [b'a', b'x', b' ma'] -> {0: 1, 2: 0}
    """
    by_bytes: dict[bytes, int] = {}
    for i, content in enumerate(target):
        if content is not None and content not in by_bytes:
            by_bytes[content] = i
    return {d: by_bytes[content] for d, content in enumerate(drafter) if content is not None and content in by_bytes}


class IntersectionTranslator(TextTranslator):
    """TLI: drafts restricted to the shared tokens map id for id; re-sync goes through text as usual."""

    name = "tli"

    def __init__(self, target: Vocab, drafter: Vocab, *, window: int = DEFAULT_WINDOW):
        super().__init__(target, drafter, window=window)
        self.to_target = intersection(target.token_bytes, drafter.token_bytes)

    def propose(self, draft_ids: Sequence[int]) -> Proposal:
        ids = []
        for d in draft_ids:  # the drafter's logits are masked to the intersection; stop at any stray id
            if d not in self.to_target:
                break
            ids.append(self.to_target[d])
        return Proposal(ids, empty=bool(draft_ids) and not ids)


def _until_special(ids: Sequence[int], special_ids: frozenset[int]) -> list[int]:
    """Ids up to the first special token. Example: [5, 6, EOS, 7] -> [5, 6]"""
    for n, i in enumerate(ids):
        if i in special_ids:
            return list(ids[:n])
    return list(ids)


def make_translator(strategy: str, target: Vocab, drafter: Vocab, *, window: int, shared: bool) -> Translator:
    """The translator for a strategy; `shared` vocabularies always get the identity translator."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if shared:
        return Translator(target, drafter, window=window)
    cls = {
        "none": PassThroughTranslator,
        "naive": NaiveTranslator,
        "context": TextTranslator,
        "tli": IntersectionTranslator,
    }[strategy]
    return cls(target, drafter, window=window)
