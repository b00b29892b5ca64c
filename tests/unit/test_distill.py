"""On-policy distillation (``algo.teacher.*``) trains what the papers say: one step on a tiny float64 batch through the
run's own path (the config, ``build_objectives``, ``RLTrainer.advantages``, ``PolicyObjective``) against a
plain-PyTorch reference written here, one sample at a time, without the project's functions:

* reward mode (Thinking Machines 2025; GKD's on-policy reverse KL as a reward): token rewards
  ``r_t = -coef k(log pi_old - log nu)_t`` plus the score at the last response token, then the estimator;
* loss mode: each response token's loss ``+ coef k(log pi - log nu)_t`` (``k2``: the reverse KL's gradient),
  aggregated with the policy loss.

Neither is bounded to +-10 as the KL to the reference is (a token far from the teacher keeps its full value). Also:
the refusals by key, the dry-run line, and the tokenizer check.
"""

from __future__ import annotations

import itertools
import json
import shutil
from types import SimpleNamespace

import pytest
import rl_reference_math as ref
import torch
from shared_helpers import padded_rows, tiny_float64_policy

from rlhf.batch import Batch
from rlhf.config.rl_schema import AlgorithmConfig, RewardConfig, RLRunConfig, RolloutConfig, TeacherConfig
from rlhf.config.schema import ConfigError, DataConfig, ModelConfig, TrainConfig
from rlhf.data.vocab import check_same_tokenizer
from rlhf.trainers.online.checks import describe_distillation
from rlhf.trainers.online.runner import build_objectives
from rlhf.trainers.online.steps import RLTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, TEMPERATURE, COEF = 64, 0.7, 0.4
LENGTHS = [(3, 5), (2, 2), (4, 6), (1, 3), (3, 4), (2, 7)]  # (prompt, response) per row
GROUPS = [1, 0, 1, 0, 0, 1]
SCORES = [0.875, -0.375, 0.125, 1.25, 0.25, -1.125]
FAR = (2, 1, 14.0)  # (row, response position, log nu - log pi_old): k3 = e^14, beyond the reference KL's +-10 bound


def _config(estimator, mode, kl_estimator="auto", agg="auto", functions=("r.py:f",)) -> RLRunConfig:
    return RLRunConfig(
        model=ModelConfig(path="model"),
        data=DataConfig(train_path="prompts.jsonl"),
        train=TrainConfig(global_batch_size=len(LENGTHS), micro_batch_size=len(LENGTHS)),
        rollout=RolloutConfig(prompts_per_step=2, n_samples_per_prompt=3, max_new_tokens=8, temperature=TEMPERATURE),
        reward=RewardConfig(functions=functions),
        algo=AlgorithmConfig(
            advantage_estimator=estimator,
            loss_agg_mode=agg,
            teacher=TeacherConfig(path="teacher", mode=mode, coef=COEF, estimator=kl_estimator),
        ),
    )


def _spans():
    return [range(p, p + r) for p, r in LENGTHS]


def _samples(ids):
    return [(ids[i, :p].tolist(), ids[i, p : p + r].tolist()) for i, (p, r) in enumerate(LENGTHS)]


def _ragged(x):
    return [x[i, s] for i, s in enumerate(_spans())]


@pytest.fixture(scope="module")
def policy():
    return tiny_float64_policy(VOCAB)


@pytest.fixture(scope="module")
def problem(policy):
    """The rollout batch with pi_old, the teacher's log-probs and values as data (float64)."""
    gen = torch.Generator().manual_seed(11)
    ids, attn, loss_mask = padded_rows(LENGTHS, VOCAB, gen)
    now = ref.padded_logps(policy, ids, LENGTHS, TEMPERATURE)
    old = (now + 0.3 * torch.randn(ids.shape, generator=gen, dtype=torch.float64)) * loss_mask
    teacher = (old + torch.randn(ids.shape, generator=gen, dtype=torch.float64)) * loss_mask
    row, pos, shift = FAR
    teacher[row, LENGTHS[row][0] + pos] = old[row, LENGTHS[row][0] + pos] + shift
    teacher = teacher + 99.0 * (1 - loss_mask)  # padding and prompts hold garbage: it must reach nothing
    values = torch.randn(ids.shape, generator=gen, dtype=torch.float64) * loss_mask
    batch = Batch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=loss_mask,
        old_logps=old,
        teacher_logps=teacher,
        values=values,
    )
    return SimpleNamespace(batch=batch, old=old, teacher=teacher, values=values)


def _divergence(estimator, logp, teacher):
    """Schulman's k1 / k2 / k3 of ``x = log pi - log nu``, unbounded."""
    x = logp - teacher
    return {"k1": x, "k2": 0.5 * x * x, "k3": torch.exp(-x) - 1 + x}[estimator]


def _reference_advantages(name, estimator, p):
    scores = list(SCORES)
    if name == "reinforce_pp_baseline":
        scores = [
            s - sum(SCORES[j] for j in range(len(SCORES)) if GROUPS[j] == g) / GROUPS.count(g)
            for s, g in zip(SCORES, GROUPS)
        ]
    penalty = [_divergence(estimator, o, t) for o, t in zip(_ragged(p.old), _ragged(p.teacher))]
    rewards = ref.token_rewards(scores, penalty, COEF)
    if name == "gae":
        return ref.gae(rewards, _ragged(p.values), 1.0, 1.0)[0]
    return ref.whiten_all(ref.discounted_returns(rewards, 1.0))


