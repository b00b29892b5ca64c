"""A bounded-staleness checkpoint written before #38 moved the rollout modules still resumes: its pickled samples
name classes under their old modules (``rlhf.trainers.rl_rollout.Rollout``, ``rlhf.rollout.vllm_engine.Generation``),
and :func:`rlhf.trainers.moved.load_pickled` finds them where they live now."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rlhf.rollout.sources import Rollout
from rlhf.rollout.types import Generation
from rlhf.trainers.moved import MOVED, load_pickled


def _saved_under_old_names(path, obj, classes):
    """``torch.save(obj)`` as the old code wrote it: each class of ``classes`` pickled under its old module."""
    saved = {}
    for cls, old in classes:
        module = sys.modules.setdefault(old, types.ModuleType(old))
        setattr(module, cls.__name__, cls)
        saved[cls] = cls.__module__
        cls.__module__ = old
    try:
        torch.save(obj, path)
    finally:
        for cls, old in classes:
            cls.__module__ = saved[cls]
            del sys.modules[old]


def test_a_checkpoint_of_the_old_module_names_loads(tmp_path):
    generation = Generation(prompt_ids=(1, 2), response_ids=(3,), response_logps=(-0.5,), finish_reason="stop")
    state = {"ready": {3: [generation]}, "updated": 2}
    path = str(tmp_path / "rollouts.pt")
    _saved_under_old_names(path, state, [(Generation, "rlhf.rollout.vllm_engine")])
    with pytest.raises(ModuleNotFoundError, match="rlhf.rollout.vllm_engine"):
        torch.load(path, weights_only=False)  # what a resume did before the remap
    loaded = load_pickled(path)
    assert loaded == state and type(loaded["ready"][3][0]) is Generation


def test_every_moved_module_is_gone_and_its_new_homes_exist():
    import importlib

    for old, new in MOVED.items():
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
        for module in new:
            importlib.import_module(module)
    assert "rlhf.trainers.rl_rollout" in MOVED and Rollout.__module__ == "rlhf.rollout.sources"
