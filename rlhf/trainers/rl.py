"""Online RL driver: PPO (GAE + critic), GRPO, Dr. GRPO, RLOO, REINFORCE++ over vLLM rollouts.

One RL step reads like the algorithm::

    generate (vLLM) -> score (reward functions / reward model) -> old & reference log-probs, values
    -> advantages over the whole rollout batch -> policy (and critic) updates -> weight sync -> log

Each stage is one method below; the maths lives in ``rlhf.ops`` and ``rlhf.objectives.rl``, the actors in
``rlhf.distributed`` and ``rlhf.rollout``.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from rlhf.batch import Batch
from rlhf.data.plan import EpochPlan, StepPlan
from rlhf.objectives.base import add_sums
from rlhf.trainers.rl_experience import PromptSet, advantages_for, logp_mismatch, rollout_batch
from rlhf.utils.metrics import MetricsWriter, format_row

CONSOLE_KEYS = ("reward_mean", "accuracy", "kl", "policy_loss", "value_loss", "entropy", "clip_frac",
                "response_length", "logp_mismatch", "samples_per_s")


class StageTimer:
    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        started = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - started


@dataclass
class RLActors:
    policy: object  # WorkerGroup (trainable)
    engines: List  # VLLMEngine actor handles
    reference: Optional[object] = None  # WorkerGroup (frozen), when a KL term is used
    critic: Optional[object] = None  # WorkerGroup (trainable), for GAE
    reward_model: Optional[object] = None  # WorkerGroup (frozen scalar head)


class RLTrainer:
    def __init__(self, cfg, tokenizer, prompts: PromptSet, plan: EpochPlan, actors: RLActors, scorer,
                 policy_objective, value_objective, writer: MetricsWriter) -> None:
        self.cfg, self.tokenizer, self.prompts, self.plan = cfg, tokenizer, prompts, plan
        self.actors, self.scorer, self.writer = actors, scorer, writer
        self.policy_objective, self.value_objective = policy_objective, value_objective

    # ---------------------------------------------------------------------------------------- the loop
    def fit(self) -> dict:
        last: dict = {}
        for step in self.plan.steps():
            timer = StageTimer()
            with timer("generate"):
                generations, prompt_index = self.generate(step)
            with timer("score"):
                scores, per_source = self.score(generations, prompt_index)
            batch = rollout_batch(generations, self.tokenizer.pad_token_id)
            with timer("logprobs"):
                batch = self.annotate(batch)
            batch, kl_stats = self.advantages(batch, scores, prompt_index)
            with timer("train"):
                train_stats = self.update(batch, step.step)
            with timer("sync"):
                sync = self.actors.policy.push_weights(self.actors.engines,
                                                       self.cfg.rollout.weight_sync_bucket_mb << 20)
            last = self.log(step, scores, per_source, batch, {**train_stats, **kl_stats}, sync, timer)
        return last

    # ---------------------------------------------------------------------------------------- stages
    def generate(self, step: StepPlan):
        """``n_samples_per_prompt`` samples of each prompt of the step, spread over the engines."""
        import ray

        from rlhf.rollout.vllm_engine import SamplingSpec

        r = self.cfg.rollout
        prompt_index = [i for i in step.indices for _ in range(r.n_samples_per_prompt)]
        ids = [self.prompts.prompt_ids[i] for i in prompt_index]
        engines = self.actors.engines
        per_engine = -(-len(ids) // len(engines))
        sampling = [SamplingSpec(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                 seed=self.cfg.train.seed * 1_000_003 + step.step * 10_007 + e * per_engine,
                                 stop_token_ids=(self.tokenizer.eos_token_id,))
                    for e in range(len(engines))]
        refs = [engine.generate.remote(ids[e * per_engine:(e + 1) * per_engine], sampling[e])
                for e, engine in enumerate(engines)]
        return [g for chunk in ray.get(refs) for g in chunk], prompt_index

    def score(self, generations, prompt_index):
        responses = self.tokenizer.batch_decode([list(g.response_ids) for g in generations], skip_special_tokens=True)
        prompts = [self.prompts.texts[i] for i in prompt_index]
        columns = {k: [v[i] for i in prompt_index] for k, v in self.prompts.columns.items()}
        total = torch.zeros(len(generations))
        per_source: Dict[str, torch.Tensor] = {}
        if self.scorer is not None:
            total, per_source = self.scorer(prompts, responses, columns)
        if self.actors.reward_model is not None:
            from rlhf.objectives.rl import SequenceScores

            batch = rollout_batch(generations, self.tokenizer.pad_token_id)
            rm = torch.cat(self.actors.reward_model.score(self._chunks(batch), SequenceScores()))
            per_source["reward_model"] = rm
            total = total + self.cfg.reward.model_weight * rm
        return total.float(), per_source

    def annotate(self, batch: Batch) -> Batch:
        """Per-token log-probs of the policy that generated the batch (pi_old), of the reference, and values."""
        from rlhf.objectives.rl import TokenLogps, TokenValues

        logps = TokenLogps(temperature=self.cfg.rollout.temperature)
        batch = batch.replace(old_logps=self._score_rows(self.actors.policy, batch, logps))
        if self.actors.reference is not None:
            batch = batch.replace(ref_logps=self._score_rows(self.actors.reference, batch, logps))
        if self.actors.critic is not None:
            batch = batch.replace(values=self._score_rows(self.actors.critic, batch, TokenValues()))
        return batch

    def advantages(self, batch: Batch, scores: torch.Tensor, prompt_index: List[int]):
        a = self.cfg.algo
        return advantages_for(batch, scores, torch.tensor(prompt_index, dtype=torch.long),
                              estimator=a.advantage_estimator, gamma=a.gamma, lam=a.lam, kl_coef=a.kl_coef,
                              kl_estimator=a.kl_estimator, kl_in_reward=a.kl_mode == "reward")

    def update(self, batch: Batch, rl_step: int) -> dict:
        """``algo.ppo_epochs`` passes over the rollout batch in exact global train batches (policy, critic)."""
        t, a = self.cfg.train, self.cfg.algo
        plan = EpochPlan(num_samples=len(batch), global_batch_size=t.global_batch_size, max_epochs=a.ppo_epochs,
                         seed=t.seed * 7919 + rl_step)
        policy_sums, value_sums = {}, {}
        for train_step in plan.steps():
            policy_sums = add_sums(policy_sums, self._train(self.actors.policy, self.policy_objective, batch,
                                                            train_step, t.num_workers))
            if self.actors.critic is not None:
                value_sums = add_sums(value_sums, self._train(self.actors.critic, self.value_objective, batch,
                                                              train_step, self.cfg.critic.num_workers))
        steps = plan.total_steps
        return {k: v / steps for k, v in {**policy_sums, **value_sums}.items()}  # mean over optimizer steps

    # ---------------------------------------------------------------------------------------- helpers
    def _train(self, group, objective, batch: Batch, step: StepPlan, num_workers: int) -> dict:
        shards = [[batch.select(rows).trim() for rows in rank]
                  for rank in step.shards(num_workers, self.cfg.train.micro_batch_size)]
        normalizer = sum(objective.count(mb) for rank in shards for mb in rank)
        results = group.train_step(shards, objective, normalizer)
        sums: dict = {}
        for result in results:
            sums = add_sums(sums, result.sums)
        metrics = objective.finalize(sums, normalizer)
        prefix = "critic_" if objective is self.value_objective else ""
        metrics[prefix + "grad_norm"] = results[0].grad_norm
        metrics[prefix + "lr"] = results[0].lr
        return metrics

    def _chunks(self, batch: Batch) -> List[Batch]:
        size = self.cfg.train.micro_batch_size
        return [batch.slice(i, min(i + size, len(batch))).trim() for i in range(0, len(batch), size)]

    def _score_rows(self, group, batch: Batch, fn) -> torch.Tensor:
        """``fn`` over the batch in micro-batch chunks, re-padded to the batch width -> ``(B, T)``."""
        width = batch.input_ids.shape[1]
        parts = group.score(self._chunks(batch), fn)
        return torch.cat([torch.nn.functional.pad(p.float(), (0, width - p.shape[1])) for p in parts])

    def log(self, step: StepPlan, scores, per_source, batch: Batch, train_stats: dict, sync: dict,
            timer: StageTimer) -> dict:
        # accuracy: a sample is correct when every 0/1-valued (verifiable) reward source says so
        binary = [v for v in per_source.values() if bool(((v == 0) | (v == 1)).all())]
        total_s = sum(timer.seconds.values())
        row = {"step": step.step, "epoch": step.epoch,
               "reward_mean": float(scores.mean()), "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
               **{f"reward/{k}": float(v.float().mean()) for k, v in per_source.items()},
               **({"accuracy": float(torch.stack(binary).min(0).values.mean())} if binary else {}),
               "response_length": float(batch.loss_mask.sum(-1).float().mean()),
               **train_stats,
               "logp_mismatch": logp_mismatch(batch),
               "num_samples": len(batch),
               **{f"time/{k}": round(v, 4) for k, v in timer.seconds.items()},
               "sync_mb_per_s": sync.get("bytes", 0.0) / 2**20 / max(sync.get("seconds", 0.0), 1e-9),
               "samples_per_s": len(batch) / max(total_s, 1e-9),
               "prompts_skipped": self.prompts.skipped, "prompts_truncated": self.prompts.truncated}
        row = {k: v for k, v in row.items() if v is not None}
        self.writer.log(row)
        if step.step % self.cfg.logging.print_every == 0 or step.step == self.plan.total_steps:
            print(f"[rl] step {step.step}/{self.plan.total_steps} " + format_row(row, CONSOLE_KEYS), flush=True)
        return row
