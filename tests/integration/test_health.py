"""The training health guard: non-finite values, an exactly-zero loss, grad-norm spikes; stop or warn."""

from __future__ import annotations

import json
import math
import os
import re
from collections import deque

import pytest
import torch

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
        "step 3: grad_norm = 0.0 exactly for 2 steps in a row"
    )
    assert HealthGuard(("loss",), zero_loss_key=None).problem({"step": 1, "loss": 0.0}) is None  # RL: not checked


def test_grad_norm_spike_against_the_running_median():
    guard = HealthGuard(("grad_norm",), spike_factor=10.0, spike_window=4, min_history=3)
    # window before step 6: (2.0, 1.5, 1.0, 2.0) -> median 1.75 -> limit 17.5
    assert _first_problem(guard, _rows([1.0] * 5, [1.0, 2.0, 1.5, 1.0, 2.0])) is None
    problem = guard.problem({"step": 6, "loss": 1.0, "grad_norm": 19.0})
    assert problem == ("step 6: grad_norm = 19 is 10.9x the running median 1.75 of the last 4 steps (limit 10x)")
    calm = HealthGuard(("grad_norm",), spike_factor=10.0, spike_window=4, min_history=3)
    assert _first_problem(calm, _rows([1.0] * 6, [1.0, 2.0, 1.5, 1.0, 2.0, 17.0])) is None


def test_steps_with_no_gradient_are_not_the_scale_a_spike_is_judged_against():
    """A sparse-reward GRPO run (the docs' first agent run tripped this): steps whose groups all tied train with a
    gradient of exactly 0; counted, they made the median 0.17 and an ordinary 2.1 a 12.6x spike."""
    norms = [2.0, 0.0, 0.0, 1.5, 0.0, 0.0, 0.0, 2.2]
    sparse = HealthGuard(("grad_norm",), zero_loss_key=None, spike_factor=10.0, spike_window=4, min_history=2)
    assert _first_problem(sparse, _rows([1.0] * len(norms), norms)) is None
    assert sparse._history == deque([2.0, 1.5, 2.2], maxlen=4)
    problem = sparse.problem({"step": 9, "loss": 1.0, "grad_norm": 30.0})  # a real spike still trips
    assert problem is not None and "the running median 2 of the last 3 steps" in problem


def test_an_rl_run_guards_its_kl_its_log_prob_gap_and_a_flat_reward():
    """The RL trainer's ceilings with the default health section: a GRPO run that reaches KL ~2 (a reward model it
    games) trips at the step it crosses 1.0; a log-prob gap of 0.6 (weights that never reached the engines) trips;
    ten steps in a row where every sample scored the same trip; the SFT trainer names none of these."""
    from rlhf.config.schema import HealthConfig
    from rlhf.trainers.health import guard_from_config
    from rlhf.trainers.offline.loop import OfflineSteps
    from rlhf.trainers.online.steps import RLTrainer

    def guard(health=None, steps=RLTrainer):
        health = health or HealthConfig()
        return guard_from_config(
            health, steps.watched, steps.zero_loss_key, ceilings=steps.ceilings, flat_key=steps.flat_key
        )

    drifting = [{"step": i, "kl": 0.02 * i**2, "reward_std": 0.3, "logp_mismatch": 1e-6} for i in range(1, 25)]
    problem = _first_problem(guard(), drifting)
    assert problem.startswith("step 8: kl = 1.28 is above health.max_kl=1: the policy has drifted far"), problem
    assert _first_problem(guard(HealthConfig(max_kl=0)), drifting) is None  # 0: off
    assert _first_problem(guard(HealthConfig(max_kl=2.5)), drifting).startswith("step 12: kl = 2.88")
    stale = [{"step": 1, "kl": 0.0, "reward_std": 0.3, "logp_mismatch": 0.6}]
    assert "logp_mismatch = 0.6 is above health.max_logp_mismatch=0.5: " in _first_problem(guard(), stale)
    flat = [{"step": i, "kl": 0.01, "reward_std": 0.0 if i != 3 else 0.1, "logp_mismatch": 0.0} for i in range(1, 14)]
    problem = _first_problem(guard(), flat)
    assert problem.startswith("step 13: reward_std = 0.0 for 10 steps in a row (health.flat_reward_steps=10)")
    assert _first_problem(guard(HealthConfig(flat_reward_steps=0)), flat) is None
    sft = [{"step": 1, "loss": 1.0, "grad_norm": 1.0, "kl": 9.0, "reward_std": 0.0, "logp_mismatch": 9.0}] * 12
    assert _first_problem(guard(steps=OfflineSteps), sft) is None


