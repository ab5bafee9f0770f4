"""benchmarks/serve_many.py (`serve.py --concurrency`) without a server: waves, rows, the summary's maths, the
issue's targets, losslessness, the plot, and the edit conversations' turns in order under a fake client."""

import argparse
import json
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serve  # noqa: E402  (benchmarks/serve.py)
import serve_many as sm  # noqa: E402
import serving  # noqa: E402
from serving import Condition, Reply  # noqa: E402

from uag.study.datasets import Conversation  # noqa: E402

UAG = Condition("uag:lookup", "uag", ("uag", "serve"), "demo-target")


def request(
    condition,
    workload,
    concurrency,
    *,
    item="a",
    turn=2,
    wave=0,
    repeat=0,
    started=0.0,
    done=1.0,
    tokens=10,
    ttft=0.5,
    text="x",
    drafted=None,
    accepted=None,
    batch=None,
) -> dict:
    """A request row as serve_many writes it, with only the fields the summary reads."""
    return {
        "kind": "request",
        "condition": condition,
        "workload": workload,
        "concurrency": concurrency,
        "item": item,
        "turn": turn,
        "wave": wave,
        "repeat": repeat,
        "started_s": started,
        "done_s": done,
        "e2e_s": done - started,
        "completion_tokens": tokens,
        "ttft_s": ttft,
        "text": text,
        "drafted": drafted,
        "accepted": accepted,
        "speculative": None if batch is None else {"batch": {"mean": batch, "largest": 4}},
    }


def at(condition, workload, concurrency, tps, *, ttft=0.5, turn=2) -> list[dict]:
    """One wave of one request whose aggregate tokens/s is `tps` (100 tokens)."""
    return [request(condition, workload, concurrency, done=100 / tps, tokens=100, ttft=ttft, turn=turn)]


# --- pure helpers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([1, 2, 3, 4], 50, 2.5), ([1, 2, 3, 4], 95, 3.85), ([4, 1, 3, 2], 0, 1), ([7.0], 95, 7.0), ([2, None, 4], 50, 3)],
)
def test_percentile_is_linear_between_ranks(values, q, expected):
    assert sm.percentile(values, q) == pytest.approx(expected)


def test_rounds_rows_are_scrape_differences_and_pool_to_ms_per_round():
    condition = Condition("uag:off", "uag", ("x",), "demo-target")
    before = {"rounds": 10.0, "wall": {"passes": 1.0, "members": 0.5, "rest": 0.1}, "cpu": {"passes": 0.2}}
    after = {"rounds": 30.0, "wall": {"passes": 1.2, "members": 0.6, "rest": 0.1}, "cpu": {"passes": 0.3}}
    row = sm.rounds_row(condition, 0, 4, 0, "chat", before, after)
    assert (
        row["rounds"] == 20
        and row["wall"]["passes"] == pytest.approx(0.2)
        and row["cpu"] == {"passes": pytest.approx(0.1)}
    )
    later = {**row, "wave": 1, "rounds": 20, "wall": {"passes": 0.6, "members": 0.3, "rest": 0.0}}
    (line,) = [x for x in sm.rounds_lines([row, later]) if x.startswith("uag:off")]
    # 40 rounds: passes (0.2 + 0.6) s, members (0.1 + 0.3) s, cpu passes (0.1 + 0.1) s
    assert "40 rounds" in line and "passes 20.00 / 5.00" in line and "members 10.00 / 0.00" in line
    assert sm.rounds_lines([{"kind": "request"}]) == []


