"""``python -m rlhf.cli.report``: PNG plots from metrics.jsonl, several runs in one figure, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf.cli.report import load_runs, main, panels_for, run_names
from rlhf.reports.plots import moving_average


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture()
def two_runs(tmp_path):
    sft, rl = tmp_path / "a" / "sft", tmp_path / "b" / "grpo"
    _write(sft / "metrics.jsonl", [{"step": s, "loss": 2.0 / s, "grad_norm": 1.0, "lr": 1e-3} for s in range(1, 6)])
    _write(
        rl / "metrics.jsonl",
        [
            {"step": s, "reward_mean": 0.1 * s, "kl": 0.01, "grad_norm": 2.0, "time/generate": 0.2, "time/train": 0.5}
            for s in range(1, 6)
        ],
    )
    _write(rl / "eval.jsonl", [{"step": s, "reward_mean": 0.05 * s} for s in (0, 5)])
    return sft, rl


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_several_runs_in_one_figure_with_every_metric_present(two_runs, tmp_path, capsys):
    out = tmp_path / "cmp.png"
    assert main([str(two_runs[0]), str(two_runs[1]), "--out", str(out)]) == 0
    width, height = _png_size(out)
    assert width > 500 and height > 500
    printed = capsys.readouterr().out
    for key in ("loss", "reward_mean", "kl", "grad_norm", "lr", "time/generate", "time/train"):
        assert key in printed


def test_one_run_writes_into_its_directory(two_runs):
    assert main([str(two_runs[1])]) == 0
    _png_size(two_runs[1] / "report.png")


def test_held_out_rows_are_their_own_series(two_runs):
    runs, held_out = load_runs([str(two_runs[1])])
    assert held_out == ["grpo (held-out)"] and [r["step"] for r in runs["grpo (held-out)"]] == [0, 5]
    assert [k for k, _ in panels_for(runs)] == ["reward_mean", "kl", "grad_norm", "time/generate", "time/train"]


def test_runs_with_the_same_base_name_get_parent_names():
    assert run_names(["x/run", "y/run", "z/other"]) == ["x/run", "y/run", "z/other"]
    assert run_names(["x/a", "y/b"]) == ["a", "b"]


def test_missing_run_and_bad_line_are_named(tmp_path, two_runs, capsys):
    result = subprocess.run(
        [sys.executable, "-m", "rlhf.cli.report", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert result.returncode == 2 and "nope: no metrics.jsonl" in result.stderr and "Traceback" not in result.stderr
    bad = tmp_path / "bad"
    _write(bad / "metrics.jsonl", [{"step": 1, "loss": 1.0}])
    with open(bad / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    assert main([str(bad)]) == 2
    assert "metrics.jsonl:2: not JSON" in capsys.readouterr().err


def test_moving_average_is_trailing():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 1) == [2.0, 4.0]


def test_without_matplotlib_the_report_says_what_to_install(two_runs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert main([str(two_runs[0])]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the report draws with matplotlib")
    assert "pip install matplotlib" in err and "Traceback" not in err
    assert not (two_runs[0] / "report.png").exists()


def test_episode_metrics_get_their_panels_turns_in_order():
    row = {
        "step": 1,
        "reward_mean": 1.0,
        "reward/env": 0.5,
        "episode/turns": 2.0,
        "episode/env_tokens": 7.0,
        "episode/reward_turn_10": 0.1,
        "episode/reward_turn_2": 0.2,
        "episode/reward_turn_1": 0.3,
        "time/env": 0.1,
    }
    keys = [k for k, _ in panels_for({"run": [row]})]
    assert keys == [
        "reward_mean",
        "reward/env",
        "episode/turns",
        "episode/env_tokens",
        "episode/reward_turn_1",
        "episode/reward_turn_2",
        "episode/reward_turn_10",
        "time/env",
    ]


def test_each_reward_source_gets_its_panel():
    row = {
        "step": 1,
        "reward_mean": 1.0,
        "reward/env": 0.5,
        "reward/rewards.py:correct": 1.0,
        "reward/reward_model": 0.2,
    }
    assert panels_for({"run": [row]}) == [
        ("reward_mean", "reward"),
        ("reward/env", "environment reward"),
        ("reward/reward_model", "reward of reward_model"),
        ("reward/rewards.py:correct", "reward of rewards.py:correct"),
    ]


def test_reward_functions_are_logged_by_file_name_unless_two_files_share_one():
    from rlhf.rewards.functions import metric_names

    assert metric_names(["/tmp/a/rewards.py:correct", "pkg.mod:fn", "/tmp/a/other.py:correct"]) == {
        "/tmp/a/rewards.py:correct": "rewards.py:correct",
        "pkg.mod:fn": "pkg.mod:fn",
        "/tmp/a/other.py:correct": "other.py:correct",
    }
    both = ["/x/rewards.py:f", "/y/rewards.py:f"]
    assert metric_names(both) == {name: name for name in both}
