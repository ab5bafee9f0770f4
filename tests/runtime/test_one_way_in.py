"""One way in (uag.runtime.pair, uag.costs.pair.open_auto): every front end loads a pair, reads its prompt, opens
`auto` and checks a run against the target alone through the same functions. Tiny random models on a real
tokenizer; the app's `auto` and the CLI's open from the same saved evidence and save what their runs taught."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import uag.core.engine
import uag.costs.calibrate
from tests.server.test_server_costs import QUIET, SAVED, calibration, fake_target
from tests.support.tiny_models import build_tiny
from uag.app.session import Session
from uag.app.settings import Settings
from uag.core.config import GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.core.engine import generate
from uag.core.evidence import Evidence
from uag.core.records import Run
from uag.costs.pair import AutoInputs, evidence_key, open_auto
from uag.costs.profiles import Calibration, find_evidence, save, save_evidence
from uag.errors import InputError, ModelError
from uag.models.loading import load_model
from uag.models.store import ModelStore
from uag.runtime import pair as one_way
from uag.runtime.pair import Loaded, check_against_target, open_pair, prompt_ids_for, what_ran
from uag.runtime.worker import MLXWorker

PROMPT = "Ala ma kota, a kot ma Alę. Ala ma kota, a kot ma"


@pytest.fixture(scope="module")
def models() -> dict[str, str]:
    return {
        "target": str(build_tiny("llama", "llama-3.2")),
        "drafter": str(build_tiny("llama", "llama-3.2", seed=3)),
        "short_drafter": str(build_tiny("llama", "llama-3.2", seed=3, max_position_embeddings=16)),
    }


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UAG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def normal(evidence: Evidence | dict) -> dict:
    """Evidence as it reads back from its file (JSON keys and numbers)."""
    return json.loads(json.dumps(evidence if isinstance(evidence, dict) else evidence.to_dict(), sort_keys=True))


# --- open_pair ----------------------------------------------------------------------------------------------------


def test_open_pair_checks_memory_first_then_loads_the_target_the_drafter_and_the_target_again(
    models, store, monkeypatch
):
    said = []
    monkeypatch.setattr(one_way, "check_memory", lambda store, wanted: said.append(("memory", *wanted)))

    def load(store, name, *, role, progress=None, keep=(), dtype=None):
        said.append((role, list(keep)))
        return load_model(store, name, role=role, progress=progress, keep=keep, dtype=dtype)

    loaded = open_pair(
        store, models["target"], f"lookup+{models['drafter']}", load=load, between=lambda: said.append(("between",))
    )
    assert said == [
        ("memory", ("target", models["target"], None), ("drafter", models["drafter"], None)),
        ("target", []),
        ("between",),
        ("drafter", [models["target"]]),  # loading the drafter may not unload the target
        ("target", [models["drafter"]]),
    ]
    assert loaded.choice.lookup and loaded.choice.model is not None and loaded.pair is not None
    assert 0 < loaded.r and loaded.drafter is loaded.choice  # the hybrid goes to the engine as the choice


def test_open_pair_loads_nothing_the_memory_check_refuses_and_the_target_alone_has_no_drafter(
    models, store, monkeypatch
):
    alone = open_pair(store, models["target"], None, between=lambda: pytest.fail("no drafter: nothing between"))
    assert alone.choice is None and alone.pair is None and alone.drafter is None and alone.r is None
    lookup = open_pair(store, models["target"], "lookup")
    assert lookup.choice == DrafterChoice(lookup=True) and lookup.pair is None and lookup.target is alone.target

    def refuse(store, wanted):
        raise ModelError("the target (9 GB) and the drafter (1 GB) need 10 GB; 4 GB are free")

    monkeypatch.setattr(one_way, "check_memory", refuse)
    with pytest.raises(ModelError, match="4 GB are free"):
        open_pair(store, models["target"], models["drafter"], load=lambda *a, **kw: pytest.fail("loaded"))


# --- prompt_ids_for ---------------------------------------------------------------------------------------------


def test_a_prompt_reads_the_same_as_text_or_as_ids_and_is_checked_against_both_contexts(models, store):
    config = GenerationConfig("context", k=2)
    loaded = open_pair(store, models["target"], models["drafter"])
    ids = prompt_ids_for(loaded, PROMPT, config)
    assert prompt_ids_for(loaded, ids, config) == ids
    short = open_pair(store, models["target"], models["short_drafter"])
    for prompt in (PROMPT * 2, prompt_ids_for(loaded, PROMPT * 2, config)):
        with pytest.raises(InputError, match="whose context is 16 tokens: shorten the prompt"):
            prompt_ids_for(short, prompt, config)
    assert prompt_ids_for(short, PROMPT * 2, config.replace(strategy="baseline"))  # the target alone: no drafter
    with pytest.raises(InputError, match="the prompt is empty"):
        prompt_ids_for(loaded, [], config)


def test_a_prompt_far_too_long_for_the_context_is_refused_before_it_is_tokenised():
    target = fake_target(context=10)  # at most 4 characters a token: 40 characters
    target.name = "org/short-target"
    loaded = Loaded(target, None, None)
    with pytest.raises(InputError, match="41 characters are more than the target org/short-target's context of 10"):
        prompt_ids_for(loaded, "x" * 41, GenerationConfig())
    assert target.tokenizer.encoded == 0
    assert prompt_ids_for(loaded, "x" * 36, GenerationConfig()) and target.tokenizer.encoded == 1


# --- check_against_target ---------------------------------------------------------------------------------------


def test_a_greedy_run_checked_against_the_target_alone_in_float32_is_identical(models, store):
    loaded = open_pair(store, models["target"], "lookup")
    config = GenerationConfig("context", k=3, max_tokens=12)
    ids = prompt_ids_for(loaded, PROMPT, config)
    run = generate(loaded.target, loaded.choice, ids, config)
    checked = check_against_target(loaded, ids, config, run)
    assert checked.divergence.kind == "identical" and checked.baseline.generated == run.generated
    report = checked.to_dict()
    assert report["kind"] == "identical" and report["measured_speedup"] == pytest.approx(checked.measured_speedup)
    assert report["baseline_tokens_per_second"] == checked.baseline.tokens_per_second


def test_a_run_the_target_alone_parts_from_is_named_and_a_run_without_tokens_is_not_compared(
    models, store, monkeypatch
):
    from uag.runtime import divergence

    monkeypatch.setitem(divergence.NEAR_TIE_MARGIN, "float32", 0.0)  # no margin is a near-tie: a mismatch is a bug
    loaded = open_pair(store, models["target"], "lookup")
    config = GenerationConfig("context", k=3, max_tokens=8)
    ids = prompt_ids_for(loaded, PROMPT, config)
    run = generate(loaded.target, loaded.choice, ids, config)

    def perturbed(target, drafter, prompt, plain, **kw):  # a target alone that picks another last token
        events = list(uag.core.engine.stream(target, drafter, prompt, plain, **kw))
        last = events[-1].run.tokens[-1]
        events[-1].run.tokens[-1] = type(last)(last.id + 1, last.text, last.from_draft)
        return iter(events)

    checked = check_against_target(loaded.target, ids, config, run, stream=perturbed)
    assert checked.divergence.kind == "diverged" and checked.divergence.position == run.generated - 1
    empty = Run("context", loaded.target.name, prompt_ids=ids, max_tokens=4)
    assert check_against_target(loaded, ids, config, empty).to_dict() == {
        "kind": None,
        "message": "not compared: the reply has no tokens",
    }


# --- open_auto: a value, not the caller's dict -----------------------------------------------------------------


@pytest.fixture
def no_calibration(monkeypatch):
    for name in ("calibrate", "calibrate_target"):
        monkeypatch.setattr(uag.costs.calibrate, name, lambda *a, **kw: pytest.fail("a calibration ran"))


def test_open_auto_returns_what_a_run_opens_from_and_leaves_the_callers_arguments_alone(cache, no_calibration):
    target, lookup = fake_target(), DrafterChoice(lookup=True)
    save(calibration(SAVED, QUIET))
    given = {"cancel": None}
    auto = open_auto(target, lookup, given)
    assert given == {"cancel": None} and isinstance(auto, AutoInputs)
    assert auto.profile == SAVED and auto.evidence == Evidence()  # nothing saved yet: a new one to learn into
    auto.finish()
    assert find_evidence(evidence_key(target, lookup)) == auto.evidence  # saved for the pair's next run

    own = Evidence(verify_ms={1: 5.0})
    mine = open_auto(target, lookup, {"profile": None, "evidence": own})
    assert mine.engine_kwargs() == {"profile": None, "evidence": own}
    held: dict = {}
    first, second = open_auto(target, lookup, held=held), open_auto(target, lookup, held=held)
    assert first.evidence is second.evidence and len(held) == 1  # a long-lived caller's runs share it
    assert open_auto(target, lookup).evidence is not first.evidence  # a process's run reads it again


def test_a_server_schedules_missing_costs_instead_of_measuring_them(cache, no_calibration):
    wanted = []
    auto = open_auto(fake_target(), DrafterChoice(lookup=True), schedule=lambda key, why: wanted.append(why))
    assert auto.profile is None and wanted == ["no costs are saved for it yet"]


def test_the_server_calls_the_engine_itself(cache):
    from uag.runtime.host import Host
    from uag.runtime.jobs import JobRunner
    from uag.server.protocol import ServerDefaults
    from uag.server.service import Service

    defaults = ServerDefaults(model="org/target", drafter="lookup", drafters=("lookup",))
    served = Service(Host(ModelStore(), JobRunner(MLXWorker()), target="org/target"), defaults, cache_bytes=0)
    assert served.host.stream is uag.core.engine.stream  # not uag.api.stream, which would open auto a second time


def test_a_host_saves_auto_evidence_at_once_alone_and_once_its_batch_has_drained_under_load(cache, no_calibration):
    """A request's end writes its pair's evidence (a file written and renamed) only where the worker runs nothing
    else: while others run, the write waits for the last of them, which writes every pair's newest evidence."""
    from uag.runtime.host import Host
    from uag.runtime.jobs import JobRunner

    host = Host(ModelStore(), JobRunner(MLXWorker(name="test-evidence")), target="org/target")

    class Busy:  # a worker's counts, set by hand; `alone` read from them as the worker reads it
        running, backlog, alone = 3, 0, MLXWorker.alone

    real, busy = host.runner, Busy()
    host.runner = SimpleNamespace(worker=busy)
    try:
        save(calibration(SAVED, QUIET))  # the pair's costs, saved: nothing is measured
        target, lookup = fake_target(), DrafterChoice(lookup=True)
        loaded = Loaded(target, lookup, None)
        key = evidence_key(target, lookup)
        first = host.open_auto(loaded, "lookup")
        first.evidence.expansion = 1.5  # what the first request taught
        first.finish()
        assert find_evidence(key) is None and host.unsaved  # others still run: nothing written yet
        busy.running, busy.backlog = 1, 2  # alone, but requests wait to start: still later
        host.open_auto(loaded, "lookup").finish()
        assert find_evidence(key) is None
        busy.backlog = 0  # the last of them ends
        last = host.open_auto(loaded, "lookup")
        assert last.evidence is first.evidence  # the host's one evidence per pair, in memory meanwhile
        last.finish()
        assert find_evidence(key).expansion == 1.5 and not host.unsaved
    finally:
        host.runner = real
        real.worker.close(timeout=10)


