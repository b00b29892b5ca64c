"""Hand-checked values for the RL maths: KL estimators, advantage estimators, policy/value losses, aggregation.

Expected numbers are written from first principles (plain Python arithmetic, ``math`` and ``statistics``) on tiny
inputs, or come from straightforward per-sequence loops written here; never from calling the function under test
a second way.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from rlhf.ops.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    token_level_rewards,
    whiten,
)
from rlhf.ops.aggregation import LOSS_AGGREGATIONS, aggregate_count, aggregate_sum
from rlhf.ops.kl import KL_ESTIMATORS, kl_estimate
from rlhf.ops.policy_loss import POLICY_LOSSES, PolicyLoss, PolicyLossConfig, policy_loss, ppo_loss, value_loss
from rlhf.registry import UnknownNameError

NAN = float("nan")
INF = float("inf")


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def m(x):
    return torch.tensor(x, dtype=torch.bool)


def close(actual: torch.Tensor, expected, atol=1e-12) -> bool:
    """Element-wise ``|actual - expected| <= atol`` against a nested list (shapes must match)."""
    expected = torch.tensor(expected, dtype=torch.float64)
    return actual.shape == expected.shape and torch.allclose(actual.detach().double(), expected, atol=atol, rtol=0)


# ============================================================================================== KL estimators
def test_kl_estimators_at_known_log_ratios():
    logps = t([[-1.0, -2.0, -0.7]])
    ref = t([[-1.5, -1.5, -0.7]])  # log r = +0.5, -0.5, 0
    k1 = kl_estimate("k1", logps, ref)[0].tolist()
    k2 = kl_estimate("k2", logps, ref)[0].tolist()
    k3 = kl_estimate("k3", logps, ref)[0].tolist()
    assert k1 == pytest.approx([0.5, -0.5, 0.0], abs=1e-12)
    assert k2 == pytest.approx([0.125, 0.125, 0.0], abs=1e-12)
    assert k3 == pytest.approx([math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1, 0.0], abs=1e-12)


def test_k3_is_non_negative_and_accurate_near_zero():
    x = torch.linspace(-20, 20, 4001, dtype=torch.float64)
    assert (kl_estimate("k3", x[None], torch.zeros_like(x)[None]) >= 0).all()
    # for tiny log r, k3 ~ x^2 / 2; a naive exp(-x) - 1 + x in float32 would be pure rounding noise
    tiny = torch.tensor([[1e-4]], dtype=torch.float32)
    assert kl_estimate("k3", tiny, torch.zeros_like(tiny)).item() == pytest.approx(0.5e-8, rel=1e-3)


def test_kl_estimator_bias_and_gradient_claims_on_an_exact_distribution():
    # Exact expectations over a 3-outcome distribution (no sampling): k1 and k3 are unbiased for KL(pi || ref),
    # k2 is not; as losses, E_pi[grad k2] = grad KL(pi || ref) and E_pi[grad k3] = grad KL(ref || pi).
    pi = [0.5, 0.3, 0.2]
    ref = [0.2, 0.5, 0.3]
    kl_pr = sum(p * math.log(p / q) for p, q in zip(pi, ref))
    logp, logq = t([[math.log(p) for p in pi]]), t([[math.log(q) for q in ref]])
    weights = t([pi])
    assert (weights * kl_estimate("k1", logp, logq)).sum().item() == pytest.approx(kl_pr, abs=1e-12)
    assert (weights * kl_estimate("k3", logp, logq)).sum().item() == pytest.approx(kl_pr, abs=1e-12)
    assert abs((weights * kl_estimate("k2", logp, logq)).sum().item() - kl_pr) > 1e-3

    logits = t([0.3, -0.2, 0.1]).requires_grad_(True)
    ref_logp = logq[0]

    def expected_grad(name):
        lp = torch.log_softmax(logits, -1)
        est = kl_estimate(name, lp[None], ref_logp[None])[0]
        (g,) = torch.autograd.grad((lp.exp().detach() * est).sum(), logits)  # samples held fixed
        return g

    def true_grad(forward):
        lp = torch.log_softmax(logits, -1)
        kl = ((lp.exp() * (lp - ref_logp)) if not forward else (ref_logp.exp() * (ref_logp - lp))).sum()
        (g,) = torch.autograd.grad(kl, logits)
        return g

    assert torch.allclose(expected_grad("k2"), true_grad(forward=False), atol=1e-12)
    assert torch.allclose(expected_grad("k3"), true_grad(forward=True), atol=1e-12)
    assert torch.allclose(expected_grad("k1"), torch.zeros(3, dtype=torch.float64), atol=1e-12)


def test_kl_clamp_limits_the_log_ratio_only_when_asked():
    logps, ref = t([[-1.0, -200.0]]), t([[-4.0, -1.0]])  # log r = 3, -199
    assert kl_estimate("k1", logps, ref, clamp=1.0)[0].tolist() == [1.0, -1.0]
    assert kl_estimate("k3", logps, ref, clamp=10.0)[0, 1].item() == pytest.approx(math.exp(10) - 11)
    assert math.isinf(kl_estimate("k3", logps.float(), ref.float())[0, 1].item())  # exact formula overflows
    with pytest.raises(ValueError, match="clamp"):
        kl_estimate("k1", logps, ref, clamp=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_bounded_kl_stays_within_10_with_a_zero_gradient_beyond(dtype):
    """What a run trains on or rewards: each value within +-10 (k3's exp(-log r) would overflow float32 at
    log r < -88), exact inside the bound, and a token beyond it gets gradient exactly 0, never 0 x inf = NaN."""
    log_r = torch.tensor([[0.5, -1000.0, 1000.0, -2.0]], dtype=dtype)
    for name, inside in (("k1", 0.5), ("k2", 0.125), ("k3", math.exp(-0.5) + 0.5 - 1)):
        logps = log_r.clone().requires_grad_(True)
        value = kl_estimate(name, logps, torch.zeros_like(log_r), bounded=True)
        value.sum().backward()
        assert value[0, 0].item() == pytest.approx(inside, rel=1e-6)
        assert value[0, 1].item() == (-10.0 if name == "k1" else 10.0) and value[0, 2].item() == 10.0
        assert torch.isfinite(logps.grad).all() and logps.grad[0, 1] == 0 and logps.grad[0, 2] == 0
        assert logps.grad[0, 0] != 0
    unbounded = kl_estimate("k3", log_r[:, 3:], torch.zeros_like(log_r[:, 3:]))
    assert unbounded.item() == pytest.approx(math.exp(2) - 3)  # 4.39: inside the bound, the same value


# ============================================================================================== token rewards
def test_token_level_rewards_put_the_score_on_the_last_response_token():
    scores = t([1.0, 2.0, 5.0])
    mask = m([[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    kl = t([[9.0, 0.1, 0.2, NAN], [INF, 0.3, NAN, 7.0], [1.0, 1.0, 1.0, 1.0]])
    r = token_level_rewards(scores, mask, kl, kl_coef=0.5)
    assert r[0].tolist() == pytest.approx([0.0, -0.05, -0.1 + 1.0, 0.0])
    assert r[1].tolist() == pytest.approx([0.0, -0.15 + 2.0, 0.0, 0.0])
    assert r[2].tolist() == [0.0, 0.0, 0.0, 0.0]  # no response token: nowhere to put the score
    assert token_level_rewards(scores, mask, None, 0.5)[0].tolist() == [0.0, 0.0, 1.0, 0.0]


# ============================================================================================== GAE
def test_gae_by_hand_on_a_three_token_response():
    # column 0 = prompt, columns 1..3 = response, column 4 = padding (garbage on purpose)
    mask = m([[0, 1, 1, 1, 0]])
    rewards = t([[5.0, 1.0, 0.0, 2.0, NAN]])
    values = t([[7.0, 0.5, 1.0, 1.5, INF]])
    gamma, lam = 0.9, 0.8
    d2 = 2.0 + gamma * 0.0 - 1.5  # last token: bootstrap 0
    d1 = 0.0 + gamma * 1.5 - 1.0
    d0 = 1.0 + gamma * 1.0 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    inputs = AdvantageInputs(rewards, t([0.0]), mask, values=values, gamma=gamma, lam=lam)
    adv, ret = compute_advantages("gae", inputs)
    assert adv[0].tolist() == pytest.approx([0.0, a0, a1, a2, 0.0], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([0.0, a0 + 0.5, a1 + 1.0, a2 + 1.5, 0.0], abs=1e-12)
    assert (a0, a1, a2) == pytest.approx((1.9112, 0.71, 0.5))


def _gae_reference(rewards, values, mask, gamma, lam):
    """Per-sequence Python loop over the row's response tokens (prompt, holes and padding skipped)."""
    out = [[0.0] * len(row) for row in mask]
    for b, row in enumerate(mask):
        idx = [i for i, x in enumerate(row) if x]
        last = 0.0
        for k in reversed(range(len(idx))):
            i = idx[k]
            next_v = values[b][idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rewards[b][i] + gamma * next_v - values[b][i]
            last = delta + gamma * lam * last
            out[b][i] = last
    return out


def _random_response_mask(rng, batch, width, holes=True):
    rows = []
    for b in range(batch):
        prompt = rng.randint(1, 3)
        length = 0 if b == 1 else rng.randint(1, width - prompt)
        row = [0] * prompt + [1] * length + [0] * (width - prompt - length)
        if holes and length >= 4 and b % 2 == 0:
            row[prompt + 2] = 0  # a masked-out hole (e.g. tool output) inside the response
        rows.append(row)
    return rows


def test_gae_vectorized_matches_a_per_sequence_loop_on_random_padded_data():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7)]:
        mask_rows = _random_response_mask(rng, 7, 12)
        rewards = torch.randn(7, 12, generator=gen, dtype=torch.float64)
        values = torch.randn(7, 12, generator=gen, dtype=torch.float64)
        expected = _gae_reference(rewards.tolist(), values.tolist(), mask_rows, gamma, lam)
        mask = m(mask_rows)
        adv, ret = compute_advantages("gae", AdvantageInputs(rewards, t([0.0] * 7), mask, values, None, gamma, lam))
        assert torch.allclose(adv, t(expected), atol=1e-12)
        assert torch.allclose(ret, torch.where(mask, t(expected) + values, 0.0), atol=1e-12)


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", AdvantageInputs(t([[1.0]]), t([1.0]), m([[1]])))


