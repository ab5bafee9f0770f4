"""The model store: one copy per resolved model, LRU eviction within a budget, clear messages for bad folders."""

from __future__ import annotations

import json
import shutil

import pytest

from uag.errors import ModelError
from uag.models.store import ModelStore


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Three tiny model folders (real tokenizers, random weights) copied under one parent."""
    from tests.support.tiny_models import build_tiny

    root = tmp_path_factory.mktemp("models")
    folders = []
    for i, (arch, tokenizer) in enumerate((("mistral", "mistral-v1"), ("qwen2", "qwen2.5"), ("llama", "qwen2.5"))):
        folder = root / f"m{i}"
        shutil.copytree(build_tiny(arch, tokenizer), folder)
        folders.append(folder)
    return root, folders


def test_every_spelling_of_a_folder_is_one_model(tiny, monkeypatch):  # finding 8
    root, (m0, *_) = tiny
    monkeypatch.chdir(root)
    store = ModelStore()
    first = store.get("m0")
    for spelling in ("m0/", "m0//", "./m0", str(m0), f"{root}/./m0"):
        assert store.get(spelling) is first and spelling in store
    assert store.loaded == ["m0"]


def test_the_least_recently_used_model_is_unloaded_beyond_the_budget(tiny):
    _, (m0, m1, m2) = tiny
    store, gone = ModelStore(max_models=2), []
    store.on_evict.append(lambda model: gone.append(model.name))
    a = store.get(str(m0))
    store.get(str(m1))
    store.get(str(m0))  # m0 is now the most recently used
    store.get(str(m2))
    assert gone == [str(m1)] and store.loaded == [str(m0), str(m2)] and store.holds(a)
    store.get(str(m1), keep=[str(m0)])  # m0 is in use by the job: m2 goes instead
    assert gone == [str(m1), str(m2)] and set(store.loaded) == {str(m0), str(m1)}


def test_a_pinned_model_is_never_unloaded_and_the_budget_holds_again_once_none_pins_it(tiny):
    _, (m0, m1, m2) = tiny
    store, gone = ModelStore(max_models=2), []
    store.on_evict.append(lambda model: gone.append(model.name))
    a, b = store.get(str(m0)), store.get(str(m1))
    with store.pinned(a, None):
        with store.pinned(a, b):  # two runs, one of them on two models: each holds its own
            store.get(str(m2))  # nothing left to unload but pinned models and the one just loaded: over budget
            assert gone == [] and store.loaded == [str(m0), str(m1), str(m2)]
        assert gone == [str(m1)] and store.pinned_names == [str(m0)]  # b's last pin gone: down to the budget
        store.get(str(m1))  # m0 is the least recently used, but pinned: m2 goes
        assert gone == [str(m1), str(m2)] and store.holds(a)
    assert store.loaded == [str(m0), str(m1)] and not store.pinned_names


def test_clear_unloads_every_model_no_run_uses_and_frees_its_memory(tiny):
    import weakref

    _, (m0, m1, _) = tiny
    store, gone = ModelStore(), []
    store.on_evict.append(lambda model: gone.append(model.name))
    a, b = store.get(str(m0)), store.get(str(m1))
    freed = weakref.ref(b)
    with store.pinned(a):
        del b
        store.clear()
        assert gone == [str(m1)] and store.loaded == [str(m0)] and freed() is None
    store.clear()
    assert gone == [str(m1), str(m0)] and store.loaded == []


def test_a_gigabyte_budget_unloads_down_to_it(tiny):
    _, (m0, m1, _) = tiny
    store = ModelStore(max_gb=1e-12)  # smaller than any model: only the one just loaded stays
    store.get(str(m0))
    store.get(str(m1))
    assert store.loaded == [str(m1)]


def test_room_is_made_before_a_model_loads_never_after(tiny):
    """A store at its budget unloads first, so that it never holds the new model on top of a budget's worth."""
    _, (m0, m1, m2) = tiny
    sizes = [ModelStore().size_on_disk(str(m)) for m in (m0, m1, m2)]
    store, held_when_unloading = ModelStore(max_gb=(sizes[1] + sizes[2]) / 1e9), []  # room for m1 and m2
    store.on_evict.append(lambda model: held_when_unloading.append((model.name, list(store.loaded))))
    store.get(str(m0))
    store.get(str(m1))
    assert [model.name for model in store.unloads_for([sizes[2]])] == [str(m0)]  # what loading m2 would unload
    store.get(str(m2))
    assert held_when_unloading == [(str(m0), [str(m1)])]  # m0 was gone before m2 loaded
    assert store.loaded == [str(m1), str(m2)] and store.weight_bytes <= store.max_bytes


