"""The reference-free preference losses of ``rlhf.ops.preference``: SimPO (Meng et al. 2024), CPO (Xu et al. 2024) and
ORPO (Hong et al. 2024). Each checked in float64 against its paper's formula written here with Python's ``math``, then
through :class:`rlhf.objectives.dpo.DPOObjective` on a real (tiny, random) causal LM against a plain-PyTorch loss and
gradient; their registry facts, and what the config and the run plan make of them."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.batch import Batch
from rlhf.config.loader import load_config
from rlhf.config.schema import ConfigError, DPORunConfig
from rlhf.objectives.dpo import DPOObjective
from rlhf.ops.preference import DPO_LOSSES, dpo_pair_losses, log_odds
from rlhf.trainers.kinds import kind_of
from rlhf.trainers.offline.dpo import dpo_batch_lines

F64 = torch.float64
# summed log-probs (chosen, rejected) of three pairs and their target-token counts
SUMS = [(-6.0, -9.0), (-2.5, -1.0), (-12.0, -12.0)]
LENGTHS = [(3, 4), (5, 2), (6, 6)]  # pair 2: equal sums and averages


def _log_sigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z)) if z > 0 else z - math.log1p(math.exp(z))


def _simpo(c: float, r: float, lc: int, lr: int, beta: float, gamma: float, eps: float) -> float:
    """Meng et al. 2024, eq. 6, with cDPO's soft label."""
    z = beta / lc * c - beta / lr * r - gamma
    return -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)


def _odds(avg: float) -> float:
    """log(P / (1 - P)), P = exp(avg): 1 - P as -expm1(avg), exact near avg = 0."""
    return math.log(math.exp(avg) / -math.expm1(avg))


def _orpo(c: float, r: float, lc: int, lr: int, lam: float, nll_coef: float) -> float:
    """Hong et al. 2024, eq. 6-7: the chosen NLL (token-averaged per pair) + lambda x the odds-ratio loss."""
    return nll_coef * -c / lc - lam * _log_sigmoid(_odds(c / lc) - _odds(r / lr))


def _cpo(c: float, r: float, lc: int, beta: float, nll_coef: float) -> float:
    """Xu et al. 2024, eq. 3 and 6: reference-free DPO on summed log-probs + the chosen NLL."""
    return -_log_sigmoid(beta * (c - r)) + nll_coef * -c / lc


def _pairs() -> tuple:
    return torch.tensor(SUMS, dtype=F64), torch.tensor(LENGTHS)


# ----------------------------------------------------------------------------------------------- the losses
def test_entries_hold_the_papers_facts():
    simpo, cpo, orpo = (DPO_LOSSES.get(n) for n in ("simpo", "cpo", "orpo"))
    assert not (simpo.reference or cpo.reference or orpo.reference)
    assert (simpo.beta, simpo.margin, simpo.nll_coef, simpo.average_logps) == (2.0, 1.0, 0.0, True)
    assert (cpo.beta, cpo.margin, cpo.nll_coef, cpo.average_logps) == (0.1, None, 1.0, False)
    assert (orpo.beta, orpo.margin, orpo.nll_coef, orpo.average_logps) == (0.1, None, 1.0, True)
    assert not orpo.label_smoothing and simpo.label_smoothing and cpo.label_smoothing
    assert all(DPO_LOSSES.get(n).reference for n in ("sigmoid", "ipo", "hinge", "robust", "apo_zero", "apo_down"))
    assert "Meng" in simpo.paper and "Xu" in cpo.paper and "Hong" in orpo.paper


