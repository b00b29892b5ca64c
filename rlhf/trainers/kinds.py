"""The trainers, one descriptor each: everything that differs between SFT, reward modelling, DPO and online RL.

A :class:`TrainerKind` holds a trainer's facts: its run config class, its train function, the role and kind of the
model it trains, the models LoRA wraps, its resource plan, the libraries it needs, the loss column the audit
tabulates, and what tells its configs apart. The command lines, ``--dry-run``, the audit, LoRA's checks and the
output directory read the descriptor of a config (:func:`kind_of`, by the config's class); no code asks a config
which sections it has. Adding a trainer is one entry here, its config class and its train function.
"""

from __future__ import annotations

import importlib
import os
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple, Type

from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import DPORunConfig, RewardModelRunConfig, RunConfig, SFTRunConfig
from rlhf.distributed.resource_plan import ResourcePlan, offline_plan, rl_plan
from rlhf.hub import RUN_MODEL_KEYS
from rlhf.models.loading import CAUSAL_LM, SCALAR_HEAD
from rlhf.registry import Registry
from rlhf.utils.versions import TRAINING_PACKAGES


@dataclass(frozen=True)
class TrainerKind:
    """One trainer (module docstring)."""

    name: str  # sft | rm | dpo | ppo: the registry name, the audit's --trainer
    run_name: str  # sft | rm | dpo | rl: the prefix of the run's log lines and of a new output directory
    config_cls: Type[RunConfig]  # its run config
    train_path: str  # "module:function" (cfg -> RunResult), imported when called: the trainers import this module
    cli_module: str  # its command line, python -m <cli_module>
    row_fields_path: str  # "module:function" (cfg -> rlhf.data.io.read_rows arguments): what a data row holds
    read_data_path: str  # "module:function" ((cfg, tokenizer) -> a line): the data read and tokenized as a run does
    policy_role: str  # the role of the model it trains
    policy_kind: str  # CAUSAL_LM, or SCALAR_HEAD for a reward model
    primary_loss: str  # the loss column of the audit's table
    sections: Tuple[str, ...]  # config sections only this trainer has (what tells its configs apart)
    preset_prefixes: Tuple[str, ...]  # its shipped presets are named <prefix>_...
    # whether a run scores against a frozen reference model (with LoRA, the base under the adapters)
    has_reference: Callable[[Any], bool] = lambda cfg: False
    reference_ranks: Callable[[Any], int] = lambda cfg: 0  # offline: the reference group's ranks
    model_keys: Tuple[str, ...] = RUN_MODEL_KEYS  # the config keys naming models it loads (hub ids pinned)
    online: bool = False  # rollouts from vLLM engines: online RL's plan, its extra trained models, vLLM needed

    @property
    def packages(self) -> Tuple[str, ...]:
        """The libraries a run checks on the driver and on every node (``rlhf.utils.versions``)."""
        return TRAINING_PACKAGES + (("vllm",) if self.online else ())

    def resume_command(self, output_dir: str) -> str:
        """The command that continues a run in ``output_dir`` from its newest checkpoint: its saved, resolved
        ``config.yaml`` (hub ids pinned) with ``train.resume=true``."""
        config = shlex.quote(os.path.join(output_dir, "config.yaml"))
        return f"python -m {self.cli_module} --config {config} train.resume=true"

    def row_fields(self, cfg: RunConfig) -> Dict[str, Any]:
        """The :func:`rlhf.data.io.read_rows` arguments of this trainer's data rows under ``cfg`` (the fields kept,
        their types, the per-row layout check): what the run reads, and ``--dry-run`` checks without a tokenizer."""
        return _call(self.row_fields_path, cfg)

    def read_data(self, cfg: RunConfig, tokenizer) -> str:
        """Read and tokenize the run's data with every check a run makes of it before any actor starts; a line
        saying what was read (``--dry-run``)."""
        return _call(self.read_data_path, cfg, tokenizer)

    def train(self, cfg: RunConfig):
        return _call(self.train_path, cfg)

    def plan(self, cfg: RunConfig, gpus_per_worker: float) -> ResourcePlan:
        """What a run of ``cfg`` asks the cluster for, and the actors its runner starts, in order
        (:func:`rlhf.trainers.actors.start_plan`)."""
        if self.online and isinstance(cfg, RLRunConfig):  # online: always an RLRunConfig (narrows the type)
            return rl_plan(cfg, gpus_per_worker, reference=self.reference_group(cfg))
        reference_ranks = self.reference_ranks(cfg) if self.reference_group(cfg) else 0
        return offline_plan(cfg, gpus_per_worker, self.policy_role, reference_ranks)

    def reference_group(self, cfg: RunConfig) -> bool:
        """Whether a run of ``cfg`` starts a frozen reference group of its own."""
        return self.has_reference(cfg) and not cfg.model.reference_is_base

    def reference_on_policy(self, cfg: RunConfig) -> bool:
        """Whether the reference is the policy's own frozen base (LoRA with the adapters off): the policy's workers
        score it, and no reference group is started."""
        return self.has_reference(cfg) and cfg.model.reference_is_base

    def trained_models(self, cfg: RunConfig) -> List[Tuple[str, str]]:
        """``(path, kind)`` of every model a run of ``cfg`` trains, and so wraps with LoRA when ``model.lora`` is on:
        the policy (a reward model for ``rm``) and, in online RL, the critic when the algorithm has one."""
        models = [(cfg.model.path, self.policy_kind)]
        if self.online and isinstance(cfg, RLRunConfig) and cfg.algo.needs_critic:
            models.append((cfg.critic.path or cfg.model.path, SCALAR_HEAD))
        return models


