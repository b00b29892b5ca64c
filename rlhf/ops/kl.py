"""Per-token estimators of the KL divergence between the policy and the reference model.

Notation: for a response token ``y_t`` sampled from the policy ``pi``, ``log r_t = log pi(y_t) - log ref(y_t)``
(``logps - ref_logps``). Each estimator maps ``log r`` to a per-token value whose expectation under samples from
``pi`` relates to ``KL(pi || ref) = E_pi[log r]`` (Schulman 2020, "Approximating KL divergence",
http://joschu.net/blog/kl-approx.html):

=====  =================================  =====================================  ==============================
name   value                              as an estimate of KL(pi || ref)        gradient when used as a loss
=====  =================================  =====================================  ==============================
k1     ``log r``                          unbiased; can be negative per token    ``E_pi[grad log pi] = 0``
k2     ``0.5 (log r)^2``                  biased (exact to 2nd order in log r);   ``grad KL(pi || ref)``
                                          non-negative
k3     ``exp(-log r) + log r - 1``        unbiased (``E_pi[ref / pi] = 1``);      ``grad KL(ref || pi)``
                                          non-negative (``e^x >= 1 + x``)
=====  =================================  =====================================  ==============================

"As an estimate" is about the value, e.g. a KL penalty folded into the reward (there no gradient flows through
it). "As a loss" is the expected gradient when the value is differentiated through ``log pi`` with the samples
held fixed, on-policy (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL"):
``grad k2 = log r * grad log pi`` averages to the gradient of the reverse KL, whereas
``grad k3 = (1 - ref / pi) grad log pi`` averages to the gradient of the *forward* KL ``KL(ref || pi)``, and
``k1`` gives no gradient in expectation, so ``algo.kl_mode=loss`` refuses it (:attr:`KLEstimator.usable_as_loss`).
DeepSeekMath's GRPO uses ``k3`` as its KL loss; ``k2`` is the one whose gradient is the reverse KL's.

All functions are element-wise: values at padding are whatever the inputs make them, and the caller's mask (or
:mod:`rlhf.ops.aggregation`) drops them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlhf.registry import Registry

Tensor = torch.Tensor


@dataclass(frozen=True)
class KLEstimator:
    """One estimator and what it is good for (the facts config validation, ``--dry-run`` and the docs read).

    Attributes:
        fn: ``log r (B, T) -> (B, T)`` per-token values.
        loss_gradient: what the gradient of the value, used as a loss, follows in expectation (on-policy samples,
            Tang & Munos 2025): ``"none"`` (zero in expectation: noise only), ``"reverse KL"`` or ``"forward KL"``.
    """

    fn: Callable[[Tensor], Tensor]
    loss_gradient: str

    @property
    def usable_as_loss(self) -> bool:
        """Whether a KL *loss* with this estimator regularises anything (``algo.kl_mode=loss``)."""
        return self.loss_gradient != "none"


KL_ESTIMATORS = Registry[KLEstimator]("KL estimator")

# The per-token bound of a KL that is trained on (a loss) or rewarded: values are clamped to [-10, 10], as OpenRLHF
# and verl do. k3 grows like exp(-log r): one token the reference finds ~1e-9 as likely as the policy does would
# otherwise outweigh a whole batch. The clamp zeroes the gradient of a token beyond it.
KL_VALUE_BOUND = 10.0
# Before an estimator, log r is clamped far outside the bound's reach (k3 = 10 at log r ~ -2.4 and ~ 11; k2 at
# |log r| ~ 4.5): exp stays finite, so a clamped token's zero gradient is not 0 x inf = NaN.
_LOG_RATIO_GUARD = 30.0


def _register(name: str, loss_gradient: str) -> Callable[[Callable[[Tensor], Tensor]], Callable[[Tensor], Tensor]]:
    """Registers the decorated function as KL estimator ``name`` with its :class:`KLEstimator` facts."""
    return KL_ESTIMATORS.register_entry(name, lambda fn: KLEstimator(fn, loss_gradient))


@_register("k1", loss_gradient="none")
def _k1(log_ratio: Tensor) -> Tensor:
    """``log r``: the plain Monte Carlo estimate of ``KL(pi || ref)``; unbiased, negative where ``ref > pi``."""
    return log_ratio


@_register("k2", loss_gradient="reverse KL")
def _k2(log_ratio: Tensor) -> Tensor:
    """``0.5 (log r)^2``: the f-divergence with ``f(u) = 0.5 log(u)^2``, which agrees with KL to second order in
    ``log r``; biased upward for distant policies, non-negative, low variance."""
    return 0.5 * log_ratio.square()


@_register("k3", loss_gradient="forward KL")
def _k3(log_ratio: Tensor) -> Tensor:
    """``(ref / pi - 1) - log(ref / pi) = exp(-log r) + log r - 1``: ``k1`` plus the zero-mean control variate
    ``ref / pi - 1``; unbiased and non-negative (``e^x >= 1 + x``), exactly 0 at ``log r = 0``.

    ``expm1`` keeps the value accurate near ``log r = 0``, where ``exp(-x) - 1`` and ``x`` nearly cancel.
    """
    return torch.expm1(-log_ratio) + log_ratio


def kl_estimate(
    name: str, logps: Tensor, ref_logps: Tensor, clamp: Optional[float] = None, bounded: bool = False
) -> Tensor:
    """Per-token KL estimate ``name`` (``"k1"``, ``"k2"`` or ``"k3"``) from policy and reference log-probs.

    Args:
        name: a name in :data:`KL_ESTIMATORS` (an unknown name raises an error listing the valid ones).
        logps: ``(B, T)`` per-token log-probs under the policy that sampled the tokens.
        ref_logps: ``(B, T)`` per-token log-probs under the reference model.
        clamp: if set (> 0), the log-ratio is clamped to ``[-clamp, clamp]`` before the estimator is applied.
            This is a numerical guard, not part of the estimators: ``k3`` contains ``exp(-log r)``, which
            overflows float32 for ``log r < -88``. Clamping changes values (and zeroes the gradient) only where
            ``|log r| > clamp``; ``None`` (default) computes the exact formula.
        bounded: clamp each value to ``[-KL_VALUE_BOUND, KL_VALUE_BOUND]`` (what a run trains on or rewards: the
            KL loss and the KL penalty in the reward). ``log r`` is first held within ``+-30`` so that no value
            overflows and a clamped token's gradient is exactly 0.

    Returns:
        ``(B, T)`` per-token estimates in at least float32 (float64 for float64 inputs), not summed or averaged.
        Differentiable through ``logps`` (and ``ref_logps``); detach them if the value is used as a reward.
    """
    fn = KL_ESTIMATORS.get(name).fn
    if logps.shape != ref_logps.shape:
        raise ValueError(f"logps shape {tuple(logps.shape)} != ref_logps shape {tuple(ref_logps.shape)}")
    dtype = torch.float64 if torch.float64 in (logps.dtype, ref_logps.dtype) else torch.float32
    log_ratio = logps.to(dtype) - ref_logps.to(dtype)
    if clamp is not None:
        if not (clamp > 0 and math.isfinite(clamp)):
            raise ValueError(f"clamp must be a positive finite number or None, got {clamp}")
        log_ratio = log_ratio.clamp(-clamp, clamp)
    if not bounded:
        return fn(log_ratio)
    return fn(log_ratio.clamp(-_LOG_RATIO_GUARD, _LOG_RATIO_GUARD)).clamp(-KL_VALUE_BOUND, KL_VALUE_BOUND)
