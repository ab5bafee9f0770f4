"""How far does a prompt-lookup match have to run back before its proposal holds? Replayed over real answers.

A model answers the bundled `edit` conversations (each turn after its own earlier answers, greedy, as a
server sees them; the answers are written to --answers and reused on the next run). Then prompt lookup is
replayed over every answer as a run would draft it: where the index has a match it proposes --k tokens, the
answer keeps the longest agreeing prefix plus one token of its own, and the next proposal starts after it.
Per band of how far the match ran back (uag.core.lookup.match_band) it prints how many proposals there were,
the share rejected at their first token, the mean tokens kept, and the chance each token tried holds (kept ÷
(kept + proposals that broke before their end): with long proposals, what a copy's next token is worth, which
sets lookup.BAND_FLOORS); and, pooled, the same for other n-gram sizes.
No timing: the answers are the model's, the replay is pure Python (its figures: docs/results.md).

Usage: python benchmarks/lookup_match.py [--model coder-drafter] [--conversations 6] [--ids edit-001 …]
       [--max-tokens 320] [--k 8] [--answers FILE] [--ngrams 4,3,2 16,8,4,3,2 …]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from datetime import date
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)
from uag.core.lookup import MATCH_BANDS, MATCH_CAP, NGRAMS, NgramIndex, match_band
from uag.core.translate import longest_common_prefix
from uag.study.datasets import load_conversations

BAND_NAMES = [f"{lo}-{hi - 1}" for lo, hi in zip((2, *MATCH_BANDS), MATCH_BANDS)] + [f"{MATCH_BANDS[-1]}+"]


def answer(model_name: str, ids: list[str] | None, n: int, max_tokens: int, path: Path) -> list[dict]:
    """Each conversation's turns answered by `model_name` (lookup drafting: fast, and greedy output is the
    model's own), as {"id", "turn", "prompt": token ids, "output": token ids}; read back from `path` if there."""
    if path.exists():
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    from uag import api
    from uag.core.config import GenerationConfig

    model, lookup = api.load(model_name), api.load_drafter("lookup")
    chosen = load_conversations("edit", None if ids else n)
    chosen = [c for c in chosen if c.id in ids] if ids else chosen
    rows = []
    for conv in chosen:
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        for t, text in enumerate(conv.turns):
            messages.append({"role": "user", "content": text})
            prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            run = api.generate(model, lookup, prompt, GenerationConfig("context", k=8, max_tokens=max_tokens))
            rows.append({"id": conv.id, "turn": t + 1, "prompt": list(prompt), "output": run.token_ids})
            messages.append({"role": "assistant", "content": run.text})
            print(f"  {conv.id} turn {t + 1}: {len(prompt)} prompt tokens, {run.generated} answered", flush=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def replay(rows: list[dict], ngrams: tuple[int, ...], k: int, turns: set[int]) -> dict[int, list[int]]:
    """Per match band: [proposals, rejected at the first token, tokens kept, proposals that broke before their
    end], lookup drafting over each answer."""
    out: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for row in rows:
        if row["turn"] not in turns:
            continue
        index, answer_ids, at = NgramIndex(ngrams), row["output"], 0
        index.extend(row["prompt"])
        while at < len(answer_ids):
            if index.match is None:
                index.extend(answer_ids[at : at + 1])
                at += 1
                continue
            band, proposal = match_band(index.match_length()), index.propose(k)
            kept = longest_common_prefix(proposal, answer_ids[at : at + len(proposal)])
            counts = out[band]
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + (kept == 0), counts[2] + kept
            counts[3] += kept < min(len(proposal), len(answer_ids) - at)
            step = min(kept + 1, len(answer_ids) - at)
            index.extend(answer_ids[at : at + step])
            at += step
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="coder-drafter", help="what answers the conversations")
    parser.add_argument("--conversations", type=int, default=6, help="the first N edit conversations")
    parser.add_argument("--ids", nargs="+", help="these edit conversations instead")
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--k", type=int, default=8, help="tokens each lookup proposes")
    parser.add_argument("--answers", default="lookup-match-answers.jsonl", help="where the answers are kept")
    parser.add_argument(
        "--ngrams", nargs="+", default=["4,3,2", ",".join(map(str, NGRAMS))], help="n-gram sizes to compare"
    )
    args = parser.parse_args(argv)
    sizes = [tuple(int(n) for n in spec.split(",")) for spec in args.ngrams]
    rows = answer(args.model, args.ids, args.conversations, args.max_tokens, Path(args.answers))
    ids = sorted({r["id"] for r in rows})
    print(
        f"lookup match length — {date.today()}, answers by {args.model}: {len(ids)} edit conversations "
        f"({ids[0]}…{ids[-1]}), {len(rows)} turns, proposals of {args.k}, matches followed back {MATCH_CAP} tokens"
    )
    for label, turns in (("turn 1 (the file given)", {1}), ("turns 2-3 (the file changed again)", {2, 3})):
        print(f"\n{label}")
        print(
            f"{'n-grams':<18} {'band':>6} {'proposals':>10} {'rejected at 1st':>16} {'kept (mean)':>12} "
            f"{'per token':>10}"
        )
        for ngrams in sizes:
            bands = replay(rows, ngrams, args.k, turns)
            total = [sum(c[i] for c in bands.values()) for i in range(4)]
            for name, counts in [*((BAND_NAMES[b], bands[b]) for b in sorted(bands)), ("all", total)]:
                if counts[0]:
                    print(
                        f"{','.join(map(str, ngrams)):<18} {name:>6} {counts[0]:>10} "
                        f"{counts[1] / counts[0]:>16.0%} {counts[2] / counts[0]:>12.2f} "
                        f"{counts[2] / max(1, counts[2] + counts[3]):>10.3f}"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
