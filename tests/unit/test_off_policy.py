"""Behaviour corrections (rlhf/ops/off_policy.py) against their formulas written out here element by element in
float64 Python (no call of the code under test): TIS, MIS, IcePop and sequence masking by the geometric-mean ratio;
the PPO loss with each one against the plain clipped surrogate times the weights; PolicyObjective whole vs split
into micro-batches with each one; and the config keys (algo.off_policy_*) with their refusals."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from shared_helpers import host_reads_outside_modules, padded_rows, tiny_float64_policy

from rlhf.batch import Batch
from rlhf.config.rl_schema import AlgorithmConfig, RewardConfig, RLRunConfig, RolloutConfig
from rlhf.config.schema import ConfigError, DataConfig, ModelConfig, TrainConfig
from rlhf.objectives.actor_critic import PolicyObjective, TokenLogps, response_mask
from rlhf.objectives.base import add_sums
from rlhf.ops.off_policy import BEHAVIOUR_CORRECTIONS, BehaviourCorrection, behaviour_weights
from rlhf.ops.policy_loss import PolicyLossConfig, policy_loss
from rlhf.registry import UnknownNameError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAN, INF = float("nan"), float("inf")

# Hand-made log rho = log pi_prox - log pi_behav per response token; None is padding. Row 0 straddles every token
# bound (0.3 / 0.6 / 1 / 1.5 / 2.5 / 6 against tis/mis high 2, icepop [0.5, 5]); rows 1-3 have geometric means
# inside [0.999, 1.001] (though single tokens leave it), above and below it; row 4 has no response token.
LOG_RHO = [
    [math.log(0.3), math.log(0.6), 0.0, math.log(1.5), math.log(2.5), math.log(6.0)],
    [0.01, -0.01, 0.0005, None, None, None],
    [None, 0.002, 0.003, None, None, None],
    [-0.004, None, None, None, None, None],
    [None, None, None, None, None, None],
]


def _tensors(dtype=torch.float64, garbage=NAN):
    """(proximal, behaviour, mask) from LOG_RHO; the padding of both log-prob tensors holds ``garbage``."""
    gen = torch.Generator().manual_seed(3)
    behaviour = -torch.rand(len(LOG_RHO), len(LOG_RHO[0]), generator=gen, dtype=torch.float64) * 3
    mask = torch.tensor([[x is not None for x in row] for row in LOG_RHO])
    log_rho = torch.tensor([[0.0 if x is None else x for x in row] for row in LOG_RHO], dtype=torch.float64)
    proximal = torch.where(mask, behaviour + log_rho, garbage)
    behaviour = torch.where(mask, behaviour, garbage)
    return proximal.to(dtype), behaviour.to(dtype), mask


# ------------------------------------------------------------------ the formulas, one element at a time, float64
def _reference(name: str, low, high, prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor):
    """(weight, masked, capped) as nested lists: the papers' formulas, token by token in Python floats."""
    rows = []
    for i in range(mask.shape[0]):
        keep = [bool(mask[i, t]) for t in range(mask.shape[1])]
        lr = [float(prox[i, t]) - float(behav[i, t]) if keep[t] else 0.0 for t in range(mask.shape[1])]
        n = sum(keep)
        geo = math.exp(sum(lr) / n) if n else 1.0
        row_out = not (low <= geo <= high) if name == "seq_mask" else False
        row = []
        for t, on in enumerate(keep):
            rho = math.exp(lr[t])
            if not on:
                row.append((1.0, False, False))
            elif name == "tis":
                row.append((min(rho, high), False, rho > high))
            elif name == "mis":
                row.append((rho if rho <= high else 0.0, rho > high, False))
            elif name == "icepop":
                inside = low <= rho <= high
                row.append((rho if inside else 0.0, not inside, False))
            else:  # seq_mask: rejection only
                row.append((0.0 if row_out else 1.0, row_out, False))
        rows.append(row)
    return (
        [[w for w, _, _ in r] for r in rows],
        [[mk for _, mk, _ in r] for r in rows],
        [[c for _, _, c in r] for r in rows],
    )


