"""Structured output with speculation: a `json_schema` reply with auto against the same constrained reply with
speculation off, and what the grammar adds to a step.

Per task (a chat request and the JSON Schema its reply must fit; most copy names and numbers out of the prompt,
as extraction does), in one process, each condition once per repeat in an order that rotates from repeat to
repeat (medians over repeats):
- `off`: the target alone, constrained (uag.core.grammar: masked at every step);
- `auto`: auto over `--drafter`, constrained (drafts checked against the grammar, forced tokens proposed free);
- `free`: the target alone without the constraint (what a step costs with no grammar).
Printed per task and pooled: tokens/s of each, `auto / off` (target ≥ 1.3, issue #38), whether auto's reply equals
off's token for token (lossless) and fits the schema, the cycles the grammar's forced tokens made, and the grammar's
cost: its own clock per token written (`Run.grammar_ms`: masks, draft checks, forced tokens) as a share of the
constrained target's time per token, and the constrained target's ms per token against the free one's (whose
replies differ, so that ratio also carries the replies' lengths and contexts).

Usage: python benchmarks/structured_output.py [--target coder-target] [--drafter lookup+demo-drafter]
       [--tasks person order …] [--max-tokens 160] [--repeats 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import date

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx

from uag.api import generate
from uag.core.config import GRAMMAR, GenerationConfig
from uag.core.grammar import response_format_constraint
from uag.costs.profiles import machine_load
from uag.machine import backend, blas, device_name
from uag.models.store import ModelStore
from uag.runtime.pair import open_pair

STRING, INTEGER, NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def obj(required: dict, **optional) -> dict:
    return {
        "type": "object",
        "properties": {**required, **optional},
        "required": list(required),
        "additionalProperties": False,
    }


def array(items: dict) -> dict:
    return {"type": "array", "items": items}


TASKS = {
    "person": (
        "Extract the person as JSON.\n\nMaria Kowalska (34) works as a nurse at the university hospital in Gdańsk. "
        "She speaks Polish, German and a little Spanish, and can be reached at maria.kowalska@example.pl.",
        obj(
            {"name": STRING, "age": INTEGER, "job": STRING, "city": STRING, "languages": array(STRING), "email": STRING}
        ),
    ),
    "order": (
        "Turn this order into JSON.\n\nOrder 2024-118 for Jan Nowak, ul. Długa 5, 00-238 Warszawa:\n"
        "- 2 x USB-C cable 1 m, 19.99 each\n- 1 x Mechanical keyboard (Cherry MX Brown), 349.00\n"
        "- 3 x Notebook A5 dotted, 12.50 each\nShipping: courier, 14.99. Paid by card.",
        obj(
            {
                "order_id": STRING,
                "customer": STRING,
                "address": STRING,
                "items": array(obj({"name": STRING, "quantity": INTEGER, "unit_price": NUMBER})),
                "shipping": obj({"method": STRING, "price": NUMBER}),
                "payment": STRING,
            }
        ),
    ),
    "function": (
        "Describe this Python function as JSON.\n\n```python\n"
        "def moving_average(values: list[float], window: int = 3) -> list[float]:\n"
        "    if window < 1:\n"
        '        raise ValueError("window must be at least 1")\n'
        "    if len(values) < window:\n"
        "        return []\n"
        "    return [sum(values[i : i + window]) / window for i in range(len(values) - window + 1)]\n```",
        obj(
            {
                "name": STRING,
                "parameters": array(obj({"name": STRING, "type": STRING, "default": STRING})),
                "returns": STRING,
                "raises": array(STRING),
                "summary": STRING,
            }
        ),
    ),
    "config": (
        "Convert this INI file to JSON, one object per section.\n\n[server]\nhost = 127.0.0.1\nport = 8080\n"
        "workers = 4\n\n[database]\nurl = postgres://app@db.internal:5432/shop\npool_size = 10\ntimeout_s = 30\n\n"
        "[logging]\nlevel = info\nfile = /var/log/shop/app.log",
        obj(
            {
                "server": obj({"host": STRING, "port": INTEGER, "workers": INTEGER}),
                "database": obj({"url": STRING, "pool_size": INTEGER, "timeout_s": INTEGER}),
                "logging": obj({"level": STRING, "file": STRING}),
            }
        ),
    ),
    "meeting": (
        "Summarise the meeting notes as JSON.\n\nSprint review, 14 March. Present: Ola, Piotr, Kasia, Tomek.\n"
        "Decided: release 2.3 ships on 21 March; the old export API is removed in 2.4.\nActions: Piotr writes the "
        "migration guide; Kasia fixes the login timeout bug; Tomek updates the staging servers.",
        obj(
            {
                "date": STRING,
                "attendees": array(STRING),
                "decisions": array(STRING),
                "actions": array(obj({"owner": STRING, "task": STRING})),
            }
        ),
    ),
    "review": (
        'Classify this product review as JSON.\n\n"The blender is powerful and easy to clean, but it is very loud '
        'and the lid cracked after two months. Customer service replaced it quickly."',
        obj(
            {
                "sentiment": {"enum": ["positive", "negative", "mixed"]},
                "score": INTEGER,
                "pros": array(STRING),
                "cons": array(STRING),
            }
        ),
    ),
    "bug": (
        "Turn this bug report into JSON.\n\nTitle: Export to CSV drops the last row\nWhen I export a table with 10 "
        "rows from the Reports page, the CSV has only 9. Steps: open Reports, pick 'Monthly sales', click Export, "
        "choose CSV. Happens in Firefox 128 and Chrome 126. Version 2.2.1.",
        obj(
            {
                "title": STRING,
                "severity": {"enum": ["low", "medium", "high", "critical"]},
                "component": STRING,
                "steps": array(STRING),
                "browsers": array(STRING),
                "version": STRING,
            }
        ),
    ),
    "addresses": (
        "List the addresses as JSON.\n\n1. Anna Wiśniewska, ul. Polna 12/4, 31-155 Kraków\n2. Marek Zieliński, "
        "al. Jerozolimskie 44, 00-024 Warszawa\n3. Ewa Lewandowska, ul. Morska 7, 81-323 Gdynia",
        obj({"addresses": array(obj({"name": STRING, "street": STRING, "postcode": STRING, "city": STRING}))}),
    ),
}


def fits(text: str, schema: dict) -> bool:
    """Whether the reply parses and has the schema's required keys at the top level."""
    try:
        reply = json.loads(text)
    except ValueError:
        return False
    return isinstance(reply, dict) and set(schema["required"]) <= set(reply)


