"""Per-token policy-gradient losses (PPO clip family, GSPO, CISPO, SAPO) and the clipped value loss.

Every loss here is returned per token, ``(B, T)``, exactly 0 outside the mask, together with per-token statistics
(also ``(B, T)``, detached, 0 outside the mask). Nothing is averaged: the caller reduces losses and statistics
alike with :mod:`rlhf.ops.aggregation` (a numerator per micro-batch, one denominator counted over the whole train
batch), so a clip fraction is the fraction of the global batch's tokens (or sequences) that were clipped.

Conventions as in :mod:`rlhf.batch`: ``logps[b, t]`` is the log-prob of token ``t`` under the policy being
trained (differentiable), ``old_logps`` the same under the policy that the advantages were computed for (the
trainer's recomputation at rollout time; detached here), and ``mask`` marks response tokens. Inputs outside the
mask are replaced by constants *before* any arithmetic, so inf/NaN in padding can reach neither the loss nor its
gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, cast

import torch

from rlhf.ops.off_policy import BehaviourCorrection, behaviour_weights
from rlhf.registry import Registry

Tensor = torch.Tensor


@dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the policy losses: the clip range (PPO, GSPO; CISPO clips its weight with it; SAPO, which
    clips nothing, reads the gate's temperatures instead), dual clip and the behaviour correction.

    Attributes:
        clip_low: ``eps_low``: the ratio is clipped below at ``1 - clip_low`` (in ``[0, 1]``; 1: no lower bound, the
            ratio being positive).
        clip_high: ``eps_high``: the ratio is clipped above at ``1 + clip_high`` (>= 0). ``clip_high > clip_low``
            is DAPO's "clip-higher" (Yu et al. 2025), which leaves more room for raising unlikely tokens.
        dual_clip: the dual-clip constant ``c > 1`` (Ye et al. 2020), bounding the loss of a token with a negative
            advantage by ``-c * A``; ``None`` disables it. PPO only (the losses whose entry has ``dual_clip``).
        tis_cap: truncated importance sampling cap ``C`` (> 0) for the rollout-engine / trainer log-prob mismatch
            (Yao et al. 2025); shorthand for ``off_policy=BehaviourCorrection("tis", high=tis_cap)``; requires
            ``rollout_logps``; ``None`` disables it. As ``off_policy``.
        gate_tau_pos, gate_tau_neg: the temperatures of SAPO's soft gate for tokens with a positive / a negative
            advantage (> 0); ``None``: its paper's (its registry entry's ``gate_taus``). SAPO only.
        off_policy: the correction of the behaviour policy (:mod:`rlhf.ops.off_policy`: ``tis``, ``mis``,
            ``icepop``, ``seq_mask``); requires ``rollout_logps``; ``None`` disables it; not together with
            ``tis_cap``. The token-level losses only (PPO, CISPO, SAPO: their entry's ``behaviour_corrections``).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    tis_cap: Optional[float] = None
    off_policy: Optional[BehaviourCorrection] = None
    gate_tau_pos: Optional[float] = None
    gate_tau_neg: Optional[float] = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_low <= 1.0):
            raise ValueError(f"clip_low must be in [0, 1] (1: no lower bound: the ratio is > 0), got {self.clip_low}")
        if not (self.clip_high >= 0.0 and math.isfinite(self.clip_high)):
            raise ValueError(f"clip_high must be a finite number >= 0, got {self.clip_high}")
        if self.dual_clip is not None and not (self.dual_clip > 1.0 and math.isfinite(self.dual_clip)):
            raise ValueError(f"dual_clip must be a finite number > 1 (or None), got {self.dual_clip}")
        if self.tis_cap is not None and not (self.tis_cap > 0.0 and math.isfinite(self.tis_cap)):
            raise ValueError(f"tis_cap must be a finite number > 0 (or None), got {self.tis_cap}")
        for name, tau in (("gate_tau_pos", self.gate_tau_pos), ("gate_tau_neg", self.gate_tau_neg)):
            if tau is not None and not (tau > 0.0 and math.isfinite(tau)):
                raise ValueError(f"{name} must be a finite number > 0 (or None), got {tau}")
        if self.off_policy is not None and not isinstance(self.off_policy, BehaviourCorrection):
            raise TypeError(f"off_policy must be a rlhf.ops.off_policy.BehaviourCorrection, got {self.off_policy!r}")
        if self.off_policy is not None and self.tis_cap is not None:
            raise ValueError(
                f"tis_cap={self.tis_cap} and off_policy={self.off_policy.name!r} are both set: tis_cap is the "
                "shorthand for off_policy=BehaviourCorrection('tis', high=tis_cap); set one"
            )

    @property
    def correction(self) -> Optional[BehaviourCorrection]:
        """The behaviour correction in effect: ``off_policy``, or TIS at ``tis_cap``, or ``None``."""
        if self.tis_cap is not None:
            return BehaviourCorrection("tis", high=self.tis_cap)
        return self.off_policy


PolicyLossFn = Callable[..., Tuple[Tensor, Dict[str, Tensor]]]


@dataclass(frozen=True)
class PolicyLoss:
    """One policy loss: its maths and the facts the rest of the project reads (config validation, ``--dry-run``,
    the audit lint, docs/algorithms); no other list of loss names exists.

    Attributes:
        fn: the maths (signature of :func:`ppo_loss`).
        paper: the paper it follows.
        clip_low, clip_high: the paper's clip range (``algo.clip_low`` / ``algo.clip_high`` unset take these);
            ``None`` for a loss that clips nothing (SAPO).
        gate_taus: the paper's temperatures of a soft gate, ``(positive advantages, negative ones)``
            (``algo.gate_tau_pos`` / ``gate_tau_neg`` unset take these); ``None`` for a loss without one.
        sequence_level: its ratio is one number per sequence; then the paper's objective is a mean over
            sequences whatever the estimator, and ``aggregation`` says which mode reproduces it.
        aggregation: the aggregation of the paper's objective when the loss's paper fixes one (GSPO's mean over
            sequences, CISPO's token mean; ``None``: the estimator's paper decides).
        dual_clip: dual clip (``algo.dual_clip``) applies to it.
        behaviour_corrections: the behaviour corrections (``algo.off_policy_correction``, ``algo.tis_cap``: a weight
            on each token's loss) apply to it.
        refusal: why it refuses what it refuses (the config's errors quote it).
    """

    fn: PolicyLossFn
    paper: str
    clip_low: Optional[float]
    clip_high: Optional[float]
    gate_taus: Optional[Tuple[float, float]] = None
    sequence_level: bool = False
    aggregation: Optional[str] = None
    dual_clip: bool = True
    behaviour_corrections: bool = True
    refusal: str = ""

    def __post_init__(self) -> None:
        clips = (self.clip_low is not None, self.clip_high is not None)
        if clips not in ((True, True), (False, False)) or clips[0] == (self.gate_taus is not None):
            raise ValueError(f"{self.paper}: a policy loss has a clip range (clip_low and clip_high) or gate_taus")


POLICY_LOSSES = Registry[PolicyLoss]("policy loss")


def _policy_loss(name: str, **facts) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Registers the decorated function as policy loss ``name`` with its :class:`PolicyLoss` facts."""
    return POLICY_LOSSES.register_entry(name, lambda fn: PolicyLoss(fn=fn, **facts))


def policy_loss(
    name: str,
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    rollout_logps: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Policy loss ``name``'s maths: ``(loss (B, T), stats)`` (see :func:`ppo_loss`)."""
    return POLICY_LOSSES.get(name).fn(logps, old_logps, advantages, mask, cfg, rollout_logps=rollout_logps)


# ------------------------------------------------------------------------------------------------ helpers
def _dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in tensors) else torch.float32


def _check_shapes(mask: Tensor, **tensors: Optional[Tensor]) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be (B, T), got shape {tuple(mask.shape)}")
    for name, x in tensors.items():
        if x is not None and x.shape != mask.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} != mask shape {tuple(mask.shape)}")


def _on_mask(x: Tensor, m: Tensor, dtype: torch.dtype, fill: float = 0.0) -> Tensor:
    """``x`` in ``dtype`` on the mask, the constant ``fill`` elsewhere (no gradient reaches ``x`` there)."""
    return torch.where(m, x.to(dtype), torch.tensor(fill, dtype=dtype, device=x.device))


def _clip_surrogate(ratio: Tensor, adv: Tensor, cfg: PolicyLossConfig) -> Tuple[Tensor, Tensor]:
    """``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and where the clipped branch is the larger.

    ``where`` rather than ``torch.maximum``: identical values, but the gradient is exactly that of the selected
    branch (``maximum`` splits it between equal branches, which sums to the same only by luck of ``clamp``).
    """
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    is_clipped = clipped > unclipped
    return torch.where(is_clipped, clipped, unclipped), is_clipped


def _approx_kl(log_ratio: Tensor) -> Tensor:
    """``k3`` estimate of ``KL(pi_old || pi)`` per token from ``log r = log pi - log pi_old`` (samples from
    ``pi_old``): ``(r - 1) - log r``; non-negative, unbiased (Schulman 2020)."""
    return torch.expm1(log_ratio) - log_ratio


# ------------------------------------------------------------------------------------------------ losses
@_policy_loss("ppo", paper="Schulman et al. 2017 (PPO), eq. 7", clip_low=0.2, clip_high=0.2)
def ppo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    rollout_logps: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017, eq. 7), negated to a loss, with optional asymmetric
    clipping, dual clipping and a correction of the behaviour policy (truncated importance sampling and others).

    With ``r = exp(logps - old_logps)`` and advantage ``A``:

    * ``loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` (clip-higher when ``clip_high > clip_low``,
      DAPO, Yu et al. 2025);
    * dual clip (Ye et al. 2020, "Mastering complex control in MOBA games with deep RL", eq. 5), for ``A < 0``
      only: ``loss = min(loss, -c A)``, so a token whose ratio has grown huge cannot produce an unbounded loss;
    * behaviour correction (``cfg.correction``, :mod:`rlhf.ops.off_policy`): the tokens were sampled by the
      rollout engine (e.g. vLLM) whose log-probs ``rollout_logps`` differ from the trainer's ``old_logps`` (engine
      numerics; stale weights in asynchronous RL, where ``old_logps`` is the proximal policy of decoupled PPO); the
      per-token loss is multiplied by a detached weight ``w`` of ``rho = exp(old_logps - rollout_logps)``: TIS
      (Yao et al. 2025) ``w = min(rho, tis_cap)``, or the masking corrections (MIS, IcePop, sequence masking),
      which set ``w = 0`` on the tokens they drop. A dropped token keeps its place in the aggregation's
      denominator (its loss is 0).

    Args:
        logps: ``(B, T)`` log-probs under the current policy (differentiable).
        old_logps: ``(B, T)`` log-probs under the policy the ratio is taken against (PPO's pi_old; the proximal
            policy when the samples come from another one; detached here).
        advantages: ``(B, T)`` advantages (detached here).
        mask: ``(B, T)`` 0/1 or bool, 1 on response tokens.
        cfg: clip settings; a behaviour correction (``tis_cap`` or ``off_policy``) must be set exactly when
            ``rollout_logps`` is given.
        rollout_logps: ``(B, T)`` log-probs reported by the rollout engine (the behaviour policy's).

    Returns:
        ``(loss, stats)``: ``loss`` ``(B, T)`` per-token losses in at least float32, 0 outside the mask; ``stats``
        per-token ``(B, T)`` detached tensors, 0 outside the mask: ``clipped`` (1 where the clipped branch is the
        larger, i.e. the token gets no gradient from clipping), ``dual_clipped`` (1 where the dual clip binds),
        ``ratio`` (``r``), ``approx_kl`` (``k3`` estimate of ``KL(pi_old || pi)``: ``(r - 1) - log r``), with TIS
        ``tis_weight`` (``w``) and ``tis_capped`` (1 where ``w`` hit the cap), with a masking correction
        ``is_weight`` (``w``) and ``is_masked`` (1 where ``w`` was set to 0).
    """
    _check_shapes(mask, logps=logps, old_logps=old_logps, advantages=advantages, rollout_logps=rollout_logps)
    correction = _check_correction(cfg, rollout_logps)
    m = mask != 0
    dtype = _dtype(logps, old_logps, advantages, rollout_logps)
    log_ratio = _on_mask(logps, m, dtype) - _on_mask(old_logps.detach(), m, dtype)
    ratio = torch.exp(log_ratio)
    adv = _on_mask(advantages.detach(), m, dtype)
    loss, clipped = _clip_surrogate(ratio, adv, cfg)
    dual = torch.zeros_like(clipped)
    if cfg.dual_clip is not None:
        bound = -cfg.dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    loss, stats = _behaviour_weighted(correction, loss, old_logps, rollout_logps, m)
    zero = torch.zeros((), dtype=dtype, device=loss.device)
    loss = torch.where(m, loss, zero)
    stats.update(_ratio_stats(clipped, ratio, log_ratio, m), dual_clipped=(dual & m).to(dtype))
    return loss, stats


def _ratio_stats(clipped: Tensor, ratio: Tensor, log_ratio: Tensor, m: Tensor) -> Dict[str, Tensor]:
    """The statistics every policy loss reports, ``(B, T)``, detached, 0 outside the mask ``m``: ``clipped`` (the
    bool ``clipped`` as 0/1), ``ratio`` and ``approx_kl`` (:func:`_approx_kl` of the per-token ``log_ratio``)."""
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    return {
        "clipped": (clipped & m).to(ratio.dtype),
        "ratio": torch.where(m, ratio.detach(), zero),
        "approx_kl": torch.where(m, _approx_kl(log_ratio.detach()), zero),
    }


def _behaviour_weighted(
    correction: Optional[BehaviourCorrection],
    loss: Tensor,
    old_logps: Tensor,
    rollout_logps: Optional[Tensor],
    m: Tensor,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``loss (B, T)`` times the detached weight of ``correction`` (``rlhf.ops.off_policy``) of
    ``rho = exp(old_logps - rollout_logps)``, and its statistics (``tis_weight`` / ``tis_capped``, or ``is_weight`` /
    ``is_masked`` for a masking correction; 0 outside the mask ``m``); ``loss`` as it is without a correction."""
    if correction is None:
        return loss, {}
    assert rollout_logps is not None, "_check_correction: a correction without rollout_logps already raised"
    dtype = loss.dtype  # float64 whenever any input is, as the ratio is
    weight, masked, capped = behaviour_weights(
        correction, old_logps.detach().to(dtype), rollout_logps.detach().to(dtype), m
    )
    zero = torch.zeros((), dtype=dtype, device=loss.device)
    if correction.entry.masks:
        return loss * weight, {"is_weight": torch.where(m, weight, zero), "is_masked": masked.to(dtype)}
    return loss * weight, {"tis_weight": torch.where(m, weight, zero), "tis_capped": capped.to(dtype)}


def _check_correction(cfg: PolicyLossConfig, rollout_logps: Optional[Tensor]) -> Optional[BehaviourCorrection]:
    """The correction in effect; it and ``rollout_logps`` must come together."""
    # Either half without the other is a configuration mistake that would otherwise go unnoticed.
    correction = cfg.correction
    what = "tis_cap" if cfg.tis_cap is not None else f"off_policy={correction.name!r}" if correction else ""
    if correction is not None and rollout_logps is None:
        raise ValueError(f"{what} is set but rollout_logps was not given: the correction needs the behaviour log-probs")
    if correction is None and rollout_logps is not None:
        raise ValueError("rollout_logps was given but no correction is set: set tis_cap or off_policy to apply one")
    return correction


@_policy_loss(
    "gspo",
    paper="Zheng et al. 2025 (GSPO), eq. 5-7 and 13-14",
    clip_low=3e-4,
    clip_high=4e-4,
    sequence_level=True,
    aggregation="seq-mean-token-mean",
    dual_clip=False,
    behaviour_corrections=False,
    refusal="they are token-level corrections and its ratio is one number per sequence",
)
def gspo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    rollout_logps: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO clipping on the length-normalized
    *sequence* importance ratio ``s_i = exp(mean_t (logps - old_logps))`` over the row's response tokens.

    Implemented in the paper's GSPO-token form (its eq. 13-14): token ``t`` uses
    ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]``, whose *value* is ``s_i`` on every token and whose gradient is
    ``s_i grad log pi(y_t)``, and the per-token loss is the clipped surrogate
    ``max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - clip_low, 1 + clip_high))``. With a sequence-constant
    advantage (GRPO-style) every token of row ``i`` carries the loss value of the sequence, and the per-sequence
    token mean has exactly the value and gradient of GSPO's sequence objective, so

    * aggregate with ``seq-mean-token-mean`` to get the paper's objective (``1 / G sum_i``); ``token-mean``
      weights each sequence by its length instead;
    * the clip ranges of the paper are tiny (``3e-4`` / ``4e-4``) because ``s_i`` is a per-token geometric mean:
      its registry entry carries them, and a run that leaves ``algo.clip_low`` / ``algo.clip_high`` unset trains
      with them (the :class:`PolicyLossConfig` defaults, 0.2, are PPO's: a length-normalized ratio almost never
      leaves ``[0.8, 1.2]``, so GSPO would run unclipped).

    Dual clip and the behaviour corrections (TIS, MIS, IcePop, sequence masking) are token-level corrections with no
    counterpart in the paper's sequence-level objective; they are rejected rather than applied in some invented
    form. A row with no response token contributes nothing.

    Args and returns as :func:`ppo_loss`; ``stats`` has ``clipped`` (the row's clip indicator on its tokens),
    ``ratio`` (``s_i`` on every token of row ``i``) and ``approx_kl`` (per-token ``k3`` of ``KL(pi_old || pi)``).
    """
    _check_shapes(mask, logps=logps, old_logps=old_logps, advantages=advantages, rollout_logps=rollout_logps)
    if cfg.dual_clip is not None or cfg.correction is not None or rollout_logps is not None:
        raise ValueError(
            "policy loss 'gspo' supports neither dual_clip nor a behaviour correction (tis_cap / off_policy / "
            "rollout_logps)"
        )
    m = mask != 0
    dtype = _dtype(logps, old_logps, advantages)
    lp = _on_mask(logps, m, dtype)
    log_ratio = lp - _on_mask(old_logps.detach(), m, dtype)
    counts = m.sum(-1).clamp(min=1).to(dtype)
    seq_log_ratio = log_ratio.sum(-1) / counts  # (B,); 0 for a row without tokens
    token_log_ratio = seq_log_ratio.detach()[:, None] + (lp - lp.detach())  # value s_i, gradient grad log pi_t
    ratio = torch.exp(token_log_ratio)
    adv = _on_mask(advantages.detach(), m, dtype)
    loss, clipped = _clip_surrogate(ratio, adv, cfg)
    zero = torch.zeros((), dtype=dtype, device=loss.device)
    return torch.where(m, loss, zero), _ratio_stats(clipped, ratio, log_ratio, m)


@_policy_loss(
    "cispo",
    paper="Chen et al. 2025 (MiniMax-M1, arXiv 2506.13585), sec. 3.1",
    clip_low=1.0,
    clip_high=5.0,
    aggregation="token-mean",
    dual_clip=False,
    refusal="its loss is a weighted log-prob, with no clipped surrogate for dual clip to bound",
)
def cispo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    rollout_logps: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """CISPO (Chen et al. 2025, "MiniMax-M1", sec. 3.1): the importance weight is clipped and detached, and every
    token keeps its gradient.

    ``loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logps`` with ``r = exp(logps - old_logps)``: REINFORCE
    weighted by the clipped ratio. Where PPO's clip gives a token whose ratio left the range no gradient at all, CISPO
    only bounds the size of its weight, so the rare tokens whose probability moves fast (the paper's "However",
    "Recheck") keep contributing after the first update. On-policy (``r = 1``) its gradient is PPO's.

    Its registry entry carries the paper's range: no lower bound (``clip_low = 1``: the paper sets its lower epsilon
    large) and an upper bound that the paper tunes without publishing; 5 (a weight of at most 6) is NeMo RL's CISPO
    recipe's. And the paper's normalisation, over all the batch's tokens (``token-mean``, what
    ``algo.loss_agg_mode=auto`` trains with). The loss's *value* is the paper's objective, a weighted log-prob, so
    ``policy_loss`` does not compare with PPO's (``-A r``); its gradient is what trains.

    A behaviour correction (TIS, MIS, IcePop, sequence masking) multiplies each token's loss as for PPO (the clipped
    weight is of ``pi / pi_old``, the correction's of ``pi_old / pi_rollout``); dual clip is refused: there is no
    clipped surrogate for it to bound.

    Args and returns as :func:`ppo_loss`; ``stats`` has ``clipped`` (1 where the weight was clipped; the token
    still has its gradient), ``ratio`` (``r``), ``approx_kl`` and the correction's statistics.
    """
    _check_shapes(mask, logps=logps, old_logps=old_logps, advantages=advantages, rollout_logps=rollout_logps)
    if cfg.dual_clip is not None:
        raise ValueError("policy loss 'cispo' has no clipped surrogate for dual_clip to bound; unset it")
    correction = _check_correction(cfg, rollout_logps)
    m = mask != 0
    dtype = _dtype(logps, old_logps, advantages, rollout_logps)
    lp = _on_mask(logps, m, dtype)
    log_ratio = lp.detach() - _on_mask(old_logps.detach(), m, dtype)
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    weight = ratio.clamp(low, high)
    adv = _on_mask(advantages.detach(), m, dtype)
    loss, stats = _behaviour_weighted(correction, -weight * adv * lp, old_logps, rollout_logps, m)
    zero = torch.zeros((), dtype=dtype, device=loss.device)
    stats.update(_ratio_stats((ratio < low) | (ratio > high), ratio, log_ratio, m))
    return torch.where(m, loss, zero), stats


@_policy_loss(
    "sapo",
    paper="Gao et al. 2025 (SAPO, arXiv 2511.20347)",
    clip_low=None,
    clip_high=None,
    gate_taus=(1.0, 1.05),
    dual_clip=False,
    refusal="its soft gate bounds each token's loss already (|A| 4 / tau at most), leaving dual clip nothing to cap",
)
def sapo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    rollout_logps: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): PPO's hard clip replaced by a smooth gate on the
    ratio, whose temperature depends on the advantage's sign.

    ``loss = -(4 / tau) sigmoid(tau (r - 1)) A`` with ``r = exp(logps - old_logps)`` and ``tau = tau_pos`` where
    ``A > 0``, ``tau_neg`` elsewhere. Its gradient is ``-4 s (1 - s) r A grad log pi`` with
    ``s = sigmoid(tau (r - 1))``: at ``r = 1`` exactly PPO's (``4 s (1 - s) = 1``), and falling off smoothly as the
    ratio leaves 1, where PPO's clip cuts the gradient to 0 at a threshold. ``tau_neg > tau_pos`` (the paper's
    1.05 / 1.0, its registry entry's ``gate_taus``) damps tokens with a negative advantage faster: pushing a sampled
    token down raises every other token of the vocabulary, the less stable direction.

    No clip range (``algo.clip_low`` / ``clip_high`` are refused), and no dual clip: the gate bounds each token's
    loss by ``|A| 4 / tau``. A behaviour correction (TIS, MIS, IcePop, sequence masking) multiplies each token's loss
    as for PPO.

    Args and returns as :func:`ppo_loss`; ``cfg.gate_tau_pos`` / ``gate_tau_neg`` set the temperatures (``None``:
    the paper's). ``stats`` has ``clipped`` (0: the gate clips nothing), ``ratio`` (``r``), ``approx_kl``,
    ``gate_grad`` (``4 s (1 - s) r``, the factor of ``-A grad log pi``: 1 on-policy, near 1 close to it (a little
    above for ``r`` just over 1), falling toward 0 as the ratio moves away) and the correction's statistics.
    """
    _check_shapes(mask, logps=logps, old_logps=old_logps, advantages=advantages, rollout_logps=rollout_logps)
    if cfg.dual_clip is not None:
        raise ValueError("policy loss 'sapo' bounds each token's loss with its gate already; unset dual_clip")
    correction = _check_correction(cfg, rollout_logps)
    m = mask != 0
    dtype = _dtype(logps, old_logps, advantages, rollout_logps)
    log_ratio = _on_mask(logps, m, dtype) - _on_mask(old_logps.detach(), m, dtype)
    ratio = torch.exp(log_ratio)
    adv = _on_mask(advantages.detach(), m, dtype)
    paper_pos, paper_neg = cast(Tuple[float, float], POLICY_LOSSES.get("sapo").gate_taus)
    tau_pos = paper_pos if cfg.gate_tau_pos is None else cfg.gate_tau_pos
    tau_neg = paper_neg if cfg.gate_tau_neg is None else cfg.gate_tau_neg
    tau = torch.full_like(adv, tau_neg).masked_fill(adv > 0, tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss, stats = _behaviour_weighted(correction, -(4.0 / tau) * gate * adv, old_logps, rollout_logps, m)
    zero = torch.zeros((), dtype=dtype, device=loss.device)
    with torch.no_grad():
        gate_grad = 4.0 * gate * (1.0 - gate) * ratio
    stats.update(_ratio_stats(torch.zeros_like(m), ratio, log_ratio, m), gate_grad=torch.where(m, gate_grad, zero))
    return torch.where(m, loss, zero), stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    clip: Optional[float] = None,
    mask: Optional[Tensor] = None,
) -> Tensor:
    """Per-token critic loss, with PPO's value clipping when ``clip`` is set.

    ``0.5 (V - R)^2`` without clipping; with it, ``0.5 max((V - R)^2, (V_clip - R)^2)`` where
    ``V_clip = V_old + clamp(V - V_old, -clip, clip)`` (the value clipping of the PPO reference implementation,
    OpenAI baselines ``ppo2``; Andrychowicz et al. 2021 found it rarely helps, hence optional).

    Args:
        values: ``(B, T)`` current critic values (differentiable).
        old_values: ``(B, T)`` the values at rollout time (detached here).
        returns: ``(B, T)`` value targets, e.g. the GAE returns (detached here).
        clip: the clip range (> 0) or ``None``.
        mask: optional ``(B, T)`` response mask; when given, the output is exactly 0 outside it and inputs there
            (even inf/NaN) cannot reach the gradient. Without it every position is computed, and the caller's
            aggregation drops the padding (whose inputs must then be finite for a finite gradient).

    Returns:
        ``(B, T)`` per-token losses in at least float32 (not summed).
    """
    if not (values.shape == old_values.shape == returns.shape):
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)} and returns {tuple(returns.shape)} "
            "must have the same shape"
        )
    if clip is not None and not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"value clip must be a positive finite number or None, got {clip}")
    dtype = _dtype(values, old_values, returns)
    v, v_old, ret = values.to(dtype), old_values.detach().to(dtype), returns.detach().to(dtype)
    if mask is not None:
        _check_shapes(mask, values=values)
        m = mask != 0
        v, v_old, ret = _on_mask(v, m, dtype), _on_mask(v_old, m, dtype), _on_mask(ret, m, dtype)
    loss = (v - ret).square()
    if clip is not None:
        v_clipped = v_old + (v - v_old).clamp(-clip, clip)
        clipped_loss = (v_clipped - ret).square()
        loss = torch.where(clipped_loss > loss, clipped_loss, loss)
    return 0.5 * loss