# ============================================================================================== group estimators
def _group_inputs():
    # group 7: scores 1, 2, 6 (rows 0, 2, 4); group 3: scores 4, 0 (rows 1, 3); group 9: a single sample (row 5)
    scores = t([1.0, 4.0, 2.0, 0.0, 6.0, 8.0])
    group_ids = torch.tensor([7, 3, 7, 3, 7, 9])
    mask = m([[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 0, 0], [0, 1, 0], [0, 1, 1]])
    return AdvantageInputs(torch.zeros(6, 3, dtype=torch.float64), scores, mask, group_ids=group_ids, eps=1e-6)


def _per_row(adv, mask):
    """The per-sample advantage, checking it is broadcast over the row's tokens and 0 elsewhere."""
    out = []
    for b in range(adv.shape[0]):
        vals = adv[b][mask[b]].tolist()
        assert all(v == vals[0] for v in vals)
        assert (adv[b][~mask[b]] == 0).all()
        out.append(vals[0] if vals else None)
    return out


def test_grpo_uses_the_unbiased_group_std_and_zero_for_singletons():
    inputs = _group_inputs()
    adv, ret = compute_advantages("grpo", inputs)
    std7 = math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / (3 - 1))  # sqrt(7), Bessel-corrected
    std3 = math.sqrt(((4 - 2) ** 2 + (0 - 2) ** 2) / (2 - 1))
    assert std7 == pytest.approx(statistics.stdev([1, 2, 6]))
    rows = _per_row(adv, inputs.response_mask)
    expected = [-2 / (std7 + 1e-6), 2 / (std3 + 1e-6), -1 / (std7 + 1e-6), None, 3 / (std7 + 1e-6), 0.0]
    assert rows == pytest.approx(expected, abs=1e-12)
    assert torch.equal(ret, adv)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_groups_of_equal_scores_and_singletons_get_exactly_zero_even_with_eps_0(name):
    # (0.1 + 0.1 + 0.1) / 3 != 0.1 in floating point: s - mean and the std are both ~1e-17 rounding noise, and
    # without an exact check GRPO with eps = 0 would turn their ratio into an advantage of about -0.8.
    assert (0.1 + 0.1 + 0.1) / 3 != 0.1
    scores = t([0.1, 0.1, 0.1, 2.0, 1.0, 3.0])
    inputs = AdvantageInputs(
        torch.zeros(6, 2), scores, torch.ones(6, 2), group_ids=torch.tensor([0, 0, 0, 1, 2, 2]), eps=0.0
    )
    adv, _ = compute_advantages(name, inputs)
    assert adv[:4].tolist() == [[0.0, 0.0]] * 4
    assert (adv[4:] != 0).all() and torch.isfinite(adv).all()


