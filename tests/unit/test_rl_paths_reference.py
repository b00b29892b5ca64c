"""The off-policy and shaping paths of RL train what their papers say: one step on a tiny float64 batch, through the
run's own path (the config, ``rlhf.trainers.online.runner.build_objectives``, ``StepScoring.score`` / ``turn_credit`` /
``advantages`` / ``_partial``, ``PolicyObjective``), against the plain-PyTorch reference of
``tests/rl_reference_math.py`` (ragged, one sample at a time, no ``rlhf`` import): advantages to 1e-12, the loss to
1e-11, its gradient to 1e-10 relative.

* Behaviour corrections on ``rho_t = pi_prox(y_t) / pi_behav(y_t)`` (``algo.off_policy_correction``, ``algo.tis_cap``,
  ``algo.off_policy_low`` / ``off_policy_high``), each with its default bounds and with bounds set: TIS (Yao et al.
  2025) ``min(rho, high)``; MIS (Liu et al. 2025) ``rho``, 0 above ``high``; IcePop (Ling Team 2025, Ring-1T)
  ``rho``, 0 outside ``[low, high]``; sequence masking (verl's geometric rejection) 1, or 0 on a whole sequence whose
  ``exp(mean_t log rho_t)`` leaves ``[low, high]``; a masked token keeps its place in every aggregation's denominator.
  Each weights PPO's clipped surrogate of ``pi / pi_prox`` (decoupled PPO, Hilton et al. 2022; their untruncated
  weight is TIS with an unreachable cap), never the KL loss or the entropy bonus. GSPO refuses them all.
* Asynchronous RL, ``rollout.max_staleness = k`` in {1, 2}: step ``t`` trains on samples that version
  ``t - 1 - k`` generated (their ``rollout_logps``: an older model's, in float32 as the engines report them), with
  ``old_logps`` the proximal policy, version ``t - 1``; at the step's first update (the trained weights are the
  proximal ones) and at a later one (they moved).
* Partial rollouts: each response's first ``c`` tokens sampled by version ``v``, the rest by ``v + 1``, through the
  trainer's own ``_partial`` with stand-in engines; every token weighted by its own version's ratio.
* Per-turn credit (``algo.turn_credit=turn``) for ``reinforce_pp``, ``reinforce_pp_baseline`` and ``gae`` on episodes
  with observation holes (docs/algorithms/multi_turn.md): each turn's ``env.reward_weight x reward`` at its last
  policy token, the rest of the score at the last one, discounting over policy tokens only.
* DAPO's overlong shaping (Yu et al. 2025, eq. 13) in ``StepScoring.score``, then through every estimator.
"""

from __future__ import annotations

import copy
import itertools
import math
from types import SimpleNamespace

import pytest
import rl_reference_math as ref
import torch
from shared_helpers import tiny_float64_policy

from rlhf.batch import Batch
from rlhf.config.rl_schema import AlgorithmConfig, EnvConfig, RewardConfig, RLRunConfig, RolloutConfig
from rlhf.config.schema import ConfigError, DataConfig, ModelConfig, TrainConfig
from rlhf.data.plan import EpochPlan, StepPlan
from rlhf.ops.advantages import ADVANTAGE_ESTIMATORS
from rlhf.ops.aggregation import LOSS_AGGREGATIONS
from rlhf.ops.dapo import overlong_penalty
from rlhf.rewards.scoring import reward_scorers
from rlhf.rl import Episode, episodes_batch, turn_reward_tokens
from rlhf.rollout.prompts import PromptSet
from rlhf.rollout.sources import Rollout
from rlhf.rollout.types import Generation
from rlhf.trainers.online.runner import build_objectives
from rlhf.trainers.online.schedule import behaviour_version
from rlhf.trainers.online.scoring import StepScoring, reward_sources
from rlhf.trainers.online.steps import RLActors, RLTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, TEMPERATURE, KL_COEF, ENTROPY_COEF, BUDGET = 64, 0.7, 0.3, 0.01, 8
PPO_CLIP, GSPO_CLIP = (0.2, 0.2), (3e-4, 4e-4)  # Schulman et al. 2017; Zheng et al. 2025 sec. 5.1
CISPO_CLIP = (1.0, 5.0)  # no lower bound, the weight capped at 6
SAPO_TAUS = (1.0, 1.05)  # Gao et al. 2025: the gate's temperatures for A > 0, A < 0
PROMPT_LENGTHS = (3, 2)  # one prompt per group
RESPONSE_LENGTHS = (5, 2, 6, 3, 4, 7)
GROUPS = [0, 0, 0, 1, 1, 1]  # a prompt's samples are consecutive, as a rollout lays them out
SCORES = [0.875, -0.375, 0.125, 1.25, 0.25, -1.125]  # exact in float32 (the trainer's scores are float32)

