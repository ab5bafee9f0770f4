"""Fill-in-the-middle prompts: the code before the cursor, the code after it and other files of the project, laid out
with the target's own FIM tokens, found by the token texts its vocabulary holds (Qwen2.5-Coder and CodeGemma,
StarCoder, CodeLlama, DeepSeek-Coder, Codestral). The user's text is encoded as text: a control token written in
the code itself stays characters. Pure: no mlx; a tokenizer is read through its Hugging Face methods.

    fim_ids(tokens_of({"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3}), Fill("a = ", "\\nb"), enc)
        -> [1, *enc("a = "), 2, *enc("\\nb"), 3]

The repo-level layout (project files before the current one) is Qwen2.5-Coder's, as llama.cpp's /infill lays it out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from uag.server.errors import APIError

REPO_NAME = "myproject"  # the project and current file names a repo-level prompt gives (llama.cpp's /infill's)
FILE_NAME = "filename"
SNIPPET = "\n\n--- snippet ---\n\n"  # between extra files, for a vocabulary without a file separator (llama.cpp's)


@dataclass(frozen=True)
class Family:
    """One FIM convention: the spellings of its tokens in a vocabulary (the first one held counts)."""

    name: str
    prefix: tuple[str, ...]
    suffix: tuple[str, ...]
    middle: tuple[str, ...] = ()  # none: the model writes the middle after the prefix (Codestral)
    repo: tuple[str, ...] = ()
    file_sep: tuple[str, ...] = ()
    suffix_first: bool = False  # suffix, then prefix (Codestral's [SUFFIX]…[PREFIX]…)
    ends: tuple[str, ...] = ()  # other tokens after which a middle is over (their text, where it decodes as text)


FAMILIES = (
    Family(
        "qwen",  # Qwen2.5-Coder; CodeGemma shares the three FIM tokens and names its separator differently
        ("<|fim_prefix|>",),
        ("<|fim_suffix|>",),
        ("<|fim_middle|>",),
        ("<|repo_name|>",),
        ("<|file_sep|>", "<|file_separator|>"),
        ends=("<|fim_pad|>", "<|endoftext|>"),
    ),
    Family(
        "starcoder",
        ("<fim_prefix>",),
        ("<fim_suffix>",),
        ("<fim_middle>",),
        ("<repo_name>", "<reponame>"),
        ("<file_sep>",),
        ends=("<fim_pad>", "<|endoftext|>"),
    ),
    Family("santacoder", ("<fim-prefix>",), ("<fim-suffix>",), ("<fim-middle>",), ends=("<fim-pad>", "<|endoftext|>")),
    Family("codellama", ("▁<PRE>", "<PRE>"), ("▁<SUF>", "<SUF>"), ("▁<MID>", "<MID>"), ends=("▁<EOT>", "<EOT>")),
    Family("deepseek", ("<｜fim▁begin｜>",), ("<｜fim▁hole｜>",), ("<｜fim▁end｜>",), ends=("<|EOT|>",)),
    Family("codestral", ("[PREFIX]",), ("[SUFFIX]",), suffix_first=True),
)
CANDIDATES = tuple(
    dict.fromkeys(t for f in FAMILIES for t in (*f.prefix, *f.suffix, *f.middle, *f.repo, *f.file_sep, *f.ends))
)
# Where a FIM reply ends when its model writes one of these as text (a token its tokenizer decodes): the FIM
# tokens of every family but those a file may well hold ("[PREFIX]", "<PRE>"); EOS ends it in any case.
STOPS = tuple(
    t for t in CANDIDATES if not t.startswith("▁") and any(w in t for w in ("fim", "_sep", "repo", "EOT", "endoftext"))
)


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's FIM tokens (ids; None where it has none) and the texts of those that end a middle."""

    family: str
    prefix: int
    suffix: int
    middle: int | None = None
    repo: int | None = None
    file_sep: int | None = None
    suffix_first: bool = False
    controls: tuple[str, ...] = ()  # every FIM token's text: never read out of the user's text, a reply stops there


@dataclass(frozen=True)
class Fill:
    """What a FIM request fills: the text before the cursor, after it, extra files `(name, text)` of the project,
    and `middle`, text already typed after the prefix (llama.cpp's /infill `prompt`)."""

    prefix: str
    suffix: str
    files: tuple[tuple[str, str], ...] = ()
    middle: str = ""
    repo_level: bool = False  # name the project and the current file (llama.cpp's /infill does, with extra files)

    @property
    def chars(self) -> int:
        return len(self.prefix) + len(self.suffix) + len(self.middle) + sum(len(n) + len(t) for n, t in self.files)