# (name, low, high) used below: each correction's defaults, and custom bounds.
CASES = [(name, None, None) for name in BEHAVIOUR_CORRECTIONS.names()] + [
    ("tis", None, 1.2),
    ("mis", None, 3.0),
    ("icepop", 0.25, 2.0),
    ("seq_mask", 0.99, 1.0004),
]


@pytest.mark.parametrize("name,low,high", CASES)
def test_weights_match_the_formulas(name, low, high):
    corr = BehaviourCorrection(name, low=low, high=high)
    entry = BEHAVIOUR_CORRECTIONS.get(name)
    assert (corr.low, corr.high) == (entry.low if low is None else low, entry.high if high is None else high)
    prox, behav, mask = _tensors()
    weight, masked, capped = behaviour_weights(corr, prox.requires_grad_(True), behav, mask)
    ref_w, ref_masked, ref_capped = _reference(name, corr.low, corr.high, prox.detach(), behav, mask)
    assert weight.dtype == torch.float64 and not weight.requires_grad
    torch.testing.assert_close(weight, torch.tensor(ref_w, dtype=torch.float64), rtol=0, atol=1e-12)
    assert masked.tolist() == ref_masked and capped.tolist() == ref_capped
    # the hand-made tokens really exercise this correction: something is kept as rho and something is cut
    cut = sum(map(sum, ref_capped if name == "tis" else ref_masked))
    assert 0 < cut < int(mask.sum())


def test_defaults_exercise_both_sides_of_every_bound():
    """The hand-made tensors put tokens (rows for seq_mask) below, inside and above each default range; with the
    defaults each masking correction drops exactly those outside, one-sided ones only above."""
    prox, behav, mask = _tensors()
    dropped = {}
    for name in BEHAVIOUR_CORRECTIONS:
        _, masked, capped = behaviour_weights(BehaviourCorrection(name), prox, behav, mask)
        dropped[name] = (masked | capped).nonzero().tolist()
    assert dropped["tis"] == dropped["mis"] == [[0, 4], [0, 5]]  # rho 2.5 and 6 above 2
    assert dropped["icepop"] == [[0, 0], [0, 5]]  # 0.3 below 0.5, 6 above 5
    assert dropped["seq_mask"] == [[0, t] for t in range(6)] + [[2, 1], [2, 2], [3, 0]]  # rows 0, 2 high, 3 low


@pytest.mark.parametrize("name", BEHAVIOUR_CORRECTIONS.names())
def test_padding_and_dtype(name):
    """Garbage in the padding changes nothing; float32 / bfloat16 inputs are computed in float32."""
    corr = BehaviourCorrection(name)
    base = behaviour_weights(corr, *_tensors(garbage=0.0))
    for garbage in (NAN, INF, -INF):
        again = behaviour_weights(corr, *_tensors(garbage=garbage))
        assert torch.equal(again[0], base[0]) and torch.equal(again[1], base[1]) and torch.equal(again[2], base[2])
    prox, behav, mask = _tensors()
    assert (base[0][~mask] == 1).all() and not base[1][~mask].any() and not base[2][~mask].any()
    for dtype in (torch.float32, torch.bfloat16):
        weight, _, _ = behaviour_weights(corr, prox.to(dtype), behav.to(dtype), mask)
        assert weight.dtype == torch.float32


def test_behaviour_correction_validation():
    with pytest.raises(UnknownNameError, match="icepop, mis, seq_mask, tis"):
        BehaviourCorrection("ice_pop")
    with pytest.raises(ValueError, match="no lower bound"):
        BehaviourCorrection("tis", low=0.5)
    with pytest.raises(ValueError, match="low"):
        BehaviourCorrection("icepop", low=6.0)  # above the default high 5: nothing kept
    for kwargs in ({"high": 0.0}, {"high": INF}, {"high": -1.0}, {"low": -0.1}, {"low": NAN}):
        with pytest.raises(ValueError):
            BehaviourCorrection("icepop", **kwargs)