def test_an_edit_waves_turn_1_rounds_pool_apart_from_its_measured_turns():
    condition = Condition("uag:lookup", "uag", ("x",), "demo-target")
    zero = {"rounds": 0.0, "wall": {"passes": 0.0}, "cpu": {}}
    read = {**sm.rounds_row(condition, 0, 4, 0, "edit", zero, {"rounds": 2.0, "wall": {"passes": 1.0}, "cpu": {}})}
    later = {**sm.rounds_row(condition, 0, 4, 0, "edit", zero, {"rounds": 10.0, "wall": {"passes": 0.1}, "cpu": {}})}
    lines = sm.rounds_lines([{**read, "turns": "1"}, {**later, "turns": "2-3"}])
    (first,) = [x for x in lines if "edit turn 1" in x]
    (measured,) = [x for x in lines if x.startswith("uag:lookup") and "turn 1" not in x]
    assert "2 rounds" in first and "passes 500.00" in first
    assert "10 rounds" in measured and "passes 10.00" in measured


def test_kernels_are_the_files_of_mlxs_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    assert sm.kernel_cache() == tmp_path / "ptx" and sm.kernels() == set()  # none compiled yet: no folder
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "gather_2_float.cubin").write_bytes(b"")
    assert sm.kernels() == {"gather_2_float.cubin"}
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    assert sm.kernel_cache().parts[-3:-1] == ("mlx", mx.__version__) and sm.kernel_cache().name == "ptx"


def test_percentile_of_nothing_is_none():
    assert sm.percentile([], 50) is None
    assert sm.percentile([None], 95) is None


@pytest.mark.parametrize(
    ("items", "size", "expected"),
    [
        ("abcde", 2, [["a", "b"], ["c", "d"]]),
        ("abcd", 4, [list("abcd")]),
        ("abc", 1, [["a"], ["b"], ["c"]]),
        ("ab", 4, []),
    ],
)
def test_waves_are_full_and_drop_the_rest(items, size, expected):
    assert sm.waves(items, size) == expected


def test_at_once_releases_every_call_together_and_keeps_order():
    inside, arrived = threading.Event(), []

    def call(i):
        def run():
            arrived.append(i)
            if len(arrived) == 3:
                inside.set()
            assert inside.wait(5), "a call ran before the others had started"  # all three run at the same time
            return i * 10

        return run

    assert sm.at_once([call(i) for i in range(3)]) == [0, 10, 20]


def test_at_once_raises_a_calls_error():
    def boom():
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        sm.at_once([lambda: 1, boom])


def test_request_row_times_are_from_the_wave_start():
    reply = Reply(
        "hi",
        ttft_s=0.25,
        generation_s=1.0,
        e2e_s=1.5,
        usage={"completion_tokens": 3, "prompt_tokens": 9},
        speculative={"acceptance_rate": 0.5, "batch": {"mean": 2.0, "largest": 2}},
    )
    r = sm.request_row(UAG, 1, 4, 2, sm.Sent("edit", "edit-001", 3, reply, 0.5))
    assert (r["kind"], r["condition"], r["concurrency"], r["wave"], r["repeat"]) == ("request", "uag:lookup", 4, 2, 1)
    assert (r["workload"], r["item"], r["turn"], r["completion_tokens"]) == ("edit", "edit-001", 3, 3)
    assert (r["started_s"], r["first_token_s"], r["done_s"]) == (0.5, 0.75, 2.0)
    assert r["speculative"]["batch"] == {"mean": 2.0, "largest": 2} and r["acceptance"] == 0.5


def test_request_row_without_a_first_token():
    r = sm.request_row(UAG, 0, 1, 0, sm.Sent("chat", "p", 1, Reply("", None, None, 3.0), 0.0))
    assert r["first_token_s"] is None and r["done_s"] == 3.0


# --- the summary's maths -----------------------------------------------------------------------------------------
def test_stats_pool_waves_from_first_sent_to_last_done():
    rows = [
        request("uag:lookup", "chat", 2, wave=0, started=0.0, done=2.0, tokens=10, drafted=8, accepted=6, batch=2),
        request("uag:lookup", "chat", 2, wave=0, started=0.1, done=4.0, tokens=10, drafted=2, accepted=0, batch=1.5),
        request("uag:lookup", "chat", 2, wave=1, started=0.0, done=1.0, tokens=5),
    ]
    s = sm.Stats.of(rows)
    assert (s.tokens, s.wall_s) == (25, 5.0)
    assert s.tps == 5.0 and s.alpha == 0.6 and s.batch == [2, 1.5]
    assert s.e2e_s == [2.0, 3.9, 1.0]