def test_skipped_rows_are_neither_judged_nor_counted():
    guard = HealthGuard(("loss",), zero_loss_steps=2)
    assert guard.problem({"step": 1, "loss": 0.0}) is None
    assert guard.problem({"step": 2, "epoch": 0, "skipped": 1}) is None  # neither a zero nor a streak breaker
    assert guard.problem({"step": 3, "loss": 0.0}).startswith("step 3: loss = 0.0 exactly for 2 steps in a row")


def test_observed_history_decides_like_the_uninterrupted_guard():
    """A resumed or rewound run rebuilds the guard from the rows kept: the next step is judged the same."""
    rows = _rows([1.0] * 6, [1.0, 2.0, 1.5, 1.0, 2.0, 1.2])
    spike = {"step": 7, "loss": 1.0, "grad_norm": 30.0}
    whole = HealthGuard(("grad_norm",), spike_factor=10.0, spike_window=4, min_history=3)
    assert _first_problem(whole, rows) is None
    rebuilt = HealthGuard(("grad_norm",), spike_factor=10.0, spike_window=4, min_history=3)
    rebuilt.observe(rows)
    assert rebuilt.problem(dict(spike)) == whole.problem(dict(spike)) is not None
    assert HealthGuard(("grad_norm",), spike_factor=10.0, min_history=3).problem(dict(spike)) is None  # no history


def test_skip_needs_checkpoints_and_skip_steps_need_step_numbers():
    from rlhf.config.loader import load_config
    from rlhf.config.schema import ConfigError, SFTRunConfig

    base = ["model.path=m", "data.train_path=d.jsonl"]
    with pytest.raises(ConfigError, match=r"^health\.action is skip, which needs train\.save_every > 0"):
        load_config(SFTRunConfig, None, base + ["health.action=skip"])
    assert load_config(SFTRunConfig, None, base + ["health.action=skip", "train.save_every=5"]).health.action == "skip"
    with pytest.raises(ConfigError, match=r"^train\.skip_steps must be step numbers >= 1, got \[3, 0\]"):
        load_config(SFTRunConfig, None, base + ["train.skip_steps=[3,0]"])


def test_stop_raises_and_warn_reports():
    row = {"step": 4, "loss": math.nan}
    with pytest.raises(TrainingHealthError, match=r"health guard: step 4: loss = nan .*newest checkpoint") as caught:
        check_health(HealthGuard(("loss",)), "stop", row)
    assert caught.value.step == 4
    with pytest.raises(TrainingHealthError, match=r"^health guard: step 4: loss = nan \(not finite\)$") as caught:
        check_health(HealthGuard(("loss",)), "skip", row)  # the runner rewinds and skips step 4
    assert caught.value.step == 4
    said = []
    check_health(HealthGuard(("loss",)), "warn", row, say=said.append)
    assert said == ["[health] warning: step 4: loss = nan (not finite)"]


@pytest.mark.usefixtures("ray_session")
def test_a_diverging_run_stops_naming_step_and_metric_and_keeps_the_last_good_checkpoint(
    tiny_model, sft_data, tmp_path
):
    """lr=1e4 without clipping saturates the tiny model after one step (its gradient is exactly 0 from then on,
    the loss stuck): the run stops naming the step and metric, the checkpoint (taken every step) is the step
    before the one that tripped, no final/ is written."""
    from rlhf.config.loader import load_config
    from rlhf.config.schema import SFTRunConfig
    from rlhf.trainers.checkpoint import Checkpoints
    from rlhf.trainers.offline.sft import train_sft

    out = tmp_path / "run"
    cfg = load_config(
        SFTRunConfig,
        None,
        [
            f"model.path={tiny_model}",
            f"data.train_path={sft_data}",
            f"train.output_dir={out}",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "train.lr=1e4",
            "train.max_grad_norm=0",
            "train.lr_scheduler=constant",
            "train.max_epochs=5",
            "train.save_every=1",
            "train.keep_checkpoints=1",
            "health.spike_factor=5",
            "logging.tensorboard=false",
        ],
    )
    with pytest.raises(TrainingHealthError) as caught:
        train_sft(cfg)
    match = re.match(r"health guard: step (\d+): (loss|grad_norm) = ", str(caught.value))
    assert "grad_norm = 0.0 exactly for 3 steps in a row" in str(caught.value)
    assert match, str(caught.value)
    tripped = int(match.group(1))
    assert tripped >= 2  # step 1 is healthy: there is a good state to keep
    assert Checkpoints(str(out), keep=1).latest()[1]["step"] == tripped - 1
    assert not (out / "final").exists()