# ------------------------------------------------------------------------------------------------ ppo_loss
def _clipped_surrogate(lp, old, adv, eps_low, eps_high):
    """Plain PPO (Schulman et al. 2017, eq. 7), negated: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))."""
    r = torch.exp(lp - old)
    return torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - eps_low, 1 + eps_high))


@pytest.mark.parametrize("name,low,high", CASES)
def test_ppo_loss_is_the_surrogate_times_the_weights(name, low, high):
    prox, behav, mask = _tensors()
    gen = torch.Generator().manual_seed(8)
    old = torch.where(mask, prox, NAN)
    logps = torch.where(mask, old + 0.3 * torch.randn(mask.shape, generator=gen, dtype=torch.float64), NAN)
    adv = torch.where(mask, torch.randn(mask.shape, generator=gen, dtype=torch.float64), 100.0)
    corr = BehaviourCorrection(name, low=low, high=high)
    cfg = PolicyLossConfig(clip_low=0.1, clip_high=0.15, off_policy=corr)
    lp = logps.clone().requires_grad_(True)
    loss, stats = policy_loss("ppo", lp, old, adv, mask, cfg, rollout_logps=behav)

    ref_w = torch.tensor(_reference(name, corr.low, corr.high, prox, behav, mask)[0], dtype=torch.float64)
    lp_ref = torch.where(mask, logps, 0.0).requires_grad_(True)
    ref = torch.where(
        mask, _clipped_surrogate(lp_ref, torch.where(mask, old, 0.0), torch.where(mask, adv, 0.0), 0.1, 0.15), 0.0
    )
    ref = ref * ref_w
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    (ref_grad,) = torch.autograd.grad(ref.sum(), lp_ref)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)  # the weight is a constant
    assert (loss[~mask] == 0).all() and torch.isfinite(grad).all()
    weight_key, flag_key = ("tis_weight", "tis_capped") if name == "tis" else ("is_weight", "is_masked")
    assert {weight_key, flag_key} <= stats.keys() and not ({"is_weight", "tis_weight"} - {weight_key}) & stats.keys()
    torch.testing.assert_close(stats[weight_key], torch.where(mask, ref_w, 0.0), rtol=0, atol=1e-12)
    # tis_cap is the shorthand of the tis correction: the same numbers
    if name == "tis":
        short = PolicyLossConfig(clip_low=0.1, clip_high=0.15, tis_cap=corr.high)
        assert short.correction == corr
        loss2, stats2 = policy_loss("ppo", logps, old, adv, mask, short, rollout_logps=behav)
        assert torch.equal(loss2, loss.detach()) and torch.equal(stats2["tis_capped"], stats["tis_capped"])


def test_policy_loss_config_and_gspo_refuse():
    prox, behav, mask = _tensors(garbage=0.0)
    with pytest.raises(ValueError, match="tis_cap"):
        PolicyLossConfig(tis_cap=2.0, off_policy=BehaviourCorrection("mis"))
    assert PolicyLossConfig().correction is None
    cfg = PolicyLossConfig(off_policy=BehaviourCorrection("icepop"))
    with pytest.raises(ValueError, match="rollout_logps"):
        policy_loss("ppo", prox, prox, prox, mask, cfg)
    with pytest.raises(ValueError, match="off_policy"):
        policy_loss("ppo", prox, prox, prox, mask, PolicyLossConfig(), rollout_logps=behav)
    for name in BEHAVIOUR_CORRECTIONS:
        gspo_cfg = PolicyLossConfig(clip_low=0.01, clip_high=0.01, off_policy=BehaviourCorrection(name))
        with pytest.raises(ValueError, match="gspo"):
            policy_loss("gspo", prox, prox, prox, mask, gspo_cfg, rollout_logps=behav)
        with pytest.raises(ValueError, match="gspo"):
            PolicyObjective(loss_type="gspo", clip=gspo_cfg, correct_off_policy=True)
    with pytest.raises(ValueError, match="correct_off_policy"):
        PolicyObjective(clip=cfg)
    with pytest.raises(ValueError, match="off_policy"):
        PolicyObjective(correct_off_policy=True)