# Behaviour log-ratios log rho per response token, chosen against every bound below (none within 1e-6 of one).
# Tokens: rho from 0.3 to 6 on rows 0, 2 and 5; rows 1, 3 and 4 within 0.5% of 1. Geometric means: row 0 ~0.92,
# row 1 1.0001, row 2 ~1.33, row 3 1.002, row 4 0.9985, row 5 ~1.29.
LOG_RHO = [
    [math.log(x) for x in (0.3, 0.6, 1.0, 1.5, 2.5)],
    [4e-4, -2e-4],
    [math.log(x) for x in (6.0, 0.4, 1.2, 0.9, 3.0, 0.7)],
    [3e-3, 2e-3, 1e-3],
    [-2e-3, -3e-3, 0.0, -1e-3],
    [math.log(x) for x in (1.8, 5.5, 0.45, 1.0, 0.55, 2.2, 1.1)],
]
# name -> (the config's algo keys, the reference's (correction, low, high); None: the paper's default)
CORRECTIONS = {
    "tis": ({"off_policy_correction": "tis"}, ("tis", None, None)),
    "tis-1.6": ({"off_policy_correction": "tis", "off_policy_high": 1.6}, ("tis", None, 1.6)),
    "tis_cap-1.6": ({"tis_cap": 1.6}, ("tis", None, 1.6)),  # the shorthand
    "hilton": ({"off_policy_correction": "tis", "off_policy_high": 1e6}, ("tis", None, 1e6)),  # untruncated rho
    "mis": ({"off_policy_correction": "mis"}, ("mis", None, None)),
    "mis-1.6": ({"off_policy_correction": "mis", "off_policy_high": 1.6}, ("mis", None, 1.6)),
    "icepop": ({"off_policy_correction": "icepop"}, ("icepop", None, None)),
    "icepop-0.65-2.4": (
        {"off_policy_correction": "icepop", "off_policy_low": 0.65, "off_policy_high": 2.4},
        ("icepop", 0.65, 2.4),
    ),
    "seq_mask": ({"off_policy_correction": "seq_mask"}, ("seq_mask", None, None)),
    "seq_mask-0.95-1.1": (
        {"off_policy_correction": "seq_mask", "off_policy_low": 0.95, "off_policy_high": 1.1},
        ("seq_mask", 0.95, 1.1),
    ),
}
# Stale samples drift further than an engine mismatch: seq_mask's bounds widened, as docs/algorithms/async.md says.
STALE_CORRECTIONS = {
    "none": ({}, (None, None, None)),
    "tis": CORRECTIONS["tis"],
    "mis": CORRECTIONS["mis"],
    "icepop": CORRECTIONS["icepop"],
    "seq_mask-0.8-1.25": (
        {"off_policy_correction": "seq_mask", "off_policy_low": 0.8, "off_policy_high": 1.25},
        ("seq_mask", 0.8, 1.25),
    ),
}
STEP = 4  # the RL step trained on: the proximal policy is version STEP - 1 (the weights when it starts)
VERSION_SCALE, MOVED_SCALE = 0.05, 0.01  # weight noise of one RL update, and of an optimizer step within one
FIRST_TOKENS = 3  # rollout.partial_rollout_tokens


def _config(*, rollout=None, env=None, **algo) -> RLRunConfig:
    base = {
        "prompts_per_step": 2,
        "n_samples_per_prompt": 3,
        "max_new_tokens": BUDGET,
        "temperature": TEMPERATURE,
    }
    return RLRunConfig(
        model=ModelConfig(path="model"),
        data=DataConfig(train_path="prompts.jsonl"),
        train=TrainConfig(global_batch_size=6, micro_batch_size=6),
        rollout=RolloutConfig(**{**base, **(rollout or {})}),
        reward=RewardConfig(functions=("r.py:f",)),
        env=EnvConfig(**(env or {})),
        algo=AlgorithmConfig(**algo),
    )


# ------------------------------------------------------------------------------------------ the tiny problems
def _layout(prompt_lengths, response_lengths, groups, seed):
    """Right-padded rows ``prompt + response`` (ids in 1 .. VOCAB - 1, pad 0), the prompt shared by its group; the
    ``(prompt, response)`` samples the reference scores one at a time, and each row's response columns."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in prompt_lengths]
    samples = [
        (prompts[g], torch.randint(1, VOCAB, (r,), generator=gen).tolist()) for g, r in zip(groups, response_lengths)
    ]
    width = max(len(p) + len(r) for p, r in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(samples):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        mask[i, len(p) : len(p) + len(r)] = 1
    spans = [range(len(p), len(p) + len(r)) for p, r in samples]
    return SimpleNamespace(prompts=prompts, samples=samples, ids=ids, attn=attn, mask=mask, spans=spans)


def _place(ragged, spans, width):
    out = torch.zeros(len(spans), width, dtype=torch.float64)
    for i, s in enumerate(spans):
        out[i, list(s)] = ragged[i].detach().double()
    return out


def _layout_batch(layout, **ragged):
    """The layout's padded rows, each ``ragged`` per-token field (one ``(R_i,)`` tensor a row) placed on its span."""
    width = layout.ids.shape[1]
    return Batch(
        input_ids=layout.ids,
        attention_mask=layout.attn,
        loss_mask=layout.mask,
        sample_index=torch.arange(len(layout.spans)),
        **{name: _place(values, layout.spans, width) for name, values in ragged.items()},
    )


def _ragged(x, spans):
    return [x[i, list(s)] for i, s in enumerate(spans)]


def _noise(gen, lengths, scale):
    return [scale * torch.randn(n, generator=gen, dtype=torch.float64) for n in lengths]