@pytest.mark.parametrize(
    "estimator, kl_estimator",
    list(itertools.product(("reinforce_pp", "reinforce_pp_baseline", "gae"), ("auto", "k2", "k3"))),
    ids="-".join,
)
def test_reward_mode_matches_the_token_rewards_of_the_paper(problem, estimator, kl_estimator):
    cfg = _config(estimator, "reward", kl_estimator)
    batch, stats = RLTrainer.advantages(SimpleNamespace(cfg=cfg), problem.batch, torch.tensor(SCORES), GROUPS)
    name = "k1" if kl_estimator == "auto" else kl_estimator
    expected = _reference_advantages(estimator, name, problem)
    for i, s in enumerate(_spans()):
        torch.testing.assert_close(batch.advantages[i, s], expected[i], rtol=1e-12, atol=1e-12)
    tokens = sum(r for _, r in LENGTHS)
    k1 = torch.cat([o - t for o, t in zip(_ragged(problem.old), _ragged(problem.teacher))])
    penalty = torch.cat([_divergence(name, o, t) for o, t in zip(_ragged(problem.old), _ragged(problem.teacher))])
    assert stats["distill/teacher_kl"] == pytest.approx(float(k1.sum()) / tokens, rel=1e-12)
    assert stats["distill/reward_penalty"] == pytest.approx(COEF * float(penalty.sum()) / tokens, rel=1e-12)


@pytest.mark.parametrize(
    "estimator, kl_estimator, agg",
    list(
        itertools.product(
            ("grpo", "rloo", "reinforce_pp"), ("auto", "k3"), ("auto", "token-mean", "seq-mean-token-sum-norm")
        )
    ),
    ids="-".join,
)
def test_loss_mode_adds_the_teacher_kl_to_each_tokens_loss(policy, problem, estimator, kl_estimator, agg):
    cfg = _config(estimator, "loss", kl_estimator, agg)
    batch, _ = RLTrainer.advantages(SimpleNamespace(cfg=cfg), problem.batch, torch.tensor(SCORES), GROUPS)
    objective, _ = build_objectives(cfg)
    name = "k2" if kl_estimator == "auto" else kl_estimator
    logps, _ = ref.logps_and_entropy(policy, _samples(problem.batch.input_ids), TEMPERATURE)
    per_row, distill = [], []
    for lp, old, adv, t in zip(logps, _ragged(problem.old), _ragged(batch.advantages), _ragged(problem.teacher)):
        loss, _ = ref.ppo_token_loss(lp, old, adv, 0.2, 0.2)
        d = _divergence(name, lp, t)
        per_row.append(loss + COEF * d)
        distill.append(d.detach())
    expected = ref.aggregate(cfg.algo.aggregation, per_row, cfg.max_response_tokens)
    metrics = ref.objective_metrics_matching(policy, objective, batch, expected)
    reported = ref.aggregate(cfg.algo.aggregation, distill, cfg.max_response_tokens)
    assert metrics["distill"] == pytest.approx(float(reported), rel=1e-11)


def test_a_far_token_keeps_its_whole_divergence(problem):
    """The reference KL's +-10 bound would cut the far token's k3 (e^14); distillation keeps it."""
    row, pos, _ = FAR
    cfg = _config("reinforce_pp", "reward", "k3")
    _, stats = RLTrainer.advantages(SimpleNamespace(cfg=cfg), problem.batch, torch.tensor(SCORES), GROUPS)
    assert stats["distill/reward_penalty"] * sum(r for _, r in LENGTHS) > COEF * 1e5


def test_refusals_name_their_keys():
    with pytest.raises(ConfigError, match=r"^algo\.teacher\.mode \(reward\) .*advantage_estimator=grpo"):
        _config("grpo", "reward")
    with pytest.raises(ConfigError, match=r"^algo\.teacher\.estimator: k1 has no gradient"):
        _config("grpo", "loss", "k1")
    with pytest.raises(ConfigError, match=r"^algo\.teacher\.coef must be > 0"):
        TeacherConfig(path="t", coef=0.0)
    with pytest.raises(ConfigError, match=r"^algo\.teacher\.mode must be one of"):
        TeacherConfig(path="t", mode="both")
    with pytest.raises(ConfigError, match=r"^reward\.functions is required unless .*algo\.teacher\.path"):
        RLRunConfig(model=ModelConfig(path="m"), data=DataConfig(train_path="p.jsonl"))
    alone = _config("grpo", "loss", functions=())
    assert alone.distills_alone and "alone (no task reward)" in describe_distillation(alone)
    line = describe_distillation(_config("reinforce_pp", "reward"))
    assert "(k1), -0.4 x it in the token rewards, read by reinforce_pp; with the task reward" in line


def test_the_teacher_is_a_model_key_of_the_run():
    """Pinned like every model (a hub id becomes org/name@sha), checked with them (sequence-parallel heads)."""
    from rlhf.hub import config_value, with_value
    from rlhf.trainers.online.runner import PPO

    assert "algo.teacher.path" in PPO.model_keys
    cfg = _config("grpo", "loss")
    pinned = with_value(cfg, "algo.teacher.path", "org/teacher@" + "0" * 40)
    assert config_value(pinned, "algo.teacher.path") == "org/teacher@" + "0" * 40
    assert (
        pinned.algo.teacher.mode == "loss" and pinned.algo.advantage_estimator == "grpo" and pinned.model == cfg.model
    )


def test_a_teacher_reading_ids_otherwise_is_refused(tiny_model, tmp_path):
    assert check_same_tokenizer(tiny_model, tiny_model, "algo.teacher.path") > 0
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    tokenizer_json = other / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    tokenizer_json.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"^algo\.teacher\.path: the tokenizer of .* reads id {vocab[b]} as"):
        check_same_tokenizer(tiny_model, str(other), "algo.teacher.path")
