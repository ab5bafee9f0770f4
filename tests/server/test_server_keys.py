"""Several API keys (`uag serve --api-key-file`, issue #50 item 4): the key file's forms and refusals, keys held as
digests and read again when the file changes, and over HTTP on a tiny random target that nothing crosses between
keys — key B gets no cached tokens and no shared-index drafts from key A's identical request, cannot read A's stored
response, and counts apart in GET /metrics under its name, never its key.
"""

from __future__ import annotations

import logging
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import serve_args
from tests.support.tiny_models import build_tiny
from uag.errors import InputError
from uag.server.keys import ApiKeys, Key, digest_of, hash_line, parse_keys

ALICE, BOB, CAROL = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef0", "carol-key-0123456789abcdef"
PROMPT = "Ala ma kota, a kot ma Alę."


def write(path, text: str) -> None:
    """Write the key file and move its modification time on (a rewrite within one clock tick is seen too)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_a_key_file_holds_named_keys_plain_or_hashed():
    keys = parse_keys(f"# team keys\nalice: {ALICE}\n\nbob:   sha256:{digest_of(BOB).upper()}\n")
    assert keys == {"alice": digest_of(ALICE), "bob": digest_of(BOB)}
    assert hash_line(f" {BOB}\n") == "sha256:" + digest_of(BOB)
    with pytest.raises(InputError, match="one key"):
        hash_line("two words")


@pytest.mark.parametrize(
    "text, says",
    [
        ("alice", "write `name: key`"),
        ("alice:", "write `name: key`"),
        ("al ice: k", "is not 1-64 letters"),
        ("alice: a\nalice: b", "given twice"),
        ("alice: a\nbob: a", "also another name's"),
        ("alice: sha256:abc", "64 hex digits"),
        ("alice: two words", "holds a space"),
    ],
)
def test_a_wrong_key_file_line_is_named(text, says):
    with pytest.raises(InputError, match=says) as err:
        parse_keys(text)
    assert "line" in str(err.value) and "two words" not in str(err.value)  # never the key itself


def test_keys_are_matched_by_digest_and_read_again_when_the_file_changes(tmp_path, caplog):
    path = tmp_path / "keys.txt"
    write(path, f"alice: {ALICE}\nbob: sha256:{digest_of(BOB)}\n")
    keys = ApiKeys(path=path)
    alice = keys.match(ALICE)
    assert isinstance(alice, Key) and alice.name == "alice" and alice == digest_of(ALICE) and ALICE not in repr(alice)
    assert keys.match(BOB).name == "bob" and keys.match(CAROL) is None and keys.match("") is None
    write(path, f"alice: {ALICE}\ncarol: {CAROL}\n")  # bob revoked, carol added: no restart
    assert keys.match(BOB) is None and keys.match(CAROL).name == "carol"
    with caplog.at_level(logging.ERROR, logger="uag.server.keys"):
        write(path, "alice: \n")  # a typo mid-edit: the keys read last stay
        assert keys.match(ALICE).name == "alice" and keys.match(CAROL).name == "carol"
        keys.match(ALICE)
    assert [r.message.count("stay in force") for r in caplog.records] == [1]  # said once per version of the file
    path.unlink()
    assert keys.match(ALICE).name == "alice"


def test_the_serve_options_of_several_keys(tmp_path):
    path = tmp_path / "keys.txt"
    write(path, f"alice: {ALICE}\n")
    settings = serve_args("--api-key-file", str(path), "--api-key", BOB, "--host", "0.0.0.0")
    keys = settings.keys
    assert keys.match(BOB).name == "default" and keys.match(ALICE).name == "alice" and keys.from_file
    assert isinstance(serve_args("--api-key", BOB).keys, str)
    with pytest.raises(InputError, match="cannot read it"):
        serve_args("--api-key-file", str(tmp_path / "none.txt"))
    write(path, f"default: {ALICE}\n")
    with pytest.raises(InputError, match="'default' is --api-key's"):
        serve_args("--api-key-file", str(path), "--api-key", BOB)


def test_hash_key_prints_a_key_files_line(monkeypatch, capsys):
    import io

    from uag.server.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO(ALICE + "\n"))
    assert main(["--hash-key"]) == 0
    assert capsys.readouterr().out.strip() == "sha256:" + digest_of(ALICE)


# --- over HTTP: nothing crosses between keys ---------------------------------------------------------------
@pytest.fixture(scope="module")
def served(store, tmp_path_factory):
    from fastapi.testclient import TestClient

    from uag.server.main import build

    target = str(build_tiny("mistral", "mistral-v1", seed=5, tie_embeddings=False))
    chat = str(build_tiny("qwen2", "qwen2.5"))
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    write(path, f"alice: {ALICE}\nbob: sha256:{digest_of(BOB)}\n")
    argv = (
        "--api-key-file",
        str(path),
        "--drafter",
        "lookup",
        "--strategy",
        "context",
        "-k",
        "8",
        "--no-ui",
        "--model-alias",
        "*",
    )
    settings = serve_args("--target", target, *argv)
    app, service = build(settings, store=store)
    settings = serve_args("--target", chat, *argv)
    chat_app, chat_service = build(settings, store=store)
    try:
        yield (
            TestClient(app, base_url="http://127.0.0.1"),
            TestClient(chat_app, base_url="http://127.0.0.1"),
            service,
            path,
        )
    finally:
        service.costs.close()
        chat_service.costs.close()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(http, key: str, speculative: bool = True) -> dict:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "speculative": speculative}
    answer = http.post("/v1/completions", json=body, headers=auth(key))
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_key_b_gets_nothing_of_key_as_identical_request(served):
    http, _, service, _ = served
    first = complete(http, ALICE, speculative=False)
    again = complete(http, ALICE)
    cached = lambda reply: reply["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert cached(again) > 0 and again["speculative"]["shared_lookup_cycles"] >= 1  # alice's own: reused
    other = complete(http, BOB)
    assert other["choices"][0]["text"] == first["choices"][0]["text"]
    assert cached(other) == 0 and other["speculative"]["shared_lookup_cycles"] == 0  # nothing of alice's
    # the conversation caches are held per key's digest, never per key
    owners = {entry.pair[0] for entry in service.caches._entries.values()}
    assert len(owners) == 2 and not any(ALICE in owner or BOB in owner for owner in owners)


def test_each_key_counts_apart_in_metrics_by_its_name(served):
    http, _, _, _ = served

    def scrape() -> dict:
        answer = http.get("/metrics", headers=auth(ALICE))
        assert answer.status_code == 200 and ALICE not in answer.text and BOB not in answer.text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(answer.text)
            for s in family.samples
        }

    before = scrape()
    replies = [complete(http, BOB, speculative=False), complete(http, BOB, speculative=False)]
    after = scrape()
    bob = (("key", "bob"),)
    added = lambda name, labels=bob: after.get((name, labels), 0) - before.get((name, labels), 0)  # noqa: E731
    assert added("uag:key_generation_tokens_total") == sum(r["usage"]["completion_tokens"] for r in replies)
    assert added("uag:key_prompt_tokens_total") == sum(r["usage"]["prompt_tokens"] for r in replies)
    assert added("uag:key_prompt_tokens_cached_total") == sum(
        r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies
    )
    assert added("uag:key_request_success_total", (("finished_reason", "length"), ("key", "bob"))) == 2
    assert added("uag:key_prompt_tokens_total", (("key", "alice"),)) == 0  # alice's count is alice's


def test_key_b_cannot_read_key_as_stored_response(served):
    _, http, _, _ = served
    made = http.post("/v1/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 4}, headers=auth(ALICE))
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    assert http.get(f"/v1/responses/{rid}", headers=auth(ALICE)).status_code == 200
    theirs = http.get(f"/v1/responses/{rid}", headers=auth(BOB))
    assert theirs.status_code == 404 and theirs.json()["error"]["type"] == "invalid_request_error"
    assert http.delete(f"/v1/responses/{rid}", headers=auth(BOB)).status_code == 404
    follow = {"model": "m", "input": "And?", "previous_response_id": rid, "max_output_tokens": 4}
    assert http.post("/v1/responses", json=follow, headers=auth(BOB)).status_code in (400, 404)
    assert http.get(f"/v1/responses/{rid}", headers=auth(ALICE)).status_code == 200


def test_a_key_added_or_revoked_takes_effect_without_a_restart(served):
    http, _, _, path = served
    assert http.get("/v1/models", headers=auth(CAROL)).status_code == 401
    write(path, f"alice: {ALICE}\ncarol: {CAROL}\n")
    try:
        assert http.get("/v1/models", headers=auth(CAROL)).status_code == 200
        refused = http.get("/v1/models", headers={"x-api-key": BOB})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    finally:
        write(path, f"alice: {ALICE}\nbob: sha256:{digest_of(BOB)}\n")
    assert http.get("/v1/models", headers={"x-api-key": BOB}).status_code == 200


def test_with_a_key_file_each_key_is_its_own_client():
    from types import SimpleNamespace

    from uag.server.routes import _client

    request = SimpleNamespace(client=SimpleNamespace(host="127.0.0.1"))
    alice, bob = Key(digest_of(ALICE), "alice"), Key(digest_of(BOB), "bob")
    assert _client(request, alice, True) != _client(request, bob, True)  # one address, two clients
    assert _client(request, alice, False) == _client(request, bob, False) == "127.0.0.1"  # one key: by address