@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 1.0, 0.0), (2.5, 0.0, 0.0), (0.5, 1.6, 0.2)])
def test_simpo_is_the_papers_loss_on_per_token_averages(beta, gamma, eps):
    policy, lengths = _pairs()
    losses, chosen, rejected = dpo_pair_losses("simpo", policy, None, beta, eps, lengths, gamma)
    expected = [_simpo(c, r, lc, lr, beta, gamma, eps) for (c, r), (lc, lr) in zip(SUMS, LENGTHS)]
    assert losses.tolist() == pytest.approx(expected, rel=1e-14, abs=1e-15)
    # the implicit rewards: beta x the per-token average log-prob (no reference)
    assert chosen.tolist() == pytest.approx([beta * c / lc for (c, _), (lc, _) in zip(SUMS, LENGTHS)], rel=1e-15)
    assert rejected.tolist() == pytest.approx([beta * r / lr for (_, r), (_, lr) in zip(SUMS, LENGTHS)], rel=1e-15)


def test_simpo_gradient_is_the_papers():
    """d/d(chosen sum) of -logsigmoid(z), z = beta c / |y_w| - beta r / |y_l| - gamma: -(beta / |y_w|) sigmoid(-z)."""
    policy, lengths = _pairs()
    policy.requires_grad_(True)
    beta, gamma = 2.0, 1.0
    dpo_pair_losses("simpo", policy, None, beta, 0.0, lengths, gamma)[0].sum().backward()
    for (c, r), (lc, lr), grad in zip(SUMS, LENGTHS, policy.grad.tolist()):
        z = beta * c / lc - beta * r / lr - gamma
        s = 1 / (1 + math.exp(z))
        assert grad == pytest.approx([-beta / lc * s, beta / lr * s], rel=1e-14)


def test_cpo_is_reference_free_dpo_on_summed_log_probs():
    policy, lengths = _pairs()
    losses, chosen, _ = dpo_pair_losses("cpo", policy, None, 0.1, 0.0, lengths)
    assert losses.tolist() == pytest.approx([_cpo(c, r, 1, 0.1, 0.0) for c, r in SUMS], rel=1e-14)
    assert chosen.tolist() == pytest.approx([0.1 * c for c, _ in SUMS], rel=1e-15)
    # sigmoid against a reference that gives every completion probability 1 (log-probs 0) is the same loss
    zero_ref = dpo_pair_losses("sigmoid", policy, torch.zeros_like(policy), 0.1, 0.0)[0]
    assert torch.equal(losses, zero_ref)


def test_orpo_odds_ratio_term_is_the_papers():
    policy, lengths = _pairs()
    losses, chosen, _ = dpo_pair_losses("orpo", policy, None, 0.1, 0.0, lengths)
    expected = [_orpo(c, r, lc, lr, 0.1, 0.0) for (c, r), (lc, lr) in zip(SUMS, LENGTHS)]
    assert losses.tolist() == pytest.approx(expected, rel=1e-14)
    assert losses[2].item() == pytest.approx(0.1 * math.log(2), rel=1e-15)  # equal averages: odds ratio 1


@pytest.mark.parametrize("avg", [-1e-12, -1e-6, -0.3, -math.log(2), -0.7, -5.0, -40.0])
def test_log_odds_is_accurate_on_both_sides_of_minus_log_2(avg):
    x = torch.tensor([avg], dtype=F64, requires_grad=True)
    value = log_odds(x)
    assert value.item() == pytest.approx(_odds(avg), rel=1e-13)
    value.backward()
    # d/da [a - log(1 - e^a)] = 1 + e^a / (1 - e^a) = 1 / (1 - e^a)
    assert x.grad.item() == pytest.approx(1 / -math.expm1(avg), rel=1e-12)
    assert torch.isfinite(x.grad).all()


def test_the_refusals_name_what_is_wrong():
    policy, lengths = _pairs()
    with pytest.raises(ValueError, match="'simpo' is reference-free: pass no reference log-probs"):
        dpo_pair_losses("simpo", policy, torch.zeros_like(policy), 2.0, 0.0, lengths, 1.0)
    with pytest.raises(ValueError, match="'sigmoid' needs reference log-probs"):
        dpo_pair_losses("sigmoid", policy, None, 0.1, 0.0)
    with pytest.raises(ValueError, match="'simpo' needs its target margin"):
        dpo_pair_losses("simpo", policy, None, 2.0, 0.0, lengths)
    with pytest.raises(ValueError, match="'cpo' has no target margin"):
        dpo_pair_losses("cpo", policy, None, 0.1, 0.0, lengths, 1.0)
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        dpo_pair_losses("simpo", policy, None, 2.0, 0.0, lengths, -0.5)
    with pytest.raises(ValueError, match="orpo loss does not use label_smoothing"):
        dpo_pair_losses("orpo", policy, None, 0.1, 0.1, lengths)
    with pytest.raises(ValueError, match="averages log-probs per token: pass lengths"):
        dpo_pair_losses("orpo", policy, None, 0.1, 0.0)


