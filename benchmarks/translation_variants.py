"""Which translation choices raise acceptance? Drafter-only replay of speculative runs, variant by variant.

Greedy speculation is lossless, so the target's verdict on any proposal is known in advance: it accepts
the longest prefix that matches its own baseline continuation and then writes the baseline's next token.
This script records the target's baseline once per prompt, then replays speculative cycles with the real
drafter and a translator variant, exactly as uag/engine.py runs them (the drafter reads what it has not
seen with its first pass, its cache is rewound to the translator's re-sync cut). Only the drafter runs,
so a variant costs a third of a real run and the counts are exact and free of timing noise; the winner is
then checked end to end with benchmarks/peer_fork.py. The fork's own translation is replayed too (as in
its speculative_generate_step), which checks the replay against the fork's real runs.

Variants (comma-separated, each `name` or `name:key=value:key=value`):
  uag            uag's TextTranslator as it is       fork        the fork's translation and re-sync
  fork-commit    uag's translation of drafts with the fork's re-sync (drafts dropped, each cycle's text alone)
  keys for uag:  prompt=plain|fork|token=<control token>   resync=own|canonical|pieces|pieces-all   backoff=N   window=N
                 (pieces: the drafter's history split where the target's is — accepted drafts kept, each
                 committed target piece after them encoded on its own, in context; pieces-all: drafts dropped too)
  keys for both: first=draft|prefill (both draft before the prompt pass, which verifies that draft; prefill:
                 the prompt pass writes the first token and drafting starts after it, as uag once did)
                 end=bonus|fill (uag leaves room for the target's own token at the budget; the fork does not)

Usage: python benchmarks/translation_variants.py [--datasets wiki alpaca synthetic] [--n 4] [--skip 0]
       [--ks 2 4] [--max-tokens 48] [--variants uag fork uag:prompt=doc ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx

import uag.core.translate as translate
from uag.core import anatomy
from uag.core.config import GenerationConfig
from uag.core.engine import generate, prompt_ids
from uag.core.translate import Proposal, Resync, TextTranslator, Translator
from uag.machine import cache_dir
from uag.models.store import ModelStore
from uag.study.datasets import load_bundled

SHOW: set[str] = set()  # loss causes whose cycles are printed (--show)
TRACE: list[bool] = []  # print every cycle (--trace)
ENGLISH = (
    "The history of the bicycle begins in the early nineteenth century, when",
    "Explain in simple words why the sky is blue during the day and red at sunset.",
    "Write a short list of five tips for someone who wants to learn to cook.",
    "What is the capital of Australia, and why is it not Sydney?",
)


# --- translator variants ---------------------------------------------------------------------------


class Variant(TextTranslator):
    """uag's context translator with one choice changed (the defaults are uag's own)."""

    def __init__(self, target, drafter, *, window: int, prompt: str, resync: str, backoff: int):
        super().__init__(target, drafter, window=window)
        self.prompt_mode, self.resync_mode, self.backoff = prompt, resync, backoff

    def start(self, prompt_ids: Sequence[int]) -> list[int]:
        ids = super().start(prompt_ids)
        if self.prompt_mode == "fork":  # the target's prompt decoded with its control tokens as text
            text = self.target.backend.decode(list(prompt_ids), skip_special_tokens=False)
            self.drafter_ids = self.drafter.encode(text)[0]
        elif self.prompt_mode.startswith("token="):  # a drafter control token in front
            self.drafter_ids = [self.drafter.special_id(self.prompt_mode[6:]), *ids]
        self._decode_contexts()
        return list(self.drafter_ids)

    def commit(self, draft_ids: Sequence[int], new_ids: Sequence[int]) -> Resync:
        if self.resync_mode.startswith("pieces"):
            return self._commit_pieces(draft_ids if self.resync_mode == "pieces" else [], new_ids)
        saved, translate.MAX_BACKOFF = translate.MAX_BACKOFF, self.backoff
        try:
            drafts = draft_ids if self.resync_mode == "own" else []  # canonical: re-encode accepted drafts too
            return super().commit(drafts, new_ids)
        finally:
            translate.MAX_BACKOFF = saved

    def _commit_pieces(self, draft_ids: Sequence[int], new_ids: Sequence[int]) -> Resync:
        """The drafter's history split where the target's is: the accepted drafts kept (none for
        pieces-all), then every committed target piece after them encoded on its own, in context."""
        start = self.target_stable
        self.target_ids.extend(new_ids)
        context = self._target_context()
        head = self._head(self.target, context)
        new_text, n = translate.stable_text(self.target, context, self.target_ids[start:], head)
        self.target_stable += n
        base = len(self.drafter_ids)
        if not new_text:
            return Resync(base)
        pieces = self.target_ids[start : start + n]
        bounds = []  # where each committed piece but the last ends (never inside a character)
        for i in range(1, n):
            text = translate.text_after(self.target, context, pieces[:i], head)
            if not text.endswith(translate.REPLACEMENT) and new_text.startswith(text) and text:
                bounds.append(len(text))
        kept, covered_text = self._kept_drafts(draft_ids, new_text)
        covered = len(covered_text)
        sequence = [*self.drafter_ids, *draft_ids[:kept]]
        cut = len(sequence)
        for lo, hi in zip([covered, *bounds], [*bounds, len(new_text)]):
            if hi <= covered or hi <= lo:
                continue
            lo = max(lo, covered)
            prefix = self.drafter.decode(sequence[max(0, len(sequence) - self.window) :]) if self.window else ""
            sequence += translate.encode_after(self.drafter, prefix, new_text[lo:hi]).ids
        self.drafter_ids = sequence
        self._decode_contexts()
        return Resync(cut)


class ForkTranslator(Translator):
    """The fork's cross-tokenizer path (mlx_lm/generate.py at be2f622), as a translator: the drafter's
    prompt is the target's decoded with control tokens as text; drafts are decoded alone and re-encoded
    after the decoded last W *generated* target tokens, stripped by token count; after a cycle the
    drafter's drafts are dropped and the committed text, decoded alone, is re-encoded for it."""

    name = "fork"

    def start(self, prompt_ids: Sequence[int]) -> list[int]:
        self.target_ids = list(prompt_ids)
        self.generated: list[int] = []
        text = self.target.backend.decode(list(prompt_ids), skip_special_tokens=False)
        self.drafter_ids = self.drafter.encode(text)[0]
        return list(self.drafter_ids)

    def usable(self, draft_ids):
        return list(draft_ids)

    def propose(self, draft_ids: Sequence[int]) -> Proposal:
        text = self.drafter.backend.decode(list(draft_ids), skip_special_tokens=False)
        context = self.generated[-self.window :] if self.window else []
        if not context:
            return Proposal(self.target.encode(text)[0])
        prefix = self.target.backend.decode(context, skip_special_tokens=False)
        return Proposal(self.target.encode(prefix + text)[0][len(self.target.encode(prefix)[0]) :])

    def commit(self, draft_ids: Sequence[int], new_ids: Sequence[int]) -> Resync:
        cut = len(self.drafter_ids)
        self.target_ids.extend(new_ids)
        self.generated.extend(new_ids)
        text = self.target.backend.decode(list(new_ids), skip_special_tokens=False)
        ids = self.drafter.encode(text)[0] or self.drafter.encode(" ")[0][-1:]
        self.drafter_ids.extend(ids)
        return Resync(cut)