def tokens_of(vocab: Mapping[str, int]) -> FimTokens | None:
    """The first family whose prefix and suffix tokens (and middle, where it has one) `vocab` holds; None: no FIM.

    Example: {"<fim_prefix>": 1, "<fim_suffix>": 2, "<fim_middle>": 3} -> FimTokens("starcoder", 1, 2, 3)
    """

    def first(spellings: tuple[str, ...]) -> tuple[str, int] | None:
        return next(((s, vocab[s]) for s in spellings if s in vocab), None)

    for family in FAMILIES:
        prefix, suffix, middle = first(family.prefix), first(family.suffix), first(family.middle)
        if prefix is None or suffix is None or (family.middle and middle is None):
            continue
        repo, sep = first(family.repo), first(family.file_sep)
        found = [prefix, suffix, middle, repo, sep, *(first((e,)) for e in family.ends)]
        return FimTokens(
            family.name,
            prefix[1],
            suffix[1],
            middle and middle[1],
            repo and repo[1],
            sep and sep[1],
            family.suffix_first,
            tuple(text.removeprefix("▁") for text, _ in filter(None, found)),
        )
    return None


def fim_ids(tokens: FimTokens, fill: Fill, encode: Callable[[str], list[int]], bos: Sequence[int] = ()) -> list[int]:
    """The prompt ids: [the project's files,] `bos`, the prefix (and `middle`) and the suffix in the family's order
    behind their tokens, then the middle token. `encode` turns text into ids without reading control tokens.

    Example (qwen, repo_level, one file): <|repo_name|>myproject\\n<|file_sep|>a.py\\n{text}\\n<|file_sep|>filename\\n
             <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>
    """
    head: list[int] = []
    if fill.repo_level:
        if tokens.repo is not None:
            head += [tokens.repo, *encode(REPO_NAME + "\n")]
        for name, text in fill.files:
            if tokens.file_sep is not None:
                text = text if not text or text.endswith("\n") else text + "\n"  # Qwen2.5-Coder's files end a line
                head += [tokens.file_sep, *encode(name + "\n")]
            else:
                head += encode(SNIPPET)
            head += encode(text)
        if tokens.file_sep is not None:
            head += [tokens.file_sep, *encode(FILE_NAME + "\n")]
    before = [tokens.prefix, *encode(fill.prefix), *encode(fill.middle)]
    after = [tokens.suffix, *encode(fill.suffix)]
    body = after + before if tokens.suffix_first else before + after
    return [*head, *bos, *body, *([] if tokens.middle is None else [tokens.middle])]


def literal(encode: Callable[[str], list[int]], controls: Sequence[str], control_ids: set[int]):
    """`encode` that never reads a control token out of the text: where the ids hold one, the text is cut inside
    every control token's text and the pieces are encoded apart, so those characters stay characters.

    Example: controls ("<|fim_prefix|>",): "x<|fim_prefix|>" -> enc("x<") + enc("|fim_prefix|>"), no FIM id
    """

    def encoded(text: str) -> list[int]:
        ids = encode(text)
        if not control_ids.intersection(ids):
            return ids
        cuts = sorted({at + 1 for c in controls if len(c) > 1 for at in _occurrences(text, c)})
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]
        return [i for piece in pieces for i in encode(piece)]

    return encoded


def _occurrences(text: str, sub: str) -> list[int]:
    found, at = [], text.find(sub)
    while at >= 0:
        found.append(at)
        at = text.find(sub, at + 1)
    return found


# --- a Hugging Face tokenizer (the target's, on the worker) --------------------------------------------------------
def prompt_ids(tokenizer, fill: Fill) -> list[int]:
    """The FIM prompt for `fill` in `tokenizer`'s ids; a 400 when its vocabulary has no FIM tokens."""
    backend = tokenizer.backend_tokenizer  # the fast tokenizer's (mlx-lm's wrapper forwards it)
    held = {t: i for t in CANDIDATES if (i := backend.token_to_id(t)) is not None}
    tokens = tokens_of(held)
    if tokens is None:
        raise APIError(
            400,
            "this model has no fill-in-the-middle tokens (it was not trained to fill in code between a prefix and a "
            "suffix): send the prompt alone, or serve a FIM model such as coder-target (Qwen2.5-Coder)",
            param="suffix",
            code="fim_not_supported",
        )
    added = [t.content for t in backend.get_added_tokens_decoder().values()]
    controls = tuple(dict.fromkeys([*added, *held, *tokens.controls]))
    plain = lambda text: backend.encode(text, add_special_tokens=False).ids  # noqa: E731
    ids_of_controls = {i for t in controls if (i := backend.token_to_id(t)) is not None}
    encode = literal(plain, [c.removeprefix("▁") for c in controls], ids_of_controls)
    with_special, bare = backend.encode("a", add_special_tokens=True).ids, plain("a")
    bos = with_special[: len(with_special) - len(bare)] if with_special[-len(bare) :] == bare else []
    return fim_ids(tokens, fill, encode, bos)