def test_stats_of_a_wave_that_took_no_time_has_no_rate():
    assert sm.Stats.of([request("mlx_lm", "chat", 1, done=0.0)]).tps is None


def test_levels_report_edit_turns_2_3_and_chat_per_condition_and_concurrency():
    rows = [
        {"kind": "meta"},
        request("mlx_lm", "edit", 1, turn=1, tokens=1000),
        request("mlx_lm", "edit", 1, turn=2, tokens=10),
        request("mlx_lm", "edit", 1, turn=3, tokens=20),
        request("mlx_lm", "chat", 1, turn=1, tokens=7),
        request("mlx_lm", "chat", 2, turn=1, tokens=9),
        {"kind": "warmup", "condition": "mlx_lm"},
    ]
    stats = sm.levels(rows)
    assert list(stats) == [("mlx_lm", sm.EDIT, 1), ("mlx_lm", sm.CHAT, 1), ("mlx_lm", sm.CHAT, 2)]
    assert stats[("mlx_lm", sm.EDIT, 1)].tokens == 30  # turn 1 is in the rows only


def run(condition, workload, concurrency, tps, repeat, *, turn=2) -> dict:
    """One run's wave of one request whose aggregate tokens/s is `tps` (100 tokens)."""
    return request(condition, workload, concurrency, done=100 / tps, tokens=100, turn=turn, repeat=repeat)


def test_runs_give_each_levels_tokens_per_second_per_repeat_and_the_spread_is_the_farthest_from_the_median():
    rows = [run("uag:lookup", "edit", 4, tps, r) for r, tps in enumerate((80.0, 100.0, 130.0))]
    rows += [run("mlx_lm", "chat", 4, 50.0, 1, turn=1), request("mlx_lm", "edit", 4, turn=1, repeat=0)]
    assert sm.runs(rows) == {
        ("uag:lookup", sm.EDIT, 4): [pytest.approx(80.0), pytest.approx(100.0), pytest.approx(130.0)],
        ("mlx_lm", sm.CHAT, 4): [pytest.approx(50.0)],
    }
    assert sm.spread([80.0, 100.0, 130.0]) == pytest.approx(0.3) and sm.spread([]) is None
    lines = sm.medians_lines(sm.runs(rows))
    assert any(line.startswith("uag:lookup") and "100.0  (80.0, 100.0, 130.0)  ±30%" in line for line in lines)