# --- the app's auto behaves as the CLI's --------------------------------------------------------------------------


@pytest.fixture
def policies(monkeypatch):
    """The evidence every auto run's policy was given (the object, and what it held then)."""
    given: list[tuple[Evidence, dict]] = []
    make = uag.core.engine.make_policy

    def recording(*args, **kwargs):
        evidence = next((a for a in (*args, *kwargs.values()) if isinstance(a, Evidence)), None)
        if evidence is not None:
            given.append((evidence, normal(evidence)))
        return make(*args, **kwargs)

    monkeypatch.setattr(uag.core.engine, "make_policy", recording)
    return given


@pytest.fixture
def cli(capsys, monkeypatch, store):
    """`uag generate … --json` in this process, on the test session's loaded models: the JSON object."""
    from uag.cli import main

    monkeypatch.setattr("uag.models.store.ModelStore", lambda *_, **__: store)  # not a second copy of the models

    def run(*argv: str) -> dict:
        capsys.readouterr()
        assert main(["generate", *argv, "--json", PROMPT]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    return run


def test_the_apps_auto_opens_from_and_saves_the_pairs_evidence_as_the_clis(models, store, cache, policies, cli):
    loaded = open_pair(store, models["target"], models["drafter"])
    key = evidence_key(loaded.target, loaded.choice)
    save(Calibration(key, CostProfile({1: 20.0, 2: 21.0, 3: 22.0, 4: 23.0, 5: 24.0}, drafter_ms=2.0), "now", 256))
    pair = ["--target", models["target"], "--drafter", models["drafter"], "--strategy", "auto", "-k", "4"]

    cli(*pair, "--max-tokens", "12")  # the pair's first run: it opens from nothing, and saves what it learned
    opening = normal(find_evidence(key))
    cli(*pair, "--max-tokens", "12")
    cli_taught, cli_opened = policies[-1]
    assert cli_opened == opening and normal(find_evidence(key)) == normal(cli_taught)

    save_evidence(key, Evidence.from_dict(opening))  # the app starts where the CLI's second run started
    session = Session(store=store, worker=MLXWorker(name="test-one-way-in"))
    try:
        settings = Settings.parse(
            target=models["target"], drafter=models["drafter"], strategy="auto", k=4, max_tokens=12
        )
        assert list(session.compare(PROMPT, settings))[-1].state == "done"
        assert len(policies) == 3  # the app's auto run was given evidence, as the CLI's two were
        app_taught, app_opened = policies[-1]
        assert app_opened == opening and normal(find_evidence(key)) == normal(app_taught)
        (cache / "evidence").rename(cache / "gone")  # the app's next run opens from its own, as a server's does
        assert list(session.compare(PROMPT, settings))[-1].state == "done"
        assert len(policies) == 4 and policies[-1][0] is app_taught and normal(find_evidence(key)) == normal(app_taught)
    finally:
        session.worker.close(timeout=10)


# --- uag generate --json records what ran ---------------------------------------------------------------------


def test_generate_json_records_what_ran(models, cache, cli):
    target, drafter = models["target"], models["drafter"]
    out = cli("--target", target, "--drafter", drafter, "--strategy", "tli", "-k", "3", "--max-tokens", "4")
    assert out["ran"] == {
        "target": target,
        "target_dtype": "float32",
        "drafter": drafter,
        "drafter_dtype": "float32",
        "translation": "tli",
        "k_policy": "fixed",
        "k": 3,
    }
    alone = cli("--target", target, "--strategy", "baseline", "--max-tokens", "4")
    assert alone["ran"] == {
        "target": target,
        "target_dtype": "float32",
        "drafter": None,
        "drafter_dtype": None,
        "translation": None,
        "k_policy": None,
        "k": None,
    }
    compared = cli("--target", target, "--drafter", "lookup", "-k", "2", "--max-tokens", "6", "--compare")
    assert compared["ran"]["drafter"] == "lookup" and compared["ran"]["drafter_dtype"] is None
    assert compared["divergence"]["kind"] == "identical" and "measured_speedup" in compared["divergence"]
    assert set(compared) == {"ran", "baseline", "speculative", "divergence"}


def test_what_ran_says_auto_is_adaptive_k_with_context_translation():
    target = SimpleNamespace(name="t", dtype="bfloat16")
    ran = what_ran(target, DrafterChoice(lookup=True), GenerationConfig(k=8, k_policy="adaptive"))
    assert ran["k_policy"] == "adaptive" and ran["translation"] == "context" and ran["k"] == 8
