"""The training health guard: non-finite values, an exactly-zero loss, grad-norm spikes; stop or warn."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from rlhf.trainers.health import HealthGuard, TrainingHealthError, check_health


def _rows(losses, norms):
    return [{"step": i + 1, "loss": loss, "grad_norm": norm} for i, (loss, norm) in enumerate(zip(losses, norms))]


def _first_problem(guard, rows):
    for row in rows:
        problem = guard.problem(row)
        if problem:
            return problem
    return None


def test_non_finite_values_trip_at_once():
    guard = HealthGuard(("loss", "grad_norm"))
    assert _first_problem(guard, _rows([1.0, math.nan], [1.0, 1.0])) == "step 2: loss = nan (not finite)"
    guard = HealthGuard(("loss", "grad_norm"))
    assert _first_problem(guard, _rows([1.0, 1.0], [1.0, math.inf])) == "step 2: grad_norm = inf (not finite)"


def test_zero_loss_needs_consecutive_steps():
    guard = HealthGuard(("loss",), zero_loss_steps=3)
    assert _first_problem(guard, _rows([0.0, 0.0, 0.5, 0.0, 0.0], [1] * 5)) is None  # interrupted streak
    problem = guard.problem({"step": 6, "loss": 0.0, "grad_norm": 1.0})
    assert problem.startswith("step 6: loss = 0.0 exactly for 3 steps in a row")
    assert HealthGuard(("loss",), zero_loss_key=None).problem({"step": 1, "loss": 0.0}) is None  # RL: not checked


def test_grad_norm_spike_against_the_running_median():
    guard = HealthGuard(("grad_norm",), spike_factor=10.0, spike_window=4, min_history=3)
    # window before step 6: (2.0, 1.5, 1.0, 2.0) -> median 1.75 -> limit 17.5
    assert _first_problem(guard, _rows([1.0] * 5, [1.0, 2.0, 1.5, 1.0, 2.0])) is None
    problem = guard.problem({"step": 6, "loss": 1.0, "grad_norm": 19.0})
    assert problem == ("step 6: grad_norm = 19 is 10.9x the running median 1.75 of the last 4 steps (limit 10x)")
    calm = HealthGuard(("grad_norm",), spike_factor=10.0, spike_window=4, min_history=3)
    assert _first_problem(calm, _rows([1.0] * 6, [1.0, 2.0, 1.5, 1.0, 2.0, 17.0])) is None


def test_stop_raises_and_warn_reports():
    row = {"step": 4, "loss": math.nan}
    with pytest.raises(TrainingHealthError, match=r"health guard: step 4: loss = nan .*newest checkpoint"):
        check_health(HealthGuard(("loss",)), "stop", row)
    said = []
    check_health(HealthGuard(("loss",)), "warn", row, say=said.append)
    assert said == ["[health] warning: step 4: loss = nan (not finite)"]


def test_a_diverging_run_stops_naming_step_and_metric_and_keeps_the_last_good_checkpoint(tiny_model, sft_data,
                                                                                          tmp_path):
    """lr=30 without clipping blows the tiny model up within a few steps; the CLI exits 1 with one line, the
    checkpoint (every step) is the step before the one that tripped, and no final/ is written."""
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "rlhf.cli.train_sft", f"model.path={tiny_model}",
                             f"data.train_path={sft_data}", f"train.output_dir={out}", "train.global_batch_size=4",
                             "train.micro_batch_size=4", "train.lr=30", "train.max_grad_norm=0",
                             "train.lr_scheduler=constant", "train.max_epochs=5", "train.save_every=1",
                             "train.keep_checkpoints=1", "health.spike_factor=5", "logging.tensorboard=false"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    match = re.search(r"error: health guard: step (\d+): (loss|grad_norm) = ", result.stderr)
    assert match and "Traceback" not in result.stderr, result.stderr[-2000:]
    tripped = int(match.group(1))
    from rlhf.trainers.checkpoint import Checkpoints

    assert Checkpoints(str(out), keep=1).latest()[1]["step"] == tripped - 1
    assert not (out / "final").exists()
