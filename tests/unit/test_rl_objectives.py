"""RL objectives on a tiny in-process Qwen2 (float64, so exactness checks are not blurred by rounding):
hand-computed losses at ratio 1, micro-batch split invariance of losses, metrics and gradients, the value
alignment, and the score functions against direct computations."""

from __future__ import annotations

import pytest
import torch
from shared_helpers import padded_rows, tiny_float64_policy, tiny_qwen_config

from rlhf.batch import Batch
from rlhf.objectives.actor_critic import (
    PolicyObjective,
    SequenceScores,
    TokenLogps,
    TokenValues,
    ValueObjective,
    response_mask,
    token_values,
)
from rlhf.objectives.base import add_sums
from rlhf.ops.aggregation import LOSS_AGGREGATIONS
from rlhf.ops.logprobs import token_logprobs
from rlhf.ops.policy_loss import PolicyLossConfig
from rlhf.registry import UnknownNameError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # this module's maths on one thread

VOCAB = 64
# (prompt length, response length) per row: uneven, so the 2+1+1 split re-pads every piece differently.
LENGTHS = [(3, 5), (2, 1), (4, 7), (1, 3)]
AGG_MODES = LOSS_AGGREGATIONS.names()


@pytest.fixture(scope="module")
def policy():
    return tiny_float64_policy(VOCAB)


@pytest.fixture(scope="module")
def critic():
    import transformers

    torch.manual_seed(1)
    cfg = tiny_qwen_config(VOCAB)
    cfg.num_labels = 1
    model = transformers.Qwen2ForSequenceClassification(cfg).double()
    with torch.no_grad():  # HF initialises the head with std 0.02; make values O(1) so clipping matters
        model.score.weight.normal_(0.0, 0.5)
    return model


def make_batch(seed: int = 0, lengths=LENGTHS) -> Batch:
    """Right-padded batch; token ids avoid the pad id 0 (so HF's pad-id pooling finds the same last token)."""
    ids, attn, loss_mask = padded_rows(lengths, VOCAB, torch.Generator().manual_seed(seed))
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, sample_index=torch.arange(len(lengths)))


def split_2_1_1(batch: Batch):
    return [batch.slice(0, 2).trim(), batch.slice(2, 3).trim(), batch.slice(3, 4).trim()]


def randn(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def grads(model):
    return torch.cat([p.grad.reshape(-1).clone() for p in model.parameters() if p.grad is not None])


def run_whole_and_split(model, objective, batch):
    """(whole metrics, split metrics, whole grad, split grad, whole normalized loss, split normalized loss)."""
    count = objective.count(batch)
    model.zero_grad(set_to_none=True)
    loss, sums = objective.loss(model, batch)
    (loss / count).backward()
    whole_grad = grads(model)

    parts = split_2_1_1(batch)
    assert [p.input_ids.shape[1] for p in parts] == [8, 11, 4]  # each piece really was re-padded
    total_count = sum(objective.count(p) for p in parts)
    assert total_count == count
    model.zero_grad(set_to_none=True)
    split_sums, split_loss = {}, 0.0
    for part in parts:
        part_loss, part_sums = objective.loss(model, part)
        (part_loss / total_count).backward()
        split_loss += part_loss.item()
        split_sums = add_sums(split_sums, part_sums)
    split_grad = grads(model)
    model.zero_grad(set_to_none=True)
    return (
        objective.finalize(sums, count),
        objective.finalize(split_sums, total_count),
        whole_grad,
        split_grad,
        loss.item() / count,
        split_loss / total_count,
    )


def assert_same_split(whole_m, split_m, whole_g, split_g, whole_l, split_l):
    # 1e-6, fp32's bound: a float64 model still has float32 islands inside transformers' Qwen2 (RMSNorm statistics,
    # rotary angles); the float64 agreement of whole training steps is test_fp64.py's.
    assert whole_l == pytest.approx(split_l, rel=1e-6, abs=1e-9)
    assert whole_m.keys() == split_m.keys()
    for key in whole_m:
        assert split_m[key] == pytest.approx(whole_m[key], rel=1e-6, abs=1e-9), key
    assert whole_g.abs().max() > 0
    torch.testing.assert_close(split_g, whole_g, rtol=1e-6, atol=1e-6 * float(whole_g.abs().max()))


# ============================================================================================== actor
def _rl_fields(policy, batch, temperature=1.0, seed=10, old_noise=0.0):
    mask = response_mask(batch)
    with torch.no_grad():  # experience making is forward-only (the workers' score runs under no_grad)
        old = TokenLogps(temperature)(policy, batch)
    if old_noise:
        old = old + torch.where(mask, randn(old.shape, seed, old_noise), 0.0).float()
    # Advantages are large garbage outside the mask: the objective must ignore them.
    adv = torch.where(mask, randn(mask.shape, seed + 1), torch.full(mask.shape, 100.0, dtype=torch.float64))
    return mask, old, adv.float()


def test_policy_ratio_one_is_minus_mean_advantage(policy):
    batch = make_batch(0)
    mask, old, adv = _rl_fields(policy, batch)
    batch = batch.replace(old_logps=old, advantages=adv)
    obj = PolicyObjective()
    count = obj.count(batch)
    assert count == sum(r for _, r in LENGTHS)
    loss, sums = obj.loss(policy, batch)
    expected = -float((adv.double() * mask).sum()) / count
    metrics = obj.finalize(sums, count)
    assert loss.item() / count == pytest.approx(expected, rel=1e-6)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-6)
    assert metrics["policy_loss"] == pytest.approx(expected, rel=1e-6)
    assert metrics["clip_frac"] == 0.0
    assert abs(metrics["approx_kl"]) < 1e-12
    assert metrics["num_tokens"] == count
    assert "kl" not in metrics and "logp_mismatch" not in metrics  # nothing to report without ref / rollout