class MixedTranslator(ForkTranslator):
    """The fork's re-sync (each cycle's committed text re-encoded alone, drafts dropped) with uag's
    translation of drafts (`propose`): which half of the fork makes the difference."""

    name = "fork-commit"

    def start(self, prompt_ids: Sequence[int]) -> list[int]:
        self.uag = TextTranslator(self.target, self.drafter, window=self.window)
        self.uag.start(prompt_ids)
        return super().start(prompt_ids)

    def usable(self, draft_ids):
        return self.uag.usable(draft_ids)

    def propose(self, draft_ids: Sequence[int]) -> Proposal:
        self.uag.drafter_ids = list(self.drafter_ids)  # uag's propose reads the drafter's context
        return self.uag.propose(draft_ids)

    def commit(self, draft_ids: Sequence[int], new_ids: Sequence[int]) -> Resync:
        resync = super().commit(draft_ids, new_ids)
        self.uag.target_ids.extend(new_ids)
        self.uag.target_stable = len(self.uag.target_ids)
        return resync


def make(spec: str, target, drafter):
    """(translator, how the first cycle starts) for a variant spec."""
    name, *pairs = spec.split(":")
    opts = dict(p.split("=", 1) for p in pairs)
    window = int(opts.pop("window", 10))
    first = opts.pop("first", "draft")
    end = opts.pop("end", "fill" if name == "fork" else "bonus")
    if name == "fork":
        return ForkTranslator(target, drafter, window=window), first, end
    if name == "fork-commit":
        return MixedTranslator(target, drafter, window=window), first, end
    if name != "uag":
        raise SystemExit(f"unknown variant {spec!r}")
    return (
        Variant(
            target,
            drafter,
            window=window,
            prompt=opts.pop("prompt", "plain"),
            resync=opts.pop("resync", "own"),
            backoff=int(opts.pop("backoff", translate.MAX_BACKOFF)),
        ),
        first,
        end,
    )


