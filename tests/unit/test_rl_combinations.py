"""Every (advantage estimator x policy loss x kl_mode x kl_estimator x loss aggregation) the config accepts trains what
its papers say: one step on a tiny float64 batch, through the run's own path (the config,
``rlhf.trainers.online.runner.build_objectives``, ``RLTrainer.advantages``, ``PolicyObjective``), against a
plain-PyTorch reference written here from the papers, without any of the project's functions. A combination the config
refuses must be one the maths does not support.

The reference is ``tests/rl_reference_math.py`` (ragged, one sample at a time, no ``rlhf`` import), per row ``i``
with response tokens ``t`` (columns of ``input_ids``; log-probs at column ``t`` are of ``softmax(logits[t - 1] / T)``):

* KL estimators (Schulman 2020): ``k1 = x``, ``k2 = x^2 / 2``, ``k3 = e^-x + x - 1`` with ``x = log pi - log ref``,
  each token's value clamped to [-10, 10] (the documented bound, OpenRLHF's and verl's).
* KL in the reward: ``r_t = -beta k(old, ref)_t`` plus the score at the last response token (Ziegler et al. 2019),
  for estimators that read token rewards; ``s_i - beta sum_t k_t`` (the sequence-level KL reward of Ahmadian et al.
  2024) for those that read sequence scores.
* GRPO (DeepSeekMath 4.1.2): ``(s - mean_g) / (std_g + 1e-6)``, unbiased std; Dr. GRPO (Liu et al. 2025):
  ``s - mean_g``; RLOO (Ahmadian et al. 2024 eq. 6): ``s - mean of the others``; REINFORCE++ (Hu 2025): the
  return-to-go, whitened over every response token of the batch (population variance, eps 1e-8); its baseline form
  subtracts the group mean score at the last token first; GAE (Schulman et al. 2016 eq. 16).
* PPO clip (Schulman et al. 2017 eq. 7) on ``exp(log pi - log pi_old)`` with 0.2; GSPO (Zheng et al. 2025, eq.
  13-14, GSPO-token) on ``sg[s_i] pi_t / sg[pi_t]``, ``s_i = exp(mean_t log(pi / pi_old))``, clipped at its paper's
  3e-4 / 4e-4; CISPO (Chen et al. 2025, sec. 3.1) ``-sg(clip(r, 0, 6)) A log pi``; SAPO (Gao et al. 2025)
  ``-(4 / tau) sigmoid(tau (r - 1)) A`` with tau 1 where ``A > 0``, 1.05 elsewhere.
* Per token: policy loss ``+ beta k(pi, ref)`` (KL as a loss) ``- c H``; aggregated over the batch as each mode's
  definition (``-norm``: token sums over the generation budget ``L``).
"""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import rl_reference_math as ref
import torch
from shared_helpers import padded_rows, tiny_float64_policy

from rlhf.batch import Batch
from rlhf.config.rl_schema import AlgorithmConfig, RewardConfig, RLRunConfig, RolloutConfig
from rlhf.config.schema import ConfigError, DataConfig, ModelConfig, TrainConfig
from rlhf.ops.advantages import ADVANTAGE_ESTIMATORS
from rlhf.ops.aggregation import LOSS_AGGREGATIONS
from rlhf.ops.kl import KL_ESTIMATORS
from rlhf.ops.policy_loss import POLICY_LOSSES
from rlhf.trainers.online.runner import build_objectives
from rlhf.trainers.online.steps import RLTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, TEMPERATURE, KL_COEF, ENTROPY_COEF, BUDGET = 64, 0.7, 0.3, 0.01, 8
LENGTHS = [(3, 5), (2, 2), (4, 6), (1, 3), (3, 4), (2, 7)]  # (prompt, response) per row
GROUPS = [1, 0, 1, 0, 0, 1]  # each sample's prompt: two groups of three, interleaved
SCORES = [0.875, -0.375, 0.125, 1.25, 0.25, -1.125]  # exact in float32 (the trainer's scores are float32)
# Tokens whose log-ratio to the reference is extreme (row, response position, log ref - log old): the bound matters.
FAR_TOKENS = [(2, 1, -40.0), (5, 3, 25.0)]
# Each loss's paper's clip range, or SAPO's gate temperatures: Schulman et al. 2017; Zheng et al. 2025 sec. 5.1;
# CISPO: no lower bound, the weight capped at 1 + 5; SAPO: tau 1.0 for A > 0, 1.05 for A < 0
PAPER_TRUST = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 5.0), "sapo": (1.0, 1.05)}
KL_MODES = ("loss", "reward")