def run_task(pair, name: str, args) -> dict:
    prompt, schema = TASKS[name]
    constraint = response_format_constraint(
        {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    )
    common = dict(max_tokens=args.max_tokens, chat=pair.target.tokenizer.has_chat_template)
    conditions = {
        "off": (None, GenerationConfig.parse(strategy="baseline", constraint=constraint, **common)),
        "auto": (pair.choice, GenerationConfig.parse(strategy="auto", k=args.k, constraint=constraint, **common)),
        "free": (None, GenerationConfig.parse(strategy="baseline", **common)),
    }
    names, runs, rates = list(conditions), {}, {c: [] for c in conditions}
    for rep in range(args.repeats):
        shift = rep % len(names)
        for condition in names[shift:] + names[:shift]:
            drafter, config = conditions[condition]
            run = generate(pair.target, drafter, prompt, config)
            runs.setdefault(condition, run)  # the first run's record (replies are the same every repeat)
            rates[condition].append(run.tokens_per_second)
    off, auto, free = runs["off"], runs["auto"], runs["free"]
    per_token = lambda run: (run.generation_s or 0) * 1000 / max(run.generated - 1, 1)  # noqa: E731
    return {
        "task": name,
        "tokens": off.generated,
        **{f"{c} tok/s": statistics.median(r) for c, r in rates.items()},
        "lossless": auto.token_ids == off.token_ids,
        "fits": fits(off.text, schema),
        "finish": off.finish_reason,
        "grammar cycles": auto.sources().get(GRAMMAR, 0),
        "grammar kept": sum(c.accepted for c in auto.cycles if c.source == GRAMMAR),
        "sources": auto.sources(),
        "alpha": auto.acceptance_rate,
        "grammar ms/token": off.grammar_ms / max(off.generated, 1),
        "off ms/token": per_token(off),
        "free ms/token": per_token(free),
        "text": off.text,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="coder-target")
    parser.add_argument("--drafter", default="lookup+demo-drafter")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("-k", type=int, default=16, help="auto's longest draft (uag serve's default)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write every row to this JSON file")
    args = parser.parse_args()

    load = machine_load()
    pair = open_pair(ModelStore(), args.target, args.drafter)
    generate(pair.target, pair.choice, "Hello", GenerationConfig.parse(strategy="auto", max_tokens=4))  # warm-up
    rows = []
    for name in args.tasks:
        row = run_task(pair, name, args)
        rows.append(row)
        print(
            f"[structured_output] {name}: {row['tokens']} tokens, off {row['off tok/s']:.2f}, auto "
            f"{row['auto tok/s']:.2f} ({row['auto tok/s'] / row['off tok/s']:.2f}×), free {row['free tok/s']:.2f} "
            f"tok/s; lossless {row['lossless']}, fits {row['fits']}, grammar cycles {row['grammar cycles']} "
            f"(kept {row['grammar kept']}), α {row['alpha'] or 0:.2f}",
            flush=True,
        )
    pooled = {
        c: sum(r["tokens"] for r in rows) / sum(r["tokens"] / r[f"{c} tok/s"] for r in rows)
        for c in ("off", "auto", "free")
    }
    grammar = sum(r["grammar ms/token"] * r["tokens"] for r in rows) / sum(
        r["off ms/token"] * r["tokens"] for r in rows
    )
    step = sum(r["off ms/token"] for r in rows) / sum(r["free ms/token"] for r in rows)
    print(
        f"\nstructured output — {date.today()}, {pair.target.name} ({pair.target.dtype}) ← {pair.choice.name}, "
        f"{device_name()} ({backend()}), MLX {mx.__version__}, BLAS {blas()}, {load} at the start, "
        f"{args.max_tokens} max tokens, k ≤ {args.k}, median of {args.repeats}\n"
        f"pooled tokens/s: off {pooled['off']:.2f}, auto {pooled['auto']:.2f}, free {pooled['free']:.2f}\n"
        f"auto / off (constrained, target >= 1.3): {pooled['auto'] / pooled['off']:.3f}\n"
        f"lossless: {sum(r['lossless'] for r in rows)}/{len(rows)}; replies fitting the schema: "
        f"{sum(r['fits'] for r in rows)}/{len(rows)}\n"
        f"grammar's own time per token, share of the constrained step (target <= 5 %): {grammar:.2%}; constrained "
        f"step / free step (mean ms per token; the replies differ): {step:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load": str(load), "rows": rows, "pooled": pooled}, f, indent=1)


if __name__ == "__main__":
    main()