# --- replay ----------------------------------------------------------------------------------------


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def rewind(cache: list, length: int) -> None:
    for layer in cache:
        if layer.offset > length:
            layer.trim(layer.offset - length)


def replay(drafter, translator, prompt: list[int], truth: list[int], k: int, eos, first: str, end: str) -> dict:
    """Speculative cycles against a known target continuation `truth`; counts and the loss anatomy.
    `first`: "draft" (uag and the fork: the first cycle drafts right after the prompt, and the prompt
    pass verifies that draft) or "prefill" (the prompt pass writes the first token). `end`: "bonus" (uag:
    never propose more than the budget can take with the target's own token after it) or "fill" (the
    fork: draft up to the budget; a proposal accepted to the last token leaves no room for that token)."""
    cache = drafter.make_cache()
    translator.start(prompt)
    seen = 0
    out = [truth[0]] if first == "prefill" else []
    unsynced = list(out)
    proposed = accepted = cycles = 0
    loss = anatomy.Loss()

    def sync(drafts=()):
        nonlocal seen, unsynced
        resync = translator.commit(drafts, unsynced)
        unsynced = []
        seen = min(seen, resync.cut, len(translator.drafter_ids) - 1)
        rewind(cache, seen)

    while len(out) < len(truth) and not (out and out[-1] in eos):
        remaining = len(truth) - len(out)
        room = remaining if end == "fill" else remaining - 1
        step_k = min(k, room)
        if step_k == 0:
            out.append(truth[len(out)])
            unsynced.append(out[-1])
            continue
        if unsynced:
            sync()
        ids = translator.drafter_ids
        base = len(ids)
        y = mx.array(ids[seen:])
        drafts = []
        for _ in range(step_k):
            y = mx.argmax(drafter.model(y[None], cache=cache)[:, -1, :], axis=-1)
            drafts.append(y)
        drafts = mx.concatenate(drafts).tolist()
        seen = base + step_k - 1
        usable = translator.usable(drafts)
        proposal = translator.propose(usable)
        ids_p = proposal.ids if end == "fill" else proposal.ids[:room]
        position = len(out)
        n = lcp(ids_p, truth[position:])
        new = [*ids_p[:n], *truth[position + n : position + n + 1]][:remaining]
        n = min(n, len(new))
        if isinstance(translator, TextTranslator):
            cycle_loss = anatomy.of_cycle(translator, proposal, ids_p, n, truth[position:])
            loss = loss + cycle_loss
            if SHOW & {k for k, v in cycle_loss.as_dict().items() if v}:
                t = translator.target
                print(
                    f"  {cycle_loss}: draft {proposal.text!r} → {[t.token_content(i) for i in ids_p]}, "
                    f"target {[t.token_content(i) for i in truth[position : position + 4]]}",
                    file=sys.stderr,
                )
        if TRACE:
            show = translator.target.token_content
            text = translator.drafter.backend.decode(list(drafts), skip_special_tokens=False)
            shown = [show(i) for i in ids_p]
            tail = [translator.drafter.token_content(i) for i in ids[-6:]]  # what the drafter read last
            print(f"  {position:>3} {tail} {text!r:<24} {shown} -> {n} + {show(new[-1])!r}", file=sys.stderr)
        out += new
        unsynced += new
        sync(usable)
        proposed, accepted, cycles = proposed + len(ids_p), accepted + n, cycles + 1
    assert out == truth[: len(out)], "replay diverged from the target's output"
    return {"generated": len(out), "proposed": proposed, "accepted": accepted, "cycles": cycles, "loss": loss}