def _perturbed(model, scale, seed):
    """A copy of ``model`` with Gaussian noise of std ``scale`` on every weight: another version of the policy."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return out


def _logps(model, samples):
    with torch.no_grad():
        return ref.logps_and_entropy(model, samples, TEMPERATURE)[0]


@pytest.fixture(scope="module")
def policy():
    return tiny_float64_policy(VOCAB)


@pytest.fixture(scope="module")
def versions(policy):
    """The policy's weight versions: ``STEP - 1`` is the proximal (the trained model), each earlier one an RL update
    older; and ``moved``, the proximal after an optimizer step of the RL step (the ratio to the proximal leaves 1)."""
    older = _perturbed(policy, VERSION_SCALE, 1)
    return SimpleNamespace(
        by_version={STEP - 1: policy, STEP - 2: older, STEP - 3: _perturbed(older, VERSION_SCALE, 2)},
        moved=_perturbed(policy, MOVED_SCALE, 23),
    )


@pytest.fixture(scope="module")
def problem(policy):
    """The single-turn rollout batch: pi_old (as data, away from the policy so that PPO's clip binds), reference
    log-probs, values, and behaviour log-probs ``old - LOG_RHO`` (float64)."""
    layout = _layout(PROMPT_LENGTHS, RESPONSE_LENGTHS, GROUPS, seed=7)
    gen = torch.Generator().manual_seed(8)
    now = _logps(policy, layout.samples)
    old = [n + e for n, e in zip(now, _noise(gen, RESPONSE_LENGTHS, 0.3))]
    ref_logps = [o + e for o, e in zip(old, _noise(gen, RESPONSE_LENGTHS, 0.2))]
    values = _noise(gen, RESPONSE_LENGTHS, 1.0)
    behaviour = [o - torch.tensor(x, dtype=torch.float64) for o, x in zip(old, LOG_RHO)]
    batch = _layout_batch(layout, old_logps=old, ref_logps=ref_logps, values=values, rollout_logps=behaviour)
    # the reference reads the batch's own numbers back, ragged
    return SimpleNamespace(
        layout=layout,
        batch=batch,
        now=now,
        old=_ragged(batch.old_logps, layout.spans),
        ref=_ragged(batch.ref_logps, layout.spans),
        values=_ragged(batch.values, layout.spans),
        behaviour=_ragged(batch.rollout_logps, layout.spans),
    )


# ------------------------------------------------------------------------------------------ the reference
def _group_mean(scores, groups, i):
    group = [s for s, g in zip(scores, groups) if g == groups[i]]
    return sum(group) / len(group)


def _reference_advantages(estimator, scores, groups, old, ref_logps, values, kl_in_reward, gamma=1.0, lam=1.0):
    """Single-turn ``(advantages, returns)`` per row (KL k3 to the reference in the reward when ``kl_in_reward``:
    per token for token-reward estimators, summed per response for the sequence ones; Ahmadian et al. 2024)."""
    lengths = [len(o) for o in old]
    coef = KL_COEF if kl_in_reward else 0.0
    if kl_in_reward:
        kl_old = [ref.kl("k3", o, r) for o, r in zip(old, ref_logps)]
    else:
        kl_old = [torch.zeros_like(o) for o in old]
    if estimator in ("grpo", "dr_grpo", "rloo"):
        adv = ref.group_advantages(
            estimator, [s - coef * float(k.sum()) for s, k in zip(scores, kl_old)], groups, lengths
        )
        return adv, adv
    if estimator == "reinforce_pp_baseline":
        scores = [s - _group_mean(scores, groups, i) for i, s in enumerate(scores)]
    rewards = ref.token_rewards(scores, kl_old, coef)
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        returns = ref.discounted_returns(rewards, gamma)
        return ref.whiten_all(returns), returns
    assert estimator == "gae", estimator
    return ref.gae(rewards, values, gamma, lam)


def _reference_loss(logps, entropy, p, advantages, agg, length, *, loss="ppo", kl_loss=False, correction=None):
    """The aggregated loss over rows: the policy loss (PPO, decoupled with ``correction = (name, low, high)`` on
    ``p.proximal`` / ``p.behaviour``, or GSPO, or CISPO or SAPO times the correction's weight),
    ``+ beta k3(pi, ref)`` with ``kl_loss``, ``- c H``."""
    name, low, high = correction or (None, None, None)
    per_row = []
    for i, lp in enumerate(logps):
        if loss == "gspo":
            pg = ref.gspo_token_loss(lp, p.proximal[i], advantages[i], *GSPO_CLIP)
        elif loss in ("cispo", "sapo"):
            params = CISPO_CLIP if loss == "cispo" else SAPO_TAUS
            pg = ref.policy_token_loss(loss, lp, p.proximal[i], advantages[i], params)
            if name:
                pg = pg * ref.behaviour_weights(name, p.proximal[i], p.behaviour[i], low, high)
        else:
            behaviour = p.behaviour[i] if name else None
            pg = ref.decoupled_ppo_token_loss(lp, p.proximal[i], behaviour, advantages[i], *PPO_CLIP, name, low, high)
        if kl_loss:
            pg = pg + KL_COEF * ref.kl("k3", lp, p.ref[i])
        per_row.append(pg - ENTROPY_COEF * entropy[i])
    return ref.aggregate(agg, per_row, length)


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([q.grad.reshape(-1) for q in model.parameters() if q.grad is not None])


def _assert_advantages(batch, spans, advantages, returns):
    for i, s in enumerate(spans):
        torch.testing.assert_close(batch.advantages[i, list(s)], advantages[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(batch.returns[i, list(s)], returns[i], rtol=1e-12, atol=1e-12)


def _assert_step(objective, model, batch, reference):
    """The objective's loss on ``batch`` and its gradient against ``reference()`` (built after, from ``model``)."""
    total, sums = objective.loss(model, batch)
    ours = total / objective.count(batch)
    expected = reference()
    assert float(ours.detach()) == pytest.approx(float(expected.detach()), rel=1e-11, abs=1e-13)
    ours_grad, expected_grad = _grads(model, ours), _grads(model, expected)
    assert float(expected_grad.norm()) > 1e-6  # the step moves the policy
    assert float((ours_grad - expected_grad).norm()) <= 1e-10 * float(expected_grad.norm())
    return sums


# ------------------------------------------------------------------------------------------ behaviour corrections
@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
@pytest.mark.parametrize("case", list(CORRECTIONS))
@pytest.mark.parametrize("loss", ["ppo", "cispo", "sapo"])
def test_behaviour_corrections_match_the_papers(policy, problem, loss, case, estimator, agg):
    """One PPO step with each behaviour correction (its paper's bounds, or bounds set through the config): the clipped
    surrogate of ``pi / pi_old`` times the correction's weight of ``pi_old / pi_behav`` (``rollout_logps``), next to
    an unweighted k3 KL loss and entropy bonus; a zero weight keeps its token in the denominator. CISPO alike, its
    loss (the clipped weight of ``pi / pi_old`` on ``log pi``) and SAPO's (the soft gate of ``pi / pi_old``) times the
    correction's weight. The logged
    ``tis_weight`` / ``tis_capped_frac`` or ``is_weight`` / ``is_masked_frac`` are the reference's weights and
    dropped (capped) tokens, aggregated alike."""
    keys, correction = CORRECTIONS[case]
    cfg = _config(
        policy_loss=loss,
        advantage_estimator=estimator,
        loss_agg_mode=agg,
        kl_coef=KL_COEF,
        kl_mode="loss",
        kl_estimator="k3",
        entropy_coef=ENTROPY_COEF,
        **keys,
    )
    layout = problem.layout
    batch, _ = RLTrainer.advantages(SimpleNamespace(cfg=cfg), problem.batch, torch.tensor(SCORES), GROUPS)
    objective, _ = build_objectives(cfg)
    advantages, returns = _reference_advantages(
        estimator, SCORES, GROUPS, problem.old, problem.ref, problem.values, kl_in_reward=False
    )
    _assert_advantages(batch, layout.spans, advantages, returns)

    p = SimpleNamespace(proximal=problem.old, behaviour=problem.behaviour, ref=problem.ref)

    def reference():
        logps, entropy = ref.logps_and_entropy(policy, layout.samples, TEMPERATURE)
        return _reference_loss(
            logps, entropy, p, advantages, agg, BUDGET, loss=loss, kl_loss=True, correction=correction
        )

    sums = _assert_step(objective, policy, batch, reference)
    metrics = objective.finalize(sums, objective.count(batch))
    name, low, high = correction
    weights = [ref.behaviour_weights(name, o, b, low, high) for o, b in zip(problem.old, problem.behaviour)]
    if name == "tis":
        rho = [torch.exp(o - b) for o, b in zip(problem.old, problem.behaviour)]
        expected = {"tis_weight": weights, "tis_capped_frac": [(r > w).double() for r, w in zip(rho, weights)]}
    else:
        expected = {"is_weight": weights, "is_masked_frac": [(w == 0).double() for w in weights]}
    for key, per_token in expected.items():
        assert metrics[key] == pytest.approx(float(ref.aggregate(agg, per_token, BUDGET)), rel=1e-12, abs=1e-15), key


def test_the_correction_sweep_exercises_what_it_claims(policy, problem):
    """Each correction's bounds bind on some tokens (rows for seq_mask) and not on others, no ratio sits on a bound,
    the Hilton case truncates nothing, and PPO's clip binds on some tokens (so the weight meets both branches)."""
    for case, (_, (name, low, high)) in CORRECTIONS.items():
        weights = [ref.behaviour_weights(name, o, b, low, high) for o, b in zip(problem.old, problem.behaviour)]
        rho = torch.cat([torch.exp(o - b) for o, b in zip(problem.old, problem.behaviour)])
        w = torch.cat(weights)
        changed = (w - rho).abs() > 1e-12 if name != "seq_mask" else w == 0
        if case == "hilton":
            assert not bool(changed.any()) and float(rho.max()) < 1e3
        else:
            assert 0 < int(changed.sum()) < len(w), case
        default_low, default_high = ref.BEHAVIOUR_DEFAULT_BOUNDS[name]
        lo, hi = low or default_low, high or default_high
        bounded = torch.tensor([math.exp(float((o - b).mean())) for o, b in zip(problem.old, problem.behaviour)])
        if name == "seq_mask":  # its bounds are on each row's geometric-mean ratio
            assert bool((bounded < lo).any()) and bool((bounded > hi).any()), case  # rejected below and above
        else:
            bounded = rho
        for bound in (lo, hi):
            if bound is not None:
                assert float((bounded - bound).abs().min()) > 1e-6 * bound, case
    token = torch.cat([torch.exp(n - o) for n, o in zip(problem.now, problem.old)])
    assert 0 < int(((token < 0.8) | (token > 1.2)).sum()) < len(token)


@pytest.mark.parametrize("case", list(CORRECTIONS))
def test_gspo_refuses_every_behaviour_correction(case):
    """GSPO's ratio is one number per sequence: no token weight has a form in its paper, so the config refuses each
    correction naming its key (and accepts the same keys with PPO, test_behaviour_corrections_match_the_papers)."""
    keys, _ = CORRECTIONS[case]
    key = "algo.tis_cap" if "tis_cap" in keys else "algo.off_policy_correction"
    with pytest.raises(ConfigError, match=rf"^{key} .*'gspo'"):
        _config(policy_loss="gspo", **keys)


# ------------------------------------------------------------------------------------------ asynchronous RL
def _stale_cases():
    """``(k, correction, moved, loss)``: PPO with each correction, GSPO (which takes none) uncorrected, CISPO and SAPO
    with TIS and uncorrected (their ratio against the proximal policy, the correction's weight on top)."""
    ppo = [(k, name, moved, "ppo") for k, name, moved in itertools.product((1, 2), STALE_CORRECTIONS, (False, True))]
    cases = ppo + [(k, "none", moved, "gspo") for k, moved in itertools.product((1, 2), (False, True))]
    cases += list(itertools.product((1, 2), ("none", "tis"), (False, True), ("cispo", "sapo")))
    return [pytest.param(*c, id=f"k{c[0]}-{c[1]}-{'later-update' if c[2] else 'first-update'}-{c[3]}") for c in cases]


def _stale_batch(problem, proximal, behaviour):
    """The rollout batch of a stale step: ``old_logps`` the proximal policy's (float64, the trainer's),
    ``rollout_logps`` the behaviour version's as the engines report them (float32)."""
    spans, width = problem.layout.spans, problem.layout.ids.shape[1]
    return problem.batch.replace(
        old_logps=_place(proximal, spans, width), rollout_logps=_place(behaviour, spans, width).float()
    )


@pytest.mark.parametrize("k,correction,moved,loss", _stale_cases())
def test_stale_samples_train_decoupled_ppo(policy, versions, problem, k, correction, moved, loss):
    """Decoupled PPO (Hilton et al. 2022) on samples ``k`` versions old: the ratio and its clip against the proximal
    policy (``old_logps``), each token weighted by the correction of ``pi_prox / pi_behav``; ``none``: no weight, as
    documented (docs/algorithms/async.md: the default leaves stale samples unweighted, and says so)."""
    keys, reference_correction = STALE_CORRECTIONS[correction]
    assert behaviour_version(STEP, k) == STEP - 1 - k  # the documented schedule, which the test's versions follow
    algo = dict(
        advantage_estimator="grpo",
        policy_loss=loss,
        loss_agg_mode="seq-mean-token-mean",
        kl_coef=KL_COEF,
        kl_mode="reward",
        kl_estimator="k3",
        entropy_coef=ENTROPY_COEF,
        **keys,
    )
    cfg = _config(rollout={"max_staleness": k}, **algo)
    objective, _ = build_objectives(cfg)
    assert objective == build_objectives(_config(**algo))[0]  # k changes the samples, never the objective
    if correction == "none":
        assert "no off-policy correction" in cfg.describe_schedule()
    samples = problem.layout.samples
    proximal = _logps(versions.by_version[STEP - 1], samples)
    behaviour = [b.float().double() for b in _logps(versions.by_version[STEP - 1 - k], samples)]
    batch = _stale_batch(problem, proximal, behaviour)
    batch, _ = RLTrainer.advantages(SimpleNamespace(cfg=cfg), batch, torch.tensor(SCORES), GROUPS)
    advantages, returns = _reference_advantages(
        "grpo", SCORES, GROUPS, proximal, problem.ref, problem.values, kl_in_reward=True
    )
    _assert_advantages(batch, problem.layout.spans, advantages, returns)

    trained = versions.moved if moved else versions.by_version[STEP - 1]
    p = SimpleNamespace(proximal=proximal, behaviour=behaviour, ref=problem.ref)

    def reference():
        logps, entropy = ref.logps_and_entropy(trained, samples, TEMPERATURE)
        return _reference_loss(
            logps, entropy, p, advantages, "seq-mean-token-mean", BUDGET, loss=loss, correction=reference_correction
        )

    _assert_step(objective, trained, batch, reference)


def test_the_staleness_sweep_exercises_what_it_claims(versions, problem):
    """For k = 1 and 2, whole responses of one version or split between two (partial rollouts), the behaviour ratio
    leaves every correction's bounds on some tokens (rows for seq_mask) and not on others; after an optimizer step
    the ratio to the proximal policy leaves PPO's clip range on some tokens."""
    samples = problem.layout.samples
    proximal = _logps(versions.by_version[STEP - 1], samples)
    for k in (1, 2):
        behaviour = [b.float().double() for b in _logps(versions.by_version[STEP - 1 - k], samples)]
        newer = [b.float().double() for b in _logps(versions.by_version[STEP - k], samples)]
        # whole responses of version STEP - 1 - k; partial rollouts: their first tokens only, the rest one newer
        spliced = [ref.partial_behaviour_logps(b, n, FIRST_TOKENS) for b, n in zip(behaviour, newer)]
        for (name, (_, (correction, low, high))), how in itertools.product(
            STALE_CORRECTIONS.items(), (behaviour, spliced)
        ):
            if correction is None:
                continue
            w = torch.cat([ref.behaviour_weights(correction, p, b, low, high) for p, b in zip(proximal, how)])
            rho = torch.cat([torch.exp(p - b) for p, b in zip(proximal, how)])
            changed = w == 0 if correction == "seq_mask" else (w - rho).abs() > 1e-12
            assert 0 < int(changed.sum()) < len(rho), (k, name, "partial" if how is spliced else "whole")
    token = torch.cat([torch.exp(m - p) for m, p in zip(_logps(versions.moved, samples), proximal)])
    assert 0 < int(((token < 0.8) | (token > 1.2)).sum()) < len(token)


# ------------------------------------------------------------------------------------------ partial rollouts
class _ScriptedEngines:
    """Stand-in engines that sample the problem's responses: a request of a prompt gets the next response of that
    prompt, a request that continues a response gets its rest; up to ``max_new_tokens`` tokens each, with the
    log-probs of the weights the engines hold now (``model``), as Python floats (the batch keeps them in float32)."""

    def __init__(self, samples, model):
        self.samples, self.model = samples, model
        self.queue = {}
        for j, (prompt, _) in enumerate(samples):
            self.queue.setdefault(tuple(prompt), []).append(j)

    def generate(self, prompt_ids, sampling):
        out = []
        for request in map(tuple, prompt_ids):
            if request in self.queue:
                j = self.queue[request].pop(0)
            else:
                (j,) = [j for j, (p, r) in enumerate(self.samples) if tuple(p + r)[: len(request)] == request]
            prompt, response = self.samples[j]
            done = len(request) - len(prompt)
            tokens = response[done : done + sampling.max_new_tokens]
            logps = _logps(self.model, [(prompt, response)])[0][done : done + len(tokens)]
            finish = "length" if done + len(tokens) < len(response) else "stop"
            out.append(Generation(request, tuple(tokens), tuple(logps.tolist()), finish))
        return out


@pytest.mark.parametrize("correction", ["tis", "mis", "icepop", "seq_mask-0.8-1.25"])
@pytest.mark.parametrize("k", [1, 2])
def test_partial_rollouts_weigh_each_token_by_its_version(policy, versions, problem, k, correction):
    """Partial rollouts (docs/algorithms/async.md): step ``t + k``'s responses are sampled ahead, their first ``c``
    tokens by version ``t - 1``, the rest by version ``t`` after its weights land; trained at step ``t + k`` against
    the proximal version ``t + k - 1``. Through the trainer's ``_partial`` with stand-in engines; each token's
    ``rho`` is against its own version (``k = 1``: the rest was sampled by the proximal weights themselves)."""
    keys, reference_correction = STALE_CORRECTIONS[correction]
    cfg = _config(
        rollout={"max_staleness": k, "partial_rollout_tokens": FIRST_TOKENS},
        advantage_estimator="grpo",
        loss_agg_mode="token-mean",
        entropy_coef=ENTROPY_COEF,
        **keys,
    )
    layout = problem.layout
    v = STEP - 1 - k  # the version that starts step STEP's samples
    engines = _ScriptedEngines(layout.samples, versions.by_version[v])
    tokenizer = SimpleNamespace(
        pad_token_id=0, eos_token_id=VOCAB - 1, batch_decode=lambda ids, **_: [" ".join(map(str, x)) for x in ids]
    )
    prompts = PromptSet(layout.prompts, ["p0", "p1"], {}, 0, 0)
    objective, _ = build_objectives(cfg)
    trainer = RLTrainer(
        cfg,
        tokenizer,
        prompts,
        EpochPlan(num_samples=2, global_batch_size=2, max_epochs=8, seed=0),
        RLActors(policy=None, engines=engines),
        None,
        objective,
        None,
    )

    def pause():  # the next weights land on the engines
        engines.model = versions.by_version[v + 1]

    rollout = trainer._partial(StepPlan(step=STEP, epoch=1, indices=[0, 1]), pause)
    assert torch.equal(rollout.batch.input_ids, layout.ids) and torch.equal(rollout.batch.loss_mask, layout.mask)
    for i, s in enumerate(layout.spans):  # the record agrees with the reference's split
        cut = min(FIRST_TOKENS, len(s))
        assert rollout.token_versions[i, list(s)].tolist() == [v] * cut + [v + 1] * (len(s) - cut)

    proximal = _logps(policy, layout.samples)
    older, newer = _logps(versions.by_version[v], layout.samples), _logps(versions.by_version[v + 1], layout.samples)
    behaviour = [ref.partial_behaviour_logps(o, n, FIRST_TOKENS).float().double() for o, n in zip(older, newer)]
    batch = rollout.batch.replace(old_logps=_place(proximal, layout.spans, layout.ids.shape[1]))
    batch, _ = RLTrainer.advantages(SimpleNamespace(cfg=cfg), batch, torch.tensor(SCORES), rollout.prompt_index)
    advantages, returns = _reference_advantages("grpo", SCORES, GROUPS, proximal, None, None, kl_in_reward=False)
    _assert_advantages(batch, layout.spans, advantages, returns)
    p = SimpleNamespace(proximal=proximal, behaviour=behaviour, ref=None)

    def reference():
        logps, entropy = ref.logps_and_entropy(policy, layout.samples, TEMPERATURE)
        return _reference_loss(logps, entropy, p, advantages, "token-mean", BUDGET, correction=reference_correction)

    _assert_step(objective, policy, batch, reference)
    # the split matters: weighting every token by the older version's ratio would change some weights
    name, low, high = reference_correction
    wrong = [ref.behaviour_weights(name, x, o.float().double(), low, high) for x, o in zip(proximal, older)]
    right = [ref.behaviour_weights(name, x, b, low, high) for x, b in zip(proximal, behaviour)]
    assert max(float((a - b).abs().max()) for a, b in zip(wrong, right)) > 1e-3


# ------------------------------------------------------------------------------------------ per-turn credit
MAX_TURNS, TURN_TOKENS, EPISODE_TOKENS, REWARD_WEIGHT = 3, 4, 30, 0.5
# per episode: (policy tokens of each turn, observation tokens after each turn but the last); a turn cut to no tokens
# gives its reward to the latest policy token before it, or (none before it) leaves it in the score
EPISODES = [
    ([3, 2, 4], [2, 3]),
    ([4], []),
    ([2, 0, 3], [1, 2]),
    ([1, 4], [3]),
    ([0, 3, 2], [2, 1]),
    ([2, 3], [2]),
]
TURN_REWARDS = [[0.25, -0.5, 1.0], [0.75], [0.5, 0.25, -0.25], [-1.0, 0.5], [1.0, 0.25, 0.5], [0.125, -0.375]]
OTHER_SCORES = [0.5, -0.25, 0.0, 1.25, -0.75, 0.375]  # the reward function's part of each score
# the episode's policy-token budget L of a per-length aggregation (docs/algorithms: min(turns x tokens, episode - 1))
MULTI_TURN_BUDGET = min(MAX_TURNS * TURN_TOKENS, EPISODE_TOKENS - 1)


@pytest.fixture(scope="module")
def episodes(policy):
    """Episodes with observation holes through the rollout's own layout (``episodes_batch``, ``turn_reward_tokens``);
    pi_old, reference log-probs and values on the policy tokens as data."""
    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    built, positions = [], []
    for index, (g, (turns, observations)) in enumerate(zip(GROUPS, EPISODES)):
        episode, at, cols = Episode(tuple(prompts[g]), index=index), len(prompts[g]), []
        for t, n in enumerate(turns):
            episode.add_response(torch.randint(1, VOCAB, (n,), generator=gen).tolist(), [-1.0] * n)
            cols, at = cols + list(range(at, at + n)), at + n
            if t < len(observations):
                episode.add_observation(torch.randint(1, VOCAB, (observations[t],), generator=gen).tolist())
                at += observations[t]
        built.append(episode)
        positions.append(cols)
    batch = episodes_batch(built, pad_id=0)
    width = batch.input_ids.shape[1]
    for i, cols in enumerate(positions):  # the layout the reference assumes
        assert torch.nonzero(batch.loss_mask[i]).squeeze(-1).tolist() == cols
    lengths = [len(c) for c in positions]
    sequences = [list(e.token_ids) for e in built]
    with torch.no_grad():
        now = [ref.token_logps_and_entropy(policy, s, c, TEMPERATURE)[0] for s, c in zip(sequences, positions)]
    old = [n + e for n, e in zip(now, _noise(gen, lengths, 0.3))]
    ref_logps = [o + e for o, e in zip(old, _noise(gen, lengths, 0.2))]
    values = _noise(gen, lengths, 1.0)
    batch = batch.replace(
        old_logps=_place(old, positions, width),
        ref_logps=_place(ref_logps, positions, width),
        values=_place(values, positions, width),
    )
    rollout = Rollout(
        batch,
        prompt_index=list(GROUPS),
        responses=[""] * len(built),
        env_rewards=torch.tensor([sum(r) for r in TURN_REWARDS]),
        turn_rewards=turn_reward_tokens(built, TURN_REWARDS, width),
    )
    return SimpleNamespace(
        rollout=rollout,
        prompts=PromptSet(prompts, ["p0", "p1"], {}, 0, 0),
        sequences=sequences,
        positions=positions,
        old=_ragged(batch.old_logps, positions),
        ref=_ragged(batch.ref_logps, positions),
        values=_ragged(batch.values, positions),
    )


def _other_scores(prompts, responses, columns):
    scores = torch.tensor(OTHER_SCORES)
    return scores, {"r.py:f": scores}


def _reference_turn_advantages(estimator, scores, e, per_turn, gamma, lam):
    """Per episode over its policy tokens: per-turn credit (``per_turn``) or the whole score at the last token; the
    KL k3 penalty per token; REINFORCE++ (whitened returns-to-go, its baseline the group's mean episode score at the
    last token) or GAE, each stepping over policy tokens only."""
    kl_old = [ref.kl("k3", o, r) for o, r in zip(e.old, e.ref)]
    rewards = []
    for i, (turns, _) in enumerate(EPISODES):
        score = scores[i] - (_group_mean(scores, GROUPS, i) if estimator == "reinforce_pp_baseline" else 0.0)
        placed = [REWARD_WEIGHT * r for r in TURN_REWARDS[i]] if per_turn else [0.0] * len(turns)
        rewards.append(ref.turn_token_rewards(score, turns, placed, kl_old[i], KL_COEF))
    if estimator == "gae":
        return ref.gae(rewards, e.values, gamma, lam)
    returns = ref.discounted_returns(rewards, gamma)
    return ref.whiten_all(returns), returns


def _turn_config(estimator, agg, gamma, lam, turn_credit="turn"):
    return _config(
        rollout={
            "max_new_tokens": TURN_TOKENS,
            "max_turns": MAX_TURNS,
            "max_prompt_length": 8,
            "max_episode_tokens": EPISODE_TOKENS,
        },
        env={"spec": "envs.py:Env", "reward_weight": REWARD_WEIGHT},
        advantage_estimator=estimator,
        turn_credit=turn_credit,
        loss_agg_mode=agg,
        kl_coef=KL_COEF,
        kl_mode="reward",
        kl_estimator="k3",
        entropy_coef=ENTROPY_COEF,
        gamma=gamma,
        lam=lam,
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_per_turn_credit_matches_the_docs(policy, episodes, estimator, gamma, lam, agg):
    """``algo.turn_credit=turn``: the score through ``StepScoring.score`` (``env.reward_weight`` x the turns' rewards
    summed, plus the reward function's), the turns' rewards through ``StepScoring.turn_credit``, then the advantages
    and a PPO step on episodes with observation holes, against the reference's per-episode rewards."""
    cfg = _turn_config(estimator, agg, gamma, lam)
    assert cfg.max_response_tokens == MULTI_TURN_BUDGET
    scoring = StepScoring(cfg, reward_sources(cfg, reward_scorers(_other_scores)))
    scores, per_source = scoring.score(episodes.rollout, episodes.prompts)
    expected_scores = [REWARD_WEIGHT * sum(t) + o for t, o in zip(TURN_REWARDS, OTHER_SCORES)]
    assert scores.tolist() == expected_scores  # exact: every number is a multiple of 1/64
    placed = scoring.turn_credit(episodes.rollout)
    batch, _ = RLTrainer.advantages(
        SimpleNamespace(cfg=cfg), episodes.rollout.batch, scores, episodes.rollout.prompt_index, placed
    )
    advantages, returns = _reference_turn_advantages(estimator, expected_scores, episodes, True, gamma, lam)
    _assert_advantages(batch, episodes.positions, advantages, returns)

    objective, _ = build_objectives(cfg)
    p = SimpleNamespace(proximal=episodes.old, behaviour=None, ref=episodes.ref)

    def reference():
        pairs = [
            ref.token_logps_and_entropy(policy, s, c, TEMPERATURE)
            for s, c in zip(episodes.sequences, episodes.positions)
        ]
        logps, entropy = [x for x, _ in pairs], [h for _, h in pairs]
        return _reference_loss(logps, entropy, p, advantages, agg, MULTI_TURN_BUDGET)

    _assert_step(objective, policy, batch, reference)


def test_the_turn_sweep_exercises_what_it_claims(episodes):
    """Per-turn credit moves every estimator's advantages away from episode credit's (which the project computes
    too, reading the same scores); the episodes have observation holes, an empty middle turn and an empty first
    turn; and the two credits' rewards sum to the same total per episode."""
    assert any(a != b - 1 for p in episodes.positions for a, b in zip(p, p[1:]))  # holes
    assert any(0 in turns[1:] for turns, _ in EPISODES) and any(turns[0] == 0 for turns, _ in EPISODES)
    scores = [REWARD_WEIGHT * sum(t) + o for t, o in zip(TURN_REWARDS, OTHER_SCORES)]
    for estimator in ("reinforce_pp", "reinforce_pp_baseline", "gae"):
        per_turn, _ = _reference_turn_advantages(estimator, scores, episodes, True, 0.9, 0.8)
        whole, whole_returns = _reference_turn_advantages(estimator, scores, episodes, False, 0.9, 0.8)
        assert max(float((a - b).abs().max()) for a, b in zip(per_turn, whole)) > 0.05, estimator
        cfg = _turn_config(estimator, "token-mean", 0.9, 0.8, turn_credit="episode")
        batch, _ = RLTrainer.advantages(SimpleNamespace(cfg=cfg), episodes.rollout.batch, torch.tensor(scores), GROUPS)
        _assert_advantages(batch, episodes.positions, whole, whole_returns)
    zeros = [torch.zeros(len(p), dtype=torch.float64) for p in episodes.positions]
    for i, (turns, _) in enumerate(EPISODES):
        placed = [REWARD_WEIGHT * r for r in TURN_REWARDS[i]]
        assert float(ref.turn_token_rewards(scores[i], turns, placed, zeros[i], 0.0).sum()) == pytest.approx(scores[i])


# ------------------------------------------------------------------------------------------ overlong shaping
OVERLONG_BUFFER = 4  # L_cache; L_max = BUDGET, so responses longer than 4 tokens are punished
OVERLONG_LENGTHS = (2, 5, 8, 4, 6, 7)  # below, inside, at L_max | at L_max - L_cache, inside, inside


@pytest.fixture(scope="module")
def shaped(policy):
    layout = _layout(PROMPT_LENGTHS, OVERLONG_LENGTHS, GROUPS, seed=41)
    gen = torch.Generator().manual_seed(42)
    old = [n + e for n, e in zip(_logps(policy, layout.samples), _noise(gen, OVERLONG_LENGTHS, 0.3))]
    values = _noise(gen, OVERLONG_LENGTHS, 1.0)
    batch = _layout_batch(layout, old_logps=old, values=values)
    rollout = Rollout(batch, prompt_index=list(GROUPS), responses=[""] * len(GROUPS))
    prompts = PromptSet(layout.prompts, ["p0", "p1"], {}, 0, 0)
    return SimpleNamespace(layout=layout, rollout=rollout, prompts=prompts, old=old, values=values)


def _fixed_scores(prompts, responses, columns):
    scores = torch.tensor(SCORES)
    return scores, {"r.py:f": scores}


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS.names())
@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_overlong_shaping_matches_dapo(policy, shaped, penalty, estimator):
    """``StepScoring.score`` adds DAPO's eq. 13 (times ``rollout.overlong_penalty``) for each response's length to its
    reward, and every estimator then reads the shaped score (Yu et al. 2025: ``R = R_correct + R_length``)."""
    cfg = _config(
        rollout={"overlong_buffer": OVERLONG_BUFFER, "overlong_penalty": penalty},
        advantage_estimator=estimator,
        loss_agg_mode="token-mean",
        entropy_coef=ENTROPY_COEF,
    )
    scoring = StepScoring(cfg, reward_sources(cfg, reward_scorers(_fixed_scores)))
    scores, per_source = scoring.score(shaped.rollout, shaped.prompts)
    expected = [ref.overlong_reward(n, BUDGET, OVERLONG_BUFFER, penalty) for n in OVERLONG_LENGTHS]
    assert per_source["overlong"].tolist() == expected  # exact: multiples of 1/8
    shaped_scores = [s + r for s, r in zip(SCORES, expected)]
    assert scores.tolist() == shaped_scores

    batch, _ = RLTrainer.advantages(SimpleNamespace(cfg=cfg), shaped.rollout.batch, scores, GROUPS)
    advantages, returns = _reference_advantages(
        estimator, shaped_scores, GROUPS, shaped.old, None, shaped.values, kl_in_reward=False
    )
    _assert_advantages(batch, shaped.layout.spans, advantages, returns)
    objective, _ = build_objectives(cfg)
    p = SimpleNamespace(proximal=shaped.old, behaviour=None, ref=None)

    def reference():
        logps, entropy = ref.logps_and_entropy(policy, shaped.layout.samples, TEMPERATURE)
        return _reference_loss(logps, entropy, p, advantages, "token-mean", BUDGET)

    _assert_step(objective, policy, batch, reference)


def test_overlong_penalty_is_eq_13_at_every_length():
    """The penalty the trainer adds (``rlhf.ops.dapo.overlong_penalty``, float32) against eq. 13 for every length
    from 0 to past ``L_max`` (the ``-1`` branch, which a single-turn response cut at ``L_max`` never reaches), with
    non-dyadic buffers and factors (float32's rounding)."""
    for max_length, cache, penalty in ((8, 4, 1.0), (16, 3, 0.3), (10, 10, 2.5), (7, 1, 1.0)):
        lengths = list(range(0, max_length + 4))
        ours = overlong_penalty(torch.tensor(lengths), max_length, cache, penalty)
        expected = [ref.overlong_reward(n, max_length, cache, penalty) for n in lengths]
        for n, got, want in zip(lengths, ours.tolist(), expected):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-7), (max_length, cache, penalty, n)


def test_the_overlong_sweep_exercises_what_it_claims(shaped):
    """The lengths reach every branch of eq. 13 the trainer can see (below, at ``L_max - L_cache``, inside, at
    ``L_max``), and the shaping moves every estimator's advantages."""
    values = [ref.overlong_reward(n, BUDGET, OVERLONG_BUFFER) for n in OVERLONG_LENGTHS]
    assert {0.0, -1.0} <= set(values) and any(-1.0 < v < 0.0 for v in values)
    assert BUDGET - OVERLONG_BUFFER in OVERLONG_LENGTHS
    shaped_scores = [s + r for s, r in zip(SCORES, values)]
    for estimator in ADVANTAGE_ESTIMATORS.names():
        a, _ = _reference_advantages(estimator, shaped_scores, GROUPS, shaped.old, None, shaped.values, False)
        b, _ = _reference_advantages(estimator, SCORES, GROUPS, shaped.old, None, shaped.values, False)
        assert max(float((x - y).abs().max()) for x, y in zip(a, b)) > 0.05, estimator