def _manual_terms(policy, batch, temperature):
    """Per-token log-probs and entropies of softmax(logits[t-1] / T) placed at column t (column 0 = 0), computed
    from scratch with plain autograd (differentiable)."""
    logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    zero = torch.zeros(logits.shape[0], 1, dtype=logits.dtype)
    logp = torch.cat([zero, logp_all[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)], dim=1)
    h = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.cat([zero, h[:, :-1]], dim=1)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_policy_entropy_and_kl_terms_add_exactly(policy, temperature):
    batch = make_batch(1)
    mask, old, adv = _rl_fields(policy, batch, temperature)
    delta = randn(mask.shape, 5, 0.5)  # ref - policy on the mask
    ref = torch.where(mask, old.double() + delta, torch.full(mask.shape, float("nan"), dtype=torch.float64)).float()
    delta = ref.double() - old.double()  # what the float32 round trip actually stored
    rollout = torch.where(mask, old.double() + randn(mask.shape, 6, 0.1), 0.0).float()
    batch = batch.replace(old_logps=old, advantages=adv, ref_logps=ref, rollout_logps=rollout)
    count = int(mask.sum())

    # The expected loss, built by hand and differentiable: ratio 1 (unclipped), so pg = -A r per token.
    logp, entropy = _manual_terms(policy, batch, temperature)
    log_r = logp - torch.where(mask, ref.double(), 0.0)  # finite everywhere: padding NaN must not reach grads
    k3 = torch.expm1(-log_r) + log_r
    pg = -adv.double() * torch.exp(logp - old.double())
    masked_mean = lambda x: torch.where(mask, x, 0.0).sum() / count  # noqa: E731
    mean = lambda x: float(masked_mean(x.detach()))  # noqa: E731
    expected_loss = masked_mean(pg - 0.05 * entropy + 0.2 * k3)
    policy.zero_grad(set_to_none=True)
    expected_loss.backward()
    expected_grad = grads(policy)
    assert expected_loss.item() == pytest.approx(
        -mean(adv.double()) - 0.05 * mean(entropy) + 0.2 * mean(torch.expm1(delta) - delta), rel=1e-6
    )

    obj = PolicyObjective(temperature=temperature, entropy_coef=0.05, kl_loss_coef=0.2)
    policy.zero_grad(set_to_none=True)
    loss, sums = obj.loss(policy, batch)
    (loss / obj.count(batch)).backward()
    got_grad = grads(policy)
    policy.zero_grad(set_to_none=True)
    metrics = obj.finalize(sums, obj.count(batch))
    assert loss.item() / count == pytest.approx(expected_loss.item(), rel=1e-6)
    assert metrics["loss"] == pytest.approx(expected_loss.item(), rel=1e-6)
    # Every term's gradient is there (a detached entropy or KL term would leave the value right, not this).
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-6, atol=1e-9 * float(expected_grad.abs().max()))
    assert metrics["policy_loss"] == pytest.approx(-mean(adv.double()), rel=1e-6)
    assert metrics["entropy"] == pytest.approx(mean(entropy), rel=1e-9)
    assert metrics["kl"] == pytest.approx(mean(k3), rel=1e-6)
    assert metrics["logp_mismatch"] == pytest.approx(mean((old.double() - rollout.double()).abs()), rel=1e-9)
    assert metrics["logp_mismatch"] > 0

    # Without the coefficients the loss is the pg part alone, and entropy / kl are still reported.
    plain = PolicyObjective(temperature=temperature)
    loss0, sums0 = plain.loss(policy, batch)
    metrics0 = plain.finalize(sums0, count)
    assert loss0.item() / count == pytest.approx(-mean(adv.double()), rel=1e-6)
    assert metrics0["entropy"] == pytest.approx(mean(entropy), rel=1e-9)
    assert metrics0["kl"] == pytest.approx(mean(k3), rel=1e-6)