def test_dr_grpo_subtracts_the_group_mean_only():
    inputs = _group_inputs()
    adv, _ = compute_advantages("dr_grpo", inputs)
    assert _per_row(adv, inputs.response_mask) == pytest.approx([-2.0, 2.0, -1.0, None, 3.0, 0.0], abs=1e-12)


def test_rloo_subtracts_the_mean_of_the_other_samples():
    inputs = _group_inputs()
    adv, _ = compute_advantages("rloo", inputs)
    expected = [1 - (2 + 6) / 2, 4 - 0, 2 - (1 + 6) / 2, None, 6 - (1 + 2) / 2, 0.0]
    assert _per_row(adv, inputs.response_mask) == pytest.approx(expected, abs=1e-12)
    assert expected[:3] == [-3.0, 4.0, -1.5]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_need_group_ids(name):
    inputs = AdvantageInputs(torch.zeros(2, 2), t([0.0, 1.0]), m([[1, 1], [1, 0]]))
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(name, inputs)


# ============================================================================================== REINFORCE++
def test_reinforce_pp_return_to_go_and_global_whitening():
    mask = m([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]])
    rewards = t([[3.0, 1.0, 0.0, 2.0, NAN], [1.0, 0.0, 4.0, INF, 5.0]])
    gamma = 0.5
    g0 = [1.0 + gamma * (0.0 + gamma * 2.0), 0.0 + gamma * 2.0, 2.0]  # [1.5, 1.0, 2.0]
    g1 = [0.0 + gamma * 4.0, 4.0]  # [2.0, 4.0]
    adv, ret = compute_advantages("reinforce_pp", AdvantageInputs(rewards, t([0.0, 0.0]), mask, gamma=gamma))
    assert ret[0].tolist() == pytest.approx([0.0, *g0, 0.0])
    assert ret[1].tolist() == pytest.approx([0.0, *g1, 0.0, 0.0])
    allg = g0 + g1
    mu, sigma = statistics.fmean(allg), statistics.pstdev(allg)  # 2.1 and sqrt(1.04): population std
    assert (mu, sigma**2) == pytest.approx((2.1, 1.04))
    white = [(g - mu) / math.sqrt(sigma**2 + 1e-8) for g in allg]
    assert adv[0].tolist() == pytest.approx([0.0, *white[:3], 0.0], abs=1e-12)
    assert adv[1].tolist() == pytest.approx([0.0, *white[3:], 0.0, 0.0], abs=1e-12)


