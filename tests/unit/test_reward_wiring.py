"""The RL run's reward keys (``reward.num_workers``, ``reward.on_error``, ``reward.http*``): validation, the plan's
reward actors, the scorers the trainer sums, and ``on_error=drop`` taking a failed sample's whole group out of the
loss (rlhf.ops.failures). tests/integration/test_reward_pool_actors.py runs them in a real run."""

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
from rlhf.rollout.sources import Rollout
from rlhf.trainers.kinds import kind_of
from rlhf.trainers.online.steps import RLTrainer

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


def test_only_the_judge_gets_the_rollouts_group_ids():
    seen = {}

    class Source:
        def __init__(self, name):
            self.name = name

        def score(self, prompts, responses, columns, **kwargs):
            seen[self.name] = kwargs
            none = torch.zeros(2, dtype=torch.bool)
            return ScoreResult(torch.ones(2), {self.name: torch.ones(2)}, none, none)

    scorers = RewardScorers(pool=Source("pool"), http=Source("http"), judge=Source("judge"))
    assert scorers.score(["p", "p"], ["a", "b"], {}, groups=[4, 9]).total.tolist() == [3.0, 3.0]
    assert seen == {"pool": {}, "http": {}, "judge": {"groups": [4, 9]}}
    scorers.score(["p", "p"], ["a", "b"], {})
    assert seen["judge"] == {"groups": None}


def test_a_dropped_samples_group_is_out_of_the_step_and_the_others_keep_theirs():
    """GRPO: the failed sample's whole group (rlhf.ops.failures); REINFORCE++ (no groups): the sample alone."""
    ones = torch.ones(6, 3, dtype=torch.long)
    batch = Batch(input_ids=ones, attention_mask=ones, loss_mask=ones, old_logps=torch.zeros(6, 3))
    rollout = Rollout(batch, prompt_index=[4, 4, 7, 7, 9, 9], responses=[""] * 6)
    rollout.reward_failed = torch.tensor([False, False, False, True, False, False])
    scores = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    for estimator, kept in (("grpo", [3, 3, 0, 0, 3, 3]), ("reinforce_pp", [3, 3, 3, 0, 3, 3])):
        cfg = _cfg("reward.num_workers=2", "reward.on_error=drop", f"algo.advantage_estimator={estimator}")
        trainer = SimpleNamespace(cfg=cfg)
        out, stats = RLTrainer.advantages(trainer, batch, scores, rollout.prompt_index, None, rollout.failures())
        assert out.loss_mask.sum(-1).tolist() == kept and stats["failed/rows_out"] == kept.count(0)
        assert bool((out.advantages[torch.tensor(kept) == 0] == 0).all())
        whole, _ = RLTrainer.advantages(trainer, batch, scores, rollout.prompt_index)
        assert torch.equal(whole.loss_mask, batch.loss_mask)  # nothing failed: every row trains


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


# the tiny model as its own judge: its 512 positions hold no 2048-token judge context (test_engine_context.py)
JUDGE_CONTEXT = "reward.judge.max_model_len=512"


def test_judge_keys_are_checked_before_any_actor_and_planned_as_engines(tiny_model, tmp_path):
    from shared_helpers import preflight

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    run = [f"model.path={tiny_model}", f"data.train_path={prompts}", f"reward.judge.path={tiny_model}", JUDGE_CONTEXT]
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


PAIRWISE = ["reward.judge.path=/j", "reward.judge.mode=pairwise", "reward.judge.template={response_a} {response_b}"]


def test_a_pairwise_judge_refuses_one_sample_per_held_out_prompt_before_any_actor():
    # the evaluation would rank each held-out response against nothing, and fail at the first evaluation
    with pytest.raises(ConfigError) as error:
        _cfg(*PAIRWISE, "data.eval_path=/e.jsonl", "rollout.eval_samples_per_prompt=1")
    assert str(error.value).startswith("rollout.eval_samples_per_prompt (1) must be >= 2 with reward.judge.mode=")
    assert "reward.judge.mode=pairwise" in str(error.value) and "data.eval_path" in str(error.value)
    assert _cfg(*PAIRWISE, "data.eval_path=/e.jsonl", "rollout.eval_samples_per_prompt=2").data.eval_path
    assert _cfg(*PAIRWISE, "rollout.eval_samples_per_prompt=1").rollout.eval_samples_per_prompt == 1  # no evaluation
    assert _cfg("reward.judge.path=/j", "data.eval_path=/e.jsonl", "rollout.eval_samples_per_prompt=1")  # score mode


