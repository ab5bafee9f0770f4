"""Conversation caches on disk (`uag serve --cache-dir`, issue #50 item 3): a finished request's caches are saved
per API key and model, a new server on the same folder reads them back (the first request after the restart gets
cached tokens), the folder stays within its bound, another key never reads them, and a corrupt, truncated,
foreign-model or other-version file is skipped with a warning, never loaded. A tiny random target over HTTP.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from tests.support.server import serve_args
from tests.support.tiny_models import build_tiny
from uag.server.disk_cache import SUFFIX, DiskCaches, model_identity, read_header
from uag.server.keys import digest_of

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef0"
HEAD = "Ala ma kota, a kot ma Alę. " * 6  # ~100 tokens: the head an agent re-sends every turn
MIN_TOKENS = 32


@pytest.fixture(scope="module")
def target(store):
    path = str(build_tiny("mistral", "mistral-v1", seed=5, tie_embeddings=False))
    store.get(path)
    return path


@pytest.fixture
def start(store, target, tmp_path):
    """start(folder) -> an HTTP client of a new server over the cache folder (a restart: a new Service, the
    same loaded model), with keys alice and bob."""
    from fastapi.testclient import TestClient

    from uag.server.main import build

    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice: {ALICE}\nbob: {BOB}\n")
    services = []

    def start(folder: Path, max_gb: float = 1.0):
        argv = ("--target", target, "--drafter", "off", "--api-key-file", str(keys), "--no-ui", "--model-alias", "*")
        settings = serve_args(*argv, "--cache-dir", str(folder), "--cache-dir-gb", str(max_gb))
        app, service = build(settings, store=store)
        service.costs.close()
        service.disk.min_tokens = MIN_TOKENS
        services.append(service)
        return TestClient(app, base_url="http://127.0.0.1"), service

    yield start
    for service in services:
        service.costs.close()


def complete(http, key: str, prompt: str) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    answer = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return answer.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def saved(service, n: int) -> list[Path]:
    """The folder's cache files once the worker has written `n` of them (it writes after the reply went out)."""
    deadline = time.monotonic() + 30
    while service.disk.saves < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.disk.saves >= n
    return sorted(service.disk.folder.glob("*" + SUFFIX))


def test_a_restarted_server_reads_a_saved_head_from_disk_for_its_key_only(start, tmp_path):
    folder = tmp_path / "kv"
    http, service = start(folder)
    first = complete(http, ALICE, HEAD)
    assert cached(first) == 0
    [file] = saved(service, 1)
    header = read_header(file)
    assert header["owner"] != digest_of(ALICE) and ALICE not in file.read_bytes().decode("latin-1")  # never the key
    http, service = start(folder)  # restart: nothing in memory
    assert len(service.disk.index) == 1 and len(service.caches) == 0
    turn = complete(http, ALICE, HEAD + " Kot ma Alę.")
    assert cached(turn) >= first["usage"]["prompt_tokens"] - 1 and service.disk.loads == 1
    other = complete(http, BOB, HEAD + " Kot ma Alę.")  # another key: the same head is read cold
    assert cached(other) == 0 and service.disk.loads == 1
    cold = complete(start(tmp_path / "empty")[0], ALICE, HEAD + " Kot ma Alę.")
    assert cold["choices"][0]["text"] == turn["choices"][0]["text"] == other["choices"][0]["text"]  # lossless


def test_a_conversation_keeps_one_file_and_the_folder_its_bound(start, tmp_path):
    folder = tmp_path / "kv"
    http, service = start(folder)
    reply = complete(http, ALICE, HEAD)
    [one] = saved(service, 1)
    complete(http, ALICE, HEAD + reply["choices"][0]["text"] + " Dalej.")  # the next turn replaces the first's file
    [two] = saved(service, 2)
    assert two != one and not one.exists()
    service.disk.max_bytes = two.stat().st_size * 1.5  # room for one file
    complete(http, BOB, "Zupełnie inna rozmowa, o psach. " * 6)
    [three] = saved(service, 3)
    assert not two.exists() and three.exists() and service.disk.nbytes <= service.disk.max_bytes


def copy_with(source: Path, dest: Path, old: bytes, new: bytes) -> Path:
    data = source.read_bytes()
    assert len(old) == len(new) and data.count(old) == 1
    dest.write_bytes(data.replace(old, new))
    return dest


def test_corrupt_truncated_foreign_and_other_version_files_are_skipped_with_a_warning(start, tmp_path, caplog):
    made = tmp_path / "made"
    http, service = start(made)
    complete(http, ALICE, HEAD)
    [good] = saved(service, 1)
    header = read_header(good)
    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / f"truncated{SUFFIX}").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (folder / f"garbage{SUFFIX}").write_bytes(b"\x00" * 100)
    copy_with(good, folder / f"version{SUFFIX}", b'"0.uag_format":"1"', b'"0.uag_format":"9"')
    foreign = "f" * 64
    copy_with(good, folder / f"foreign{SUFFIX}", header["model"].encode(), foreign.encode())
    data = bytearray(good.read_bytes())
    data[-100] ^= 0xFF  # a flipped byte in the arrays: the header is whole
    (folder / f"flipped{SUFFIX}").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="uag.server.disk_cache"):
        http, service = start(folder)
        assert sorted(p.name for p in service.disk.index) == [f"flipped{SUFFIX}", f"foreign{SUFFIX}"]
        turn = complete(http, ALICE, HEAD + " Kot ma Alę.")
    assert cached(turn) == 0 and service.disk.loads == 0  # none loaded
    assert not {f"flipped{SUFFIX}", f"foreign{SUFFIX}"} & {p.name for p in service.disk.index}
    said = "\n".join(r.getMessage() for r in caplog.records)
    for name, why in [
        ("truncated", "not a readable uag cache file"),
        ("garbage", "not a readable uag cache file"),
        ("version", "uag format '9'"),
        ("foreign", "another model"),
        ("flipped", "checksum"),
    ]:
        assert f"{name}{SUFFIX} skipped" in said and why in said.split(f"{name}{SUFFIX} skipped")[1].split("\n")[0]


def test_a_models_identity_names_its_dtype_config_and_weights(store, target):
    from dataclasses import replace

    model = store.get(target)
    same = model_identity(model)
    assert model_identity(model) == same
    assert model_identity(replace(model, config={**model.config, "rope_theta": 1.0})) != same
    assert model_identity(replace(model, name="another")) != same


def test_the_cache_dir_options(tmp_path):
    from uag.errors import InputError

    settings = serve_args("--cache-dir", str(tmp_path))
    assert settings.cache_dir == str(tmp_path) and settings.cache_dir_gb > 0
    with pytest.raises(InputError, match="--cache-dir-gb must be more than 0"):
        serve_args("--cache-dir", str(tmp_path), "--cache-dir-gb", "0")
    assert DiskCaches(tmp_path / "new", 1e9).index == {}  # made where missing


def test_a_pending_write_is_replaced_by_its_conversations_later_turn(tmp_path):
    from uag.server.disk_cache import Held

    disk = DiskCaches(tmp_path, 1e9)
    turn = lambda tokens, owner="a": Held(owner, "m", tokens, [], 1)  # noqa: E731
    first, second = turn(list(range(40))), turn([*range(40), 7, 7])
    other, theirs = turn([9] * 40), turn(list(range(40)), owner="b")
    for held in (first, other, second, theirs):
        disk.later(held)
    assert disk.pending == [other, second, theirs]  # the first turn's write is the second's; another key's stays
