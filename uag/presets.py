"""Model pairs users pick from a list: the offline demo pair and the study's pairs (hub ids)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    label: str
    target: str
    drafter: str
    note: str = ""

    @property
    def offline(self) -> bool:
        return self.target.startswith("demo-") and self.drafter.startswith("demo-")


BIELIK_11B = "speakleash/Bielik-11B-v3.0-Instruct-MLX-8bit"

PRESETS: tuple[Preset, ...] = (
    Preset(
        "Offline demo: Gemma-3-270M ← SmolLM2-135M",
        "demo-target",
        "demo-drafter",
        "embedded, no network; SentencePiece 262K target, byte-level BPE 49K drafter",
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


def by_label(label: str) -> Preset | None:
    return next((p for p in PRESETS if p.label == label), None)


def preset_models() -> frozenset[str]:
    """Every model named by a preset (what a remote user of a shared app may load)."""
    return frozenset(m for p in PRESETS for m in (p.target, p.drafter))
