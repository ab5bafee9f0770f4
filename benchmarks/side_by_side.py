"""Shared by the comparison benchmarks: run conditions side by side on one prompt, interleaved.

Each condition runs `repeats` times in an order that rotates every repetition, so drift on a shared
machine hits all alike; tokens/s is the median per condition. Each greedy run's tokens are compared
with the baseline's: "same <c>" is False where they differ (on the CPU a bug; on a GPU a float32 near-tie
can round differently in a k-token verification than in a 1-token step — reported, never hidden).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
from uag.api import generate
from uag.core.config import GenerationConfig
from uag.core.drafters import DrafterChoice
from uag.models.store import LoadedModel


@dataclass(frozen=True)
class Condition:
    """One way to generate: a name for the tables, the drafter (None: the target alone) and the config."""

    name: str
    drafter: DrafterChoice | None
    config: GenerationConfig


def run_prompt(
    target: LoadedModel, conditions: Sequence[Condition], text: str | list[int], repeats: int, *, profile=None
) -> dict:
    """{condition: median tokens/s, "alpha <c>": α, "draft share <c>": share of output from drafts,
    "ks <c>": the k of each cycle (auto), "same <c>": its greedy tokens equal the first condition's}."""
    rates: dict[str, list[float]] = {c.name: [] for c in conditions}
    runs = {}
    for rep in range(repeats):
        shift = rep % len(conditions)
        for c in [*conditions[shift:], *conditions[:shift]]:
            kw = {"profile": profile} if profile is not None and c.config.k_policy == "adaptive" else {}
            runs[c.name] = generate(target, c.drafter, text, c.config, **kw)
            rates[c.name].append(runs[c.name].tokens_per_second or 0.0)
    reference = runs[conditions[0].name].token_ids
    row: dict = {name: statistics.median(r) for name, r in rates.items()}
    for c in conditions[1:]:
        run = runs[c.name]
        row[f"same {c.name}"] = run.token_ids == reference if c.config.temperature == 0 else None
        row[f"alpha {c.name}"] = run.acceptance_rate
        row[f"draft share {c.name}"] = run.draft_fraction
        row[f"ks {c.name}"] = [cy.k for cy in run.cycles]
        row[f"sources {c.name}"] = run.sources()
    row["tokens"] = runs[conditions[0].name].generated
    return row


def speedups(rows: Sequence[dict], names: Sequence[str], base: str = "baseline") -> dict[str, float]:
    """Mean over prompts of each condition's tokens/s ÷ the baseline's on the same prompt."""
    return {n: statistics.fmean(r[n] / r[base] for r in rows) for n in names}


def pooled(rows: Sequence[dict], name: str, base: str = "baseline") -> float:
    """Pooled speedup: total tokens over total time, condition vs baseline (long prompts weigh more)."""
    t_cond = sum(r["tokens"] / r[name] for r in rows if r[name])
    t_base = sum(r["tokens"] / r[base] for r in rows if r[base])
    return t_base / t_cond


def mean_alpha(rows: Sequence[dict], name: str) -> float | None:
    values = [r[f"alpha {name}"] for r in rows if r.get(f"alpha {name}") is not None]
    return statistics.fmean(values) if values else None


def differing(rows: Sequence[dict], names: Sequence[str]) -> list[str]:
    """'prompt: condition' for every greedy run whose tokens differ from the baseline's."""
    return [f"{r['id']}: {n}" for r in rows for n in names if r.get(f"same {n}") is False]