def _combinations():
    return list(
        itertools.product(
            ADVANTAGE_ESTIMATORS.names(),
            POLICY_LOSSES.names(),
            KL_MODES,
            KL_ESTIMATORS.names(),
            LOSS_AGGREGATIONS.names(),
        )
    )


def _config(estimator, loss, kl_mode, kl_estimator, agg) -> RLRunConfig:
    return RLRunConfig(
        model=ModelConfig(path="model"),
        data=DataConfig(train_path="prompts.jsonl"),
        train=TrainConfig(global_batch_size=len(LENGTHS), micro_batch_size=len(LENGTHS)),
        rollout=RolloutConfig(
            prompts_per_step=2, n_samples_per_prompt=3, max_new_tokens=BUDGET, temperature=TEMPERATURE
        ),
        reward=RewardConfig(functions=("r.py:f",)),
        algo=AlgorithmConfig(
            advantage_estimator=estimator,
            policy_loss=loss,
            kl_mode=kl_mode,
            kl_estimator=kl_estimator,
            kl_coef=KL_COEF,
            entropy_coef=ENTROPY_COEF,
            loss_agg_mode=agg,
        ),
    )


# ------------------------------------------------------------------------------------------ the tiny problem
@pytest.fixture(scope="module")
def policy():
    return tiny_float64_policy(VOCAB)


def _spans():
    return [range(p, p + r) for p, r in LENGTHS]


@pytest.fixture(scope="module")
def problem(policy):
    """The rollout batch with pi_old, reference log-probs and values as data (float64)."""
    gen = torch.Generator().manual_seed(7)
    ids, attn, loss_mask = padded_rows(LENGTHS, VOCAB, gen)
    now = ref.padded_logps(policy, ids, LENGTHS, TEMPERATURE)
    noise = 0.3 * torch.randn(ids.shape, generator=gen, dtype=torch.float64)
    noise[0] = 0.0  # row 0's ratio is exactly 1: GSPO's tiny clip range leaves it a gradient
    old = (now + noise) * loss_mask
    ref_logps = (old + 0.2 * torch.randn(ids.shape, generator=gen, dtype=torch.float64)) * loss_mask
    for row, pos, shift in FAR_TOKENS:
        ref_logps[row, LENGTHS[row][0] + pos] = old[row, LENGTHS[row][0] + pos] + shift
    values = torch.randn(ids.shape, generator=gen, dtype=torch.float64) * loss_mask
    batch = Batch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=loss_mask,
        sample_index=torch.arange(len(LENGTHS)),
        old_logps=old,
        ref_logps=ref_logps,
        values=values,
    )
    return SimpleNamespace(batch=batch, old=old, ref=ref_logps, values=values)


# ------------------------------------------------------------------------------------------ the reference
def _samples(ids):
    """``(prompt ids, response ids)`` per row: what the reference scores, one unpadded sequence at a time."""
    return [(ids[i, :p].tolist(), ids[i, p : p + r].tolist()) for i, (p, r) in enumerate(LENGTHS)]


def _ragged(x, spans):
    return [x[i, s] for i, s in enumerate(spans)]


def _reference_advantages(name, kl_mode, kl_estimator, p):
    """Per row: ``(advantages, returns)`` over its response tokens, and the mean reward penalty per token."""
    spans, lengths = _spans(), [len(s) for s in _spans()]
    kl_old = [ref.kl(kl_estimator, o, r) for o, r in zip(_ragged(p.old, spans), _ragged(p.ref, spans))]
    coef = KL_COEF if kl_mode == "reward" else 0.0
    mean_penalty = float(coef * torch.cat(kl_old).sum() / sum(lengths))
    if name in ("grpo", "dr_grpo", "rloo"):  # sequence scores: the KL penalty summed over the response
        scores = [s - coef * float(k.sum()) for s, k in zip(SCORES, kl_old)]
        adv = ref.group_advantages(name, scores, GROUPS, lengths)
        return adv, adv, mean_penalty
    scores = list(SCORES)
    if name == "reinforce_pp_baseline":  # the group's mean score as a baseline, at the last token
        scores = [
            s - sum(SCORES[j] for j in range(len(SCORES)) if GROUPS[j] == g) / GROUPS.count(g)
            for s, g in zip(SCORES, GROUPS)
        ]
    rewards = ref.token_rewards(scores, kl_old, coef)
    if name in ("reinforce_pp", "reinforce_pp_baseline"):
        returns = ref.discounted_returns(rewards, 1.0)
        return ref.whiten_all(returns), returns, mean_penalty
    assert name == "gae", name  # gamma = lambda = 1 (the defaults)
    adv, ret = ref.gae(rewards, _ragged(p.values, spans), 1.0, 1.0)
    return adv, ret, mean_penalty


