"""Failed samples never steer the samples that train (issue #36), checked on the driver's own RL step.

One RL step runs through :meth:`RLTrainer.train` itself (generate, score, log-probs, advantages, update, log) on
stand-ins for the actors alone: engines that return fixed generations, a reward pool that scores from a table
through the project's own failure policy (``rlhf.rewards.results.assemble``), and an in-process float64 policy
group that cuts and counts the batch as ``WorkerGroup.train_batch`` does and backpropagates. What it trains and logs
is compared with the reference of ``rl_reference_math.py`` (no ``rlhf`` import) applying the rule of
docs/algorithms/rl.md, "Failed samples": a failed sample (a reward source under ``reward.on_error=drop``, an
environment or agent under ``env.on_error=drop``) is out of every statistic of the step; under a group estimator
its whole group is. Compared: the gradient (1e-10 relative), ``policy_loss``, ``reward_mean``, ``reward_std``,
``accuracy``, ``failed/samples``, ``failed/rows_out``, and which groups dynamic sampling trains.

The placeholder a failed sample carries is set to 0, 1 and NaN: every trained and logged number must be the same.
On the code before the fix these fail: REINFORCE++'s whitening and ``algo.whiten_advantages`` saw the placeholder
(bug 1), a failed episode stayed in its group's baseline (bug 2), dynamic sampling counted a group varied by its
placeholder (bug 3) and filtered on the summed score, overlong shaping included (bug 4), and the pairwise judge
ranked runs of equal adjacent prompt texts instead of the rollout's groups (bug 5).
"""

from __future__ import annotations

import functools
import json
import math
import re
from types import SimpleNamespace

import pytest
import rl_reference_math as ref
import torch
from group_helpers import LocalGroup
from shared_helpers import Service, tiny_float64_policy

from rlhf.config.rl_schema import AlgorithmConfig, EnvConfig, JudgeConfig, RewardConfig, RLRunConfig, RolloutConfig
from rlhf.config.schema import DataConfig, ModelConfig, TrainConfig
from rlhf.data.plan import EpochPlan
from rlhf.distributed.engine import EngineSpec
from rlhf.distributed.worker import RankStepResult
from rlhf.objectives.base import add_sums
from rlhf.rewards.functions import RewardFunctionError
from rlhf.rewards.judge import LLMJudge
from rlhf.rewards.judge_spec import JudgeSpec
from rlhf.rewards.remote import HttpReward
from rlhf.rewards.results import Failure, assemble
from rlhf.rewards.scoring import RewardScorers
from rlhf.rollout.prompts import PromptSet
from rlhf.rollout.sources import single_turn_of
from rlhf.rollout.types import Generation
from rlhf.rollout.vllm.judge_engines import judge_sampling
from rlhf.trainers.online.runner import build_objectives
from rlhf.trainers.online.steps import RLActors, RLTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, N, BUDGET = 64, 4, 8
SOURCE = "r.py:f"  # the reward function's name, logged as reward/r.py:f
# 8 prompts x 4 responses: the reward function's 0/1 verdict on each (prompt p's responses are rows 4p .. 4p + 3)
# and each response's length. Dynamic sampling (2 groups a step) draws prompts 7, 5, then 1, 2, then 4, 3, ...
CORRECT = [
    [1, 1, 1, 1],  # tied
    [0, 0, 0, 0],  # tied
    [1, 1, 0, 1],  # varied
    [1, 1, 1, 1],  # tied
    [0, 1, 1, 0],  # varied
    [1, 1, 1, 1],  # tied on accuracy; lengths across the overlong buffer: varied on the summed score
    [0, 0, 0, 0],  # tied
    [0, 0, 0, 0],  # tied; its response 0 fails (dynamic sampling's case): the placeholder must not make it varied
]
# BUDGET 8, buffer 4: the overlong shaping starts after 4 tokens; only prompts 2, 4 (varied anyway) and 5 cross it
LENGTHS = [
    [3, 3, 3, 3],
    [2, 3, 4, 2],
    [5, 2, 3, 3],
    [4, 4, 2, 3],
    [4, 4, 2, 5],
    [2, 8, 3, 7],
    [3, 2, 2, 4],
    [2, 4, 4, 3],
]
PLACEHOLDERS = (0.0, 1.0, math.nan)
# each estimator's paper's loss aggregation (algo.loss_agg_mode=auto): DeepSeekMath's per-sequence token mean, Dr.
# GRPO's and RLOO's token sums over the generation budget, REINFORCE++'s batch token mean
PAPER_AGGREGATION = {
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "rloo": "seq-mean-token-sum-norm",
    "reinforce_pp": "token-mean",
    "reinforce_pp_baseline": "token-mean",
}
OVERLONG_BUFFER = 4