def _per_row(agg_mode: str, mask: torch.Tensor, length: int) -> float:
    """The largest value a 0/1 per-token statistic can take under ``agg_mode``: 1 for the means, the mean tokens per
    row for a token sum (over ``length`` for the per-length one)."""
    if agg_mode.startswith("seq-mean-token-sum"):
        return float(mask.sum()) / len(mask) / (length if agg_mode.endswith("-norm") else 1)
    return 1.0


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_policy_split_matches_whole_batch(policy, agg_mode):
    temperature = 0.9
    batch = make_batch(2)
    mask, old, adv = _rl_fields(policy, batch, temperature, seed=20, old_noise=0.5)
    ref = torch.where(mask, old.double() + randn(mask.shape, 30, 0.3), 0.0).float()
    rollout = torch.where(mask, old.double() + randn(mask.shape, 31, 0.3), 0.0).float()
    batch = batch.replace(old_logps=old, advantages=adv, ref_logps=ref, rollout_logps=rollout)
    obj = PolicyObjective(
        clip=PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=1.5, tis_cap=1.2),
        agg_mode=agg_mode,
        agg_length=batch.input_ids.shape[1],
        temperature=temperature,
        entropy_coef=0.01,
        kl_loss_coef=0.1,
        correct_off_policy=True,
    )
    result = run_whole_and_split(policy, obj, batch)
    whole_metrics = result[0]
    # The clipped branch, the dual clip and the TIS cap are really exercised (and not everywhere: under the
    # token-sum modes a "fraction" is a count per sequence (over L), so compare with the tokens per row).
    mask = response_mask(batch)
    per_row = _per_row(agg_mode, mask, batch.input_ids.shape[1])
    assert 0 < whole_metrics["clip_frac"] < per_row
    assert 0 < whole_metrics["dual_clip_frac"] < per_row
    assert 0 < whole_metrics["tis_capped_frac"] < per_row
    # The metrics use the loss's own aggregation: the total is exactly the combination of its reported parts.
    combined = whole_metrics["policy_loss"] - 0.01 * whole_metrics["entropy"] + 0.1 * whole_metrics["kl"]
    assert whole_metrics["loss"] == pytest.approx(combined, rel=1e-9)
    assert_same_split(*result)


def test_policy_per_micro_batch_mean_would_differ(policy):
    """The split test has teeth: averaging inside each micro-batch gives a different number on this batch."""
    batch = make_batch(2)
    mask, old, adv = _rl_fields(policy, batch, seed=20, old_noise=0.3)
    batch = batch.replace(old_logps=old, advantages=adv)
    obj = PolicyObjective()
    whole = obj.loss(policy, batch)[0].item() / obj.count(batch)
    parts = split_2_1_1(batch)
    naive = sum(obj.loss(policy, p)[0].item() / obj.count(p) for p in parts) / len(parts)
    assert abs(naive - whole) > 1e-3


def test_policy_gspo_split_matches_whole_batch(policy):
    batch = make_batch(3)
    mask, old, adv = _rl_fields(policy, batch, seed=40, old_noise=0.05)
    batch = batch.replace(old_logps=old, advantages=adv)
    obj = PolicyObjective(
        loss_type="gspo", clip=PolicyLossConfig(clip_low=0.01, clip_high=0.01), agg_mode="seq-mean-token-mean"
    )
    assert_same_split(*run_whole_and_split(policy, obj, batch))