def test_reinforce_pp_baseline_subtracts_group_mean_score_then_whitens():
    # group 0 = rows 0 and 1, scores 3 and 1 (mean 2); row 0 also has a KL penalty on its first response token.
    scores = t([3.0, 1.0])
    mask = m([[0, 1, 1, 1], [0, 1, 1, 0]])
    kl = t([[0.0, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rewards = token_level_rewards(scores, mask, kl, kl_coef=1.0)
    assert close(rewards, [[0, -0.2, 0, 3.0], [0, 0, 1.0, 0]])
    inputs = AdvantageInputs(rewards, scores, mask, group_ids=torch.tensor([0, 0]), gamma=1.0)
    adv, ret = compute_advantages("reinforce_pp_baseline", inputs)
    r0 = [-0.2, 0.0, 3.0 - 2.0]
    r1 = [0.0, 1.0 - 2.0]
    g0 = [sum(r0[i:]) for i in range(3)]  # [0.8, 1.0, 1.0]
    g1 = [sum(r1[i:]) for i in range(2)]  # [-1.0, -1.0]
    assert close(ret, [[0.0, *g0], [0.0, *g1, 0.0]])
    allg = g0 + g1
    mu, var = statistics.fmean(allg), statistics.pvariance(allg)
    white = [(g - mu) / math.sqrt(var + 1e-8) for g in allg]
    assert close(adv, [[0.0, *white[:3]], [0.0, *white[3:], 0.0]])


def test_whiten_statistics_shift_and_errors():
    values = t([[1.0, 2.0, NAN], [3.0, INF, 6.0]])
    mask = m([[1, 1, 0], [1, 0, 1]])
    xs = [1.0, 2.0, 3.0, 6.0]
    sd = math.sqrt(statistics.pvariance(xs) + 1e-8)
    out = whiten(values, mask)
    assert out[mask].tolist() == pytest.approx([(x - 3.0) / sd for x in xs], abs=1e-12)
    assert out[~mask].tolist() == [0.0, 0.0]
    assert whiten(values, mask, shift_mean=False)[mask].tolist() == pytest.approx([x / sd for x in xs], abs=1e-12)
    assert whiten(t([[5.0]]), m([[1]])).item() == 0.0  # one entry: defined, centred to 0
    with pytest.raises(ValueError, match="no entries"):
        whiten(values, torch.zeros_like(mask))


def test_advantage_inputs_validate_shapes_and_ranges():
    with pytest.raises(ValueError, match="scores"):
        AdvantageInputs(torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="gamma"):
        AdvantageInputs(torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), gamma=1.5)
    with pytest.raises(ValueError, match="integers"):
        AdvantageInputs(torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), group_ids=torch.zeros(2))


# ============================================================================================== PPO
# (log ratio, advantage) cases with clip_low=0.2, clip_high=0.3, dual_clip=3: expected loss, clipped, dual, grad
_PPO_CASES = [
    # ratio inside [0.8, 1.3]: unclipped, d loss / d logp = -A r
    (1.1, +1.0, -1.1, 0, 0, -1.1),
    (1.25, +1.0, -1.25, 0, 0, -1.25),  # clip-higher: inside 1.3 (a symmetric 0.2 would have clipped it)
    (0.9, -2.0, 1.8, 0, 0, 1.8),
    # A > 0: clipped above 1 + clip_high (no gradient), not below 1 - clip_low
    (1.5, +1.0, -1.3, 1, 0, 0.0),
    (0.5, +1.0, -0.5, 0, 0, -0.5),
    (5.0, +1.0, -1.3, 1, 0, 0.0),  # dual clip never applies to positive advantages
    # A < 0: clipped below 1 - clip_low, not above; dual clip bounds the loss by -c A = 3 |A|
    (0.5, -1.0, 0.8, 1, 0, 0.0),
    (1.5, -1.0, 1.5, 0, 0, 1.5),
    (5.0, -1.0, 3.0, 0, 1, 0.0),
    (1.7, 0.0, 0.0, 0, 0, 0.0),  # zero advantage: zero loss, not clipped
]


def _ppo_tensors(cases, pad_with_garbage=True):
    ratios = [c[0] for c in cases]
    old = [-1.0 - 0.1 * i for i in range(len(cases))]
    logps = [o + math.log(r) for o, r in zip(old, ratios)]
    adv = [c[1] for c in cases]
    if pad_with_garbage:  # one extra masked-out column holding garbage
        logps, old, adv = logps + [NAN], old + [-INF], adv + [INF]
    mask = [1] * len(cases) + ([0] if pad_with_garbage else [])
    return t([logps]).requires_grad_(True), t([old]), t([adv]), m([mask])


def test_ppo_clip_and_dual_clip_by_hand():
    logps, old, adv, mask = _ppo_tensors(_PPO_CASES)
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.3, dual_clip=3.0)
    loss, stats = policy_loss("ppo", logps, old, adv, mask, cfg)
    n = len(_PPO_CASES)
    assert loss[0, :n].tolist() == pytest.approx([c[2] for c in _PPO_CASES], abs=1e-9)
    assert loss[0, n].item() == 0.0
    assert stats["clipped"][0].tolist() == [c[3] for c in _PPO_CASES] + [0]
    assert stats["dual_clipped"][0].tolist() == [c[4] for c in _PPO_CASES] + [0]
    assert stats["ratio"][0, :n].tolist() == pytest.approx([c[0] for c in _PPO_CASES], abs=1e-9)
    kl = [(r - 1) - math.log(r) for r, *_ in _PPO_CASES]
    assert stats["approx_kl"][0, :n].tolist() == pytest.approx(kl, abs=1e-9)
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    assert grad[0, :n].tolist() == pytest.approx([c[5] for c in _PPO_CASES], abs=1e-9)
    assert grad[0, n].item() == 0.0  # garbage in the padding reaches neither the loss nor the gradient
    assert all(not v.requires_grad for v in stats.values())


def test_ppo_without_dual_clip_is_unbounded_for_negative_advantages():
    logps, old, adv, mask = _ppo_tensors([(5.0, -1.0, None, None, None, None)], pad_with_garbage=False)
    loss, stats = policy_loss("ppo", logps, old, adv, mask, PolicyLossConfig())
    assert loss.item() == pytest.approx(5.0) and stats["dual_clipped"].item() == 0


def test_ppo_truncated_importance_sampling():
    logps, old, adv, mask = _ppo_tensors([(1.1, 1.0, None, None, None, None)] * 3, pad_with_garbage=False)
    # old - rollout = log 3 (capped at 2), log 1.5, log 0.5
    rollout = old - t([[math.log(3.0), math.log(1.5), math.log(0.5)]])
    cfg = PolicyLossConfig(tis_cap=2.0)
    loss, stats = policy_loss("ppo", logps, old, adv, mask, cfg, rollout_logps=rollout)
    assert stats["tis_weight"][0].tolist() == pytest.approx([2.0, 1.5, 0.5])
    assert stats["tis_capped"][0].tolist() == [1.0, 0.0, 0.0]
    assert loss[0].tolist() == pytest.approx([-1.1 * 2.0, -1.1 * 1.5, -1.1 * 0.5])
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    assert grad[0].tolist() == pytest.approx([-1.1 * 2.0, -1.1 * 1.5, -1.1 * 0.5])  # weight is a constant
    with pytest.raises(ValueError, match="rollout_logps"):
        policy_loss("ppo", logps, old, adv, mask, cfg)
    with pytest.raises(ValueError, match="tis_cap"):
        policy_loss("ppo", logps, old, adv, mask, PolicyLossConfig(), rollout_logps=rollout)


@pytest.mark.parametrize(
    "kwargs", [{"dual_clip": 1.0}, {"dual_clip": 0.5}, {"clip_low": 1.5}, {"clip_high": -0.1}, {"tis_cap": 0.0}]
)
def test_policy_loss_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        PolicyLossConfig(**kwargs)


def test_clip_low_one_is_no_lower_bound():
    """``clip_low = 1`` clips the ratio below at 0, which a positive ratio never reaches: PPO's loss for ``A < 0``
    is then unclipped below (as CISPO's paper sets its weight)."""
    old = t([[0.0, 0.0]])
    logps = t([[-3.0, -0.05]]).requires_grad_(True)
    adv = t([[-1.0, -1.0]])
    loss, stats = policy_loss("ppo", logps, old, adv, m([[1, 1]]), PolicyLossConfig(clip_low=1.0, clip_high=0.2))
    assert loss[0].tolist() == pytest.approx([math.exp(-3.0), math.exp(-0.05)])
    assert stats["clipped"].tolist() == [[0, 0]]


