"""A trainer's descriptor: everything that differs between SFT, reward modelling, DPO and online RL.

A :class:`TrainerKind` holds a trainer's facts (its run config class, the role and kind of the model it trains, the
loss column the audit tabulates, what tells its configs apart) and its functions: the train function, what a data
row holds, the data read as a run reads it, the resource plan, and the hooks through which the generic rooms (the
preflight, ``--dry-run``, the audit) reach what only this trainer checks or prints, so none of them branches on a
run's type. Each trainer defines its own descriptor beside its train function (``offline/sft.py``, ``offline/dpo.py``,
``offline/reward_model.py``, ``online/runner.py``) and hands it to the core it runs in (:class:`rlhf.trainers.run.Run`,
:func:`rlhf.trainers.preflight.preflight`); :mod:`rlhf.trainers.kinds` lists them all by name, above both wings.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from rlhf.config.schema import RunConfig
from rlhf.distributed.resource_plan import Devices, ResourcePlan, offline_plan
from rlhf.hub import RUN_MODEL_KEYS
from rlhf.models.loading import CAUSAL_LM
from rlhf.trainers.findings import Finding, offline_batch_findings
from rlhf.utils.versions import TRAINING_PACKAGES

Row = Tuple[str, str, str]  # a preflight row: (config key, path, status)


def _no_rows(cfg: Any, here: bool) -> List[Row]:
    return []


def _no_lines(cfg: Any, plan: ResourcePlan, devices: Devices) -> List[str]:
    return []


def _no_models(cfg: Any) -> List[Tuple[str, str]]:
    return []


def _no_overrides(cfg: Any, micro: int, ranks: int) -> List[str]:
    return []


def _any_split(cfg: Any, micro: int, ranks: int) -> bool:
    return True


@dataclass(frozen=True)
class TrainerKind:
    """One trainer (module docstring). ``cfg`` below is a run config of ``config_cls``."""

    name: str  # sft | rm | dpo | ppo: the registry name, the audit's --trainer
    run_name: str  # sft | rm | dpo | rl: the prefix of the run's log lines and of a new output directory
    config_cls: Type[RunConfig]  # its run config
    train: Callable[[Any], Any]  # cfg -> RunResult: the run end to end
    cli_module: str  # its command line, python -m <cli_module>
    row_fields: Callable[[Any], Dict[str, Any]]  # cfg -> the rlhf.data.io.read_rows arguments of a data row
    read_data: Callable[[Any, Any], str]  # (cfg, tokenizer) -> a line: the data read and tokenized as a run does
    batch_lines: Callable[[Any, List[str]], List[str]]  # --dry-run's batch lines from the common ones (LoRA, batch)
    preset_prefixes: Tuple[str, ...]  # its shipped presets are named <prefix>_...
    sections: Tuple[str, ...] = ()  # config sections only this trainer has (what tells its configs apart)
    policy_role: str = "policy"  # the role of the model it trains
    policy_kind: str = CAUSAL_LM  # or SCALAR_HEAD for a reward model
    primary_loss: str = "loss"  # the loss column of the audit's table
    # the audit's findings on the batch arithmetic (an offline trainer's: the epochs its rows give)
    lint_batches: Callable[[Any, Optional[int]], List[Finding]] = offline_batch_findings
    # whether a run scores against a frozen reference model (with LoRA, the base under the adapters)
    has_reference: Callable[[Any], bool] = lambda cfg: False
    reference_ranks: Callable[[Any], int] = lambda cfg: 0  # offline: the reference group's ranks
    # whether the reference is the starting policy, scored once before the first step (DPO's precompute without
    # another model.ref_path): the policy's ranks score it with their starting weights, no reference group starts
    reference_is_initial_policy: Callable[[Any], bool] = lambda cfg: False
    # whether each policy rank holds a frozen copy of the reference in its own process when it needs one (online
    # RL's colocate.reference_in_policy, DPO's dpo.ref_num_workers=0): the policy's ranks score it, no reference
    # group starts
    reference_held_by_policy: Callable[[Any], bool] = lambda cfg: False
    model_keys: Tuple[str, ...] = RUN_MODEL_KEYS  # the config keys naming models it loads (hub ids pinned)
    extra_packages: Tuple[str, ...] = ()  # libraries beyond DeepSpeed's stack (online RL: vllm)
    # (cfg, gpus per worker, reference group?) -> its plan; None: the offline plan (policy + reference ranks)
    resource_plan: Optional[Callable[[Any, float, bool], ResourcePlan]] = None
    extra_trained: Callable[[Any], List[Tuple[str, str]]] = _no_models  # models trained beside the policy
    # hooks of the generic rooms: its own start-up checks (raise ConfigError; return rows of the paths they read),
    # its --dry-run lines after the devices, the audit's overrides and feasibility for a (micro, ranks) split
    checks: Callable[[Any, bool], List[Row]] = _no_rows
    describe: Callable[[Any, ResourcePlan, Devices], List[str]] = _no_lines
    audit_overrides: Callable[[Any, int, int], List[str]] = _no_overrides
    audit_split_fits: Callable[[Any, int, int], bool] = _any_split
    online: bool = False  # rollouts from engines: the audit counts RL steps (each its rollout batch)

    @property
    def packages(self) -> Tuple[str, ...]:
        """The libraries a run checks on the driver and on every node (``rlhf.utils.versions``)."""
        return TRAINING_PACKAGES + self.extra_packages

    def resume_command(self, output_dir: str) -> str:
        """The command that continues a run in ``output_dir`` from its newest checkpoint: its saved, resolved
        ``config.yaml`` (hub ids pinned) with ``train.resume=true``."""
        config = shlex.quote(os.path.join(output_dir, "config.yaml"))
        return f"python -m {self.cli_module} --config {config} train.resume=true"

    def plan(self, cfg: RunConfig, gpus_per_worker: float) -> ResourcePlan:
        """What a run of ``cfg`` asks the cluster for, in order, and the actors its runner starts
        (:func:`rlhf.trainers.actors.start_plan`)."""
        if self.resource_plan is not None:
            return self.resource_plan(cfg, gpus_per_worker, self.reference_group(cfg))
        reference_ranks = self.reference_ranks(cfg) if self.reference_group(cfg) else 0
        return offline_plan(cfg, gpus_per_worker, self.policy_role, reference_ranks)

    def reference_group(self, cfg: RunConfig) -> bool:
        """Whether a run of ``cfg`` starts a frozen reference group of its own."""
        return self.has_reference(cfg) and not self.reference_on_policy(cfg)

    def reference_on_policy(self, cfg: RunConfig) -> bool:
        """Whether the policy's workers score the reference, and no reference group is started: the policy's own
        frozen base (:meth:`reference_on_base`), the starting policy itself scored before the first step
        (``reference_is_initial_policy``), or a frozen copy each policy rank holds (:meth:`reference_held`)."""
        return (
            self.reference_on_base(cfg)
            or self.reference_held(cfg)
            or (self.has_reference(cfg) and self.reference_is_initial_policy(cfg))
        )

    def reference_held(self, cfg: RunConfig) -> bool:
        """Whether each policy rank loads a frozen copy of the reference beside the model it trains and scores it
        there (``reference_held_by_policy``): not LoRA's reference, the base the ranks already hold, nor the
        starting policy scored before the first step (``reference_is_initial_policy``), which needs no copy."""
        return (
            self.has_reference(cfg)
            and not cfg.model.reference_is_base
            and not self.reference_is_initial_policy(cfg)
            and self.reference_held_by_policy(cfg)
        )

    def reference_on_base(self, cfg: RunConfig) -> bool:
        """Whether the reference is the policy's own frozen base (LoRA with the adapters off), at every step."""
        return self.has_reference(cfg) and cfg.model.reference_is_base

    def trained_models(self, cfg: RunConfig) -> List[Tuple[str, str]]:
        """``(path, kind)`` of every model a run of ``cfg`` trains, and so wraps with LoRA when ``model.lora`` is on:
        the policy (a reward model for ``rm``) and what the trainer trains beside it (online RL: the critic)."""
        return [(cfg.model.path, self.policy_kind), *self.extra_trained(cfg)]