def test_count_ignores_column_zero_and_validation():
    batch = make_batch(0)
    lm = batch.loss_mask.clone()
    lm[:, 0] = 1  # column 0 is never a target
    batch = batch.replace(loss_mask=lm)
    assert PolicyObjective().count(batch) == sum(r for _, r in LENGTHS)
    assert ValueObjective(agg_mode="seq-mean-token-sum").count(batch) == len(LENGTHS)
    assert batch.loss_mask[:, 0].all()  # the batch's own mask is not modified

    with pytest.raises(UnknownNameError, match="ppo"):
        PolicyObjective(loss_type="ppo2")
    with pytest.raises(UnknownNameError, match="token-mean"):
        PolicyObjective(agg_mode="token_mean")
    with pytest.raises(UnknownNameError, match="k3"):
        PolicyObjective(kl_estimator="k4")
    with pytest.raises(ValueError, match="tis_cap"):
        PolicyObjective(correct_off_policy=True)
    with pytest.raises(ValueError, match="correct_off_policy"):
        PolicyObjective(clip=PolicyLossConfig(tis_cap=2.0))
    with pytest.raises(ValueError, match="gspo"):
        PolicyObjective(loss_type="gspo", clip=PolicyLossConfig(dual_clip=3.0))
    with pytest.raises(ValueError):
        ValueObjective(clip=0.0)
    with pytest.raises(UnknownNameError):
        ValueObjective(agg_mode="sum")


def test_policy_missing_fields_are_named(policy):
    batch = make_batch(0)
    mask, old, adv = _rl_fields(policy, batch)
    with pytest.raises(ValueError, match="old_logps"):
        PolicyObjective().loss(policy, batch.replace(advantages=adv))
    with pytest.raises(ValueError, match="ref_logps"):
        PolicyObjective(kl_loss_coef=0.1).loss(policy, batch.replace(old_logps=old, advantages=adv))
    with pytest.raises(ValueError, match="rollout_logps"):
        PolicyObjective(clip=PolicyLossConfig(tis_cap=2.0), correct_off_policy=True).loss(
            policy, batch.replace(old_logps=old, advantages=adv)
        )


# ============================================================================================== critic
def test_token_values_shift(critic):
    batch = make_batch(4)
    got = token_values(critic, batch)
    with torch.no_grad():
        hidden = critic.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        head = hidden @ critic.score.weight.reshape(-1)  # the head applied to every position, by hand
    assert got.shape == batch.input_ids.shape and got.dtype == torch.float64  # a float64 model's values stay float64
    assert (got[:, 0] == 0).all()
    torch.testing.assert_close(got[:, 1:].double(), head[:, :-1], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got[:, 1:].double(), head[:, 1:], atol=1e-3)  # an unshifted version would fail

    # Value at column t is the state before token t: changing token t leaves columns <= t unchanged.
    ids = batch.input_ids.clone()
    ids[2, 6] = ids[2, 6] % (VOCAB - 1) + 1
    changed = token_values(critic, batch.replace(input_ids=ids))
    assert torch.equal(changed[2, :7], got[2, :7])
    assert not torch.allclose(changed[2, 7:11], got[2, 7:11])
    torch.testing.assert_close(TokenValues()(critic, batch), got.detach(), rtol=0, atol=0)


def test_value_loss_hand_values(critic):
    batch = make_batch(5)
    mask = response_mask(batch)
    with torch.no_grad():
        v = TokenValues()(critic, batch).double()
    returns = torch.where(mask, v + randn(mask.shape, 50), 0.0)
    count = int(mask.sum())
    mean = lambda x: float(torch.where(mask, x, 0.0).sum()) / count  # noqa: E731
    obj = ValueObjective(clip=0.2)

    # Old values equal the current ones: the clipped branch equals the unclipped one and is never "active".
    at_old = batch.replace(values=v.float(), returns=returns.float())
    loss, sums = obj.loss(critic, at_old)
    m = obj.finalize(sums, obj.count(at_old))
    r = returns.float().double()
    assert loss.item() / count == pytest.approx(0.5 * mean((v - r) ** 2), rel=1e-6)
    assert m["value_clip_frac"] == 0.0
    assert m["values"] == pytest.approx(mean(v), rel=1e-6)

    # Old values 1 above: V_clip = V_old - 0.2 = V + 0.8, so the clipped branch wins iff 0.8 + 2 (V - R) > 0.
    shifted = batch.replace(values=(v + 1.0).float(), returns=returns.float())
    loss, sums = obj.loss(critic, shifted)
    m = obj.finalize(sums, count)
    active = (v - r) > -0.4
    expected = 0.5 * torch.where(active, (v + 0.8 - r) ** 2, (v - r) ** 2)
    assert loss.item() / count == pytest.approx(mean(expected), rel=1e-5)
    assert m["value_clip_frac"] == pytest.approx(mean(active.double()), abs=1e-12)
    assert 0 < m["value_clip_frac"] < 1


