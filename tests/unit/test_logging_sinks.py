"""Metrics sinks: metrics.jsonl + TensorBoard + Weights & Biases in offline mode (no network, no account)."""

from __future__ import annotations

import glob
import json
import os

from rlhf.config.loader import load_config
from rlhf.config.schema import SFTRunConfig
from rlhf.utils.metrics import ConsoleTable, RunWriters


def _cfg(out, *extra):
    return load_config(
        SFTRunConfig,
        None,
        [
            "model.path=m",
            "data.train_path=d.jsonl",
            f"train.output_dir={out}",
            "logging.wandb=true",
            "logging.tensorboard=false",
            *extra,
        ],
    )


def test_wandb_offline_run_is_written_and_continued_on_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path / "run")
    writers = RunWriters(_cfg(out), resume_after=None, with_eval=True)
    for step in (1, 2):
        writers.metrics.log({"step": step, "loss": 1.0 / step, "note": "not a number"})
    writers.eval.log({"step": 2, "loss": 0.7})
    writers.close()
    run_files = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(run_files) == 1 and os.path.getsize(run_files[0]) > 0
    run_id = open(os.path.join(out, "wandb_run_id")).read().strip()
    assert run_id in run_files[0]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]

    resumed = RunWriters(_cfg(out), resume_after=2, with_eval=False)  # a resume continues the same W&B run
    resumed.metrics.log({"step": 3, "loss": 0.3})
    resumed.close()
    assert all(run_id in path for path in glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb")))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]


def test_a_rewind_forgets_later_steps_in_jsonl_and_tensorboard(tmp_path):
    """Rewinding to step 2 (a health-guard skip, a resume) cuts the later rows from metrics.jsonl and purges them
    from TensorBoard: the replayed steps appear once, with their new values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "run")
    cfg = load_config(SFTRunConfig, None, ["model.path=m", "data.train_path=d.jsonl", f"train.output_dir={out}"])
    writers = RunWriters(cfg, resume_after=None, with_eval=False)
    for step in (1, 2, 3, 4):
        writers.metrics.log({"step": step, "loss": float(step)})
    writers.rewind(2)
    for step in (3, 4):
        writers.metrics.log({"step": step, "loss": 10.0 * step})
    writers.close()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [(r["step"], r["loss"]) for r in map(json.loads, f)] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_console_table_repeats_its_header():
    table = ConsoleTable((("step", "step"), ("loss", "loss")), width=6, header_every=2)
    lines = [table.render({"step": s, "loss": 0.5}) for s in (1, 2, 3)]
    assert lines[0].splitlines()[0].split() == ["step", "loss"] and lines[0].splitlines()[1].split() == ["1", "0.5"]
    assert len(lines[1].splitlines()) == 1 and len(lines[2].splitlines()) == 2
    assert table.render({"step": 4}).split() == ["4", "-"]
