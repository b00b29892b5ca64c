"""The training health guard: non-finite values, an exactly-zero loss, grad-norm spikes; stop or warn."""
from __future__ import annotations

import math
import re

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
    dead = HealthGuard(("loss", "grad_norm"), zero_loss_steps=2)
    assert _first_problem(dead, _rows([6.2, 6.2, 6.2], [9.7, 0.0, 0.0])).startswith(
        "step 3: grad_norm = 0.0 exactly for 2 steps in a row")
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


@pytest.mark.usefixtures("ray_session")
def test_a_diverging_run_stops_naming_step_and_metric_and_keeps_the_last_good_checkpoint(tiny_model, sft_data,
                                                                                          tmp_path):
    """lr=1e4 without clipping saturates the tiny model after one step (its gradient is exactly 0 from then on,
    the loss stuck): the run stops naming the step and metric, the checkpoint (taken every step) is the step
    before the one that tripped, no final/ is written."""
    from rlhf.config.loader import load_config
    from rlhf.config.schema import SFTRunConfig
    from rlhf.trainers.checkpoint import Checkpoints
    from rlhf.trainers.sft import train_sft

    out = tmp_path / "run"
    cfg = load_config(SFTRunConfig, None, [
        f"model.path={tiny_model}", f"data.train_path={sft_data}", f"train.output_dir={out}",
        "train.global_batch_size=4", "train.micro_batch_size=4", "train.lr=1e4", "train.max_grad_norm=0",
        "train.lr_scheduler=constant", "train.max_epochs=5", "train.save_every=1", "train.keep_checkpoints=1",
        "health.spike_factor=5", "logging.tensorboard=false"])
    with pytest.raises(TrainingHealthError) as caught:
        train_sft(cfg)
    match = re.match(r"health guard: step (\d+): (loss|grad_norm) = ", str(caught.value))
    assert "grad_norm = 0.0 exactly for 3 steps in a row" in str(caught.value)
    assert match, str(caught.value)
    tripped = int(match.group(1))
    assert tripped >= 2  # step 1 is healthy: there is a good state to keep
    assert Checkpoints(str(out), keep=1).latest()[1]["step"] == tripped - 1
    assert not (out / "final").exists()


def test_the_cli_reports_a_tripped_guard_in_one_line_with_exit_code_1(monkeypatch, capsys):
    from rlhf.cli.common import run_cli
    from rlhf.config.schema import SFTRunConfig

    def diverge(cfg):
        raise TrainingHealthError("health guard: step 3: loss = nan (not finite); stopped")

    code = run_cli(SFTRunConfig, diverge, "train_sft", ["model.path=m", "data.train_path=d.jsonl"])
    assert code == 1 and capsys.readouterr().err.strip() == "error: health guard: step 3: loss = nan (not finite); stopped"