# ============================================================================================== CISPO
def test_cispo_by_hand():
    """Each token's loss is ``-sg(clip(r, 1 - low, 1 + high)) A log pi``: its gradient ``-w A`` never vanishes,
    where PPO's clip gives the tokens that left the range none."""
    mask = m([[1, 1, 1, 0], [1, 1, 0, 0]])
    old = t([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    delta = t([[0.1, 1.0, -1.5, NAN], [-0.3, 0.0, INF, 9.0]])  # garbage in the padding
    logps = (old + delta).requires_grad_(True)
    adv = t([[2.0, 2.0, -1.0, 5.0], [-1.0, 0.5, 1.0, 1.0]])
    cfg = PolicyLossConfig(clip_low=0.5, clip_high=1.0)  # weight in [0.5, 2]
    loss, stats = policy_loss("cispo", logps, old, adv, mask, cfg)
    r = [[math.exp(0.1), math.exp(1.0), math.exp(-1.5)], [math.exp(-0.3), 1.0]]
    w = [[r[0][0], 2.0, 0.5], [r[1][0], 1.0]]  # e^1 = 2.72 capped at 2, e^-1.5 = 0.22 raised to 0.5
    lp = [[-0.9, -1.0, -2.0], [-1.3, -1.0]]
    a = [[2.0, 2.0, -1.0], [-1.0, 0.5]]
    expected = [[-w[i][j] * a[i][j] * lp[i][j] for j in range(len(w[i]))] for i in range(2)]
    assert loss[0, :3].tolist() == pytest.approx(expected[0]) and loss[1, :2].tolist() == pytest.approx(expected[1])
    assert loss[0, 3] == 0 and (loss[1, 2:] == 0).all()
    assert stats["clipped"].tolist() == [[0, 1, 1, 0], [0, 0, 0, 0]]
    assert stats["ratio"][0, :3].tolist() == pytest.approx(r[0])
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    assert grad[0].tolist() == pytest.approx([-w[0][0] * 2.0, -2.0 * 2.0, 0.5, 0.0])
    assert grad[1].tolist() == pytest.approx([w[1][0], -0.5, 0.0, 0.0])
    ppo, _ = policy_loss("ppo", logps, old, adv, mask, cfg)
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), logps)
    assert ppo_grad[0, 1] == 0 and ppo_grad[0, 2] == 0  # the same two tokens: PPO's clip drops them


def test_cispo_on_policy_gradient_is_ppos():
    """At ``r = 1`` (the first update on fresh samples) CISPO's gradient is PPO's, ``-A grad log pi``."""
    gen = torch.Generator().manual_seed(3)
    mask = m(_random_response_mask(random.Random(3), 4, 6))
    old = -torch.rand(4, 6, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    grads = []
    for name in ("cispo", "ppo"):
        logps = old.clone().requires_grad_(True)
        loss, _ = policy_loss(name, logps, old, adv, mask, PolicyLossConfig(clip_low=1.0, clip_high=5.0))
        grads.append(torch.autograd.grad(aggregate_sum("token-mean", loss, mask), logps)[0])
    assert grads[0].abs().sum() > 0 and torch.equal(grads[0], grads[1])


def test_cispo_takes_a_behaviour_correction_and_refuses_dual_clip():
    old = t([[-1.0, -1.0]])
    logps = t([[-0.5, -1.0]]).requires_grad_(True)
    rollout = t([[-1.0, -2.0]])  # rho = 1, e^1 = 2.72 -> TIS at 2
    adv = t([[1.0, 1.0]])
    loss, stats = policy_loss("cispo", logps, old, adv, m([[1, 1]]), PolicyLossConfig(tis_cap=2.0), rollout)
    w = min(math.exp(0.5), 1.2)  # PolicyLossConfig's default range [0.8, 1.2]
    assert loss[0].tolist() == pytest.approx([w * 0.5, 2.0 * 1.0])
    assert stats["tis_weight"].tolist() == [[1.0, 2.0]] and stats["tis_capped"].tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="cispo.*dual_clip"):
        policy_loss("cispo", logps, old, adv, m([[1, 1]]), PolicyLossConfig(dual_clip=3.0))