def _call(path: str, *args: Any) -> Any:
    """Call the function ``"module:function"`` names, importing its module now (the trainers import this one)."""
    module, function = path.split(":")
    return getattr(importlib.import_module(module), function)(*args)


# In the order an audit tries a config's class against them.
_KINDS: Tuple[TrainerKind, ...] = (
    TrainerKind(
        name="sft",
        run_name="sft",
        config_cls=SFTRunConfig,
        train_path="rlhf.trainers.sft:train_sft",
        cli_module="rlhf.cli.train_sft",
        row_fields_path="rlhf.trainers.sft:row_fields",
        read_data_path="rlhf.trainers.sft:read_data",
        policy_role="policy",
        policy_kind=CAUSAL_LM,
        primary_loss="loss",
        sections=(),
        preset_prefixes=("sft",),
    ),
    TrainerKind(
        name="rm",
        run_name="rm",
        config_cls=RewardModelRunConfig,
        train_path="rlhf.trainers.reward_model:train_reward_model",
        cli_module="rlhf.cli.train_rm",
        row_fields_path="rlhf.trainers.reward_model:row_fields",
        read_data_path="rlhf.trainers.reward_model:read_data",
        policy_role="reward_model",
        policy_kind=SCALAR_HEAD,
        primary_loss="loss",
        sections=("rm",),
        preset_prefixes=("rm",),
    ),
    TrainerKind(
        name="dpo",
        run_name="dpo",
        config_cls=DPORunConfig,
        train_path="rlhf.trainers.dpo:train_dpo",
        cli_module="rlhf.cli.train_dpo",
        row_fields_path="rlhf.trainers.dpo:row_fields",
        read_data_path="rlhf.trainers.dpo:read_data",
        policy_role="policy",
        policy_kind=CAUSAL_LM,
        primary_loss="loss",
        sections=("dpo",),
        preset_prefixes=("dpo",),
        has_reference=lambda cfg: True,
        reference_ranks=lambda cfg: cfg.dpo.ref_num_workers,
    ),
    TrainerKind(
        name="ppo",
        run_name="rl",
        config_cls=RLRunConfig,
        train_path="rlhf.trainers.rl_runner:train_ppo",
        cli_module="rlhf.cli.train_ppo",
        row_fields_path="rlhf.trainers.rl_runner:row_fields",
        read_data_path="rlhf.trainers.rl_runner:read_data",
        policy_role="policy",
        policy_kind=CAUSAL_LM,
        primary_loss="policy_loss",
        sections=("rollout", "reward", "algo", "critic", "colocate"),
        preset_prefixes=("ppo", "grpo"),
        has_reference=lambda cfg: cfg.algo.kl_coef > 0,
        model_keys=RUN_MODEL_KEYS + ("critic.path", "reward.model_path"),
        online=True,
    ),
)
TRAINER_KINDS: Registry[TrainerKind] = Registry("trainer")
for _kind in _KINDS:
    TRAINER_KINDS.register(_kind.name)(_kind)


def kinds() -> List[TrainerKind]:
    """Every trainer: sft, rm, dpo, ppo (the order an audit tries a config against them)."""
    return list(_KINDS)


def kind_of(cfg: RunConfig) -> TrainerKind:
    """The descriptor of a run config, by its class."""
    for kind in kinds():
        if type(cfg) is kind.config_cls:
            return kind
    raise TypeError(
        f"{type(cfg).__name__} is no trainer's run config; the trainers' are "
        + ", ".join(kind.config_cls.__name__ for kind in kinds())
    )
