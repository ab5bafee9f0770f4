"""Where a server benchmark's reply parts from the reference's for the same request: a near-tie, or a bug (issue 52).

The server benchmarks keep texts, not tokens. Where a condition's greedy text differs from the reference's (uag:off
for the same request; serve_many also uag:off batched against uag:off at the lowest concurrency), the request's
messages are rebuilt from the rows — a conversation's earlier turns are equal in both, or the turn follows an
earlier parting and shares its verdict — and, after the servers stop, the target is loaded in this process:
`uag.runtime.margins.text_divergence` tokenizes both texts and weighs the target's margin at their first differing
token against the dtype's near-tie bound. One "parted" row per difference goes to the rows file; the summaries count
them. Everything here but `classify` is pure (no mlx).

    found = compare("uag:lookup", "uag:off", texts, reference_texts, {"repeat": 0}, {"repeat": 0})
    rows = classify(found.parted, "demo-target")          # loads the target
    note(found, verdicts(rows))  -> "(1 near-tie: code-024 t1 (r1) margin 0.003; 0 bugs)"
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

Turn = tuple[str, str, int]  # (workload, item, turn)
NOT_COMPARED = ("ttft-cold",)  # a stream closed at its first token
NEAR_TIE, BUG, FOLLOWS, UNCLASSIFIED = "near-tie", "bug", "follows", "not classified"
LISTED = 6  # near-ties and bugs named on a summary line


@dataclass(frozen=True)
class Said:
    """One reply: its text, and whether the model ended it itself (finish reason "stop": an end-of-text token)."""

    text: str
    ended: bool = False


@dataclass(frozen=True)
class Parted:
    """A reply whose text differs from the reference's for the same request. `earlier`: the texts of the turns its
    messages are built from (equal in both runs); None where one of them parted too (`follows`, the first that did)
    or is not in the rows."""

    condition: str
    reference: str
    where: Mapping[str, int]  # the condition's run: {"repeat": 0} or {"repeat": 0, "concurrency": 4}
    reference_where: Mapping[str, int]
    turn: Turn
    texts: tuple[Said, Said]  # the reference's, the condition's
    earlier: tuple[str, ...] | None
    follows: Turn | None = None

    @property
    def key(self) -> tuple:
        return key_of(self.condition, self.reference, self.where, self.reference_where, self.turn)


@dataclass
class Comparison:
    """A condition's replies against the reference's: how many were compared, how many equal, which parted."""

    condition: str
    reference: str
    same: int = 0
    total: int = 0
    parted: list[Parted] = field(default_factory=list)
    label: str = ""  # what tells this comparison from another of the same two conditions (e.g. "C=4 vs C=1")

    def add(self, other: Comparison) -> None:
        self.same, self.total = self.same + other.same, self.total + other.total
        self.parted += other.parted


def key_of(condition: str, reference: str, where: Mapping, reference_where: Mapping, turn: Sequence) -> tuple:
    """What ties a parted row to its parting. Example: ("a", "b", {"repeat": 0}, {"repeat": 0}, ["chat", "x", 1])
    -> ("a", "b", (("repeat", 0),), (("repeat", 0),), ("chat", "x", 1))"""
    return condition, reference, tuple(sorted(where.items())), tuple(sorted(reference_where.items())), tuple(turn)


def replies(rows: Iterable[dict], by: Sequence[str] = ("repeat",)) -> dict[str, dict[tuple, dict[Turn, Said]]]:
    """The rows' replies (kind "turn" or "request"): per condition, per run (the `by` fields' values), per turn.

    Example: [{"kind": "turn", "condition": "uag:off", "repeat": 0, "workload": "chat", "item": "code-024",
               "turn": 1, "text": "Hi", "finish_reason": "stop"}] -> {"uag:off": {(0,): {("chat", "code-024", 1):
               Said("Hi", True)}}}
    """
    out: dict[str, dict[tuple, dict[Turn, Said]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r.get("kind") in ("turn", "request") and r["workload"] not in NOT_COMPARED:
            turn = (r["workload"], r["item"], r["turn"])
            out[r["condition"]][tuple(r[f] for f in by)][turn] = Said(r["text"], r.get("finish_reason") == "stop")
    return out


def sources(turn: Turn) -> list[Turn]:
    """The turns whose replies a turn's messages carry: a conversation's earlier turns; a retry's first turn (the
    edit conversation's); none for open chat.

    Example: ("edit", "edit-001", 3) -> [("edit", "edit-001", 1), ("edit", "edit-001", 2)];
             ("retry", "edit-001", 2) -> [("edit", "edit-001", 1)];  ("chat", "code-024", 1) -> []
    """
    workload, item, n = turn
    if workload == "retry":
        return [("edit", item, 1)]
    if workload == "chat":
        return []
    return [(workload, item, k) for k in range(1, n)]


def compare(
    condition: str,
    reference: str,
    said: Mapping[Turn, Said],
    reference_said: Mapping[Turn, Said],
    where: Mapping[str, int],
    reference_where: Mapping[str, int],
) -> Comparison:
    """`condition`'s replies in one run against `reference`'s in one run, turn by turn (the turns both have).

    Example: {t1: "a", t2: "b"} against {t1: "a", t2: "c"} -> same 1, total 2, parted [t2 (earlier ("a",))]
    """
    out = Comparison(condition, reference)
    for turn in [t for t in said if t in reference_said]:
        out.total += 1
        if said[turn].text == reference_said[turn].text:
            out.same += 1
            continue
        before = sources(turn)
        follows = next(
            (t for t in before if t in said and t in reference_said and said[t].text != reference_said[t].text), None
        )
        known = all(t in reference_said for t in before)
        earlier = tuple(reference_said[t].text for t in before) if known and follows is None else None
        texts = (reference_said[turn], said[turn])
        out.parted.append(
            Parted(condition, reference, dict(where), dict(reference_where), turn, texts, earlier, follows)
        )
    return out


def messages(turn: Turn, earlier: Sequence[str], conversations: Mapping, chats: Mapping[str, str]) -> list[dict]:
    """The messages a benchmark sent for `turn`, after the replies `earlier` (`sources(turn)`'s texts): open chat's
    one instruction, a conversation's turns so far (`edit`, its `retry`, the `ttft` conversation), or an aider
    format's replay (`aider-whole`, `aider-diff`: the file moved on by each earlier reply, as aider sends it).

    Example: ("edit", "edit-001", 2), ["Fixed."] -> [{"role": "system", …}, {"role": "user", <turn 1>},
             {"role": "assistant", "content": "Fixed."}, {"role": "user", <turn 2>}]
    """
    workload, item, _ = turn
    if workload == "chat":
        return [{"role": "user", "content": chats[item]}]
    conversation = conversations[item]
    if not workload.startswith("aider-"):
        return conversation.messages(list(earlier))
    import edit_formats  # benchmarks/edit_formats.py, beside this module

    replay = edit_formats.Replay.of(conversation, workload.removeprefix("aider-"))
    for text in earlier:
        replay.answer(text)
    return replay.messages()


def parted_row(p: Parted, verdict: dict | None, why: str | None) -> dict:
    """The rows file's record of one parting and its verdict (`uag.runtime.divergence.Divergence.to_dict()`)."""
    return {
        "kind": "parted",
        "condition": p.condition,
        "reference": p.reference,
        "where": dict(p.where),
        "reference_where": dict(p.reference_where),
        "workload": p.turn[0],
        "item": p.turn[1],
        "turn": p.turn[2],
        "follows": None if p.follows is None else list(p.follows),
        "verdict": verdict,
        "why": why,
    }


def verdicts(rows: Iterable[dict]) -> dict[tuple, dict]:
    """The rows file's parted rows by the key of their parting (`Parted.key`)."""
    return {
        key_of(
            r["condition"], r["reference"], r["where"], r["reference_where"], (r["workload"], r["item"], r["turn"])
        ): r
        for r in rows
        if r.get("kind") == "parted"
    }


def kind_of(p: Parted, found: Mapping[tuple, dict]) -> str:
    """NEAR_TIE, BUG or UNCLASSIFIED for one parting (one that follows an earlier parting: that one's kind)."""
    if p.follows is not None:
        first = key_of(p.condition, p.reference, p.where, p.reference_where, p.follows)
        row = found.get(first)
    else:
        row = found.get(p.key)
    kind = ((row or {}).get("verdict") or {}).get("kind")
    return {"diverged_near_tie": NEAR_TIE, "diverged": BUG}.get(kind, UNCLASSIFIED)


def note(comparison: Comparison, found: Mapping[tuple, dict]) -> tuple[str, str]:
    """(what the summary says of a comparison's partings, its verdict): met where every reply is equal or parted at a
    near-tie (or follows one); NOT met where one is a bug; "not classified" where some are not known.

    Example: 2 parted, one a near-tie at margin 0.003 and one following it ->
             ("(1 near-tie: code-024 t1 (r1) margin 0.003; 0 bugs; 1 follows an earlier parting)", "met: near-ties")
    """
    if not comparison.parted:
        return "", "met" if comparison.total else "NOT met"
    kinds = {p.key: kind_of(p, found) for p in comparison.parted}
    ties = [p for p in comparison.parted if p.follows is None and kinds[p.key] == NEAR_TIE]
    bugs = [p for p in comparison.parted if p.follows is None and kinds[p.key] == BUG]
    follow = sum(p.follows is not None for p in comparison.parted)
    unknown = sum(kind == UNCLASSIFIED for kind in kinds.values())

    def named(ps: list[Parted]) -> str:
        out = []
        for p in ps[:LISTED]:
            where = ", ".join(f"r{v + 1}" if k == "repeat" else f"C={v}" for k, v in p.where.items())
            margin = ((found.get(p.key) or {}).get("verdict") or {}).get("margin")
            out.append(f"{p.turn[1]} t{p.turn[2]} ({where}) margin {'?' if margin is None else f'{margin:.2g}'}")
        return ", ".join(out) + (", …" if len(ps) > LISTED else "")

    parts = [f"{len(ties)} near-tie{'s' * (len(ties) != 1)}" + (f": {named(ties)}" if ties else "")]
    parts.append(f"{len(bugs)} bug{'s' * (len(bugs) != 1)}" + (f": {named(bugs)}" if bugs else ""))
    if follow:
        parts.append(f"{follow} follow{'s' * (follow == 1)} an earlier parting")
    if unknown:
        parts.append(f"{unknown} not classified")
    verdict = "NOT met" if bugs else "not classified" if unknown else "met: near-ties"
    return f"({'; '.join(parts)})", verdict


def chat_texts() -> dict[str, str]:
    """Every bundled instruction open chat may send, by id (serving.chat_prompts draws from these)."""
    from uag.study.datasets import load_bundled

    return {p.id: p.text for p in [*load_bundled("alpaca"), *load_bundled("code")]}


def classify(parted: Sequence[Parted], target, say=print) -> list[dict]:
    """A parted row per parting, with its verdict: the target (a name: loaded here as the servers load it, as
    stored, only where a parting needs it; or a loaded model), each request's messages through its chat template
    (uag.server.chat.render, as the server reads them), and the margin where the two texts part
    (uag.runtime.margins.text_divergence)."""
    needed = [p for p in parted if p.follows is None and p.earlier is not None]
    rows = {p.key: parted_row(p, None, f"follows turn {p.follows[2]}") for p in parted if p.follows is not None}
    rows |= {
        p.key: parted_row(p, None, "the turns its messages carry are not in the rows")
        for p in parted
        if p.follows is None and p.earlier is None
    }
    if needed:
        from uag.models.store import ModelStore
        from uag.runtime.margins import text_divergence
        from uag.server.chat import render
        from uag.study.datasets import load_conversations

        model = ModelStore().get(target) if isinstance(target, str) else target
        conversations, chats = {c.id: c for c in load_conversations("edit")}, chat_texts()
        for p in needed:
            ids = render(model.tokenizer, messages(p.turn, p.earlier, conversations, chats))
            (a, b) = p.texts
            found = text_divergence(model, ids, a.text, b.text, ended=(a.ended, b.ended))
            why = None if found is not None else "the retokenized texts' tokens there are not the target's top choice"
            rows[p.key] = parted_row(p, None if found is None else found.to_dict(), why)
            kind = "not classified" if found is None else found.kind
            say(f"{p.condition} vs {p.reference}, {p.turn[1]} turn {p.turn[2]} {dict(p.where)}: {kind}")
    return [rows[p.key] for p in parted]
