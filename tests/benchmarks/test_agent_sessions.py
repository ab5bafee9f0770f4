"""benchmarks/agent_sessions.py: a recorded agent request as uag serve is sent it (natively, greedy, capped) and as
mlx_lm.server is (the same conversation as chat completions, read by uag's own parser for the client's API), which
turns count as edits, and the summary's ratios. Checked on the requests Claude Code and Codex CLI sent
(tests/fixtures/agents)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import agent_sessions  # noqa: E402  (benchmarks/agent_sessions.py)
from agent_sessions import Answer, as_chat, edits, native, summary  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
RECORDED = {
    "/v1/messages": json.loads((FIXTURES / "claude_code_2.1.332_messages.json").read_text())["body"],
    "/v1/responses": json.loads((FIXTURES / "codex_0.171.0_responses.json").read_text())["body"],
}


@pytest.mark.parametrize("path", sorted(RECORDED))
def test_a_recorded_request_goes_natively_capped_and_greedy(path):
    body = native(path, RECORDED[path], 16)
    cap = "max_tokens" if path == "/v1/messages" else "max_output_tokens"
    assert body[cap] == 16 and body["temperature"] == 0.0 and body["stream"] is True
    assert body["tools"] == RECORDED[path]["tools"]  # everything else as the client sent it


@pytest.mark.parametrize("path", sorted(RECORDED))
def test_the_peer_reads_the_same_conversation_as_chat_completions(path):
    chat = as_chat(path, RECORDED[path], "coder-target", 16)
    roles = [m["role"] for m in chat["messages"]]
    assert roles[0] == "system" and "user" in roles
    names = {t["function"]["name"] for t in chat["tools"]}
    assert ("Edit" in names) if path == "/v1/messages" else ("exec_command" in names)
    assert chat["max_tokens"] == 16 and chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert not any(t.get("type") == "web_search" for t in chat["tools"])  # a hosted tool no local server runs


def answer(*calls: tuple[str, str], seconds: float = 1.0, tokens: int = 10) -> Answer:
    return Answer(seconds, tokens, 0, [n for n, _ in calls], [a for _, a in calls], "")


def test_edit_turns_are_the_ones_that_write_a_file():
    assert edits(answer(("Edit", "{}")))
    assert edits(answer(("exec_command", '{"cmd": "sed -i s/a/b/ calc.py"}')))
    assert not edits(answer(("exec_command", '{"cmd": "cat calc.py"}')))
    assert not edits(answer(("Read", "{}")))
    assert not edits(answer())


def row(server, turn, seconds, tokens, ttft, edits=False, round_=0):
    return {
        "session": "s",
        "turn": turn,
        "round": round_,
        "server": server,
        "e2e_s": seconds,
        "output_tokens": tokens,
        "ttft_s": ttft,
        "edits": edits,
    }


def test_the_summary_pools_edit_turns_and_takes_the_cold_turns_median():
    rows = [
        row("uag:lookup", 1, 10.0, 40, 20.0, edits=True),
        row("mlx_lm", 1, 20.0, 40, 16.0),
        row("uag:lookup", 2, 5.0, 30, 2.0),
        row("mlx_lm", 2, 10.0, 30, 4.0),
    ]
    lines = summary(rows)
    assert lines[0].startswith("generation, edit turns (1): uag 4.00 tok/s, mlx_lm 2.00 tok/s, 2.00x")
    assert "median 1.25x" in lines[2]
    assert lines[-1].endswith("not met")  # 2.00x < 3x
    assert agent_sessions.GOALS["generation_edit"] == 3.0