# ------------------------------------------------------------------------------------------------ objective
VOCAB = 64
LENGTHS = [(3, 5), (2, 1), (4, 7), (1, 3)]  # uneven: the 2+1+1 split re-pads every piece differently
# bounds tight enough for the noise below that each correction cuts some tokens (rows) and keeps others
OBJECTIVE_CASES = [("tis", None, 1.2), ("mis", None, 1.2), ("icepop", 0.8, 1.25), ("seq_mask", 0.9, 1.1)]


@pytest.fixture(scope="module")
def policy():
    return tiny_float64_policy(VOCAB)


def _batch(policy) -> Batch:
    gen = torch.Generator().manual_seed(0)
    ids, attn, loss_mask = padded_rows(LENGTHS, VOCAB, gen)
    batch = Batch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, sample_index=torch.arange(len(LENGTHS)))
    mask = response_mask(batch)
    with torch.no_grad():
        old = TokenLogps()(policy, batch)
    noise = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    old = old + torch.where(mask, 0.3 * noise, 0.0).float()
    adv = torch.where(mask, torch.randn(mask.shape, generator=gen, dtype=torch.float64), 100.0).float()
    rollout = torch.where(mask, old.double() + 0.3 * torch.randn(mask.shape, generator=gen, dtype=torch.float64), 0.0)
    return batch.replace(old_logps=old, advantages=adv, rollout_logps=rollout.float())


def _run(policy, obj, parts):
    count = sum(obj.count(p) for p in parts)
    policy.zero_grad(set_to_none=True)
    sums, total = {}, 0.0
    for part in parts:
        (loss, part_sums), reads = host_reads_outside_modules(policy, functools.partial(obj.loss, policy, part))
        assert reads == 0  # the corrections and metrics wait for nothing: every metric stays a device tensor
        (loss / count).backward()
        total += loss.item()
        sums = add_sums(sums, part_sums)
    grad = torch.cat([p.grad.reshape(-1).clone() for p in policy.parameters() if p.grad is not None])
    policy.zero_grad(set_to_none=True)
    return obj.finalize(sums, count), total / count, grad


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name,low,high", OBJECTIVE_CASES)
def test_objective_split_matches_whole_batch(policy, name, low, high, agg_mode):
    batch = _batch(policy)
    corr = BehaviourCorrection(name, low=low, high=high)
    obj = PolicyObjective(clip=PolicyLossConfig(off_policy=corr), agg_mode=agg_mode, correct_off_policy=True)
    # a dropped token keeps its place in the denominator: the count is the uncorrected one
    assert obj.count(batch) == PolicyObjective(agg_mode=agg_mode).count(batch)
    whole_m, whole_l, whole_g = _run(policy, obj, [batch])
    parts = [batch.slice(0, 2).trim(), batch.slice(2, 3).trim(), batch.slice(3, 4).trim()]
    assert [p.input_ids.shape[1] for p in parts] == [8, 11, 4]  # each piece re-padded
    split_m, split_l, split_g = _run(policy, obj, parts)
    # 1e-6: transformers' Qwen2 keeps float32 islands inside a float64 model (see test_rl_objectives.py)
    assert split_l == pytest.approx(whole_l, rel=1e-6, abs=1e-9)
    assert whole_m.keys() == split_m.keys()
    for key in whole_m:
        assert split_m[key] == pytest.approx(whole_m[key], rel=1e-6, abs=1e-9), key
    torch.testing.assert_close(split_g, whole_g, rtol=1e-6, atol=1e-6 * float(whole_g.abs().max()))

    # The reported metrics are those of the formula: per-row token means (or token means) of w and of the cut flag.
    mask = response_mask(batch)
    old, rollout = batch.old_logps.double(), batch.rollout_logps.double()
    ref_w, ref_masked, ref_capped = _reference(name, corr.low, corr.high, old, rollout, mask)
    cut = ref_capped if name == "tis" else ref_masked
    rows = [[(ref_w[i][t], cut[i][t]) for t in range(mask.shape[1]) if mask[i, t]] for i in range(len(LENGTHS))]
    if agg_mode == "token-mean":
        n = sum(len(r) for r in rows)
        mean_w, mean_cut = sum(w for r in rows for w, _ in r) / n, sum(c for r in rows for _, c in r) / n
    else:
        mean_w = sum(sum(w for w, _ in r) / len(r) for r in rows) / len(rows)
        mean_cut = sum(sum(c for _, c in r) / len(r) for r in rows) / len(rows)
    weight_key, frac_key = ("tis_weight", "tis_capped_frac") if name == "tis" else ("is_weight", "is_masked_frac")
    assert whole_m[weight_key] == pytest.approx(mean_w, rel=1e-6)
    assert whole_m[frac_key] == pytest.approx(mean_cut, rel=1e-9, abs=1e-12)
    assert 0 < mean_cut < 1  # the correction really cut some tokens and kept others on this batch
    # and it changed the loss: the same objective without the correction gives another number
    plain_l = _run(policy, PolicyObjective(agg_mode=agg_mode), [batch])[1]
    assert abs(plain_l - whole_l) > 1e-4


