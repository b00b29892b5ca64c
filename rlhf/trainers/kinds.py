"""Every trainer's descriptor by name (:class:`~rlhf.trainers.descriptor.TrainerKind`): SFT, the reward model, the
DPO family and online RL. The command lines, ``--dry-run`` and the audit look a config's trainer up here
(:func:`kind_of`, by the config's class). It sits above both wings and nothing below imports it: each trainer
defines its descriptor beside its train function and hands it to the core itself. Adding a trainer is its config
class, its module with a train function and a descriptor, and one line in :data:`_KINDS`.
"""

from __future__ import annotations

from typing import List, Tuple

from rlhf.config.schema import RunConfig
from rlhf.registry import Registry
from rlhf.trainers.descriptor import TrainerKind
from rlhf.trainers.offline.dpo import DPO
from rlhf.trainers.offline.reward_model import RM
from rlhf.trainers.offline.sft import SFT
from rlhf.trainers.online.runner import PPO

# In the order an audit tries a config's class against them.
_KINDS: Tuple[TrainerKind, ...] = (SFT, RM, DPO, PPO)
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
