"""Corrections for the behaviour policy of off-policy samples: per-token weights of the PPO policy loss.

The tokens of an RL batch were sampled by the *behaviour* policy ``pi_behav``, whose log-probs ``behaviour_logps``
the rollout engine reports (vLLM; :attr:`rlhf.batch.Batch.rollout_logps`). The PPO ratio is taken against the
*proximal* policy ``pi_prox`` (:attr:`rlhf.batch.Batch.old_logps`, the trainer's own log-probs of the same weights,
or of newer ones in asynchronous RL): the decoupled PPO objective (Hilton et al. 2022, "Batch size-invariance for
policy optimization"). The two differ through the engine / trainer numerics and, in asynchronous RL, because the
behaviour weights are some versions old. Each token's loss is therefore multiplied by a detached weight built from

    rho_t = exp(proximal_logps_t - behaviour_logps_t) = pi_prox(y_t) / pi_behav(y_t),

by one of the corrections of :data:`BEHAVIOUR_CORRECTIONS` (each named after its paper):

* ``tis``: truncated importance sampling, ``w = min(rho, high)``;
* ``mis``: masked importance sampling, ``w = rho`` where ``rho <= high``, else 0;
* ``icepop``: ``w = rho`` where ``low <= rho <= high``, else 0;
* ``seq_mask``: rejection of whole sequences whose geometric-mean ratio leaves ``[low, high]``; ``w`` is 1 on the
  kept rows and 0 on the rejected ones (no reweighting).

A masked token (``w = 0``) keeps its place in the loss aggregation's denominator: its loss is 0, the count of the
aggregation (:mod:`rlhf.ops.aggregation`, ``PolicyObjective.count``) is unchanged. This is the IcePop objective
(its masked tokens stay in ``1 / sum_i |y_i|``) and it keeps the accumulation contract, a count that depends on the
response mask only. verl's rollout correction instead drops rejected tokens from the denominator (its
``modified_response_mask``); here that would make the count depend on log-probs. Pure torch, no orchestration.

Default bounds (each registry entry carries its own; a :class:`BehaviourCorrection` with a bound unset takes it):

* ``tis`` high 2: verl's ``rollout_is_threshold`` default (docs/algo/rollout_corr.md, which follows Liu et al.).
* ``mis`` high 2: the same threshold (verl's ``seq_mis`` preset). Departure: the blog favours the sequence-level
  form; this is its token-level form (each token masked on its own ``rho``).
* ``icepop`` ``[alpha, beta] = [0.5, 5]``: the paper's as implementations cite it (rllm's IcePop loss: 0.5 / 5;
  open-instruct: beta 5, but the band ``[1 / beta, beta]``; set ``low`` = 0.2 for that reading).
* ``seq_mask`` ``[0.999, 1.001]``: verl's ``geo_rs`` preset (docs/algo/rollout_corr.md; verl documents 1.0001 -
  1.001 as the typical upper bound, and the reciprocal of the upper as the default lower one). These suit the
  engine / trainer mismatch; stale asynchronous samples drift further, so expect to widen them. verl's optional
  per-token veto is not part of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from rlhf.registry import Registry

Tensor = torch.Tensor

#: ``fn(rho, log_rho, mask, low, high) -> (weight, masked, capped)``, see :func:`behaviour_weights`.
CorrectionFn = Callable[[Tensor, Tensor, Tensor, Optional[float], float], Tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class Correction:
    """One behaviour correction: its maths and the facts config validation and the docs read.

    Attributes:
        fn: the maths (:data:`CorrectionFn`).
        paper: the paper it follows, with where its default bounds come from.
        high: the default upper bound on ``rho`` (or on the row's geometric mean for ``seq_mask``).
        low: the default lower bound; ``None`` when the correction has no lower bound (setting one is an error).
        masks: it zeroes tokens (reported as ``is_weight`` / ``is_masked``); otherwise it caps them (``tis``,
            reported as ``tis_weight`` / ``tis_capped``).
    """

    fn: CorrectionFn
    paper: str
    high: float
    low: Optional[float] = None
    masks: bool = True


BEHAVIOUR_CORRECTIONS = Registry[Correction]("behaviour correction")


def _correction(name: str, **facts) -> Callable[[CorrectionFn], CorrectionFn]:
    """Registers the decorated function as behaviour correction ``name`` with its :class:`Correction` facts."""
    return BEHAVIOUR_CORRECTIONS.register_entry(name, lambda fn: Correction(fn=fn, **facts))


def bound_problems(name: str, low: Optional[float], high: Optional[float]) -> List[Tuple[str, str]]:
    """Why bounds ``low`` / ``high`` (``None``: the correction's default) do not suit correction ``name``:
    ``[("low" | "high", message), ...]``, empty when they do. An unknown ``name`` raises, listing the valid ones."""
    entry = BEHAVIOUR_CORRECTIONS.get(name)
    problems = []
    if low is not None and entry.low is None:
        problems.append(("low", f"is {low:g}, but behaviour correction {name!r} has no lower bound"))
    elif low is not None and not (low >= 0.0 and math.isfinite(low)):
        problems.append(("low", f"must be a finite number >= 0, got {low}"))
    if high is not None and not (high > 0.0 and math.isfinite(high)):
        problems.append(("high", f"must be a finite number > 0, got {high}"))
    elif entry.low is not None and not problems:
        lo, hi = (entry.low if low is None else low), (entry.high if high is None else high)
        if not lo < hi:
            problems.append(("low", f"is {lo:g}, not below the upper bound {hi:g} of {name!r}: nothing would be kept"))
    return problems


@dataclass(frozen=True)
class BehaviourCorrection:
    """A selected correction with its bounds; unset bounds take the registry entry's defaults at construction.

    Attributes:
        name: a name in :data:`BEHAVIOUR_CORRECTIONS` (``tis``, ``mis``, ``icepop``, ``seq_mask``).
        low: lower bound on ``rho`` (``icepop``) or on the row's geometric-mean ratio (``seq_mask``); ``None``
            (the default) resolves to the entry's; ``tis`` and ``mis`` have none.
        high: upper bound (the cap of ``tis``); ``None`` resolves to the entry's default.
    """

    name: str
    low: Optional[float] = None
    high: Optional[float] = None

    def __post_init__(self) -> None:
        entry = BEHAVIOUR_CORRECTIONS.get(self.name)
        for field, message in bound_problems(self.name, self.low, self.high):
            raise ValueError(f"behaviour correction {self.name!r}: {field} {message}")
        # frozen: the resolved defaults are written once, here
        object.__setattr__(self, "low", entry.low if self.low is None else float(self.low))
        object.__setattr__(self, "high", entry.high if self.high is None else float(self.high))

    @property
    def entry(self) -> Correction:
        return BEHAVIOUR_CORRECTIONS.get(self.name)


def behaviour_weights(
    correction: BehaviourCorrection, proximal_logps: Tensor, behaviour_logps: Tensor, mask: Tensor
) -> Tuple[Tensor, Tensor, Tensor]:
    """The detached per-token weights of ``correction``.

    Args:
        correction: the correction and its (resolved) bounds.
        proximal_logps: ``(B, T)`` log-probs of the sampled tokens under the proximal policy (the trainer's
            ``old_logps``).
        behaviour_logps: ``(B, T)`` log-probs under the behaviour policy (the rollout engine's).
        mask: ``(B, T)`` 0/1 or bool, 1 on response tokens. Inputs outside it are replaced by 0 before any
            arithmetic, so inf/NaN in padding reaches nothing.

    Returns:
        ``(weight, masked, capped)``, each ``(B, T)`` and detached: ``weight`` in float32 (float64 if either input
        is float64), 1 outside the mask; ``masked`` (bool) where the correction set a response token's weight to 0;
        ``capped`` (bool) where ``tis`` truncated it. Both are False outside the mask.
    """
    if mask.dim() != 2 or proximal_logps.shape != mask.shape or behaviour_logps.shape != mask.shape:
        raise ValueError(
            f"proximal_logps {tuple(proximal_logps.shape)}, behaviour_logps {tuple(behaviour_logps.shape)} and "
            f"mask {tuple(mask.shape)} must all be (B, T)"
        )
    m = mask != 0
    dtype = torch.float64 if torch.float64 in (proximal_logps.dtype, behaviour_logps.dtype) else torch.float32
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    log_rho = torch.where(m, proximal_logps.detach().to(dtype), zero) - torch.where(
        m, behaviour_logps.detach().to(dtype), zero
    )
    rho = torch.exp(log_rho)  # 1 outside the mask
    high = correction.high
    assert high is not None, "BehaviourCorrection resolves every upper bound at construction"
    weight, masked, capped = correction.entry.fn(rho, log_rho, m, correction.low, high)
    one = torch.ones((), dtype=dtype, device=mask.device)
    return torch.where(m, weight, one), masked & m, capped & m


# ------------------------------------------------------------------------------------------------ corrections
@_correction(
    "tis",
    paper='Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training" (TIS; cap 2, '
    "verl's rollout_is_threshold default)",
    high=2.0,
    masks=False,
)
def _tis(rho: Tensor, log_rho: Tensor, m: Tensor, low: Optional[float], high: float):
    """Truncated importance sampling: ``w = min(rho, high)``; ``capped`` where ``rho > high``."""
    capped = rho > high
    return torch.where(capped, torch.full_like(rho, high), rho), torch.zeros_like(m), capped


@_correction(
    "mis",
    paper='Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference '
    "Mismatch\" (MIS, here per token; threshold 2, verl's seq_mis preset)",
    high=2.0,
)
def _mis(rho: Tensor, log_rho: Tensor, m: Tensor, low: Optional[float], high: float):
    """Masked importance sampling: ``w = rho`` where ``rho <= high``, else 0 (the token is dropped, not capped)."""
    return _dropped(rho, rho > high, m)


@_correction(
    "icepop",
    paper='Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model" '
    "(Ring-1T, IcePop; alpha 0.5, beta 5)",
    low=0.5,
    high=5.0,
)
def _icepop(rho: Tensor, log_rho: Tensor, m: Tensor, low: Optional[float], high: float):
    """IcePop's ``M(rho; alpha, beta) = rho`` where ``alpha <= rho <= beta``, else 0 (two-sided masking)."""
    assert low is not None, "icepop has a lower bound"
    return _dropped(rho, (rho < low) | (rho > high), m)


def _dropped(rho: Tensor, masked: Tensor, m: Tensor):
    """A masking correction's ``(weight, masked, capped)``: ``rho``, 0 where ``masked``; nothing capped."""
    return torch.where(masked, torch.zeros_like(rho), rho), masked, torch.zeros_like(m)


@_correction(
    "seq_mask",
    paper="verl rollout correction, geometric rejection sampling (rollout_rs=geometric; docs/algo/rollout_corr.md, "
    "geo_rs preset: 0.999 / 1.001), after Liu et al. 2025",
    low=0.999,
    high=1.001,
)
def _seq_mask(rho: Tensor, log_rho: Tensor, m: Tensor, low: Optional[float], high: float):
    """Sequence rejection by the geometric-mean ratio ``g_i = exp(sum_t m_t log rho_t / sum_t m_t)``: a row with
    ``g_i`` outside ``[low, high]`` gets ``w = 0`` on all its tokens, a kept row ``w = 1`` (rejection only, no
    reweighting). The mean is length-normalised, so the bounds are tight (1e-3 is a 0.1% mean per-token deviation).
    A row without response tokens has ``g = 1`` and nothing to mask."""
    assert low is not None, "seq_mask has a lower bound"
    counts = m.sum(-1).clamp(min=1).to(log_rho.dtype)
    geo = torch.exp(log_rho.sum(-1) / counts)  # (B,); log_rho is 0 outside the mask
    rejected = ((geo < low) | (geo > high))[:, None].expand_as(m)
    return torch.where(rejected, torch.zeros_like(rho), torch.ones_like(rho)), rejected, torch.zeros_like(m)
