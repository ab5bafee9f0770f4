"""benchmarks/request_start.py on tiny models with real tokenizers: it finds the edit conversations' second turns as a
chat template re-sends them, and times each part of a turn's start and end both ways."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import request_start as rs  # noqa: E402  (benchmarks/request_start.py)

from tests.support.tiny_models import build_tiny  # noqa: E402
from uag.study.datasets import load_conversations  # noqa: E402


def test_every_part_is_timed_before_and_now(store, capsys):
    target = str(build_tiny("qwen2", "qwen2.5", seed=41))
    drafter = str(build_tiny("llama", "llama-3.2", seed=42))
    assert rs.main(["--target", target, "--drafter", drafter, "--conversations", "2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 edit conversations' turn 2" in out
    for part in ("translation", "lookup's index", "shared index", "together"):
        assert any(line.startswith(part) and len(line.split()) >= 4 for line in out.splitlines()), part


def test_turn_two_is_what_turn_one_committed_and_the_prompt_that_goes_on_from_it(store):
    tokenizer = store.get(str(build_tiny("qwen2", "qwen2.5", seed=41))).tokenizer
    held, prompt = rs.turn_two(tokenizer, load_conversations("edit", 1)[0])
    assert len(held) < len(prompt) and prompt[: len(held)] == held
    assert tokenizer.decode(held[-1:]) == "<|im_end|>"  # the reply's end token, which its run committed last