# -------------------------------------------------------------------------------- the objective on a real model
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).to(F64)


def _pair_batch() -> Batch:
    """Two pairs, right-padded to 7 tokens; the prompt is 2 tokens, the completions 3-5 (their target tokens)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 32, (2, 2, 7), generator=g)
    lengths = torch.tensor([[7, 5], [6, 7]])
    position = torch.arange(7)
    attention = (position < lengths[..., None]).long()
    loss_mask = attention * (position >= 2).long()
    return Batch(input_ids=ids * attention, attention_mask=attention, loss_mask=loss_mask)


def _plain_sums(model: torch.nn.Module, batch: Batch) -> tuple:
    """Summed target log-probs and target counts ``(2, 2)``, each sequence on its own, unpadded."""
    sums, counts = torch.zeros(2, 2, dtype=F64), torch.zeros(2, 2, dtype=torch.long)
    for b in range(2):
        for k in range(2):
            n = int(batch.attention_mask[b, k].sum())
            ids = batch.input_ids[b, k, :n][None]
            logps = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            targets = batch.loss_mask[b, k, 1:n].to(F64)
            sums[b, k] = (logps * targets).sum()
            counts[b, k] = int(targets.sum())
    return sums, counts


def _plain_loss(name: str, sums: torch.Tensor, counts: torch.Tensor, beta: float, nll: float, gamma: float):
    """The papers' per-pair losses in torch (so autograd gives the plain gradient), summed over the pairs."""
    total = sums.new_zeros(())
    for b in range(2):
        (c, r), (lc, lr) = sums[b], counts[b].tolist()
        if name == "simpo":
            term = -torch.nn.functional.logsigmoid(beta * c / lc - beta * r / lr - gamma)
        elif name == "cpo":
            term = -torch.nn.functional.logsigmoid(beta * (c - r))
        else:  # orpo: log odds with 1 - P = -expm1(avg)
            odds = [a - torch.log(-torch.expm1(a)) for a in (c / lc, r / lr)]
            term = -beta * torch.nn.functional.logsigmoid(odds[0] - odds[1])
        total = total + term + nll * -c / lc
    return total


@pytest.mark.parametrize("name,beta,nll,gamma", [("simpo", 2.0, 0.0, 1.0), ("simpo", 2.5, 0.3, 0.5),
                                                 ("cpo", 0.1, 1.0, None), ("orpo", 0.1, 1.0, None)])  # fmt: skip
def test_the_objective_is_the_papers_loss_and_gradient_without_reference_log_probs(name, beta, nll, gamma):
    model, batch = _model(), _pair_batch()
    objective = DPOObjective(loss_type=name, beta=beta, nll_coef=nll, margin=gamma)
    assert objective.reference_free and batch.ref_logps is None
    total, sums = objective.loss(model, batch)
    total.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain_sums, counts = _plain_sums(model, batch)
    plain = _plain_loss(name, plain_sums, counts, beta, nll, 0.0 if gamma is None else gamma)
    plain.backward()
    assert total.item() == pytest.approx(plain.item(), rel=1e-12)
    for mine, theirs in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-13)
    metrics = objective.finalize(sums, 2)
    averages = plain_sums / counts if DPO_LOSSES.get(name).average_logps else plain_sums
    assert metrics["rewards/chosen"] == pytest.approx(beta * averages[:, 0].mean().item(), rel=1e-12)
    assert metrics["logps/chosen"] == pytest.approx(plain_sums[:, 0].mean().item(), rel=1e-12)
    assert ("nll/chosen" in metrics) == bool(nll)