# ============================================================================================== SAPO
def test_sapo_by_hand():
    """``-(4 / tau) sigmoid(tau (r - 1)) A``, tau by the advantage's sign; the gradient ``-4 s (1 - s) r A`` is
    smaller the further the ratio is from 1, where PPO's clip cuts it to 0 at a threshold."""
    mask = m([[1, 1, 1, 0], [1, 1, 0, 0]])
    old = t([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    delta = t([[0.0, 1.0, -0.7, NAN], [0.4, 0.0, INF, 9.0]])  # garbage in the padding
    logps = (old + delta).requires_grad_(True)
    adv = t([[2.0, 2.0, -1.0, 5.0], [-1.0, 0.0, 1.0, 1.0]])
    cfg = PolicyLossConfig(gate_tau_pos=2.0, gate_tau_neg=3.0)
    loss, stats = policy_loss("sapo", logps, old, adv, mask, cfg)

    def sig(x):
        return 1.0 / (1.0 + math.exp(-x))

    cells = [((0, 0), 0.0, 2.0, 2.0), ((0, 1), 1.0, 2.0, 2.0), ((0, 2), -0.7, -1.0, 3.0), ((1, 0), 0.4, -1.0, 3.0)]
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    for (i, j), d, a, tau in cells:
        r = math.exp(d)
        s_ = sig(tau * (r - 1.0))
        assert loss[i, j].item() == pytest.approx(-(4.0 / tau) * s_ * a, rel=1e-12)
        assert grad[i, j].item() == pytest.approx(-4.0 * s_ * (1.0 - s_) * r * a, rel=1e-12)
        assert stats["gate_grad"][i, j].item() == pytest.approx(4.0 * s_ * (1.0 - s_) * r, rel=1e-12)
    assert grad[0, 0].item() == pytest.approx(-2.0, rel=1e-15)  # r = 1: PPO's -A
    # r = e: PPO's clip gives this token no gradient, the gate less than a fifth of the unclipped -A r
    assert 0 < -grad[0, 1].item() < 0.2 * 2.0 * math.exp(1.0)
    assert loss[1, 1] == 0 and grad[1, 1] == 0  # A = 0
    assert (loss[0, 3] == 0) and (loss[1, 2:] == 0).all() and (grad[0, 3] == 0) and (grad[1, 2:] == 0).all()
    assert (stats["clipped"] == 0).all()


def test_sapo_takes_its_papers_temperatures_and_a_behaviour_correction():
    old = t([[-1.0, -1.0]])
    logps = t([[-0.5, -1.5]])
    rollout = t([[-1.0, -2.0]])  # rho = 1, e^1 -> TIS at 2
    adv = t([[1.0, -1.0]])
    loss, stats = policy_loss("sapo", logps, old, adv, m([[1, 1]]), PolicyLossConfig(tis_cap=2.0), rollout)
    r0, r1 = math.exp(0.5), math.exp(-0.5)
    expected = [-4.0 / (1 + math.exp(-(r0 - 1))), 2.0 * (4.0 / 1.05) / (1 + math.exp(-1.05 * (r1 - 1)))]
    assert loss[0].tolist() == pytest.approx(expected, rel=1e-12)  # the paper's tau 1.0 (A > 0), 1.05 (A < 0)
    assert stats["tis_weight"].tolist() == [[1.0, 2.0]]
    with pytest.raises(ValueError, match="sapo.*dual_clip"):
        policy_loss("sapo", logps, old, adv, m([[1, 1]]), PolicyLossConfig(dual_clip=3.0))
    for bad in (0.0, -1.0, INF):
        with pytest.raises(ValueError, match="gate_tau_neg"):
            PolicyLossConfig(gate_tau_neg=bad)


def test_every_policy_loss_has_a_clip_range_or_a_gate():
    for name in POLICY_LOSSES.names():
        entry = POLICY_LOSSES.get(name)
        assert (entry.clip_low is None) == (entry.clip_high is None) == (entry.gate_taus is not None), name
    with pytest.raises(ValueError, match="clip range"):
        PolicyLoss(fn=ppo_loss, paper="x", clip_low=0.2, clip_high=None)
    with pytest.raises(ValueError, match="clip range"):
        PolicyLoss(fn=ppo_loss, paper="x", clip_low=0.2, clip_high=0.2, gate_taus=(1.0, 1.0))


# ============================================================================================== GSPO
def test_gspo_sequence_ratio_by_hand():
    mask = m([[0, 1, 1, 0, 0], [0, 1, 1, 1, 0]])
    old = t([[0.0, -1.0, -2.0, 0.0, 0.0], [0.0, -1.0, -1.0, -1.0, 0.0]])
    delta = t([[9.0, 0.1, 0.3, NAN, 0.0], [0.0, -0.1, 0.0, 0.1, INF]])  # masked-out garbage
    logps = (old + delta).requires_grad_(True)
    adv = t([[0.0, 1.0, 1.0, 0.0, 0.0], [0.0, -2.0, -2.0, -2.0, 0.0]])
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.2)
    loss, stats = policy_loss("gspo", logps, old, adv, mask, cfg)
    s0 = math.exp((0.1 + 0.3) / 2)  # 1.2214 > 1.2: clipped, no gradient
    assert s0 > 1.2
    assert loss[0].tolist() == pytest.approx([0.0, -1.2, -1.2, 0.0, 0.0])
    assert loss[1].tolist() == pytest.approx([0.0, 2.0, 2.0, 2.0, 0.0])  # s1 = exp(0) = 1
    assert stats["clipped"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert stats["ratio"][0].tolist() == pytest.approx([0.0, s0, s0, 0.0, 0.0])
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    # GSPO-token: d/d logp_t of -A s_{i,t} = -A s_i (value s_i, gradient of log pi_t alone)
    assert close(grad, [[0.0] * 5, [0.0, 2.0, 2.0, 2.0, 0.0]])


def test_gspo_token_form_with_per_token_advantages():
    # s_i = exp(0) = 1 (inside the clip range); GSPO-token gives token t the gradient -A_t s_i d log pi_t, not the
    # gradient of the broadcast sequence ratio (which would spread (A_1 + A_2) / 2 over both tokens).
    old = t([[0.0, -1.0, -2.0]])
    logps = old.clone().requires_grad_(True)
    adv = t([[0.0, 1.0, 3.0]])
    loss, _ = policy_loss("gspo", logps, old, adv, m([[0, 1, 1]]), PolicyLossConfig())
    assert loss[0].tolist() == pytest.approx([0.0, -1.0, -3.0])
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    assert grad[0].tolist() == pytest.approx([0.0, -1.0, -3.0])


def test_gspo_with_seq_mean_token_mean_is_the_sequence_objective():
    gen = torch.Generator().manual_seed(1)
    mask = m(_random_response_mask(random.Random(1), 6, 9, holes=True))
    old = -torch.rand(6, 9, generator=gen, dtype=torch.float64)
    logps = (old + 0.05 * torch.randn(6, 9, generator=gen, dtype=torch.float64)).requires_grad_(True)
    seq_adv = torch.randn(6, generator=gen, dtype=torch.float64)
    cfg = PolicyLossConfig(clip_low=0.01, clip_high=0.02)
    loss, _ = policy_loss("gspo", logps, old, seq_adv[:, None].expand(6, 9), mask, cfg)
    ours = aggregate_sum("seq-mean-token-mean", loss, mask) / aggregate_count("seq-mean-token-mean", mask)
    (g_ours,) = torch.autograd.grad(ours, logps)
    # the paper's sequence-level objective, written directly
    terms = []
    for b in range(6):
        idx = mask[b].nonzero().squeeze(-1)
        if len(idx) == 0:
            continue
        s = torch.exp((logps[b, idx] - old[b, idx]).mean())
        a = seq_adv[b]
        terms.append(torch.maximum(-a * s, -a * s.clamp(1 - 0.01, 1 + 0.02)))
    paper = torch.stack(terms).mean()
    (g_paper,) = torch.autograd.grad(paper, logps)
    assert ours.item() == pytest.approx(paper.item(), abs=1e-12)
    assert torch.allclose(g_ours, g_paper, atol=1e-12)
    assert g_paper.abs().sum() > 0


def test_gspo_rejects_token_level_corrections():
    x = t([[0.0, -1.0]])
    with pytest.raises(ValueError, match="gspo"):
        policy_loss("gspo", x, x, x, m([[0, 1]]), PolicyLossConfig(dual_clip=3.0))


# ============================================================================================== value loss
def test_value_loss_clipping_by_hand():
    values = t([[1.5, 1.1, 0.5, 3.0]]).requires_grad_(True)
    old = t([[1.0, 1.0, 1.0, 0.0]])
    ret = t([[2.0, 0.0, 2.0, NAN]])
    mask = m([[1, 1, 1, 0]])
    loss = value_loss(values, old, ret, clip=0.2, mask=mask)
    # 1.5 -> clipped to 1.2: max(0.25, 0.64) = 0.64 (clipped branch, no gradient)
    # 1.1 -> inside old +- 0.2: 1.21 either way; gradient v - R = 1.1
    # 0.5 -> clipped to 0.8: max(2.25, 1.44) = 2.25 (unclipped branch): gradient v - R = -1.5
    assert loss[0].tolist() == pytest.approx([0.5 * 0.64, 0.5 * 1.21, 0.5 * 2.25, 0.0])
    (grad,) = torch.autograd.grad(loss.sum(), values)
    assert grad[0].tolist() == pytest.approx([0.0, 1.1, -1.5, 0.0])
    unclipped = value_loss(values, old, ret, clip=None, mask=mask)
    assert unclipped[0].tolist() == pytest.approx([0.5 * 0.25, 0.5 * 1.21, 0.5 * 2.25, 0.0])
    with pytest.raises(ValueError, match="clip"):
        value_loss(values, old, ret, clip=-1.0)


# ============================================================================================== aggregation
def _rows(rng, n, max_len):
    """Random per-row token values, with very uneven lengths and some empty rows."""
    lengths = [rng.choice([0, 1, 2, max_len, rng.randint(1, max_len)]) for _ in range(n)]
    return [[rng.uniform(-3, 3) for _ in range(k)] for k in lengths]


def _pack(rows, width, rng, garbage=NAN):
    """Right-pad rows (each after a random-length prompt of masked-out garbage) into (B, width) tensors."""
    values = torch.full((len(rows), width), garbage, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        start = rng.randint(0, width - len(row))
        values[b, start : start + len(row)] = t(row)
        mask[b, start : start + len(row)] = True
    return values, mask


def _whole_batch_value(mode, rows):
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) for r in nonempty) / len(nonempty)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_is_invariant_to_any_split_and_padding(mode):
    rng = random.Random(sum(map(ord, mode)))
    rows = _rows(rng, 13, 9)
    rows[0] = [1.0] * 9  # guarantee uneven lengths and a non-empty batch
    expected = _whole_batch_value(mode, rows)
    for _ in range(20):
        order = list(range(len(rows)))
        rng.shuffle(order)
        cuts = sorted(rng.sample(range(1, len(rows)), rng.randint(0, 5)))
        pieces = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(rows)])]
        num, den = 0.0, 0
        for piece in pieces:
            part = [rows[i] for i in piece]
            width = max(len(r) for r in part) + rng.randint(0, 4)  # every piece padded to its own width
            values, mask = _pack(part, max(width, 1), rng)
            num = num + aggregate_sum(mode, values, mask)
            den += aggregate_count(mode, mask)
        assert num.item() / den == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_per_micro_batch_mean_is_not_split_invariant_for_token_mean():
    # micro-batch A: one row with one token of value 1; micro-batch B: one row with three tokens of value 0
    a_vals, a_mask = t([[1.0, 0.0, 0.0]]), m([[1, 0, 0]])
    b_vals, b_mask = t([[0.0, 0.0, 0.0]]), m([[1, 1, 1]])
    whole = 1.0 / 4.0
    mean_of_means = ((1.0 / 1.0) + (0.0 / 3.0)) / 2  # what averaging per micro-batch computes
    assert mean_of_means != pytest.approx(whole)
    num = aggregate_sum("token-mean", a_vals, a_mask) + aggregate_sum("token-mean", b_vals, b_mask)
    den = aggregate_count("token-mean", a_mask) + aggregate_count("token-mean", b_mask)
    assert den == 4 and num.item() / den == pytest.approx(whole)