def _reference_loss(model, combo, p, advantages):
    estimator, loss_name, kl_mode, kl_estimator, agg = combo
    spans = _spans()
    logps, entropy = ref.logps_and_entropy(model, _samples(p.batch.input_ids), TEMPERATURE)
    per_row = []
    for lp, old, adv, h, r in zip(logps, _ragged(p.old, spans), advantages, entropy, _ragged(p.ref, spans)):
        loss = ref.policy_token_loss(loss_name, lp, old, adv, PAPER_TRUST[loss_name])
        if kl_mode == "loss":
            loss = loss + KL_COEF * ref.kl(kl_estimator, lp, r)
        per_row.append(loss - ENTROPY_COEF * h)
    return ref.aggregate(agg, per_row, BUDGET)


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([q.grad.reshape(-1) for q in model.parameters() if q.grad is not None])


# ------------------------------------------------------------------------------------------ the tests
def _refused(kl_mode, kl_estimator) -> bool:
    """What the maths does not support: a k1 KL loss (zero gradient in expectation, Tang & Munos 2025)."""
    return kl_mode == "loss" and kl_estimator == "k1"


@pytest.mark.parametrize("combo", _combinations(), ids="-".join)
def test_one_step_matches_the_papers(policy, problem, combo):
    estimator, loss_name, kl_mode, kl_estimator, agg = combo
    if _refused(kl_mode, kl_estimator):
        with pytest.raises(ConfigError, match=r"^algo\.kl_estimator .*kl_mode=loss"):
            _config(*combo)
        return
    cfg = _config(*combo)
    batch, stats = RLTrainer.advantages(SimpleNamespace(cfg=cfg), problem.batch, torch.tensor(SCORES), GROUPS)
    objective, _ = build_objectives(cfg)

    advantages, returns, penalty = _reference_advantages(estimator, kl_mode, kl_estimator, problem)
    for i, s in enumerate(_spans()):
        torch.testing.assert_close(batch.advantages[i, s], advantages[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(batch.returns[i, s], returns[i], rtol=1e-12, atol=1e-12)
    assert stats["reward_kl_penalty"] == pytest.approx(penalty, rel=1e-12, abs=1e-15)

    total, _ = objective.loss(policy, batch)
    ours = total / objective.count(batch)
    expected = _reference_loss(policy, combo, problem, advantages)
    assert float(ours.detach()) == pytest.approx(float(expected.detach()), rel=1e-11, abs=1e-13)
    ours_grad, expected_grad = _grads(policy, ours), _grads(policy, expected)
    assert float(expected_grad.norm()) > 1e-6  # the step moves the policy
    assert float((ours_grad - expected_grad).norm()) <= 1e-10 * float(expected_grad.norm())


def test_the_sweep_exercises_what_it_claims(policy, problem):
    """The problem is built so that each fixed bug would show: the reward KL moves GRPO's advantages, the KL bound
    binds, GSPO's paper clip binds on some rows and not on row 0, and PPO's clip binds on some tokens."""
    no_kl, _, _ = _reference_advantages("grpo", "loss", "k3", problem)
    with_kl, _, _ = _reference_advantages("grpo", "reward", "k3", problem)
    assert max(float((a - b).abs().max()) for a, b in zip(no_kl, with_kl)) > 0.1
    spans = _spans()
    raw = [(problem.old[i, s] - problem.ref[i, s]).abs() for i, s in enumerate(spans)]
    assert max(float(x.max()) for x in raw) > 20  # values beyond the bound (k3 ~ e^25 unbounded)
    with torch.no_grad():
        now, _ = ref.logps_and_entropy(policy, _samples(problem.batch.input_ids), TEMPERATURE)
    seq = [float(torch.exp((lp - old).mean())) for lp, old in zip(now, _ragged(problem.old, spans))]
    assert seq[0] == pytest.approx(1.0, abs=1e-12)
    assert sum(not (1 - 3e-4 <= x <= 1 + 4e-4) for x in seq) >= 3
    token = torch.cat([torch.exp(lp - old) for lp, old in zip(now, _ragged(problem.old, spans))])
    assert 0 < int(((token < 0.8) | (token > 1.2)).sum()) < len(token)


def test_refused_combinations_name_their_keys():
    """Exactly the combinations the maths does not support are refused, each error naming the keys."""
    refused = []
    for combo in _combinations():
        try:
            _config(*combo)
        except ConfigError as exc:
            refused.append(combo)
            assert str(exc).startswith("algo.kl_estimator ") and "algo.kl_mode=loss" in str(exc)
    assert refused == [c for c in _combinations() if _refused(c[2], c[3])]
    for key, kwargs in (("algo.dual_clip", {"dual_clip": 2.0}), ("algo.tis_cap", {"tis_cap": 2.0})):
        with pytest.raises(ConfigError, match=rf"^{key} .*'gspo'"):
            AlgorithmConfig(policy_loss="gspo", **kwargs)
        AlgorithmConfig(policy_loss="ppo", **kwargs)  # the token-level loss takes them
    # CISPO takes the behaviour corrections (a weight on each token's loss) but has no surrogate for dual clip to bound
    with pytest.raises(ConfigError, match=r"^algo\.dual_clip is 2, which policy loss 'cispo' .* no clipped surrogate"):
        AlgorithmConfig(policy_loss="cispo", dual_clip=2.0)
    AlgorithmConfig(policy_loss="cispo", tis_cap=2.0)
    AlgorithmConfig(policy_loss="cispo", off_policy_correction="icepop")
    AlgorithmConfig(policy_loss="sapo", tis_cap=2.0)
    with pytest.raises(ConfigError, match=r"^algo\.dual_clip is 2, which policy loss 'sapo' .* soft gate bounds"):
        AlgorithmConfig(policy_loss="sapo", dual_clip=2.0)


@pytest.mark.parametrize(
    "kwargs, key, message",
    [
        ({"policy_loss": "sapo", "clip_high": 0.28}, "algo.clip_high", "policy loss sapo clips nothing"),
        ({"policy_loss": "sapo", "clip_low": 0.2}, "algo.clip_low", "policy loss sapo clips nothing"),
        ({"policy_loss": "ppo", "gate_tau_pos": 1.0}, "algo.gate_tau_pos", "policy loss ppo has no soft gate"),
        ({"policy_loss": "cispo", "gate_tau_neg": 1.0}, "algo.gate_tau_neg", "policy loss cispo has no soft gate"),
        ({"policy_loss": "sapo", "gate_tau_neg": 0.0}, "algo.gate_tau_neg", "must be > 0"),
        ({"policy_loss": "ppo", "clip_low": 1.5}, "algo.clip_low", r"must be in \[0, 1\]"),
    ],
)
def test_a_trust_region_key_the_loss_has_no_use_for_is_refused(kwargs, key, message):
    with pytest.raises(ConfigError, match=rf"^{key} .*{message}"):
        AlgorithmConfig(**kwargs)


def test_the_run_says_which_clip_range_or_gate_it_trains_with():
    assert (
        AlgorithmConfig().describe_clip() == "ratio in [1 - 0.2, 1 + 0.2] (the paper's; algo.clip_low/clip_high unset)"
    )
    assert AlgorithmConfig(policy_loss="gspo", clip_high=0.01).describe_clip() == (
        "ratio in [1 - 0.0003, 1 + 0.01] (the paper's is 0.0003 / 0.0004)"
    )
    assert AlgorithmConfig(policy_loss="sapo").describe_clip() == (
        "soft gate, tau 1 (A > 0) / 1.05 (A < 0) (the paper's; algo.gate_tau_pos/gate_tau_neg unset)"
    )
    sapo = AlgorithmConfig(policy_loss="sapo", gate_tau_neg=2.0)
    assert sapo.clip is None and sapo.gate_taus == (1.0, 2.0)
    assert sapo.describe_clip() == "soft gate, tau 1 (A > 0) / 2 (A < 0) (the paper's is 1 / 1.05)"
    cfg = _config("grpo", "sapo", "loss", "k3", "token-mean")
    objective, _ = build_objectives(dataclasses.replace(cfg, algo=sapo))
    assert (objective.loss_type, objective.clip.gate_tau_pos, objective.clip.gate_tau_neg) == ("sapo", 1.0, 2.0)