def test_the_objective_still_needs_reference_log_probs_for_a_loss_that_reads_them():
    with pytest.raises(ValueError, match="no ref_logps"):
        DPOObjective(loss_type="sigmoid").loss(_model(), _pair_batch())


# ------------------------------------------------------------------------------------- config and the run plan
BASE = ["model.path=m", "data.train_path=d.jsonl", "train.output_dir=o"]


def _cfg(*overrides: str) -> DPORunConfig:
    return load_config(DPORunConfig, overrides=BASE + list(overrides))


def test_unset_settings_take_the_papers_and_set_ones_win():
    simpo = _cfg("dpo.loss_type=simpo").dpo
    assert (simpo.trained_beta, simpo.trained_margin, simpo.trained_nll_coef, simpo.reference_free) == (
        2.0, 1.0, 0.0, True,
    )  # fmt: skip
    tuned = _cfg("dpo.loss_type=simpo", "dpo.beta=2.5", "dpo.simpo_gamma=0.3", "dpo.nll_coef=0.2").dpo
    assert (tuned.trained_beta, tuned.trained_margin, tuned.trained_nll_coef) == (2.5, 0.3, 0.2)
    orpo = _cfg("dpo.loss_type=orpo").dpo
    assert (orpo.trained_beta, orpo.trained_margin, orpo.trained_nll_coef) == (0.1, None, 1.0)
    dpo = _cfg().dpo  # the default loss keeps its figures: beta 0.1, no NLL, a reference
    assert (dpo.trained_beta, dpo.trained_nll_coef, dpo.reference_free) == (0.1, 0.0, False)
    assert _cfg("dpo.loss_type=kto").dpo.trained_beta == 0.1


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("dpo.simpo_gamma=1",), "dpo.simpo_gamma is SimPO's target margin; dpo.loss_type=sigmoid has none"),
        (
            ("dpo.loss_type=orpo", "dpo.label_smoothing=0.1"),
            "dpo.label_smoothing is not modelled by dpo.loss_type=orpo",
        ),
        (("dpo.loss_type=ipo", "dpo.label_smoothing=0.1"), "dpo.label_smoothing is not modelled by dpo.loss_type=ipo"),
        (("dpo.loss_type=simpo", "dpo.simpo_gamma=-1"), "dpo.simpo_gamma must be >= 0"),
        (("dpo.loss_type=cpo", "model.ref_path=r"), "model.ref_path names a reference model, which dpo.loss_type=cpo"),
        (("dpo.beta=0",), "dpo.beta must be > 0"),
    ],
)
def test_the_config_refuses_what_a_loss_does_not_read_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)


@pytest.mark.parametrize("lora", [False, True])
def test_a_reference_free_run_plans_no_reference_and_says_so(lora):
    extra = ("model.lora.r=4",) if lora else ()
    cfg = _cfg("dpo.loss_type=simpo", *extra)
    kind = kind_of(cfg)
    assert not kind.reference_group(cfg) and not kind.reference_on_policy(cfg)
    assert "reference" not in [a.role for a in kind.plan(cfg, 0.0).actors]
    lines = "\n".join(dpo_batch_lines(cfg, []))
    assert "dpo.loss_type=simpo: Meng et al. 2024" in lines and "no reference model" in lines
    assert "beta 2 (the paper's), simpo_gamma 1 (the paper's)" in lines and "reference: " not in lines
    # the default loss, sigmoid, scored online: a group of its own, or with LoRA the policy's base
    with_reference = _cfg(*extra, "dpo.ref_mode=online")
    assert kind.reference_group(with_reference) is not lora and kind.reference_on_policy(with_reference) is lora
    assert ("reference" in [a.role for a in kind.plan(with_reference, 0.0).actors]) is not lora
    assert "against a frozen reference" in "\n".join(dpo_batch_lines(with_reference, []))