# --- the target's baselines, recorded once -----------------------------------------------------------


def baselines(store, prompts, max_tokens: int) -> dict[str, list[int]]:
    target = store.get("demo-target")
    path = cache_dir() / "variants" / "baselines.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    changed = False
    for text in prompts:
        key = hashlib.sha256(f"{target.path}|{max_tokens}|{text}".encode()).hexdigest()
        if key not in known:
            ids = prompt_ids(target, text)
            run = generate(target, None, ids, GenerationConfig(translation="baseline", max_tokens=max_tokens))
            known[key] = {"prompt": ids, "truth": run.token_ids}
            changed = True
            print(f"baseline recorded: {text[:40]!r}", file=sys.stderr)
    if changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known))
    return {t: known[hashlib.sha256(f"{target.path}|{max_tokens}|{t}".encode()).hexdigest()] for t in prompts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["wiki", "alpaca", "synthetic"])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--english", type=int, default=0)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--variants", nargs="+", default=["fork", "uag"])
    parser.add_argument("--json")
    parser.add_argument("--show", nargs="*", default=[], help="print the cycles that lost to these causes")
    parser.add_argument("--trace", action="store_true", help="print every cycle")
    parser.add_argument("--only", help="only the prompt with this id")
    args = parser.parse_args()
    SHOW.update(args.show)
    TRACE.extend([True] if args.trace else [])

    store = ModelStore()
    prompts = [
        (p.id, p.dataset, p.text) for name in args.datasets for p in load_bundled(name, args.skip + args.n)[args.skip :]
    ]
    prompts += [(f"english-{i + 1}", "english", t) for i, t in enumerate(ENGLISH[: args.english])]
    prompts = [p for p in prompts if args.only in (None, p[0])]
    recorded = baselines(store, [t for _, _, t in prompts], args.max_tokens)
    target, drafter = store.get("demo-target"), store.get("demo-drafter")
    eos = target.eos_ids
    rows = []
    for k in args.ks:
        for spec in args.variants:
            per = []
            for pid, dataset, text in prompts:
                rec = recorded[text]
                translator, first, end = make(spec, target.vocab, drafter.vocab)
                r = replay(drafter, translator, rec["prompt"], rec["truth"], k, eos, first, end)
                per.append({"id": pid, "dataset": dataset, **r, "share": r["accepted"] / r["generated"]})
            sets = sorted({p["dataset"] for p in per})
            by_set = {d: statistics.fmean(p["share"] for p in per if p["dataset"] == d) for d in sets}
            loss = sum((p["loss"] for p in per), anatomy.Loss())
            row = {
                "k": k,
                "variant": spec,
                "share": statistics.fmean(by_set.values()),
                "by_set": by_set,
                "alpha": sum(p["accepted"] for p in per) / max(1, sum(p["proposed"] for p in per)),
                "proposed": sum(p["proposed"] for p in per),
                "loss": loss.as_dict(),
                "per_prompt": {p["id"]: round(p["share"], 4) for p in per},
            }
            rows.append(row)
            print(
                f"k={k} {spec:<40} share {row['share']:.1%} ({', '.join(f'{d} {v:.1%}' for d, v in by_set.items())})"
                f"  α {row['alpha']:.1%}  proposed {row['proposed']}  loss {loss}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
