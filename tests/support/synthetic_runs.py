"""Hand-made runs with chosen acceptance and tokens/s, written to a results file. No mlx, no model.

Example: add_prompt(db, "wiki-001", tps_base=10.0, runs={("d", "context", 2): (8, 10, 12.0)}) stores a
baseline at 10 tok/s and a speculative run with α = 8/10 at 12 tok/s (speedup 1.2) for prompt wiki-001.
"""

from __future__ import annotations

from dataclasses import replace

from uag.core.config import GenerationConfig
from uag.core.records import Cycle, Run, Token
from uag.study.results import ResultsDB
from uag.study.runspec import Machine, RunSpec

TARGET = "org/target-11B"
GENERATED = 33  # tokens per run: tokens/s = 32 / generation seconds
# r = drafter bytes / target bytes = 0.07, as in the study.
MACHINE = Machine(
    platform="test-os",
    python="3.x",
    uag_version="0",
    mlx_version="0",
    device="Device(cpu, 0)",
    backend="cpu",
    blas="reference",
    target_bytes=10_000_000_000,
    target_dtype="8-bit (bfloat16)",
    drafter_bytes=700_000_000,
    drafter_dtype="4-bit (bfloat16)",
)
BASELINE_MACHINE = replace(MACHINE, drafter_bytes=None, drafter_dtype=None)


def spec(prompt_id: str, drafter: str | None = None, strategy: str = "baseline", k: int = 0, dataset: str = "wiki"):
    """The spec of a baseline (no drafter) or a speculative run with the sweep's fixed settings."""
    if drafter is None:
        return RunSpec.baseline(
            target=TARGET,
            max_tokens=GENERATED,
            temperature=0.0,
            seed=None,
            chat=False,
            dataset=dataset,
            prompt_id=prompt_id,
        )
    config = GenerationConfig.parse(strategy=strategy, k=k, window=16, max_tokens=GENERATED)  # "auto" too
    return RunSpec(TARGET, drafter, config, dataset, prompt_id)


def make_run(spec: RunSpec, *, tps: float, accepted: int = 0, proposed: int = 0) -> Run:
    """A finished run of GENERATED tokens at `tps` tokens/s; one cycle carries all the drafting."""
    cycles = []
    if spec.strategy != "baseline":
        cycles = [Cycle(0, spec.k, [], [7] * proposed, accepted, GENERATED - 1, verify_ms=1.0, drafter_passes=spec.k)]
    return Run(
        "baseline" if spec.drafter is None else spec.config.translation,
        spec.target,
        spec.drafter,
        k=spec.k,
        k_policy=spec.config.k_policy,
        window=spec.window,
        temperature=spec.config.temperature,
        seed=spec.config.seed,
        max_tokens=spec.config.max_tokens,
        prompt_ids=[1, 2, 3],
        prompt_ms=5.0,
        tokens=[Token(i, "ą", False) for i in range(GENERATED)],
        cycles=cycles,
        first_token_s=0.0,
        last_token_s=(GENERATED - 1) / tps,
        finish_reason="length",
    )


def add_prompt(
    db: ResultsDB,
    prompt_id: str,
    *,
    tps_base: float | None,
    runs: dict[tuple[str, str, int], tuple[int, int, float]],
    dataset: str = "wiki",
) -> None:
    """A prompt's baseline (skipped for None) and its speculative runs {(drafter, strategy, k): (accepted,
    proposed, tps)}."""
    text = f"Prompt {prompt_id}"
    if tps_base is not None:
        base = spec(prompt_id, dataset=dataset)
        db.add(make_run(base, tps=tps_base), spec=base, prompt=text, machine=BASELINE_MACHINE)
    for (drafter, strategy, k), (accepted, proposed, tps) in runs.items():
        s = spec(prompt_id, drafter, strategy, k, dataset)
        db.add(make_run(s, tps=tps, accepted=accepted, proposed=proposed), spec=s, prompt=text, machine=MACHINE)