# ------------------------------------------------------------------------------------------ the stand-ins
class Tokens:
    """Decodes ids as their numbers, so the pool can find each response in its table."""

    pad_token_id, eos_token_id = 0, 1

    @staticmethod
    def batch_decode(ids, skip_special_tokens=True):
        return [" ".join(map(str, row)) for row in ids]


def _responses():
    gen = torch.Generator().manual_seed(11)
    return [[tuple(torch.randint(2, VOCAB, (n,), generator=gen).tolist()) for n in row] for row in LENGTHS]


RESPONSES = _responses()
PROMPT_IDS = [[1 + p, 20 + p, 40 + p][: 2 + p % 2] for p in range(len(CORRECT))]


class Engines:
    """Fixed generations: prompt ``p``'s ``k``-th request of a call gets response ``k`` of the table."""

    sleeps = False

    def __init__(self) -> None:
        self.asked = []  # the prompts of each generate call, in order

    def generate(self, prompt_ids, sampling):
        prompts = [PROMPT_IDS.index(list(p)) for p in prompt_ids]
        self.asked.append(sorted(set(prompts), key=prompts.index))
        seen = {}
        out = []
        for p in prompts:
            k = seen[p] = seen.get(p, -1) + 1
            out.append(Generation(tuple(PROMPT_IDS[p]), RESPONSES[p][k], (-1.0,) * len(RESPONSES[p][k]), "stop"))
        return out

    def sleep(self):
        pass

    def wake_weights(self):
        pass

    def wake_kv_cache(self):
        pass


def _verdict(prompt: str, response: str):
    """The table's verdict on a (prompt text ``p<i>``, decoded response) pair, and its (prompt, response) index."""
    p = int(prompt[1:])
    k = [" ".join(map(str, r)) for r in RESPONSES[p]].index(response)
    return float(CORRECT[p][k]), (p, k)


class TablePool:
    """A reward pool scoring each response from :data:`CORRECT`; the ``fail`` (prompt, response) pairs raise. The
    project's own ``assemble`` applies ``on_error``."""

    def __init__(self, on_error, fail=()) -> None:
        self.on_error, self.fail = on_error, set(fail)

    def score(self, prompts, responses, columns=None):
        values, failures = [], []
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            value, pair = _verdict(prompt, response)
            if pair in self.fail:
                values.append(None)
                failures.append(Failure(i, SOURCE, "error", f"{SOURCE} failed on sample {i}"))
            else:
                values.append(value)
        return assemble([(SOURCE, 1.0)], {SOURCE: values}, failures, self.on_error, 0.0)


class Placeholder:
    """A reward source whose dropped samples' placeholder is set to ``value`` (the rule says it must not matter)."""

    def __init__(self, source, value) -> None:
        self.source, self.value = source, value

    def score(self, *args, **kwargs):
        result = self.source.score(*args, **kwargs)
        result.total[result.failed] = self.value
        for values in result.per_source.values():
            values[result.failed] = self.value
        return result

    def __getattr__(self, name):  # the judge's metrics()
        return getattr(self.source, name)


class BackpropGroup(LocalGroup):
    """:class:`LocalGroup` (the real cutting and counting of ``WorkerGroup.train_batch``) that also backpropagates
    each micro-batch's loss over the global normalizer, recording the step's gradient."""

    def __init__(self, model, global_batch: int) -> None:
        super().__init__(model, EngineSpec.for_global_batch(global_batch, 4, 1), 1)
        self.grads = []

    def train_step(self, per_rank, objective, normalizer, schedule_step=None, counted=None):
        self.given, self.counted = (per_rank, normalizer, schedule_step), counted
        self.model.zero_grad(set_to_none=True)
        results = []
        for rank, micro_batches in enumerate(per_rank):
            sums = {}
            for mb, kept in zip(micro_batches, counted[rank] if counted else [True] * len(micro_batches)):
                if kept:
                    total, mb_sums = objective.loss(self.model, mb)
                    (total / normalizer).backward()
                    sums = add_sums(sums, mb_sums)
            results.append(RankStepResult(sums=sums, grad_norm=1.0, lr=0.0))
        self.grads.append(_flat_grad(self.model))
        return results

    def push_weights(self, version=None):
        return {}

    def release_cached_memory(self):
        pass

    def perf_metrics(self):
        return {}


