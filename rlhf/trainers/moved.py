"""Checkpoints written before a module moved still load: the driver state a checkpoint pickles (the samples a
bounded-staleness run generated ahead, :meth:`rlhf.trainers.online.schedule.RolloutSchedule.save_checkpoint`) names
its classes by module, and #38 moved those modules. :func:`load_pickled` reads such a file, looking a class up under
the module it moved to (:data:`MOVED`)."""

from __future__ import annotations

import importlib
import pickle
from typing import Any, Dict, Tuple

#: old module -> the modules its classes live in now (tried in order): the moves of #38.
MOVED: Dict[str, Tuple[str, ...]] = {
    "rlhf.trainers.rl_rollout": ("rlhf.rollout.sources",),
    "rlhf.trainers.agent_rollout": ("rlhf.rollout.agent",),
    "rlhf.trainers.rl_experience": ("rlhf.rollout.prompts",),
    "rlhf.trainers.rl_steps": ("rlhf.trainers.online.steps",),
    "rlhf.trainers.rl_schedule": ("rlhf.trainers.online.schedule",),
    "rlhf.trainers.rl_draws": ("rlhf.trainers.online.draws",),
    "rlhf.rollout.vllm_engine": ("rlhf.rollout.types", "rlhf.rollout.vllm.engine"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        for new in MOVED.get(module, ()):
            found = getattr(importlib.import_module(new), name, None)
            if found is not None:
                return found
        return super().find_class(module, name)


class MovedModules:
    """A ``pickle_module`` for :func:`torch.load` whose unpickler follows :data:`MOVED` (torch subclasses
    ``Unpickler`` and calls ``find_class`` through it)."""

    Unpickler = _Unpickler
    load = staticmethod(lambda file, **kwargs: _Unpickler(file, **kwargs).load())


def load_pickled(path: str) -> Any:
    """``torch.load`` of our own file at ``path`` (not only tensors: ``weights_only=False``), classes of moved
    modules found where they live now."""
    import torch  # lazy: only a checkpoint load needs it

    return torch.load(path, weights_only=False, pickle_module=MovedModules)