@pytest.mark.usefixtures("ray_session")
def test_a_skip_rewinds_and_ends_bit_identical_to_a_run_told_to_skip_those_steps(
    tiny_model, sft_data, tmp_path, capsys
):
    """health.action=skip with a hair-trigger spike limit trips on ordinary steps: each trip rewinds the live
    actors to the newest checkpoint, replays to the tripping step and passes over it. The run must end exactly as
    a run given those steps in train.skip_steps from the start (no guard): same rows, same weights."""
    from safetensors.torch import load_file

    from rlhf.config.loader import load_config
    from rlhf.config.schema import SFTRunConfig
    from rlhf.trainers.offline.sft import train_sft

    def run(name, *extra):
        out = tmp_path / name
        cfg = load_config(
            SFTRunConfig,
            None,
            [
                f"model.path={tiny_model}",
                f"data.train_path={sft_data}",
                f"train.output_dir={out}",
                "train.global_batch_size=4",
                "train.micro_batch_size=2",
                "train.max_epochs=3",
                "train.lr=1e-3",
                "train.save_every=3",
                "train.min_lr_ratio=0.1",
                "logging.tensorboard=false",
                *extra,
            ],
        )
        result = train_sft(cfg)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "step_time_s" and not k.startswith("perf/")} for r in rows], result

    guarded, guarded_result = run("guarded", "health.action=skip", "health.spike_factor=1.05", "health.spike_window=5")
    said = capsys.readouterr().out
    skipped = [r["step"] for r in guarded if r.get("skipped")]
    assert skipped, "the hair-trigger guard never tripped: the test exercises nothing"
    assert [r["step"] for r in guarded] == list(range(1, 16))  # every step once, replays not duplicated
    for step in skipped:
        assert re.search(
            rf"\[health\] health guard: step {step}: grad_norm = .*rewound to the checkpoint of step "
            rf"\d+, step {step} will be skipped",
            said,
        )
        assert guarded[step - 1] == {"step": step, "epoch": guarded[step - 1]["epoch"], "skipped": 1}

    # A skipped step advances the LR schedule: every trained step has its planned LR, so a cosine still ends with
    # the run's step 15 (a schedule that waited would give every step after a skip its predecessor's LR).
    from rlhf.utils.schedule import lr_multiplier

    for r in guarded:
        if not r.get("skipped"):
            planned = 1e-3 * lr_multiplier(r["step"] - 1, total_steps=15, warmup_steps=0, kind="cosine", min_ratio=0.1)
            assert r["lr"] == pytest.approx(planned, rel=1e-12), r["step"]
    told, told_result = run("told", "health.action=off", f"train.skip_steps=[{','.join(map(str, skipped))}]")
    assert told == guarded
    a = load_file(os.path.join(guarded_result.final_dir, "model.safetensors"))
    b = load_file(os.path.join(told_result.final_dir, "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_cli_reports_a_tripped_guard_in_one_line_with_exit_code_1(monkeypatch, capsys):
    from rlhf.cli.common import run_cli
    from rlhf.config.schema import SFTRunConfig

    def diverge(cfg):
        raise TrainingHealthError("health guard: step 3: loss = nan (not finite); stopped")

    code = run_cli(SFTRunConfig, diverge, "train_sft", ["model.path=m", "data.train_path=d.jsonl"])
    assert code == 1
    assert capsys.readouterr().err.strip() == "error: health guard: step 3: loss = nan (not finite); stopped"
