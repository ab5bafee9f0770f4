"""Models in the dtypes users run: converted once per model and dtype into the user cache, loaded, generating,
and greedy divergence between a speculative run and the target alone classified (uag.runtime.margins)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from tests.support.tiny_models import build_tiny
from uag.core.config import GenerationConfig
from uag.core.records import Cycle, Run, Token
from uag.models import demo
from uag.models.dtypes import precision
from uag.models.memory import model_bytes
from uag.models.store import ModelStore
from uag.runtime.divergence import DIVERGED, IDENTICAL, NEAR_TIE


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """Conversions go into a fresh user cache (the tiny models' own folders stay where the test cache keeps them)."""
    monkeypatch.setenv("UAG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_cache_key_is_the_model_and_its_dtype(tmp_path):
    store = ModelStore()
    # an offline model's default is float32, its existing folder: asking for float32 is the same model
    assert store.key("demo-target") == store.key("demo-target", "fp32") == ("demo-target", "float32")
    assert store.key("demo-target", "Q4") == ("demo-target", "q4")
    folder = tmp_path / "m"
    folder.mkdir()
    assert store.key(str(folder)) == (str(folder.resolve()), None)  # as stored
    assert store.key(f"{folder}/", "bf16") == (str(folder.resolve()), "bfloat16")
    assert ModelStore(dtype="bfloat16").key("demo-drafter") == ("demo-drafter", "bfloat16")


def test_dtype_folders_sit_beside_the_offline_conversions(user_cache):
    assert demo.dtype_dir("demo-target", "q4") == user_cache / "models" / f"demo-target-{demo.CONVERTER_VERSION}-q4"
    assert demo.model_dir("demo-target") == user_cache / "models" / f"demo-target-{demo.CONVERTER_VERSION}"
    a, b = demo.dtype_dir("/x/Qwen", "q8"), demo.dtype_dir("/y/Qwen", "q8")
    assert a.parent == user_cache / "models" / "dtypes" and a.name.startswith("Qwen-") and a.name.endswith("-q8")
    assert a != b  # two folders of one name are two models


@pytest.mark.parametrize("dtype", ["bfloat16", "q8", "q4"])
def test_a_tiny_model_in_each_dtype_loads_and_generates(user_cache, dtype):
    import mlx_lm

    source = build_tiny("llama", "llama-3.2")
    store = ModelStore()
    model = store.get(str(source), dtype=dtype)
    assert precision(model.dtype) == dtype
    assert model.path.parent == user_cache / "models" / "dtypes"
    assert model.weight_bytes == model_bytes(source, dtype)  # the estimate before loading is the loaded size
    assert store.get(str(source), dtype=dtype) is model and store.get(str(source)) is not model
    text = mlx_lm.generate(model.model, model.tokenizer, "Hello", max_tokens=4)
    assert isinstance(text, str)


def test_a_conversion_is_reused_and_redone_when_the_source_changes(user_cache, tmp_path, monkeypatch):
    import shutil

    from uag.models import convert

    source = tmp_path / "model"
    shutil.copytree(build_tiny("llama", "llama-3.2"), source)
    calls = []
    real = convert.to_dtype
    monkeypatch.setattr(convert, "to_dtype", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    first = demo.in_dtype(str(source), source, "q4")
    assert demo.in_dtype(str(source), source, "q4") == first and len(calls) == 1
    stat = (source / "config.json").stat()
    os.utime(source / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert demo.in_dtype(str(source), source, "q4") == first and len(calls) == 2
    assert not list(first.parent.glob("*tmp*"))  # nothing half-written left behind


def test_a_model_stored_in_the_dtype_asked_for_is_not_converted(user_cache):
    source = build_tiny("llama", "llama-3.2")  # written in float32
    model = ModelStore().get(str(source), dtype="float32")
    assert model.path == source and not (user_cache / "models").exists()


# --- divergence on real runs: the target computes its margins where two greedy runs part -------------------------


def test_where_a_speculative_run_computed_each_token():
    from uag.runtime.margins import speculative_pass

    def cycle(proposed, emitted):
        return Cycle(0, len(proposed), [], list(proposed), max(0, emitted - 1), emitted)

    run = Run("context", "t", "d", tokens=[Token(i, "", False) for i in range(6)])
    run.cycles = [cycle([7, 8, 9], 3), Cycle.plain(1, 0.0), cycle([4, 5], 2)]
    assert [speculative_pass(run, p) for p in range(6)] == [
        (0, [7, 8, 9], 0),
        (0, [7, 8, 9], 1),
        (0, [7, 8, 9], 2),
        (3, [], 0),
        (4, [4, 5], 0),
        (4, [4, 5], 1),
    ]
    run.tokens.append(Token(9, "", False))  # the prompt pass's plain token has no cycle: everything shifts by one
    assert speculative_pass(run, 0) == (0, [], 0) and speculative_pass(run, 1) == (1, [7, 8, 9], 0)
    run.tokens.append(Token(9, "", False))
    assert speculative_pass(run, 3) is None  # cycles that do not account for the tokens


@pytest.mark.parametrize(("target_dtype", "drafter_dtype"), [("q8", "q4"), ("bfloat16", "bfloat16")])
def test_speculation_in_low_precision_is_classified(user_cache, target_dtype, drafter_dtype):
    """The study's setting on a tiny pair: whatever the outputs, a real mismatch is called a bug and rounding not."""
    from uag.core.engine import generate
    from uag.runtime.margins import compare_runs

    store = ModelStore()
    target = store.get(str(build_tiny("mistral", "mistral-v1")), dtype=target_dtype)
    drafter = store.get(str(build_tiny("llama", "llama-3.2", seed=1)), dtype=drafter_dtype)
    ids = target.tokenizer.encode("Ala ma kota, a kot ma Alę.")
    baseline = generate(target, None, ids, GenerationConfig("baseline", max_tokens=12))
    speculative = generate(target, drafter, ids, GenerationConfig("context", k=3, max_tokens=12))
    verdict = compare_runs(target, baseline, speculative)
    assert verdict is not None and verdict.kind in (IDENTICAL, NEAR_TIE)
    # an injected mismatch at token 5: the target's margin there is whatever it is, but the speculative pass
    # and the plain step both chose the baseline's token, so the run that says otherwise is a bug
    tampered = replace(speculative, tokens=[*speculative.tokens[:4], Token(3, "x", False), *speculative.tokens[5:]])
    tampered.cycles = speculative.cycles
    wrong = compare_runs(target, baseline, tampered)
    assert wrong.position == 4 and wrong.speculative_token == 3
    assert wrong.kind == (NEAR_TIE if wrong.margin <= wrong.threshold else DIVERGED)
    assert wrong.step_margin is not None and wrong.pass_margin is not None