def _flat_grad(model):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


# ------------------------------------------------------------------------------------------ the runs
def _config(estimator, whiten="none", on_error="drop", prompts=4, env=False, reward=None, **rollout) -> RLRunConfig:
    return RLRunConfig(
        model=ModelConfig(path="model"),
        data=DataConfig(train_path="prompts.jsonl"),
        train=TrainConfig(global_batch_size=prompts * N, micro_batch_size=4, seed=3),
        rollout=RolloutConfig(
            prompts_per_step=prompts,
            n_samples_per_prompt=N,
            max_new_tokens=BUDGET,
            max_prompt_length=4,
            **({"max_episode_tokens": 16} if env else {}),
            **rollout,
        ),
        reward=RewardConfig(functions=(), model_path="")
        if env
        else RewardConfig(functions=(SOURCE,), num_workers=1, on_error=on_error),
        env=EnvConfig(spec="envs.py:Env", on_error="drop") if env else EnvConfig(),
        algo=AlgorithmConfig(advantage_estimator=estimator, whiten_advantages=whiten, kl_coef=0.0),
    )


def _reward(env, on_error):
    if env:  # the environment's rewards alone
        return RewardConfig(functions=())
    return RewardConfig(functions=(SOURCE,), num_workers=1, on_error=on_error)


def _prompt_set():
    return PromptSet(PROMPT_IDS, [f"p{p}" for p in range(len(CORRECT))], {}, 0, 0)


def _step(cfg, pool=None, episodes=None, judge=None, prompts=None, http=None):
    """One RL step (step 1 of the run's plan) on the stand-ins; returns the trainer's row, the policy group (its
    gradient) and the engines (which prompts they were asked for)."""
    model = tiny_float64_policy(VOCAB)
    group, engines = BackpropGroup(model, cfg.train.global_batch_size), Engines()
    objective, _ = build_objectives(cfg)
    prompts = prompts or _prompt_set()
    plan = EpochPlan(num_samples=len(CORRECT), global_batch_size=cfg.rollout.prompts_per_step, max_epochs=1, seed=1)
    given = {"pool": pool, "judge": judge, "http": http}
    scorer = RewardScorers(**given) if any(x is not None for x in given.values()) else None
    trainer = RLTrainer(
        cfg, Tokens(), prompts, plan, RLActors(policy=group, engines=engines), scorer, objective, None, None, episodes
    )
    row = trainer.train(plan.step(1))
    return SimpleNamespace(row=row, group=group, engines=engines, model=model, plan=plan)


