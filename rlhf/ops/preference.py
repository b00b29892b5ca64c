"""Preference losses: DPO and its variants, KTO on unpaired rows, Bradley-Terry reward modelling, pair accuracy.

Every function returns per-pair values ``(B,)`` or a count; none averages over the micro-batch. The caller sums
them and divides once by the number of pairs in the global batch (:func:`rlhf.ops.losses.normalize`).

Notation: for a pair, ``chosen_logratio = log pi(y_w|x) - log pi_ref(y_w|x)``, likewise ``rejected_logratio``
for ``y_l``, and ``h = chosen_logratio - rejected_logratio``. Log-probs are sums over target tokens unless the
loss sets ``average_logps``, in which case both policy and reference log-probs are divided by the target-token
count of their completion first. A reference-free loss (SimPO, ORPO, CPO: ``DPOLoss.reference`` false) reads no
reference model: its ``chosen_logratio`` is ``log pi(y_w|x)`` alone (``log pi_ref = 0``, a reference that gives every
completion probability 1), and a run of it starts no reference workers.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from rlhf.registry import Registry, UnknownNameError

Tensor = torch.Tensor


@dataclass(frozen=True)
class DPOLoss:
    """One loss on preference pairs, and the facts of its paper a run reads.

    Attributes:
        fn: ``fn(chosen_logratio (B,), rejected_logratio (B,), beta, label_smoothing) -> (B,)`` per-pair losses; a
            loss with a ``margin`` takes it as a fifth argument.
        average_logps: whether the log-probs are per-token averages instead of sums over the completion.
        paper: the reference the formula follows.
        reference: whether the loss reads a frozen reference model; without one the log-ratios are the policy's
            log-probs alone and a run starts no reference workers.
        beta: the paper's ``beta`` (ORPO's ``lambda``): what an unset ``dpo.beta`` trains with.
        nll_coef: the paper's weight of the chosen completion's NLL (:func:`chosen_nll`), added to the loss: what an
            unset ``dpo.nll_coef`` trains with (CPO's and ORPO's SFT term, 1; 0 for the others).
        margin: the paper's target reward margin (SimPO's ``gamma``): what an unset ``dpo.simpo_gamma`` trains with;
            ``None`` for a loss without one.
        label_smoothing: whether the loss models label noise (``dpo.label_smoothing``; refused by the others).
    """

    fn: Callable[..., Tensor]
    average_logps: bool
    paper: str
    reference: bool = True
    beta: float = 0.1
    nll_coef: float = 0.0
    margin: Optional[float] = None
    label_smoothing: bool = True


DPO_LOSSES = Registry[DPOLoss]("DPO loss type")


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")


def _check_label_smoothing(name: str, label_smoothing: float) -> None:
    # eps is the probability that a label is flipped; at 0.5 the labels carry no information (and robust DPO
    # divides by 1 - 2 eps), above it they are more likely wrong than right.
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"{name} loss: label_smoothing must be in [0, 0.5), got {label_smoothing}")


def _reject_label_smoothing(name: str, label_smoothing: float) -> None:
    # Silently ignoring it would let a config believe it trains with noisy-label correction when it does not.
    if label_smoothing != 0:
        raise ValueError(f"{name} loss does not use label_smoothing (got {label_smoothing}); set it to 0")


def _soft_label_logistic(z: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - eps) logsigmoid(z) - eps logsigmoid(-z)``: the cross-entropy of ``sigmoid(z)`` against the soft label
    ``1 - eps`` (conservative DPO, Mitchell 2023)."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def _sigmoid(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """DPO (Rafailov et al. 2023, eq. 7) with conservative-DPO label smoothing ``eps`` (cDPO, Mitchell 2023).

    ``-(1 - eps) logsigmoid(beta h) - eps logsigmoid(-beta h)``, i.e. the cross-entropy of the Bradley-Terry
    implicit-reward model against the soft label ``1 - eps``. Summed log-probs, as in the paper. Registered twice:
    as ``sigmoid`` against the reference, and reference-free as CPO's preference term.
    """
    _check_beta(beta)
    _check_label_smoothing("sigmoid", label_smoothing)
    return _soft_label_logistic(beta * (chosen_logratio - rejected_logratio), label_smoothing)


def _ipo(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """IPO (Azar et al. 2023, sampled loss): ``(h - 1 / (2 beta))^2`` with ``beta`` the paper's tau.

    Departure from the paper: the paper's ``h`` uses log-probs summed over the completion; following the common
    practice of OpenRLHF and TRL this loss is registered with ``average_logps=True``, so ``h`` is built from
    per-token average log-probs, which keeps the target margin ``1 / (2 beta)`` independent of response length.
    """
    _check_beta(beta)
    _reject_label_smoothing("ipo", label_smoothing)
    return (chosen_logratio - rejected_logratio - 1 / (2 * beta)) ** 2


def _hinge(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """SLiC hinge loss (Zhao et al. 2023): ``relu(1 - beta h)``.

    Departure from the paper: SLiC-HF's calibration loss is ``max(0, delta - log pi(y_w|x) + log pi(y_l|x))``
    on policy log-probs alone; here the log-probs are normalized by the reference model and the margin is
    ``delta = 1 / beta`` (``relu(1 - beta h) = beta * relu(1 / beta - h)``), the reference-normalized form of
    Liu et al. 2023 (RSO) that DPO libraries ship as "hinge". SLiC's separate SFT regularizer is not included.
    """
    _check_beta(beta)
    _reject_label_smoothing("hinge", label_smoothing)
    return F.relu(1 - beta * (chosen_logratio - rejected_logratio))


def _robust(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """Robust DPO (Chowdhury et al. 2024): an unbiased DPO loss under label-flip probability ``eps``.

    ``((1 - eps) * -logsigmoid(beta h) - eps * -logsigmoid(-beta h)) / (1 - 2 eps)``. Unlike cDPO this is not a
    cross-entropy: for ``eps > 0`` it is unbounded below as ``h -> inf`` (the paper's estimator, by design); with
    ``eps = 0`` it equals the sigmoid loss. Summed log-probs, as in the paper.
    """
    _check_beta(beta)
    _check_label_smoothing("robust", label_smoothing)
    z = beta * (chosen_logratio - rejected_logratio)
    eps = label_smoothing
    return ((1 - eps) * -F.logsigmoid(z) - eps * -F.logsigmoid(-z)) / (1 - 2 * eps)


def _apo_zero(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, "Anchored Preference Optimization", eq. 7): ``sigmoid(-beta r_w) +
    sigmoid(beta r_l)`` with ``r = log pi - log pi_ref``: each completion's log-ratio is anchored at 0, the chosen one
    pushed up and the rejected one down (``sigmoid(-x)`` for the paper's ``1 - sigmoid(x)``: no cancellation). For
    chosen answers better than the model's own. Summed log-probs, as in the paper."""
    _check_beta(beta)
    _reject_label_smoothing("apo_zero", label_smoothing)
    return torch.sigmoid(-beta * chosen_logratio) + torch.sigmoid(beta * rejected_logratio)


def _apo_down(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """APO-down (D'Oosterlinck et al. 2024, eq. 8): ``sigmoid(beta r_w) + sigmoid(-beta (r_w - r_l))``: the chosen
    log-ratio pushed down, the rejected one further. For chosen answers worse than the model's own. Summed
    log-probs, as in the paper."""
    _check_beta(beta)
    _reject_label_smoothing("apo_down", label_smoothing)
    return torch.sigmoid(beta * chosen_logratio) + torch.sigmoid(-beta * (chosen_logratio - rejected_logratio))


def _simpo(
    chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float, margin: float
) -> Tensor:
    """SimPO (Meng et al. 2024, eq. 6): ``-logsigmoid(beta / |y_w| log pi(y_w|x) - beta / |y_l| log pi(y_l|x) -
    gamma)``, reference-free on per-token averaged log-probs, with ``gamma`` (``margin``) the target reward margin.
    Label smoothing ``eps`` as cDPO's (the SimPO code's and TRL's option; 0 in the paper)."""
    _check_beta(beta)
    _check_label_smoothing("simpo", label_smoothing)
    if not margin >= 0:
        raise ValueError(f"simpo loss: the target margin gamma must be >= 0, got {margin}")
    return _soft_label_logistic(beta * (chosen_logratio - rejected_logratio) - margin, label_smoothing)


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate on both sides of ``-log 2`` (Maechler 2012): ``log(-expm1(x))``
    near 0, where ``1 - exp(x)`` cancels, ``log1p(-exp(x))`` below. Both branches stay finite for ``x < 0``, so the
    branch not taken gives no NaN to the gradient."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def log_odds(avg_logps: Tensor) -> Tensor:
    """``log(P / (1 - P))`` with ``P = exp(avg_logps)``: the log-odds of a completion in ORPO, ``avg_logps`` its
    per-token average log-prob (< 0; at 0, a model certain of every token, the odds are infinite)."""
    return avg_logps - _log1mexp(avg_logps)


def _orpo(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """ORPO's odds-ratio term (Hong et al. 2024, eq. 7): ``lambda * -logsigmoid(log odds(y_w|x) - log odds(y_l|x))``
    with ``odds(y|x) = P(y|x) / (1 - P(y|x))`` and ``P`` the exponentiated per-token average log-prob; ``beta`` is
    the paper's ``lambda``. Reference-free. The paper's whole loss (eq. 6) adds its SFT term, the chosen completion's
    NLL with weight 1: the entry's ``nll_coef``, added by the caller (:func:`chosen_nll`, token-averaged per pair)."""
    _check_beta(beta)
    _reject_label_smoothing("orpo", label_smoothing)
    return -beta * F.logsigmoid(log_odds(chosen_logratio) - log_odds(rejected_logratio))


DPO_LOSSES.register("sigmoid")(DPOLoss(_sigmoid, False, "Rafailov et al. 2023, DPO; cDPO label smoothing"))
_IPO = "Azar et al. 2023, IPO (per-token averaged log-probs)"
DPO_LOSSES.register("ipo")(DPOLoss(_ipo, True, _IPO, label_smoothing=False))
_HINGE = "Zhao et al. 2023, SLiC-HF (reference-normalized as in RSO)"
DPO_LOSSES.register("hinge")(DPOLoss(_hinge, False, _HINGE, label_smoothing=False))
DPO_LOSSES.register("robust")(DPOLoss(_robust, False, "Chowdhury et al. 2024, Provably Robust DPO"))
_APO = "D'Oosterlinck et al. 2024, APO-{} (anchored at the reference)"
DPO_LOSSES.register("apo_zero")(DPOLoss(_apo_zero, False, _APO.format("zero"), label_smoothing=False))
DPO_LOSSES.register("apo_down")(DPOLoss(_apo_down, False, _APO.format("down"), label_smoothing=False))
# Reference-free. SimPO: beta 2 and gamma 1 (gamma / beta 0.5) are the SimPO authors' base-model configs (the paper
# tunes both per model). CPO: beta 0.1 and the NLL weight 1 of the paper (TRL's cpo_alpha). ORPO: lambda 0.1 (TRL's
# ORPOConfig.beta) and the paper's SFT weight 1.
_SIMPO = "Meng et al. 2024, SimPO (reference-free, length-normalised, target margin)"
DPO_LOSSES.register("simpo")(DPOLoss(_simpo, True, _SIMPO, reference=False, beta=2.0, margin=1.0))
_CPO = "Xu et al. 2024, CPO (reference-free DPO + chosen NLL)"
DPO_LOSSES.register("cpo")(DPOLoss(_sigmoid, False, _CPO, reference=False, nll_coef=1.0))
_ORPO = "Hong et al. 2024, ORPO (odds ratio + chosen NLL, reference-free)"
DPO_LOSSES.register("orpo")(DPOLoss(_orpo, True, _ORPO, reference=False, nll_coef=1.0, label_smoothing=False))


@dataclass(frozen=True)
class UnpairedLoss:
    """A preference loss on unpaired rows (one completion with a desirable / undesirable label).

    Attributes:
        fn: ``fn(logratio (B,), kl_baseline (B,), desirable (B,) bool, beta, desirable_weight,
            undesirable_weight) -> (B,)`` per-row losses.
        paper: the reference the formula follows.
    """

    fn: Callable[[Tensor, Tensor, Tensor, float, float, float], Tensor]
    paper: str
    beta: float = 0.1  # the paper's beta: what an unset dpo.beta trains with


UNPAIRED_LOSSES = Registry[UnpairedLoss]("unpaired preference loss type")


def _kto(
    logratio: Tensor,
    kl_baseline: Tensor,
    desirable: Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> Tensor:
    """KTO (Ethayarajh et al. 2024, eq. 7): ``lambda_y - v(x, y)`` per row, with the value
    ``v = lambda_D sigmoid(beta (r - z_0))`` for a desirable completion and ``lambda_U sigmoid(beta (z_0 - r))`` for
    an undesirable one, ``r = log pi(y|x) - log pi_ref(y|x)`` summed over the completion and ``z_0`` the detached
    KL reference point (:func:`kto_kl_baseline`). Summed log-probs, as in the paper and TRL."""
    _check_beta(beta)
    if not (desirable_weight > 0 and undesirable_weight > 0):
        raise ValueError(f"KTO weights must be > 0, got {desirable_weight}, {undesirable_weight}")
    z = beta * (logratio - kl_baseline)
    good = desirable.to(torch.bool)
    value = torch.where(good, desirable_weight * torch.sigmoid(z), undesirable_weight * torch.sigmoid(-z))
    weight = torch.where(good, z.new_tensor(desirable_weight), z.new_tensor(undesirable_weight))
    return weight - value


UNPAIRED_LOSSES.register("kto")(UnpairedLoss(_kto, "Ethayarajh et al. 2024, KTO (eq. 7; z_0 from mismatched pairs)"))


def preference_rows(loss_type: str) -> str:
    """What a DPO-family loss reads: ``"pairs"`` (:data:`DPO_LOSSES`) or ``"unpaired"`` (:data:`UNPAIRED_LOSSES`).

    Raises:
        UnknownNameError: For a name in neither registry, listing the valid names of both.
    """
    if loss_type in DPO_LOSSES:
        return "pairs"
    if loss_type in UNPAIRED_LOSSES:
        return "unpaired"
    names = sorted(DPO_LOSSES.names() + UNPAIRED_LOSSES.names())
    close = difflib.get_close_matches(loss_type, names, n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    raise UnknownNameError(f"unknown DPO loss type {loss_type!r}.{hint} Valid names: {', '.join(names)}")


def preference_loss(loss_type: str) -> Union[DPOLoss, UnpairedLoss]:
    """The registry entry of a DPO-family loss, pairs or unpaired rows: its facts (``beta``, ...).

    Raises:
        UnknownNameError: For a name in neither registry, listing the valid names of both.
    """
    return DPO_LOSSES.get(loss_type) if preference_rows(loss_type) == "pairs" else UNPAIRED_LOSSES.get(loss_type)


def kto_kl_baseline(policy_logps: Tensor, ref_logps: Tensor) -> Tensor:
    """KTO's reference point ``z_0 = max(0, mean_i [log pi(y_j|x_i) - log pi_ref(y_j|x_i)])`` (Ethayarajh et al.
    2024, section 4.1): the policy's KL from the reference estimated on mismatched pairs, the prompt of row ``i``
    with the completion of another row ``j``.

    Args:
        policy_logps: ``(N,)`` policy log-probs of the mismatched completions, summed over their target tokens.
        ref_logps: ``(N,)`` reference log-probs of the same, same layout.

    Returns:
        0-dim detached tensor. Departure: the paper (and TRL, per process) averages over the micro-batch; here the
        mean runs over the whole global batch, computed before the step, so ``z_0`` (and the loss) does not depend
        on how the batch is cut into micro-batches and ranks.
    """
    if policy_logps.shape != ref_logps.shape or policy_logps.dim() != 1 or not len(policy_logps):
        shapes = f"{tuple(policy_logps.shape)}, {tuple(ref_logps.shape)}"
        raise ValueError(f"expected two equal (N,) tensors, N > 0; got {shapes}")
    return (policy_logps - ref_logps).mean().clamp(min=0).detach()


def unpaired_losses(
    loss_type: str,
    policy_logps: Tensor,
    ref_logps: Tensor,
    kl_baseline: Tensor,
    desirable: Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> Tuple[Tensor, Tensor]:
    """Per-row unpaired preference losses and implicit rewards.

    Args:
        loss_type: a name in :data:`UNPAIRED_LOSSES`.
        policy_logps: ``(B,)`` policy log-probs of each row's completion, summed over its target tokens.
        ref_logps: ``(B,)`` reference log-probs, same layout.
        kl_baseline: ``(B,)`` the global batch's ``z_0`` on every row (:func:`kto_kl_baseline`).
        desirable: ``(B,)`` bool labels.
        beta, desirable_weight, undesirable_weight: the loss's settings (> 0).

    Returns:
        ``(losses, rewards)``, each ``(B,)``: per-row losses (not averaged; the caller divides the global sum by
        the global number of rows) and the detached implicit rewards ``beta * (policy - ref)``.
    """
    spec = UNPAIRED_LOSSES.get(loss_type)
    for name, x in (("ref_logps", ref_logps), ("kl_baseline", kl_baseline), ("desirable", desirable)):
        if x.shape != policy_logps.shape or policy_logps.dim() != 1:
            raise ValueError(f"{name} shape {tuple(x.shape)} != policy_logps {tuple(policy_logps.shape)}, (B,)")
    logratio = policy_logps - ref_logps
    losses = spec.fn(logratio, kl_baseline.to(logratio.dtype), desirable, beta, desirable_weight, undesirable_weight)
    return losses, (beta * logratio).detach()


def _check_pairs(name: str, x: Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != 2:
        raise ValueError(f"{name} must be (B, 2) with index 0 chosen, 1 rejected; got shape {tuple(x.shape)}")


def dpo_pair_losses(
    loss_type: str,
    policy_logps: Tensor,
    ref_logps: Optional[Tensor],
    beta: float,
    label_smoothing: float,
    lengths: Optional[Tensor] = None,
    margin: Optional[float] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-pair DPO-family losses and implicit rewards.

    Args:
        loss_type: a name in :data:`DPO_LOSSES` (an unknown name raises an error listing the valid ones).
        policy_logps: ``(B, 2)`` policy log-probs summed over target tokens (index 0 chosen, 1 rejected).
        ref_logps: ``(B, 2)`` reference log-probs, same layout; ``None`` for a reference-free loss (and only then).
        beta: the KL-regularization strength (> 0).
        label_smoothing: assumed label-flip probability for losses that model it, else must be 0.
        lengths: ``(B, 2)`` target-token counts of each completion; required (and > 0) when the loss averages
            log-probs per token, ignored otherwise. Not read back here to check (a 0 gives an infinite average):
            :class:`rlhf.objectives.dpo.DPOObjective` checks the counts on the host, in ``count``.
        margin: the target margin of a loss that has one (SimPO's gamma; required for it), else ``None``.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(B,)``: per-pair losses (not averaged; the caller
        divides the global sum by the global number of pairs), and the detached implicit rewards
        ``beta * (policy - ref)`` of the log-probs the loss used (per-token averages when it averages; the policy's
        alone for a reference-free loss).
    """
    spec = DPO_LOSSES.get(loss_type)
    _check_pairs("policy_logps", policy_logps)
    if spec.reference != (ref_logps is not None):
        needs = "needs reference log-probs" if spec.reference else "is reference-free: pass no reference log-probs"
        raise ValueError(f"DPO loss {loss_type!r} {needs}")
    if (spec.margin is None) != (margin is None):
        what = "has no target margin" if spec.margin is None else "needs its target margin"
        raise ValueError(f"DPO loss {loss_type!r} {what} (got margin={margin})")
    logratio = policy_logps
    if ref_logps is not None:
        _check_pairs("ref_logps", ref_logps)
        logratio = policy_logps - ref_logps
    if spec.average_logps:
        logratio = logratio / _token_counts(loss_type, lengths, policy_logps.shape)
    chosen, rejected = logratio[:, 0], logratio[:, 1]
    extra = () if margin is None else (margin,)
    losses = spec.fn(chosen, rejected, beta, label_smoothing, *extra)
    return losses, (beta * chosen).detach(), (beta * rejected).detach()


def _token_counts(loss_type: str, lengths: Optional[Tensor], shape: torch.Size) -> Tensor:
    """Validated ``(B, 2)`` target-token counts for a per-token-averaging loss."""
    if lengths is None:
        raise ValueError(f"DPO loss {loss_type!r} averages log-probs per token: pass lengths (B, 2)")
    if lengths.shape != shape:
        raise ValueError(f"lengths shape {tuple(lengths.shape)} != log-probs shape {tuple(shape)}")
    return lengths


def chosen_nll(chosen_logps: Tensor, chosen_lengths: Tensor) -> Tensor:
    """Per-pair token-averaged NLL of the chosen completion, ``(B,)``: the regularizer of RPO (Pang et al. 2024,
    "Iterative Reasoning Preference Optimization", DPO + NLL), which keeps DPO from lowering the likelihood of
    the preferred answers along with the rejected ones.

    Args:
        chosen_logps: ``(B,)`` policy log-probs summed over the chosen completion's target tokens.
        chosen_lengths: ``(B,)`` target-token counts (> 0; not read back here to check, as for
            :func:`dpo_pair_losses`'s ``lengths``).

    Departure: the paper normalizes by the chosen tokens of the batch; averaging per sequence makes the term a
    per-pair quantity, so it is normalized with the DPO loss by the number of pairs in the global batch and is
    independent of how the batch is split.
    """
    return -chosen_logps / chosen_lengths.to(chosen_logps.dtype)


def bradley_terry_losses(chosen_scores: Tensor, rejected_scores: Tensor, margin: Optional[Tensor] = None) -> Tensor:
    """Reward-model loss ``-logsigmoid(chosen - rejected - margin)`` per pair.

    Ouyang et al. 2022 (InstructGPT), eq. 1, without its ``1 / C(K, 2)`` factor (the caller's normalizer counts
    pairs); the optional margin is the one of Llama 2 (Touvron et al. 2023), which demands a larger score
    gap for pairs rated as clearly different.

    Args:
        chosen_scores: ``(B,)`` scalar rewards of the chosen completions.
        rejected_scores: ``(B,)`` scalar rewards of the rejected completions.
        margin: ``(B,)`` optional non-negative margins.

    Returns:
        ``(B,)`` per-pair losses (not averaged).
    """
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def pair_accuracy_count(chosen: Tensor, rejected: Tensor) -> Tensor:
    """Number of pairs ranked correctly, ``sum_b [chosen_b > rejected_b]``; a tie counts as wrong.

    A count rather than a fraction so the caller can sum it over micro-batches and ranks and divide once by the
    global number of pairs.

    Args:
        chosen: ``(B,)`` scores (or implicit rewards) of the chosen completions.
        rejected: ``(B,)`` scores of the rejected completions.

    Returns:
        0-dim int64 tensor, detached.
    """
    return (chosen.detach() > rejected.detach()).sum()