def test_aggregation_counts_and_sums_by_hand_with_an_empty_row():
    values = t([[1.0, 2.0, NAN], [INF, 0.0, 0.0], [4.0, 5.0, 6.0]])
    mask = m([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert aggregate_count("token-mean", mask) == 5
    assert aggregate_count("seq-mean-token-mean", mask) == 2  # the empty row is not a sample
    assert aggregate_count("seq-mean-token-sum", mask) == 2
    assert aggregate_sum("token-mean", values, mask).item() == pytest.approx(18.0)
    assert aggregate_sum("seq-mean-token-mean", values, mask).item() == pytest.approx(1.5 + 5.0)
    assert aggregate_sum("seq-mean-token-sum", values, mask).item() == pytest.approx(3.0 + 15.0)
    with pytest.raises(ValueError, match="0/1"):
        aggregate_count("token-mean", t([[0.5, 1.0]]))


def test_aggregation_gradient_ignores_garbage_and_weights_tokens_correctly():
    values = t([[1.0, 2.0, NAN], [3.0, INF, 0.0]]).requires_grad_(True)
    mask = m([[1, 1, 0], [1, 0, 0]])
    (g,) = torch.autograd.grad(aggregate_sum("seq-mean-token-mean", values, mask), values)
    assert g.tolist() == [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]
    (g,) = torch.autograd.grad(aggregate_sum("token-mean", values, mask), values)
    assert g.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


# ============================================================================================== padding
def _with_garbage_padding(x, mask, extra, value):
    """Fill masked-out entries with ``value`` and append ``extra`` masked-out columns of it."""
    x = torch.where(mask, x, torch.full_like(x, value))
    pad_x = torch.full((x.shape[0], extra), value, dtype=x.dtype)
    pad_m = torch.zeros(x.shape[0], extra, dtype=torch.bool)
    return torch.cat([x, pad_x], 1), torch.cat([mask, pad_m], 1)


@pytest.mark.parametrize("name", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_padding_never_affects_advantages(name):
    gen = torch.Generator().manual_seed(3)
    mask = m(_random_response_mask(random.Random(3), 6, 8))
    rewards = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    scores = torch.randn(6, generator=gen, dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    clean = AdvantageInputs(
        torch.where(mask, rewards, 0.0), scores, mask, torch.where(mask, values, 0.0), ids, gamma=0.9, lam=0.8
    )
    adv, ret = compute_advantages(name, clean)
    assert adv.abs().sum() > 0
    for garbage in (NAN, INF, 1e6):
        r2, mask2 = _with_garbage_padding(rewards, mask, 3, garbage)
        v2, _ = _with_garbage_padding(values, mask, 3, garbage)
        adv2, ret2 = compute_advantages(name, AdvantageInputs(r2, scores, mask2, v2, ids, gamma=0.9, lam=0.8))
        assert torch.allclose(adv2[:, :8], adv, atol=1e-12, rtol=0) and (adv2[:, 8:] == 0).all()
        assert torch.allclose(ret2[:, :8], ret, atol=1e-12, rtol=0) and (ret2[:, 8:] == 0).all()
        assert (adv2[~mask2] == 0).all() and (ret2[~mask2] == 0).all()


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "sapo"])
def test_padding_never_affects_policy_losses_or_gradients(name):
    gen = torch.Generator().manual_seed(4)
    mask = m(_random_response_mask(random.Random(4), 5, 7))
    old = -torch.rand(5, 7, generator=gen, dtype=torch.float64)
    logps = old + 0.3 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    adv = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    entry = POLICY_LOSSES.get(name)
    cfg = PolicyLossConfig(
        clip_low=0.1,
        clip_high=0.15,
        dual_clip=2.0 if entry.dual_clip else None,
        tis_cap=1.5 if entry.behaviour_corrections else None,
    )
    noise = 0.2 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    rollout = old + noise if entry.behaviour_corrections else None

    def run(lp, o, a, mk, ro):
        lp = lp.clone().requires_grad_(True)
        loss, stats = policy_loss(name, lp, o, a, mk, cfg, rollout_logps=ro)
        (g,) = torch.autograd.grad(aggregate_sum("token-mean", loss, mk), lp)
        return loss.detach(), stats, g

    loss, stats, grad = run(logps, old, adv, mask, rollout)
    assert loss.abs().sum() > 0 and grad.abs().sum() > 0
    for garbage in (NAN, -INF, 50.0):
        lp2, mask2 = _with_garbage_padding(logps, mask, 2, garbage)
        o2, _ = _with_garbage_padding(old, mask, 2, garbage)
        a2, _ = _with_garbage_padding(adv, mask, 2, garbage)
        ro2 = _with_garbage_padding(rollout, mask, 2, garbage)[0] if rollout is not None else None
        loss2, stats2, grad2 = run(lp2, o2, a2, mask2, ro2)
        assert torch.allclose(loss2[:, :7], loss, atol=1e-12, rtol=0) and (loss2[~mask2] == 0).all()
        assert torch.isfinite(grad2).all() and torch.allclose(grad2[:, :7], grad, atol=1e-12, rtol=0)
        for key, value in stats.items():
            assert torch.allclose(stats2[key][:, :7], value, atol=1e-12, rtol=0) and (stats2[key][~mask2] == 0).all()


def test_padding_never_affects_value_loss_with_a_mask():
    gen = torch.Generator().manual_seed(5)
    mask = m(_random_response_mask(random.Random(5), 4, 6))
    v, old, ret = (torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    base = value_loss(v, old, ret, clip=0.3, mask=mask)
    v2, mask2 = _with_garbage_padding(v, mask, 2, NAN)
    v2.requires_grad_(True)
    old2, _ = _with_garbage_padding(old, mask, 2, INF)
    ret2, _ = _with_garbage_padding(ret, mask, 2, NAN)
    out = value_loss(v2, old2, ret2, clip=0.3, mask=mask2)
    assert torch.equal(out[:, :6], base) and (out[~mask2] == 0).all()
    (g,) = torch.autograd.grad(out.sum(), v2)
    assert torch.isfinite(g).all() and (g[~mask2] == 0).all()


# ============================================================================================== registries
@pytest.mark.parametrize(
    "registry, expected",
    [
        (KL_ESTIMATORS, ["k1", "k2", "k3"]),
        (ADVANTAGE_ESTIMATORS, ["dr_grpo", "gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]),
        (POLICY_LOSSES, ["cispo", "gspo", "ppo", "sapo"]),
        (LOSS_AGGREGATIONS, ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"]),
    ],
)
def test_registry_errors_list_valid_names(registry, expected):
    assert registry.names() == expected
    with pytest.raises(UnknownNameError) as err:
        registry.get("bogus-name")
    for name in expected:
        assert name in str(err.value).split("Valid names: ")[1]


def test_public_functions_report_unknown_names():
    x = t([[0.0, -1.0]])
    cases = [
        (lambda: kl_estimate("k4", x, x), "k3"),
        (lambda: compute_advantages("gpro", AdvantageInputs(x, t([0.0]), m([[0, 1]]))), "grpo"),
        (lambda: policy_loss("ppo2", x, x, x, m([[0, 1]]), PolicyLossConfig()), "ppo"),
        (lambda: aggregate_sum("token_mean", x, m([[0, 1]])), "token-mean"),
        (lambda: aggregate_count("seq-mean", m([[0, 1]])), "seq-mean-token-sum"),
    ]
    for call, valid in cases:
        with pytest.raises(UnknownNameError, match="Valid names") as err:
            call()
        assert valid in str(err.value)