# ------------------------------------------------------------------------------------------ the reference
def _reference(run, cfg, scores, failed, rows, verdicts=None):
    """The step as the rule says: rows ``rows`` (prompt, response) of the step with ``scores`` (summed rewards) and
    ``verdicts`` (the reward function's alone; default: the scores); the ``failed`` ones out of every statistic, and
    their whole groups under a group estimator. Returns (gradient, loss, metrics)."""
    estimator = cfg.algo.advantage_estimator
    group_estimator = estimator != "reinforce_pp"
    groups = [p for p, _ in rows]
    out = [failed[i] or (group_estimator and any(failed[j] for j in range(len(rows)) if groups[j] == groups[i]))
           for i in range(len(rows))]  # fmt: skip
    kept = [i for i in range(len(rows)) if not out[i]]
    samples = [(PROMPT_IDS[rows[i][0]], RESPONSES[rows[i][0]][rows[i][1]]) for i in kept]
    lengths = [len(r) for _, r in samples]
    s, g = [scores[i] for i in kept], [groups[i] for i in kept]
    if estimator == "reinforce_pp":
        adv = ref.whiten_all(
            ref.discounted_returns(ref.token_rewards(s, [torch.zeros(n, dtype=torch.float64) for n in lengths], 0.0), 1)
        )
    elif estimator == "reinforce_pp_baseline":
        base = [x - sum(s[j] for j in range(len(s)) if g[j] == gi) / g.count(gi) for x, gi in zip(s, g)]
        adv = ref.whiten_all(
            ref.discounted_returns(
                ref.token_rewards(base, [torch.zeros(n, dtype=torch.float64) for n in lengths], 0.0), 1
            )
        )
    else:
        adv = ref.group_advantages(estimator, s, g, lengths)
    if cfg.algo.whiten_advantages != "none":
        adv = ref.whiten_all(adv) if cfg.algo.whiten_advantages == "whiten" else _scale_all(adv)
    model = tiny_float64_policy(VOCAB)
    logps, _ = ref.logps_and_entropy(model, samples, cfg.rollout.temperature)
    per_row = [ref.ppo_token_loss(lp, lp.detach(), a.double(), 0.2, 0.2)[0] for lp, a in zip(logps, adv)]
    agg = PAPER_AGGREGATION[estimator] if cfg.algo.loss_agg_mode == "auto" else cfg.algo.loss_agg_mode
    loss = ref.aggregate(agg, per_row, BUDGET)
    model.zero_grad(set_to_none=True)
    loss.backward()
    real = [scores[i] for i in range(len(rows)) if not failed[i]]
    metrics = {
        "reward_mean": sum(real) / len(real),
        "reward_std": float(torch.tensor(real, dtype=torch.float64).std()),
        "failed/samples": sum(failed),
        "failed/rows_out": sum(out),
    }
    said = [(verdicts or scores)[i] for i in range(len(rows)) if not failed[i]]
    if all(x in (0.0, 1.0) for x in said):  # a 0/1-valued source: accuracy is its mean over the real rewards
        metrics["accuracy"] = sum(said) / len(said)
    return _flat_grad(model), float(loss.detach()), metrics


def _scale_all(x):
    flat = torch.cat(x)
    var = ((flat - flat.mean()) ** 2).mean()
    return [v / torch.sqrt(var + 1e-8) for v in x]


def _step_rows(run):
    """``(prompt, response)`` of each row of step 1: each of the plan's prompts, its N responses in order."""
    return [(p, k) for p in run.plan.step(1).indices for k in range(N)]