@pytest.mark.parametrize("clip", [0.2, None])
@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_value_split_matches_whole_batch(critic, agg_mode, clip):
    batch = make_batch(6)
    mask = response_mask(batch)
    with torch.no_grad():
        v = TokenValues()(critic, batch).double()
    old = torch.where(mask, v + randn(mask.shape, 60, 0.3), 0.0).float()
    returns = torch.where(mask, v + randn(mask.shape, 61), 0.0).float()
    batch = batch.replace(values=old, returns=returns)
    obj = ValueObjective(clip=clip, agg_mode=agg_mode, agg_length=batch.input_ids.shape[1])
    result = run_whole_and_split(critic, obj, batch)
    per_row = _per_row(agg_mode, mask, batch.input_ids.shape[1])
    if clip is not None:
        assert 0 < result[0]["value_clip_frac"] < per_row
    else:
        assert result[0]["value_clip_frac"] == 0
    assert_same_split(*result)


# ============================================================================================== score fns
def test_token_logps_matches_ops(policy):
    batch = make_batch(7)
    got = TokenLogps(temperature=0.7)(policy, batch)
    with torch.no_grad():
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = torch.log_softmax(logits / 0.7, dim=-1)
    assert got.dtype == torch.float64 and got.shape == batch.input_ids.shape  # float64 model: float64 (fp64 runs)
    torch.testing.assert_close(got, token_logprobs(logits, batch.input_ids, 0.7), rtol=0, atol=0)
    # ... and that is the log-prob of token t under the distribution at t - 1, by hand.
    by_hand = logp[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    assert (got[:, 0] == 0).all()
    torch.testing.assert_close(got[:, 1:].double(), by_hand, rtol=1e-6, atol=1e-6)


def test_sequence_scores_match_hf_pooling(critic):
    batch = make_batch(8)
    got = SequenceScores()(critic, batch)
    with torch.no_grad():
        hf = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.squeeze(-1)
    assert got.shape == (len(LENGTHS),) and got.dtype == torch.float64  # float64 model: float64 (fp64 runs)
    full = batch.attention_mask.all(-1)
    assert full.any() and not full.all()  # both an unpadded and padded rows
    # HF pools at the last non-pad id; the ids avoid the pad id, so it must agree on every row.
    torch.testing.assert_close(got.double(), hf, rtol=1e-6, atol=1e-6)
    assert len(set(got.tolist())) == len(LENGTHS)


@pytest.mark.parametrize("mode", ["whiten", "scale"])
def test_advantage_whitening_options_use_the_whole_rollout_batch(mode):
    from rlhf.rl import advantages_for

    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1]])
    batch = Batch(
        input_ids=torch.ones(4, 4, dtype=torch.long), attention_mask=torch.ones(4, 4, dtype=torch.long), loss_mask=mask
    )
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    kwargs = dict(estimator="rloo", gamma=1.0, lam=1.0, kl_coef=0.0, kl_estimator="k3", kl_in_reward=False)
    raw, _ = advantages_for(batch, scores, torch.tensor([0, 0, 1, 1]), **kwargs)
    out, _ = advantages_for(batch, scores, torch.tensor([0, 0, 1, 1]), whiten_advantages=mode, **kwargs)
    on = mask.bool()
    a, r = out.advantages[on].double(), raw.advantages[on].double()
    assert torch.all(out.advantages[~on] == 0)
    if mode == "whiten":
        assert abs(float(a.mean())) < 1e-6 and abs(float(a.var(unbiased=False)) - 1.0) < 1e-4
    else:  # a pure rescaling by the batch std: signs and ratios kept
        assert torch.equal(torch.sign(a), torch.sign(r))
        assert torch.allclose(a, r / r.std(unbiased=False), atol=1e-5)