def test_targets_are_issue_52s_on_medians_over_runs_for_a_gpu_and_for_a_cpu():
    per_run = {
        ("uag:lookup", sm.EDIT, 4): [300.0, 250.0, 280.0],  # median 280
        ("mlx_lm", sm.EDIT, 4): [100.0, 110.0, 120.0],  # 110: 2.55x
        ("uag:lookup:serial", sm.EDIT, 4): [200.0],  # 1.4x
        ("uag:lookup", sm.CHAT, 8): [95.0, 99.0, 100.0],
        ("mlx_lm", sm.CHAT, 8): [100.0, 100.0, 100.0],  # 0.99x
        ("uag:off", sm.CHAT, 8): [98.0, 98.0, 98.0],
        ("uag:lookup", sm.CHAT, 1): [9.8],
        ("uag:lookup:serial", sm.CHAT, 1): [10.0],
    }
    gpu = {what: (value, goal, met) for what, value, goal, met in sm.targets(per_run, gpu=True)}
    assert gpu["C=4 edit t2-3 tokens/s, uag:lookup / mlx_lm"] == (pytest.approx(280 / 110), ">= 2.5x", True)
    assert gpu["C=4 edit t2-3 tokens/s, uag:lookup / uag:lookup:serial"] == (pytest.approx(1.4), ">= 1.5x", False)
    assert gpu["C=8 chat tokens/s, uag:lookup / mlx_lm"] == (pytest.approx(0.99), ">= 1x", False)
    assert gpu["C=8 chat tokens/s, uag:off / mlx_lm"] == (pytest.approx(0.98), ">= 1x", False)
    assert gpu["C=1 chat tokens/s, uag:lookup / uag:lookup:serial"] == (pytest.approx(0.98), ">= 0.97x", True)
    assert gpu["C=8 edit t2-3 tokens/s, uag:lookup / mlx_lm"] == (None, ">= 2.5x", None)
    spread = next(key for key in gpu if key.startswith("runs within"))
    assert "uag:lookup edit t2-3 C=4" in spread and gpu[spread] == (pytest.approx(30 / 280), "<= 0.15", True)
    cpu = {what: (value, goal, met) for what, value, goal, met in sm.targets(per_run, gpu=False)}
    assert cpu["C=4 edit t2-3 tokens/s, uag:lookup / mlx_lm"][1:] == (">= 2x", True)
    assert cpu["C=8 chat tokens/s, uag:off / mlx_lm"] == (pytest.approx(0.98), ">= 0.97x", True)
    assert not any("/ uag:lookup:serial" in what and what.startswith("C=4") for what in cpu)  # a GPU target only
    assert not any(
        what.startswith(("C=1 chat tokens/s, uag:off", "C=4 edit t2-3 tokens/s, uag:lookup:serial")) for what in gpu
    )


def test_lossless_compares_the_same_request_with_uag_off():
    rows = [
        request("uag:off", "edit", 2, item="e1", text="same"),
        request("uag:off", "edit", 2, item="e2", text="off"),
        request("uag:lookup", "edit", 2, item="e1", text="same"),
        request("uag:lookup", "edit", 2, item="e2", text="differs"),
        request("uag:lookup", "edit", 4, item="e1", text="not served by uag:off"),
        request("uag:lookup:serial", "edit", 2, item="e1", text="same"),
        request("mlx_lm", "edit", 2, item="e1", text="its own template"),
    ]
    assert sm.lossless(rows) == [("uag:lookup", 1, 2), ("uag:lookup:serial", 1, 1)]
    assert sm.lossless([r for r in rows if r["condition"] != "uag:off"]) == []


def test_summary_prints_a_line_per_level_and_each_verdict():
    rows = [
        {"kind": "meta", "date": "2026-11-27T10:00:00", "machine": "cpu", "target": "demo-target", "max_tokens": 8},
        *at("uag:lookup", "edit", 4, 30.0),
        *at("mlx_lm", "edit", 4, 20.0),
        request("uag:off", "edit", 4, text="x"),
    ]
    text = sm.summary(rows)
    assert "demo-target" in text and "2026-11-27" in text
    lines = text.splitlines()
    assert sum(line.startswith(("uag:lookup ", "mlx_lm ", "uag:off ")) for line in lines) == 6  # table, medians
    assert any("uag:lookup / mlx_lm" in line and "1.50x" in line and "NOT met" in line for line in lines)
    assert any("a level has 1 run(s), and a verdict counts from 3" in line for line in lines)  # one run: said so
    assert any(line.startswith("lossless: uag:lookup") and "1/1" in line and line.endswith(" met") for line in lines)