def _check(run, cfg, scores, failed, rows=None, verdicts=None):
    rows = rows or _step_rows(run)
    grad, loss, metrics = _reference(run, cfg, scores, failed, rows, verdicts)
    got = run.group.grads[0]
    assert float(grad.norm()) > 1e-6
    assert float((got - grad).norm()) <= 1e-10 * float(grad.norm())
    assert run.row["policy_loss"] == pytest.approx(loss, rel=1e-10, abs=1e-14)
    for key, value in metrics.items():
        assert run.row[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key  # logged in float32
    if "accuracy" not in metrics:
        assert "accuracy" not in run.row


# ------------------------------------------------------------------------------------------ the tests
CASES = [
    ("grpo", "none"),
    ("dr_grpo", "none"),
    ("rloo", "none"),
    ("reinforce_pp", "none"),
    ("reinforce_pp_baseline", "none"),
    ("grpo", "whiten"),
    ("dr_grpo", "scale"),
]


SOURCES = ("functions", "http", "judge")
SWEEP = [(source, *case) for source in SOURCES for case in CASES if source == "functions" or case[1] == "none"]


@pytest.mark.parametrize("source, estimator, whiten", SWEEP, ids=["-".join(c) for c in SWEEP])
def test_a_dropped_reward_steers_nothing_whatever_its_placeholder(source, estimator, whiten, service):
    """A reward source fails on one sample among 4 groups of 4 under its ``drop`` policy (bug 1): reward functions
    on the pool (``reward.on_error``), the HTTP reward (a 500 answer, ``reward.on_error``), the LLM judge (an
    unparsable verdict, ``reward.judge.on_unparsable``). The step matches the reference with the sample (and, for a
    group estimator, its group) out, and the placeholder (0, 1, NaN) changes no number."""
    cfg = _config(estimator, whiten)
    target = (_first_prompt(cfg), 2)
    runs = [_step(cfg, **{_SCORER_KEY[source]: Placeholder(_source(source, target, service), v)})
            for v in PLACEHOLDERS]  # fmt: skip
    rows = _step_rows(runs[0])
    failed = [r == target for r in rows]
    scores = [float(CORRECT[p][k]) if not f else math.nan for (p, k), f in zip(rows, failed)]
    _check(runs[0], cfg, scores, failed)
    for other in runs[1:]:
        assert torch.equal(other.group.grads[0], runs[0].group.grads[0])
        assert _numbers(other.row) == _numbers(runs[0].row)


_SCORER_KEY = {"functions": "pool", "http": "http", "judge": "judge"}


def _source(kind, target, service):
    """A reward source of ``kind`` giving the table's verdicts and failing on ``target``, under ``drop``."""
    if kind == "functions":
        return TablePool("drop", fail=[target])
    if kind == "http":
        service.target = target
        return HttpReward(service.url, batch_size=1, retries=0, on_error="drop", trust_env=False)
    tokenizer = _judge_tokenizer()
    spec = JudgeSpec(path="/judge", template="Q: {prompt}\nR: {response}\n", score_max=1.0, on_unparsable="drop")
    return LLMJudge(spec, Grader(tokenizer, target), tokenizer, judge_sampling(spec, 1))


@pytest.fixture(scope="module")
def service():
    """An HTTP reward service answering the table's verdict, one sample a request; a 500 for ``service.target``."""

    def behave(service, payload):
        (prompt,), (response,) = payload["prompts"], payload["responses"]
        value, pair = _verdict(prompt, response)
        if pair == service.target:
            return 500, b"the grader is down"
        return 200, json.dumps({"rewards": [value]}).encode()

    server = Service(behave)
    yield server
    server.close()


@functools.lru_cache(maxsize=1)
def _judge_tokenizer():
    from rlhf.models.tiny import build_tokenizer

    return build_tokenizer()


class Grader:
    """Judge engines (the ``generate`` signature) answering the table's verdict as a number, and words no pattern
    parses for ``target``."""

    def __init__(self, tokenizer, target) -> None:
        self.tokenizer, self.target = tokenizer, target

    def generate(self, prompt_ids, sampling):
        out = []
        for p in prompt_ids:
            question = self.tokenizer.decode(list(p), skip_special_tokens=True)
            prompt, response = re.search(r"Q: (.*)\nR: (.*)\n", question).groups()
            value, pair = _verdict(prompt, response)
            text = "no idea" if pair == self.target else f"Score: {int(value)}"
            ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            out.append(Generation(tuple(p), ids, (0.0,) * len(ids), "stop"))
        return out


def _first_prompt(cfg):
    plan = EpochPlan(num_samples=len(CORRECT), global_batch_size=cfg.rollout.prompts_per_step, max_epochs=1, seed=1)
    return plan.step(1).indices[0]


def _numbers(row):
    """A row's numbers (times and rates left out), NaN-safe for comparison."""
    timed = ("time/", "samples_per_s", "sync_", "reward/score_seconds", "judge/seconds_per_call")
    return {k: repr(v) for k, v in row.items() if not k.startswith(timed)}


def test_a_fixed_stand_in_is_a_reward_and_fail_stops_the_step():
    """reward.on_error=-1: the stand-in is the sample's reward, in every statistic (no longer 0/1: no accuracy);
    reward.on_error=fail: the step raises, naming the source and sample, before anything trains."""
    cfg = _config("reinforce_pp", on_error=-1.0)
    target = (_first_prompt(cfg), 1)
    run = _step(cfg, TablePool(-1.0, fail=[target]))
    rows = _step_rows(run)
    scores = [-1.0 if r == target else float(CORRECT[r[0]][r[1]]) for r in rows]
    _check(run, cfg, scores, [False] * len(rows))
    assert run.row["reward/substituted_samples"] == 1
    cfg = _config("grpo", on_error="fail")
    with pytest.raises(RewardFunctionError, match=rf"{SOURCE} failed on sample 1"):
        run = _step(cfg, TablePool("fail", fail=[target]))


class FailingEpisodes:
    """Multi-turn episodes as the driver gets them (``RLTrainer.source``): the engines' responses, the
    environment's reward (the table's verdict) and the episodes it failed in (``env.on_error=drop``), whose reward
    is the placeholder (what the environment gave before failing)."""

    def __init__(self, fail, placeholder) -> None:
        self.fail, self.placeholder = set(fail), placeholder

    def __call__(self, engines, prompts, prompt_index, sampling, step):
        rollout = single_turn_of(engines.generate([prompts.prompt_ids[i] for i in prompt_index], sampling),
                                 Tokens(), prompt_index)  # fmt: skip
        order = [sum(1 for q in prompt_index[:j] if q == p) for j, p in enumerate(prompt_index)]
        failed = [(p, k) in self.fail for p, k in zip(prompt_index, order)]
        rollout.env_rewards = torch.tensor(
            [self.placeholder if f else float(CORRECT[p][k]) for p, k, f in zip(prompt_index, order, failed)]
        )
        rollout.failed = torch.tensor(failed)
        rollout.at_limit = torch.zeros(len(prompt_index), dtype=torch.bool)
        return rollout


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "reinforce_pp"])
def test_a_failed_episode_leaves_its_group_and_every_statistic(estimator):
    """env.on_error=drop (an environment or agent that failed, bug 2): under a group estimator the episode's group
    is out (its siblings do not train against a placeholder), under REINFORCE++ the episode alone; whatever the
    placeholder."""
    cfg = _config(estimator, env=True)
    target = (_first_prompt(cfg), 0)
    runs = [_step(cfg, episodes=FailingEpisodes([target], v)) for v in PLACEHOLDERS]
    rows = _step_rows(runs[0])
    failed = [r == target for r in rows]
    scores = [math.nan if f else float(CORRECT[p][k]) for (p, k), f in zip(rows, failed)]
    _check(runs[0], cfg, scores, failed)
    for other in runs[1:]:
        assert torch.equal(other.group.grads[0], runs[0].group.grads[0])
        assert _numbers(other.row) == _numbers(runs[0].row)