def test_the_memory_check_counts_what_a_budget_would_unload(tiny):
    from uag.models.loading import check_memory

    _, (m0, m1, m2) = tiny
    size = ModelStore().size_on_disk(str(m2))
    free = int(size * 1.2) - 1  # a little less than m2 needs with room to run (uag.models.memory.HEADROOM)
    unbudgeted, budgeted = ModelStore(), ModelStore(max_models=2)
    for store in (unbudgeted, budgeted):
        store.get(str(m0))
        store.get(str(m1))
    with pytest.raises(ModelError, match="cannot load the target"):
        check_memory(unbudgeted, [("target", str(m2), None)], available=free)  # nothing would be unloaded
    check_memory(budgeted, [("target", str(m2), None)], available=free)  # m0 would go: it fits
    with budgeted.pinned(budgeted.get(str(m0)), budgeted.get(str(m1))):  # both in use: nothing would go
        with pytest.raises(ModelError, match="cannot load the target"):
            check_memory(budgeted, [("target", str(m2), None)], available=free)


def test_the_memory_check_reads_nothing_when_every_model_is_loaded(tiny, monkeypatch):
    """A server checks at every request: with its pair in memory, no header is read (nothing could fail to fit);
    with one model still to load, all are counted again."""
    from uag.models import loading, memory
    from uag.models.loading import check_memory

    _, (m0, m1, m2) = tiny
    store = ModelStore()
    store.get(str(m0))
    store.get(str(m1))
    read = []
    monkeypatch.setattr(memory, "model_bytes", lambda folder, dtype=None: read.append(folder) or 1)
    check_memory(store, [("target", str(m0), None), ("drafter", str(m1), None), ("drafter", None, None)], available=0)
    assert read == []
    with pytest.raises(ModelError, match="cannot load the target"):
        check_memory(store, [("target", str(m2), None), ("drafter", str(m1), None)], available=0)
    assert len(read) == 2 and loading.memory is memory


def test_fewer_than_two_models_cannot_hold_a_pair():
    with pytest.raises(ValueError, match="at least 2"):
        ModelStore(max_models=1)


def _broken_copy(tiny, tmp_path, name):
    _, (m0, *_) = tiny
    folder = tmp_path / name
    shutil.copytree(m0, folder)
    return folder


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "config.json").write_text(json.dumps({"hidden_size": 64})), "config.json names no model_type"),
        (lambda f: (f / "config.json").write_text("{oops"), "config.json is not valid JSON (line 1)"),
        (
            lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
            "model.safetensors is incomplete or damaged",
        ),
        (lambda f: (f / "model.safetensors").write_bytes(b"\x01\x02"), "model.safetensors is incomplete or damaged"),
    ],
)
def test_a_damaged_folder_gets_a_message_the_user_can_act_on(tiny, tmp_path, damage, message):  # finding 5
    folder = _broken_copy(tiny, tmp_path, "broken")
    damage(folder)
    with pytest.raises(ModelError) as err:
        ModelStore().get(str(folder))
    text = str(err.value)
    assert message in text and "Error" not in text and "Traceback" not in text


def test_the_api_loads_a_damaged_folder_with_the_same_message(tiny, tmp_path, monkeypatch):
    """`uag.load` goes through uag.models.loading, as the command line and the app do: one line, a UserError."""
    import uag
    from uag import api

    monkeypatch.setattr(api, "_store", ModelStore())  # not the process-wide one other tests share
    folder = _broken_copy(tiny, tmp_path, "corrupt-config")
    (folder / "config.json").write_text("{oops")
    with pytest.raises(uag.UserError) as err:
        uag.load(str(folder))
    assert isinstance(err.value, ModelError) and "config.json is not valid JSON" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ModelError, match="config.json is not valid JSON"):
        uag.load_drafter(f"lookup+{folder}")


def test_the_api_says_what_is_wrong_with_a_broken_hub_model(tmp_path):
    """A hub model whose config.json names no architecture: mlx-lm's KeyError('model_type') becomes the user's
    message (uag.models.loading), not a KeyError."""
    import subprocess
    import sys

    from tests.support.broken_models import BROKEN_HUB_ID, broken_hub_cache

    script = (
        "import uag, sys\n"
        "try:\n"
        f"    uag.load({BROKEN_HUB_ID!r})\n"
        "except uag.UserError as err:\n"
        "    print(type(err).__name__, '|', err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=broken_hub_cache(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    kind, _, message = done.stdout.strip().partition(" | ")
    assert kind == "ModelError" and f"cannot load the model {BROKEN_HUB_ID!r}" in message and "model_type" in message