# --- the plot ------------------------------------------------------------------------------------------------------
def test_figure_has_a_line_per_condition_in_each_workload_panel():
    rows = [r for c in (1, 2, 4) for r in at("uag:lookup", "edit", c, 10.0 * c)]
    rows += [r for c in (1, 2, 4) for r in at("uag:lookup:serial", "edit", c, 10.0)]
    rows += [r for c in (1, 4) for r in at("mlx_lm", "chat", c, 5.0 * c, turn=1)]
    fig = sm.figure(sm.levels(rows), "demo-target")
    traces = {(t.name, t.xaxis): t for t in fig.data}
    lookup = traces[("uag:lookup", "x")]
    assert list(lookup.x) == [1, 2, 4] and list(lookup.y) == pytest.approx([10, 20, 40])
    assert lookup.line.dash == "solid" and traces[("uag:lookup:serial", "x")].line.dash == "dash"
    assert lookup.line.color == traces[("uag:lookup:serial", "x")].line.color
    assert list(traces[("mlx_lm", "x2")].y) == pytest.approx([5, 20]) and list(traces[("mlx_lm", "x")].x) == []
    assert [t.showlegend for t in fig.data if t.name == "mlx_lm"] == [True, False]
    assert [a.text for a in fig.layout.annotations] == [sm.EDIT, sm.CHAT]


def test_family_names_the_condition_a_variant_belongs_to():
    assert sm.family("uag:lookup+demo-drafter:serial") == "uag:lookup+demo-drafter"
    assert (sm.family("mlx_lm:draft3"), sm.family("uag:off")) == ("mlx_lm", "uag:off")


def test_save_plot_falls_back_to_html_when_no_png_can_be_written(tmp_path):
    fig = sm.figure(sm.levels(at("mlx_lm", "chat", 1, 5.0, turn=1)))

    def no_png(*_args, **_kwargs):
        raise ValueError("kaleido is not installed")

    fig.write_image = no_png
    assert sm.save_plot(fig, tmp_path / "c.png") == tmp_path / "c.html"
    assert "plotly" in (tmp_path / "c.html").read_text()


def test_serve_summarize_hands_concurrency_rows_over(tmp_path, capsys):
    rows = [{"kind": "meta", "target": "demo-target"}, *at("mlx_lm", "chat", 2, 4.0, turn=1)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert serve.main(["--summarize", str(path), "--plot", str(tmp_path / "c.html")]) == 0
    assert "concurrent requests" in capsys.readouterr().out
    assert (tmp_path / "c.html").exists()


# --- conditions and pools ------------------------------------------------------------------------------------------
def options(**changes) -> argparse.Namespace:
    base = {
        "target": "/models/t",
        "drafters": ["lookup"],
        "max_tokens": 8,
        "peer_draft": None,
        "num_draft_tokens": [2],
        "only": None,
        "ablate": [],
        "concurrency": [1, 4],
        "ids": None,
        "conversations": 4,
        "chat_prompts": 2,
        "together": False,
        "without_shared_index": False,
    }
    return argparse.Namespace(**{**base, **changes})


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_conditions_batch_uag_and_add_its_serial_self():
    conds = {c.name: c for c in sm.conditions(options())}
    assert list(conds) == ["uag:lookup", "uag:lookup:serial", "uag:off", "mlx_lm"]
    assert flag(conds["uag:lookup"].argv, "--max-batch") == "4" and flag(conds["uag:off"].argv, "--max-batch") == "4"
    assert flag(conds["uag:lookup:serial"].argv, "--max-batch") == "1"
    assert all(flag(conds[n].argv, "--per-client") == "4" for n in ("uag:lookup", "uag:lookup:serial", "uag:off"))
    assert "--max-batch" not in conds["mlx_lm"].argv and "--decode-concurrency" not in conds["mlx_lm"].argv
    assert conds["uag:off"].extra_body == {"speculative": False}


def test_conditions_only_picks_and_orders():
    names = [c.name for c in sm.conditions(options(only=["mlx_lm", "uag:lookup:serial"]))]
    assert names == ["mlx_lm", "uag:lookup:serial"]
    with pytest.raises(SystemExit, match="no condition uag:nope"):
        sm.conditions(options(only=["uag:nope"]))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"conversations": 2}, "--conversations 2: concurrency 4 needs 4"),
        ({"chat_prompts": 1}, "--chat-prompts 1 gives 2 prompts .* needs --chat-prompts 2"),
        ({"concurrency": [0, 1]}, "--concurrency 0: at least 1"),
        ({"ids": ["edit-001", "edit-999"]}, "--ids: no conversation 'edit-999'"),
        ({"together": True}, "--together: not with --concurrency"),
    ],
)
def test_pools_refuse_what_cannot_run(changes, message):
    with pytest.raises(SystemExit, match=message):
        sm.pools(options(**changes))


