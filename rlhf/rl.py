"""What a custom online-RL loop needs, in one place (docs/custom_loops.md walks a loop built from it).

One RL step from these parts::

    generations = engines.generate(prompt_ids, SamplingSpec(...))             # rlhf.rollout
    batch = rollout_batch(generations, pad_id)                                 # (B, T), responses masked
    batch = batch.replace(old_logps=policy.score_batch(batch, TokenLogps()))   # pi_old per token
    batch, _ = advantages_for(batch, rewards, group_ids, estimator="rloo")     # over the whole rollout batch
    result = policy.train_batch(batch, PolicyObjective())                      # one exact optimizer step
    policy.push_weights()                                                      # into the engines

The worker group cuts the batch into ranks and micro-batches and counts the loss normalizer over the whole batch
(:meth:`rlhf.distributed.group.WorkerGroup.train_batch`); the advantages see every sample of the rollout (group
baselines and whitening never see a micro-batch). Nothing here starts an actor.

Sampling with ``temperature``, ``top_k`` or ``top_p`` in the ``SamplingSpec``: score with the same ones,
``TokenLogps(temperature=t, sampling_filter=SamplingFilter(top_k=k, top_p=p))`` and ``PolicyObjective(temperature=t,
sampling_filter=...)``. The trainer's log-probs are then those of the renormalised kept set vLLM sampled from and
reports (``logp_mismatch`` ~1e-6); without the filter every ratio is off by the kept probability mass.

Multi-turn episodes replace the first two lines: ``records = run_episodes(engines, environments, prompt_ids, rows,
sampling, encode, decode, TurnLimits(...))`` then ``episodes_batch([r.episode for r in records], pad_id)``; only
the policy's sampled tokens carry loss (rlhf/rollout/episodes.py). ``encode`` is ``TextObservations.of(tokenizer)``
or ``ChatObservations(chat, role)`` (a chat template's observation turns; a reset observation is rendered onto
the episode's own prompt: pass ``prompt_messages=``, and ``prompt_tools=`` for prompts rendered with tools, aligned
with ``prompt_ids``), or any ``text -> ids`` function.

On-policy distillation (docs/algorithms/distillation.md): ``batch.replace(teacher_logps=teacher.score_batch(batch,
TokenLogps()))`` with a frozen teacher group, then either ``advantages_for(..., distill_coef=c)`` (a per-token
penalty in the reward) or ``PolicyObjective(distill_coef=c)`` (a term of the loss); ``teacher_divergence`` is the
per-token estimate both use. GKD's whole-distribution divergences: ``logps, ids =
split_teacher_topk(teacher.score_batch(batch, TeacherTopK(k)))``, ``batch.replace(teacher_topk_logps=logps,
teacher_topk_ids=ids)`` and ``PolicyObjective(distill_coef=c, distill_divergence="jsd", distill_beta=b)``.
"""

from __future__ import annotations

from rlhf.objectives.actor_critic import (
    PolicyObjective,
    SequenceScores,
    TeacherTopK,
    TokenLogps,
    TokenValues,
    ValueObjective,
    split_teacher_topk,
)
from rlhf.ops.advantages import ADVANTAGE_ESTIMATORS
from rlhf.ops.batch_advantages import advantages_for
from rlhf.ops.distill import teacher_divergence
from rlhf.ops.logprobs import SamplingFilter
from rlhf.ops.mismatch import logp_mismatch, logp_mismatch_max
from rlhf.ops.policy_loss import PolicyLossConfig
from rlhf.rollout.episodes import Episode, EpisodeError, episodes_batch, rollout_batch, turn_reward_tokens
from rlhf.rollout.multi_turn import EpisodeRecord, TurnLimits, episode_metrics, run_episodes
from rlhf.rollout.observations import ChatObservations, TextObservations
from rlhf.rollout.types import Generation, SamplingSpec
from rlhf.rollout.vllm.engine import VLLMSpec
from rlhf.rollout.vllm.engines import RolloutEngines

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ChatObservations",
    "Episode",
    "EpisodeError",
    "EpisodeRecord",
    "Generation",
    "PolicyLossConfig",
    "PolicyObjective",
    "RolloutEngines",
    "SamplingFilter",
    "SamplingSpec",
    "SequenceScores",
    "TeacherTopK",
    "TextObservations",
    "TokenLogps",
    "TokenValues",
    "TurnLimits",
    "VLLMSpec",
    "ValueObjective",
    "advantages_for",
    "teacher_divergence",
    "split_teacher_topk",
    "episode_metrics",
    "episodes_batch",
    "turn_reward_tokens",
    "logp_mismatch",
    "logp_mismatch_max",
    "rollout_batch",
    "run_episodes",
]
