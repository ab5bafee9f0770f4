"""What identifies a run in a results file, and where it ran: `RunSpec` (the models, the generation settings and
the prompt) with its `key`, the `Machine` block, and the short model names labels use. No mlx, no SQLite.

    spec = RunSpec.baseline(target="t", dataset="wiki", prompt_id="wiki-001", max_tokens=8, temperature=0)
    spec.key                   # 32 hex digits: a run stored under it is skipped when a sweep is run again
    spec.columns()["strategy"] # "baseline"
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from uag.core.config import SAMPLING_FIELDS, GenerationConfig

BASELINE = "baseline"


@dataclass(frozen=True)
class RunSpec:
    """What identifies a run: the models, the generation settings and the prompt.

    `drafter` is as the sweep names it (a model, "lookup" or "lookup+<model>"); a baseline has none and
    strategy "baseline" (use `RunSpec.baseline`), and is stored with k = window = 0.
    """

    target: str
    drafter: str | None
    config: GenerationConfig
    dataset: str
    prompt_id: str
    target_dtype: str | None = None  # as asked for (uag.models.dtypes); None: as stored. The loaded model's dtype
    drafter_dtype: str | None = None  # is the Machine's (target_dtype / drafter_dtype columns)

    @classmethod
    def baseline(
        cls, *, target: str, dataset: str, prompt_id: str, target_dtype: str | None = None, **settings
    ) -> RunSpec:
        """The target alone; `settings` are GenerationConfig fields (max_tokens, temperature, seed, chat …)."""
        config = GenerationConfig.parse(**{**settings, "strategy": BASELINE})
        return cls(target, None, config, dataset, prompt_id, target_dtype)

    def baseline_spec(self) -> RunSpec:
        """The baseline a speculative run is compared with: the target alone, same prompt and settings."""
        c = self.config
        return RunSpec.baseline(
            target=self.target,
            dataset=self.dataset,
            prompt_id=self.prompt_id,
            target_dtype=self.target_dtype,
            max_tokens=c.max_tokens,
            temperature=c.temperature,
            seed=c.seed,
            chat=c.chat,
            **self.sampling(),
        )

    def sampling(self) -> dict:
        """The samplers and penalties set away from their neutral values (uag.core.config.SAMPLING_FIELDS).

        Example: a config with top_k=40 -> {"top_k": 40};  the defaults -> {}
        """
        neutral = GenerationConfig()
        return {
            f.name: getattr(self.config, f.name)
            for f in SAMPLING_FIELDS
            if getattr(self.config, f.name) != getattr(neutral, f.name)
        }

    @property
    def strategy(self) -> str:
        return self.config.strategy

    @property
    def k(self) -> int:
        return self.config.k if self.config.speculative else 0

    @property
    def window(self) -> int:
        return self.config.window if self.config.speculative else 0

    def columns(self) -> dict:
        """The spec as the `runs` table stores it (and as the run key hashes it)."""
        c = self.config
        return {
            "target": self.target,
            "drafter": self.drafter,
            "strategy": c.strategy,
            "k": self.k,
            "window": self.window,
            "max_tokens": c.max_tokens,
            "temperature": float(c.temperature),
            "seed": c.seed,
            "chat": bool(c.chat),
            "dataset": self.dataset,
            "prompt_id": self.prompt_id,
        }

    @property
    def key(self) -> str:
        """A hash of the stored columns (the same hash as files written before specs held a GenerationConfig,
        so old results files resume).

        Example: RunSpec.baseline(target="t", max_tokens=8, temperature=0, dataset="wiki", prompt_id="wiki-001").key
                 == the same with temperature=0.0 -> True
        """
        identity = self.columns()
        if self.target_dtype or (self.drafter_dtype and self.drafter):  # runs without a dtype keep their old key
            identity |= {"dtypes": [self.target_dtype, self.drafter_dtype if self.drafter else None]}
        if sampling := self.sampling():  # runs with the neutral samplers keep their old key too
            identity |= {"sampling": sampling}
        if self.config.constraint is not None:  # a constrained run writes other text: another key
            identity |= {"constraint": self.config.constraint}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Machine:
    """Where a run ran: software, device, BLAS, and the models' sizes as loaded (the cost model's r)."""

    platform: str
    python: str
    uag_version: str
    mlx_version: str
    device: str  # mx.default_device(), e.g. "Device(gpu, 0)"
    backend: str  # "metal", "cuda" or "cpu"
    blas: str  # uag._blas.status (matters on the CPU only)
    target_bytes: int
    target_dtype: str
    drafter_bytes: int | None = None
    drafter_dtype: str | None = None
