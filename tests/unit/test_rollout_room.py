"""``rlhf.rollout`` owns every rollout (#38): the trainer holds one :class:`~rlhf.rollout.sources.RolloutSource`
whatever the mode, the engines are chosen by ``rollout.backend``, and ``rlhf.rl`` is only the public face of the
custom-loop API (nothing inside the package imports it)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from rlhf.config import load_config
from rlhf.config.rl_schema import ROLLOUT_BACKENDS, RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.rollout.agent import AgentRollout
from rlhf.rollout.sources import EpisodeRollout, RolloutSource, SingleTurnRollout
from rlhf.trainers.online.roles import ENGINE_STARTERS

ROOT = Path(__file__).resolve().parents[2]


def test_every_rollout_mode_is_called_as_the_protocol_says():
    wanted = list(inspect.signature(RolloutSource.__call__).parameters)
    for source in (SingleTurnRollout, EpisodeRollout, AgentRollout):
        assert list(inspect.signature(source.__call__).parameters) == wanted, source.__name__


def test_the_trainer_holds_a_single_turn_source_when_given_none():
    from rlhf.trainers.online.steps import RLActors, RLTrainer

    cfg = load_config(RLRunConfig, "grpo_tiny", ["model.path=/m", "data.train_path=/d.jsonl"])
    trainer = RLTrainer(cfg, "tok", None, None, RLActors(policy=None, engines=None), None, None, None)
    assert isinstance(trainer.source, SingleTurnRollout) and trainer.source.tokenizer == "tok"


def test_each_backend_has_its_starter_and_an_unknown_one_is_refused_by_key():
    assert set(ENGINE_STARTERS) == set(ROLLOUT_BACKENDS) == {"vllm"}
    with pytest.raises(ConfigError, match=r"rollout\.backend must be one of vllm; got .sglang."):
        load_config(RLRunConfig, "grpo_tiny", ["model.path=/m", "data.train_path=/d.jsonl", "rollout.backend=sglang"])


def test_nothing_in_the_package_imports_the_public_rl_api():
    """``rlhf.rl`` re-exports what a custom loop needs; the built-in trainer imports each part from its home, so the
    public face can change its surface without moving the trainer."""
    found = []
    for path in sorted((ROOT / "rlhf").rglob("*.py")):
        if path.name == "rl.py" and path.parent.name == "rlhf":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if "rlhf.rl" in names or (
                isinstance(node, ast.ImportFrom) and node.module == "rlhf" and "rl" in [a.name for a in node.names]
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], found


def test_the_public_rl_api_still_exports_every_name():
    import rlhf.rl as rl

    assert all(hasattr(rl, name) for name in rl.__all__)
    assert rl.advantages_for.__module__ == "rlhf.ops.batch_advantages" and rl.rollout_batch.__module__ == (
        "rlhf.rollout.episodes"
    )
