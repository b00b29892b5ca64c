"""Partial rollouts (``rollout.partial_rollout_tokens``) through the trainer's own generation, with stand-in engines
that say which weights sampled each token: the first tokens of every response before the pause, the rest after it
with the new weights, continued from the prompt and the first tokens; each token's version and sampling log-prob
recorded where the batch puts it. The real engines run it in tests/integration/test_async_rl.py."""

from __future__ import annotations

import pytest
import torch

from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.data.plan import EpochPlan, StepPlan
from rlhf.objectives.actor_critic import PolicyObjective
from rlhf.rollout.prompts import PromptSet
from rlhf.rollout.types import Generation
from rlhf.trainers.online.steps import RLActors, RLTrainer


class VersionedEngines:
    """Answers every request with tokens 10 + its weights' version; a prompt ending in 99 stops after one token.
    Each token's log-prob is -(1 + version) / 10, so the batch shows which weights sampled it."""

    def __init__(self) -> None:
        self.weights, self.requests = 0, []

    def generate(self, prompt_ids, sampling):
        self.requests.append(([tuple(p) for p in prompt_ids], sampling.max_new_tokens, sampling.seed))
        out = []
        for p in prompt_ids:
            n = 1 if p[-1] == 99 else sampling.max_new_tokens
            token, logp = 10 + self.weights, -(1 + self.weights) / 10
            out.append(Generation(tuple(p), (token,) * n, (logp,) * n, "stop" if n == 1 else "length"))
        return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_a_response_spans_two_versions_recorded_per_token(tokenizer):
    cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            "model.path=/unused",
            "data.train_path=/unused.jsonl",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=5",
            "rollout.max_staleness=1",
            "rollout.partial_rollout_tokens=2",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
        ],
    )
    prompts = PromptSet([[1, 2], [3, 99]], ["p", "q"], {}, 0, 0)
    engines = VersionedEngines()
    plan = EpochPlan(num_samples=2, global_batch_size=2, max_epochs=8, seed=0)
    trainer = RLTrainer(
        cfg, tokenizer, prompts, plan, RLActors(policy=None, engines=engines), None, PolicyObjective(), None
    )

    def pause():  # what the schedule's pause does: the weights of the step training meanwhile land
        engines.weights = 3

    rollout = trainer._partial(StepPlan(step=4, epoch=1, indices=[0, 1]), pause)  # version 4 - 1 - 1 = 2
    first, rest = engines.requests
    assert first[1] == 2 and rest[1] == 3  # the first 2 tokens, then the 3 left of the budget
    assert rest[0] == [(1, 2, 10, 10), (1, 2, 10, 10)]  # only prompt 0's responses go on, from their first tokens
    assert rest[2] == first[2] + (1 << 43)  # the rest has seeds of its own
    batch = rollout.batch
    assert batch.input_ids[0].tolist() == [1, 2, 10, 10, 13, 13, 13]
    assert rollout.token_versions[0].tolist() == [-1, -1, 2, 2, 3, 3, 3]
    assert rollout.token_versions[2].tolist()[:3] == [-1, -1, 2] and set(rollout.token_versions[2].tolist()[3:]) == {-1}
    torch.testing.assert_close(batch.rollout_logps[0, 2:], torch.tensor([-0.1, -0.1, -0.4, -0.4, -0.4]) * 1.0)
    assert rollout.at_limit.tolist() == [True, True, False, False]  # the rest ran to the budget; prompt 1 stopped
    metrics = trainer._staleness(4, rollout)
    assert metrics["async/version_span"] == 0.5  # two of the four responses span two versions
    assert (
        metrics["async/staleness_max"] == 1.0 and metrics["async/staleness_mean"] == 0.5
    )  # 6 tokens 1 behind, 6 current


def test_partial_rollouts_need_a_generation_running_ahead_and_one_turn():
    base = ["model.path=/m", "data.train_path=/d.jsonl", "rollout.partial_rollout_tokens=2"]
    with pytest.raises(ConfigError, match="rollout.partial_rollout_tokens needs rollout.max_staleness >= 1"):
        load_config(RLRunConfig, "grpo_tiny", base)
    with pytest.raises(ConfigError, match=r"rollout.partial_rollout_tokens must be in \[0, rollout.max_new_tokens=6\)"):
        load_config(RLRunConfig, "grpo_tiny", [*base, "rollout.max_staleness=1", "rollout.partial_rollout_tokens=6"])
    with pytest.raises(ConfigError, match="rollout.partial_rollout_tokens and rollout.dynamic_sampling"):
        load_config(RLRunConfig, "grpo_tiny", [*base, "rollout.max_staleness=1", "rollout.dynamic_sampling=true"])
