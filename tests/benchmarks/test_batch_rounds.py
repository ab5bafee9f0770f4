"""benchmarks/batch_rounds.py on a tiny float32 target and drafter: every condition generates exactly its tokens,
uag's batch (queued, waited for, speculating with auto) the same greedy tokens as mlx-lm's BatchGenerator, and the
breakdown and profile lines appear."""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import batch_rounds as br  # noqa: E402  (benchmarks/batch_rounds.py)

from tests.support.tiny_models import build_tiny, unshare  # noqa: E402
from uag.server.chat import render  # noqa: E402


def test_every_condition_runs_and_uags_batch_gives_mlx_lms_tokens(store, capsys):
    target = str(build_tiny("llama", "llama-3.2", seed=31, tie_embeddings=False))
    drafter = str(build_tiny("llama", "llama-3.2", seed=32, tie_embeddings=False))
    args = ["--target", target, "--batch", "3", "--prompt", "40", "--max-tokens", "6", "--repeats", "1"]
    try:
        assert br.main([*args, "--breakdown", "--auto", drafter, "--profile", "3"]) == 0
    finally:
        unshare(store.get(target), store.get(drafter))
    out = capsys.readouterr().out
    for name in ("uag", "uag-wait", "mlx_lm", "uag-auto"):
        assert f"B = 3  {name} " in out and f"B = 3  {name}: the 3 functions" in out
    assert "B = 3  uag       passes " in out and "ms a round (wall / CPU)" in out
    assert "tokens equal to mlx_lm's: 3/3" in out


def test_the_endless_model_never_stops_at_an_eos(store):
    loaded = store.get(str(build_tiny("llama", "llama-3.2", seed=31, tie_embeddings=False)))
    endless = br.Endless(**{f.name: getattr(loaded, f.name) for f in dataclasses.fields(loaded)})
    assert loaded.eos_ids and endless.eos_ids == frozenset()


def test_edit_prompts_are_the_edit_conversations_first_turns_as_the_server_reads_them(store):
    loaded = store.get(str(build_tiny("llama", "llama-3.2", seed=31, tie_embeddings=False)))
    ids = br.edit_prompts(loaded, 24)  # more than the 22 bundled: from the first again
    first = br.load_conversations("edit")[0]
    assert len(ids) == 24 and ids[22] == ids[0] and ids[0] != ids[1]
    assert ids[0] == render(loaded.tokenizer, first.messages([]))  # as uag serve reads the request
    text = loaded.tokenizer.decode(ids[0])
    assert first.turns[0] in text and first.system in text  # the file to change, and its system prompt


def test_edit_prompts_drive_every_condition(store, capsys):
    target = str(build_tiny("llama", "llama-3.2", seed=31, tie_embeddings=False))
    args = ["--target", target, "--batch", "2", "--prompts", "edit", "--max-tokens", "4", "--repeats", "1"]
    try:
        assert br.main([*args, "--auto", "--breakdown"]) == 0
    finally:
        unshare(store.get(target))
    out = capsys.readouterr().out
    assert "edit prompts" in out and "B = 2  uag-auto  passes " in out and "tokens equal to mlx_lm's: 2/2" in out


def test_copy_prompts_are_an_edit_turn_then_its_own_first_half_and_drive_every_condition(store, capsys):
    target = str(build_tiny("llama", "llama-3.2", seed=31, tie_embeddings=False))
    loaded = store.get(target)
    ids = br.copy_prompts(loaded, 23)  # past the 22 bundled: from the first again
    turn = loaded.tokenizer.encode(br.load_conversations("edit")[0].turns[0])
    assert ids[0] == turn + turn[: len(turn) // 2] and ids[22] == ids[0] and ids[0] != ids[1]
    args = ["--target", target, "--batch", "2", "--prompts", "copy", "--max-tokens", "4", "--repeats", "1"]
    try:
        assert br.main([*args, "--auto", "--breakdown"]) == 0
    finally:
        unshare(loaded)
    out = capsys.readouterr().out
    assert "copy prompts" in out and "B = 2  uag-auto  passes " in out and "tokens equal to mlx_lm's: 2/2" in out
