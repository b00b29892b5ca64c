"""The RL run's reward keys (``reward.num_workers``, ``reward.on_error``, ``reward.http*``): validation, the plan's
reward actors, the scorers the trainer sums, and ``on_error=drop`` taking a failed sample's whole group out of the
loss. tests/integration/test_reward_pool_actors.py runs them in a real run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.batch import Batch
from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.rewards.results import ScoreResult
from rlhf.rewards.scoring import RewardScorers, reward_scorers
from rlhf.trainers.kinds import kind_of
from rlhf.trainers.rl_rollout import Rollout
from rlhf.trainers.rl_steps import RLTrainer

BASE = ["model.path=/m", "data.train_path=/d.jsonl"]


def _cfg(*overrides):
    return load_config(RLRunConfig, "grpo_tiny", [*BASE, *overrides])


def test_reward_keys_are_checked_naming_the_key():
    with pytest.raises(ConfigError, match=r"reward.on_error \(drop\) needs reward.num_workers >= 1"):
        _cfg("reward.on_error=drop")
    with pytest.raises(ConfigError, match="reward.on_error must be fail, drop or a finite number"):
        _cfg("reward.num_workers=2", "reward.on_error=zero")
    with pytest.raises(ConfigError, match="reward.http must be an http:// or https:// URL"):
        _cfg("reward.http=localhost:8000")
    with pytest.raises(ConfigError, match="reward.timeout_s must be > 0"):
        _cfg("reward.timeout_s=0")
    assert _cfg("reward.num_workers=2", "reward.on_error=-1").reward.failure_policy == -1.0
    # a remote reward alone is a reward
    assert _cfg("reward.functions=[]", "reward.http=http://127.0.0.1:9/score").reward.http


def test_the_plan_holds_the_reward_actors_only_when_functions_run_on_them():
    roles = lambda cfg: {a.role: a for a in kind_of(cfg).plan(cfg, 0.0).actors}  # noqa: E731
    assert "reward_pool" not in roles(_cfg())
    pool = roles(_cfg("reward.num_workers=3", "reward.cpus_per_worker=0.25"))["reward_pool"]
    assert (pool.count, pool.cpus, pool.gpus, pool.group) == (3, 0.25, 0.0, None)
    assert "reward_pool" not in roles(_cfg("reward.functions=[]", "reward.http=http://h/s", "reward.num_workers=3"))


def test_scorers_sum_their_sources_and_a_plain_scorer_runs_in_the_driver():
    def functions(prompts, responses, columns):
        return torch.tensor([1.0, 2.0]), {"f": torch.tensor([1.0, 2.0])}

    class Remote:
        def score(self, prompts, responses, columns):
            none = torch.zeros(2, dtype=torch.bool)
            return ScoreResult(torch.tensor([0.5, 0.25]), {"http:u": torch.tensor([0.5, 0.25])}, none, none, retries=2)

    both = RewardScorers(functions=functions, http=Remote()).score(["p", "q"], ["a", "b"], {})
    assert both.total.tolist() == [1.5, 2.25] and set(both.per_source) == {"f", "http:u"} and both.retries == 2
    assert reward_scorers(functions).score(["p", "q"], ["a", "b"]).total.tolist() == [1.0, 2.0]
    assert reward_scorers(None) is None
    with pytest.raises(ValueError, match="either in the driver or on a pool"):
        RewardScorers(functions=functions, pool=object())


def test_a_dropped_samples_group_carries_no_loss_and_the_others_keep_theirs():
    cfg = _cfg("reward.num_workers=2", "reward.on_error=drop")
    ones = torch.ones(6, 3, dtype=torch.long)
    batch = Batch(input_ids=ones, attention_mask=ones, loss_mask=ones)
    rollout = Rollout(batch, prompt_index=[4, 4, 7, 7, 9, 9], responses=[""] * 6)
    rollout.reward_failed = torch.tensor([False, False, False, True, False, False])
    trained = RLTrainer.trained_rows(SimpleNamespace(cfg=cfg), batch, rollout)
    assert trained.loss_mask.sum(-1).tolist() == [3, 3, 0, 0, 3, 3]  # prompt 7's group: one failed, both out
    rollout.reward_failed = torch.zeros(6, dtype=torch.bool)
    assert torch.equal(RLTrainer.trained_rows(SimpleNamespace(cfg=cfg), batch, rollout).loss_mask, batch.loss_mask)


def test_reward_failures_survive_dynamic_sampling_selection():
    ones = torch.ones(4, 2, dtype=torch.long)
    batch = Batch(input_ids=ones, attention_mask=ones, loss_mask=ones)
    parts = []
    for failed in ([False, True], [True, False]):
        part = Rollout(batch.select([0, 1]), prompt_index=[0, 0], responses=["", ""])
        part.reward_failed = torch.tensor(failed)
        parts.append(part)
    joined = Rollout.concat(parts, pad_id=0)
    assert joined.reward_failed.tolist() == [False, True, True, False]
    assert joined.select([3, 1]).reward_failed.tolist() == [False, True]


def test_judge_keys_are_checked_before_any_actor_and_planned_as_engines(tiny_model, tmp_path):
    from rlhf.trainers.preflight import preflight

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    run = [f"model.path={tiny_model}", f"data.train_path={prompts}", f"reward.judge.path={tiny_model}"]
    with pytest.raises(ConfigError, match=r"reward.judge.template: a score judge's template must use \{response\}"):
        preflight(load_config(RLRunConfig, "grpo_tiny", [*run, "reward.judge.template={prompt}"]))
    rows = preflight(load_config(RLRunConfig, "grpo_tiny", run), here=False)
    assert [r[0] for r in rows if r[0] == "reward.judge.path"] == ["reward.judge.path"]
    with pytest.raises(ConfigError, match="reward.judge.on_unparsable"):
        _cfg("reward.judge.path=/j", "reward.judge.on_unparsable=skip")
    pairwise = ["reward.judge.path=/j", "reward.judge.mode=pairwise", "reward.judge.template={response_a} {response_b}"]
    with pytest.raises(ConfigError, match=r"reward.judge.mode \(pairwise\) compares the responses of a prompt"):
        _cfg(
            *pairwise,
            "rollout.n_samples_per_prompt=1",
            "algo.advantage_estimator=reinforce_pp",
            "train.global_batch_size=16",
            "train.micro_batch_size=16",
        )
    cfg = _cfg("reward.functions=[]", "reward.judge.path=/j", "reward.judge.num_engines=2")  # a judge alone rewards
    judge = {a.role: a for a in kind_of(cfg).plan(cfg, 0.0).actors}["judge"]
    assert (judge.count, judge.cpus, judge.group) == (2, 1.0, None)
    from rlhf.rewards.judge_spec import JudgeSpec

    assert JudgeSpec.of(cfg.reward.judge, seed=7).seed == 7