def test_pools_may_leave_a_workload_out():
    edit, chat = sm.pools(options(conversations=0, chat_prompts=2))
    assert edit == [] and [i for i, _ in chat][:2] == [i for i, _ in serving.chat_prompts(1)]


# --- the client's waves, with a fake server ----------------------------------------------------------------------
def test_edit_sends_each_conversations_turns_in_order_after_every_turn_1(monkeypatch):
    conversations = [Conversation(f"edit-{i}", "edit", ("one", "two", "three")) for i in "ab"]
    seen, lock = [], threading.Lock()

    def fake_ask(_client, _condition, messages, _max_tokens):
        with lock:
            seen.append(messages)
        answered = sum(m["role"] == "assistant" for m in messages)
        return Reply(f"reply {answered + 1}", 0.01, 0.01, 0.02, usage={"completion_tokens": 2})

    monkeypatch.setattr(sm, "ask", fake_ask)
    marked = []  # how many requests had been sent when `between` was called
    sents = sm.Client(UAG, "http://127.0.0.1:9", 8).edit(conversations, between=lambda: marked.append(len(seen)))
    assert marked == [2]  # once, after both turn 1s and before any turn 2
    assert [(s.item, s.turn) for s in sents] == [
        ("edit-a", 1),
        ("edit-b", 1),
        ("edit-a", 2),
        ("edit-a", 3),
        ("edit-b", 2),
        ("edit-b", 3),
    ]
    assert all(len(m) == 1 for m in seen[:2])  # both turn 1s before any turn 2
    third = [m for m in seen if len(m) == 5]
    assert len(third) == 2 and all([t["content"] for t in m[1::2]] == ["reply 1", "reply 2"] for m in third)
    assert all(s.at_s < 1 for s in sents)


def test_several_rows_files_are_summarised_as_one_run_each_files_repeats_after_the_last(tmp_path, capsys):
    """Runs made one command at a time (a device's time limit) summarised together: repeats renumbered, verdicts'
    places with them, one meta counting every repeat; --classify, which appends, takes one file."""
    verdict = {"kind": "parted", "condition": "uag:lookup", "reference": "uag:off", "workload": "edit", "item": "a"}
    verdict |= {"turn": 2, "where": {"repeat": 0, "concurrency": 4}, "reference_where": {"repeat": 0}}
    first = [{"kind": "meta", "repeats": 2, "backend": "cuda"}, run("mlx_lm", "edit", 4, 100.0, 0)]
    first += [run("mlx_lm", "edit", 4, 120.0, 1)]
    second = [{"kind": "meta", "repeats": 1}, run("mlx_lm", "edit", 4, 90.0, 0), verdict]
    rows = serving.joined([first, second])
    assert rows[0] == {"kind": "meta", "repeats": 3, "backend": "cuda"}
    assert [r.get("repeat") for r in rows[1:]] == [0, 1, 2, None]
    assert rows[-1]["where"] == {"repeat": 2, "concurrency": 4} and rows[-1]["reference_where"] == {"repeat": 2}
    assert verdict["where"]["repeat"] == 0  # the rows read are left as they were
    paths = []
    for i, part in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in part))
    assert serve.main(["--summarize", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "100.0  (100.0, 120.0, 90.0)" in out and "(GPU)" in out
    with pytest.raises(SystemExit):
        serve.main(["--summarize", *map(str, paths), "--classify"])