# ------------------------------------------------------------------------------------------------ config
def _algo(**kwargs) -> AlgorithmConfig:
    return AlgorithmConfig(**kwargs)


def test_config_unknown_name_lists_valid_names():
    with pytest.raises(ConfigError, match=r"^algo\.off_policy_correction") as info:
        _algo(off_policy_correction="ice_pop")
    for name in ["none", *BEHAVIOUR_CORRECTIONS.names()]:
        assert name in str(info.value)


def test_config_refusals_name_their_keys():
    with pytest.raises(ConfigError, match=r"^algo\.tis_cap "):
        _algo(tis_cap=2.0, off_policy_correction="icepop")
    for name in BEHAVIOUR_CORRECTIONS:
        with pytest.raises(ConfigError, match=r"^algo\.off_policy_correction .*'gspo'"):
            _algo(policy_loss="gspo", off_policy_correction=name)
    with pytest.raises(ConfigError, match=r"^algo\.off_policy_low .*no lower bound"):
        _algo(off_policy_correction="mis", off_policy_low=0.5)
    with pytest.raises(ConfigError, match=r"^algo\.off_policy_low "):
        _algo(off_policy_correction="icepop", off_policy_low=6.0)
    with pytest.raises(ConfigError, match=r"^algo\.off_policy_high "):
        _algo(off_policy_correction="icepop", off_policy_high=-1.0)
    with pytest.raises(ConfigError, match=r"^algo\.off_policy_low "):
        _algo(off_policy_high=3.0)  # bounds without a correction
    assert _algo().behaviour_correction is None


def _run_config(**algo) -> RLRunConfig:
    return RLRunConfig(
        model=ModelConfig(path="model"),
        data=DataConfig(train_path="prompts.jsonl"),
        train=TrainConfig(global_batch_size=4, micro_batch_size=4),
        rollout=RolloutConfig(prompts_per_step=2, n_samples_per_prompt=2, max_new_tokens=8),
        reward=RewardConfig(functions=("r.py:f",)),
        algo=AlgorithmConfig(**algo),
    )


def test_runner_builds_the_configured_correction():
    from rlhf.trainers.online.runner import build_objectives

    policy_obj, _ = build_objectives(
        _run_config(off_policy_correction="icepop", off_policy_low=0.6, off_policy_high=4.0)
    )
    assert policy_obj.correct_off_policy and policy_obj.clip.correction == BehaviourCorrection("icepop", 0.6, 4.0)
    policy_obj, _ = build_objectives(_run_config(off_policy_correction="seq_mask"))  # unset bounds: the entry's
    entry = BEHAVIOUR_CORRECTIONS.get("seq_mask")
    assert (policy_obj.clip.correction.low, policy_obj.clip.correction.high) == (entry.low, entry.high)
    policy_obj, _ = build_objectives(_run_config(tis_cap=1.5))  # the shorthand still works
    assert policy_obj.correct_off_policy and policy_obj.clip.correction == BehaviourCorrection("tis", high=1.5)
    policy_obj, _ = build_objectives(_run_config())
    assert not policy_obj.correct_off_policy and policy_obj.clip.correction is None
