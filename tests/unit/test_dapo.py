"""DAPO's dynamic sampling and overlong shaping (``rlhf.ops.dapo``, ``RLTrainer._dynamic``): which groups enter the
batch, that it keeps its size, that a step's draws are a function of its number alone, and the soft overlong
punishment of eq. 13. The draws go through the trainer's own sampling and scoring with stand-in engines; the real
engines run it in tests/integration/test_async_rl.py."""

from __future__ import annotations

import pytest
import torch

from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.data.plan import StepPlan
from rlhf.objectives.actor_critic import PolicyObjective
from rlhf.ops.dapo import overlong_penalty, pick_groups, varied_groups
from rlhf.rollout.prompts import PromptSet
from rlhf.rollout.types import Generation
from rlhf.trainers.online.steps import RLActors, RLTrainer


def test_varied_groups_are_those_whose_scores_differ():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.2])
    assert varied_groups(scores, 3).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="multiple of the group size 4"):
        varied_groups(scores, 4)


def test_the_batch_takes_varied_groups_in_draw_order_then_fills_with_tied_ones():
    draws = [torch.tensor([False, True, False]), torch.tensor([True, True, False])]
    assert pick_groups(draws, 2) == ([(0, 1), (1, 0)], 0)
    assert pick_groups(draws, 3) == ([(0, 1), (1, 0), (1, 1)], 0)
    # three varied groups in all: the fourth and fifth places go to the first tied groups, in draw order
    assert pick_groups(draws, 5) == ([(0, 1), (1, 0), (1, 1), (0, 0), (0, 2)], 2)
    with pytest.raises(ValueError, match="6 groups drawn, 7 wanted"):
        pick_groups(draws, 7)


def test_overlong_punishment_is_dapo_eq_13():
    """L_max = 20, L_cache = 8: no penalty up to 12 tokens, then linear to -1 at 20 (times the penalty)."""
    lengths = torch.tensor([3, 12, 13, 16, 20])
    assert overlong_penalty(lengths, 20, 8).tolist() == [0.0, 0.0, -1 / 8, -0.5, -1.0]
    assert overlong_penalty(lengths, 20, 8, penalty=0.5).tolist() == [0.0, 0.0, -1 / 16, -0.25, -0.5]
    assert overlong_penalty(lengths, 20, 0).tolist() == [0.0] * 5


class SeededEngines:
    """Each request answers one token chosen by its sampling seed (5 or 6); the requests are logged."""

    def __init__(self) -> None:
        self.requests = []

    def generate(self, prompt_ids, sampling):
        out = []
        for j, prompt in enumerate(prompt_ids):
            seed = sampling.seed + j
            self.requests.append((tuple(prompt), seed))
            out.append(Generation(tuple(prompt), (5 + seed % 2,), (-0.5,), "stop"))
        return out


def _trainer(tokenizer, *overrides):
    """16 prompts; an even prompt's samples all score 1 (a tied group), an odd prompt's score by the token drawn."""
    prompts = PromptSet([[100 + i] for i in range(16)], [f"p{i}" for i in range(16)], {}, 0, 0)
    five = tokenizer.decode([5], skip_special_tokens=True)

    def scorer(texts, responses, columns):
        scores = torch.tensor([1.0 if int(t[1:]) % 2 == 0 else float(r == five) for t, r in zip(texts, responses)])
        return scores, {"rule": scores}

    cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            "model.path=/unused",
            "data.train_path=/unused.jsonl",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "train.global_batch_size=16",
            "train.micro_batch_size=16",
            "rollout.dynamic_sampling=true",
            *overrides,
        ],
    )
    engines = SeededEngines()
    trainer = RLTrainer(
        cfg, tokenizer, prompts, None, RLActors(policy=None, engines=engines), scorer, PolicyObjective(), None
    )
    return trainer, engines


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_dynamic_sampling_draws_until_the_groups_differ_and_keeps_the_batch_size(tokenizer):
    """The plan's prompts are all even (tied): more prompts are drawn until four groups differ; the batch holds
    exactly those four groups, their samples in order, each group's scores not all equal, and the scores are the
    ones the draws were judged by. Drawn again, the step gives the same samples (seeded by its number)."""
    trainer, engines = _trainer(tokenizer)
    step = StepPlan(step=3, epoch=1, indices=[0, 2, 4, 6])
    rollout = trainer.generate(step)
    assert len(rollout.batch) == 16 and len(rollout.prompt_index) == 16
    groups = [rollout.prompt_index[g * 4 : (g + 1) * 4] for g in range(4)]
    assert all(len(set(g)) == 1 and g[0] % 2 == 1 for g in groups)  # odd prompts only, whole groups
    scores, per_source = rollout.scored
    assert varied_groups(scores, 4).all() and torch.equal(per_source["rule"], scores)
    assert rollout.metrics["dynamic/tied_groups_in_batch"] == 0.0
    draws = rollout.metrics["dynamic/draws"]
    assert draws >= 1 and rollout.metrics["dynamic/samples_generated"] == 16 * (draws + 1)
    assert len(engines.requests) == 16 * (draws + 1)
    assert len({seed for _, seed in engines.requests}) == len(engines.requests)  # every sample its own seed
    drawn_prompts = [p[0] - 100 for p, _ in engines.requests[::4]]
    assert len(set(drawn_prompts)) == len(drawn_prompts)  # no prompt drawn twice in a step
    again, _ = _trainer(tokenizer)
    twin = again.generate(step)
    assert twin.prompt_index == rollout.prompt_index and torch.equal(twin.batch.input_ids, rollout.batch.input_ids)


def test_when_the_draws_run_out_tied_groups_fill_the_batch(tokenizer):
    trainer, engines = _trainer(tokenizer, "rollout.dynamic_sampling_draws=1")
    rollout = trainer.generate(StepPlan(step=1, epoch=1, indices=[0, 2, 4, 6]))
    varied = int(varied_groups(rollout.scored[0], 4).sum())
    assert len(rollout.batch) == 16 and rollout.metrics["dynamic/draws"] == 1.0
    assert rollout.metrics["dynamic/tied_groups_in_batch"] == 4 - varied < 4
    # the tied groups that fill it are the plan's own, in order, after the varied ones
    assert rollout.prompt_index[4 * varied :: 4] == [0, 2, 4, 6][: 4 - varied]


def test_dynamic_sampling_needs_a_group_estimator_and_one_turn():
    base = ["model.path=/m", "data.train_path=/d.jsonl", "rollout.dynamic_sampling=true"]
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling drops groups of tied scores"):
        load_config(RLRunConfig, "grpo_tiny", [*base, "algo.advantage_estimator=reinforce_pp"])
    multi = ["env.spec=e.py:E", "rollout.max_turns=2", "rollout.max_episode_tokens=300"]
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling is single-turn"):
        load_config(RLRunConfig, "grpo_tiny", [*base, *multi])
    with pytest.raises(ConfigError, match=r"rollout.overlong_buffer must be in \[0, rollout.max_new_tokens=6\)"):
        load_config(
            RLRunConfig, "grpo_tiny", ["model.path=/m", "data.train_path=/d.jsonl", "rollout.overlong_buffer=6"]
        )