# ------------------------------------------------------------------------------------------ dynamic sampling
def _overlong(length):
    return ref.overlong_reward(length, BUDGET, OVERLONG_BUFFER)


def _dapo_groups(asked, fail, metric):
    """The prompts drawn in order, whether each group holds a failed sample, whether it is varied."""

    def value(p, k):
        shaped = _overlong(len(RESPONSES[p][k])) if metric == "score" else 0.0
        return CORRECT[p][k] + shaped

    prompts = [p for call in asked for p in call]
    failed = [any((p, k) in fail for k in range(N)) for p in prompts]
    varied = [not f and len({value(p, k) for k in range(N)}) > 1 for p, f in zip(prompts, failed)]
    return prompts, failed, varied


def _dapo_varied(asked, fail, metric):
    return sum(_dapo_groups(asked, fail, metric)[2])


def _dapo_pick(asked, fail, metric, wanted):
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2, eq. 11) over the prompts the engines were asked for, in
    order: a group is kept when ``0 < #correct < G`` (``metric=accuracy``) or its summed rewards differ
    (``score``: the verdict plus eq. 13's overlong shaping), none of its samples failed; the first ``wanted`` such
    groups, then tied ones, then failed ones."""
    prompts, failed, varied = _dapo_groups(asked, fail, metric)
    order = [p for p, v in zip(prompts, varied) if v]
    order += [p for p, v, f in zip(prompts, varied, failed) if not v and not f]
    order += [p for p, f in zip(prompts, failed) if f]
    return order[:wanted]


@pytest.mark.parametrize("metric", ["accuracy", "score"])
def test_dynamic_sampling_keeps_groups_varied_on_accuracy_and_never_by_a_placeholder(metric):
    """Dynamic sampling, 2 groups a step: a failed sample never makes its group varied (bug 3: the tied group 7
    with a failure counted as varied, was picked, then dropped: one group trained of the two asked for); with
    ``accuracy`` (the paper's, the default) a group all correct but differing in length is tied (bug 4: the summed
    score, overlong shaping included, counted it varied); ``score`` keeps that reading as a named option."""
    fail = [(7, 0)]  # prompt 7: all wrong, one failure; its placeholder (1, NaN) differs from the others
    picked = []
    for placeholder in PLACEHOLDERS:
        cfg = _config(
            "grpo",
            prompts=2,
            dynamic_sampling=True,
            dynamic_sampling_draws=4,
            dynamic_sampling_metric=metric,
            overlong_buffer=OVERLONG_BUFFER,
        )
        run = _step(cfg, Placeholder(TablePool("drop", fail=fail), placeholder))
        trained = _trained_prompts(run)
        picked.append((trained, _numbers(run.row)))
        want = _dapo_pick(run.engines.asked, set(fail), metric, 2)
        assert sorted(trained) == sorted(want)
        rows = [(p, k) for p in want for k in range(N)]
        verdicts = [float(CORRECT[p][k]) for p, k in rows]
        scores = [v + _overlong(len(RESPONSES[p][k])) for v, (p, k) in zip(verdicts, rows)]
        _check(run, cfg, scores, [False] * 8, rows, verdicts)
        assert run.row["dynamic/varied_groups"] == _dapo_varied(run.engines.asked, set(fail), metric)
        assert run.row.get("failed/rows_out", 0) == 0  # no failed group was picked: two groups trained
        assert run.engines.asked[0] == [7, 5]  # the step's own prompts: the failed group and the long one
    assert all(p == picked[0] for p in picked[1:])


def _trained_prompts(run):
    """The groups the step trained on, from the rows the policy group was given with loss."""
    (per_rank, _, _) = run.group.given
    ids = [row for mb in per_rank[0] for row, mask in zip(mb.input_ids.tolist(), mb.loss_mask.tolist()) if any(mask)]
    found = []
    for row in ids:
        p = next(q for q, prompt in enumerate(PROMPT_IDS) if row[: len(prompt)] == prompt)
        if p not in found:
            found.append(p)
    return found


# ------------------------------------------------------------------------------------------ the pairwise judge
class LongerWins:
    """Judge engines (the ``generate`` signature) whose verdict on each ordered pair is the longer response."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def generate(self, prompt_ids, sampling):
        out = []
        for p in prompt_ids:
            self.calls += 1
            question = self.tokenizer.decode(list(p), skip_special_tokens=True)
            a, b = (len(x.split()) for x in re.search(r"A: (.*)\nB: (.*)\n", question).groups())
            ids = tuple(
                self.tokenizer("A" if a > b else "B" if b > a else "tie", add_special_tokens=False)["input_ids"]
            )
            out.append(Generation(tuple(p), ids, (0.0,) * len(ids), "stop"))
        return out


def _win_rates(lengths):
    """Each response's share of its comparisons with the others of its group won (both orders; a tie is half)."""
    n = len(lengths)
    return [sum(1.0 if a > b else 0.5 if a == b else 0.0 for j, b in enumerate(lengths) if j != i) / (n - 1)
            for i, a in enumerate(lengths)]  # fmt: skip


def test_the_pairwise_judge_ranks_each_group_of_the_rollout_whatever_the_prompt_texts():
    """Every prompt of the step renders to the same text (bug 5: the judge grouped runs of equal adjacent texts, so
    the step's 4 groups became one of 16, every response ranked against the other prompts' too, 240 calls instead of
    48): the rewards are the win rates within each rollout group, and the step trains as the reference says."""
    tokenizer = _judge_tokenizer()
    spec = JudgeSpec(path="/judge", mode="pairwise", template="Question: {prompt}\nA: {response_a}\nB: {response_b}\n")
    engines = LongerWins(tokenizer)
    cfg = _config(
        "grpo", reward=RewardConfig(judge=JudgeConfig(path="/judge", mode="pairwise", template=spec.template))
    )
    same_text = PromptSet(PROMPT_IDS, ["p"] * len(CORRECT), {}, 0, 0)
    run = _step(cfg, judge=LLMJudge(spec, engines, tokenizer, judge_sampling(spec, 1)), prompts=same_text)
    rows = _step_rows(run)
    rates = [r for p in run.plan.step(1).indices for r in _win_rates([len(x) for x in RESPONSES[p]])]
    scores = torch.tensor(rates, dtype=torch.float32).double().tolist()  # a reward is float32 (ScoreResult.total)
    _check(run, cfg, scores, [False] * len(rows), verdicts=[0.5] * len(rows))  # win rates: no accuracy
    assert engines.calls == 4 * N * (N - 1)