def test_judge_settings_that_would_fail_at_the_first_scoring_are_refused_naming_the_key():
    from rlhf.rewards.judge_spec import JudgeSpec

    # no room for any judge prompt: every sample would be unparsable (fail: the first step stops; else stand-ins)
    with pytest.raises(ConfigError) as error:
        JudgeSpec.of(_cfg("reward.judge.path=/j", "reward.judge.max_model_len=16").reward.judge)
    assert str(error.value).startswith("reward.judge.max_new_tokens (16) must be < reward.judge.max_model_len (16)")
    # a prompt column named like a field of the judge's template, or a key of the HTTP request
    for source, column in (("reward.judge.path=/j", "response"), ("reward.judge.path=/j", "response_b"),
                           ("reward.http=http://h/s", "prompts")):  # fmt: skip
        with pytest.raises(ConfigError) as error:
            _cfg(source, f"reward.columns=[answer,{column}]")
        assert str(error.value).startswith(f"reward.columns names {column!r}, which "), str(error.value)
        assert source.split("=")[0] in str(error.value)
    assert _cfg("reward.columns=[answer,response]").reward.columns == ("answer", "response")  # functions alone


def test_a_judge_template_field_no_sample_has_is_refused_before_any_actor(tiny_model, tmp_path):
    from shared_helpers import preflight

    from rlhf.data.io import DataError

    prompts, bare, envs = tmp_path / "p.jsonl", tmp_path / "bare.jsonl", tmp_path / "envs.py"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    bare.write_text('{"prompt": "1+1="}\n')
    envs.write_text(
        "class Once:\n    def reset(self, row):\n        return ''\n    def step(self, r, ids):\n        pass\n"
    )
    run = [f"model.path={tiny_model}", f"data.train_path={prompts}", f"reward.judge.path={tiny_model}", JUDGE_CONTEXT]

    def judged(template, *more):
        return load_config(RLRunConfig, "grpo_tiny", [*run, f"reward.judge.template={template}", *more])

    for template, field in (("{prompt} {reference} {response}", "reference"), ("{response_a} {response}", "response_a"),
                            ("{transcript} {response}", "transcript")):  # fmt: skip
        with pytest.raises(ConfigError) as error:
            preflight(judged(template))
        assert str(error.value).startswith(f"reward.judge.template uses {{{field}}}, which no sample has"), error.value
    preflight(judged("{prompt} {answer} {response}"))
    episodes = [
        f"env.spec={envs}:Once",
        "rollout.max_turns=2",
        "rollout.max_prompt_length=16",
        "rollout.max_episode_tokens=32",
    ]
    preflight(judged("{transcript} {turns} {response}", *episodes))  # an episode's columns (rlhf.rollout.sources)
    # the default reward.columns (answer) is passed when the rows have it; a template that reads it needs it in each
    with pytest.raises(DataError, match=r"bare.jsonl:1: reward.judge.template names 'answer' but the row has no such"):
        preflight(judged("{prompt} {answer} {response}", f"data.train_path={bare}"), here=False)


def test_a_reward_function_parameter_no_prompt_set_fills_is_refused_before_any_actor(tmp_path):
    from rlhf.rewards.functions import RewardFunctionScorer
    from rlhf.rollout.prompts import PromptSet
    from rlhf.trainers.online.prompts import check_reward_columns

    fns = tmp_path / "fns.py"
    fns.write_text(
        "def exact(prompts, responses, answer):\n    return [float(r == a) for r, a in zip(responses, answer)]\n"
        "def long(prompts, responses, transcript):\n    return [float(len(t)) for t in transcript]\n"
    )
    train = PromptSet([[1]], ["1+1="], {"answer": ["2"]}, 0, 0)
    held_out = PromptSet([[1]], ["2+2="], {}, 0, 0)  # its rows have no answer: the default reward.columns is optional
    cfg = _cfg(f"reward.functions=[{fns}:exact]", "data.eval_path=/e.jsonl")
    scorer = RewardFunctionScorer(cfg.reward.functions)
    check_reward_columns(cfg, scorer, train, None)
    with pytest.raises(ConfigError) as error:  # else: the evaluation before the first step, after every actor
        check_reward_columns(cfg, scorer, train, held_out)
    assert str(error.value).startswith("reward.functions: with the columns of data.eval_path (none), reward function")
    assert "needs parameter 'answer'" in str(error.value)
    single = _cfg(f"reward.functions=[{fns}:long]")  # an episode's transcript: multi-turn runs only
    with pytest.raises(ConfigError, match=r"^reward.functions: with the columns of data.train_path \(answer\), .*'tra"):
        check_reward_columns(single, RewardFunctionScorer(single.reward.functions), train, None)
    episodes = ["env.spec=/envs.py:E", "rollout.max_turns=2", "rollout.max_prompt_length=16"]
    multi = _cfg(f"reward.functions=[{fns}:long]", *episodes, "rollout.max_episode_tokens=32")
    check_reward_columns(multi, RewardFunctionScorer(multi.reward.functions), train, None)
