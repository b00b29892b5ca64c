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
``k1`` gives no gradient in expectation. Which one to use as a GRPO-style KL loss is the caller's choice; this
module only computes the values.

All functions are element-wise: values at padding are whatever the inputs make them, and the caller's mask (or
:mod:`rlhf.ops.aggregation`) drops them.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from rlhf.registry import Registry

Tensor = torch.Tensor

KL_ESTIMATORS = Registry[Callable[[Tensor], Tensor]]("KL estimator")


@KL_ESTIMATORS.register("k1")
def _k1(log_ratio: Tensor) -> Tensor:
    """``log r``: the plain Monte Carlo estimate of ``KL(pi || ref)``; unbiased, negative where ``ref > pi``."""
    return log_ratio


@KL_ESTIMATORS.register("k2")
def _k2(log_ratio: Tensor) -> Tensor:
    """``0.5 (log r)^2``: the f-divergence with ``f(u) = 0.5 log(u)^2``, which agrees with KL to second order in
    ``log r``; biased upward for distant policies, non-negative, low variance."""
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3")
def _k3(log_ratio: Tensor) -> Tensor:
    """``(ref / pi - 1) - log(ref / pi) = exp(-log r) + log r - 1``: ``k1`` plus the zero-mean control variate
    ``ref / pi - 1``; unbiased and non-negative (``e^x >= 1 + x``), exactly 0 at ``log r = 0``.

    ``expm1`` keeps the value accurate near ``log r = 0``, where ``exp(-x) - 1`` and ``x`` nearly cancel.
    """
    return torch.expm1(-log_ratio) + log_ratio


def kl_estimate(name: str, logps: Tensor, ref_logps: Tensor, clamp: Optional[float] = None) -> Tensor:
    """Per-token KL estimate ``name`` (``"k1"``, ``"k2"`` or ``"k3"``) from policy and reference log-probs.

    Args:
        name: a name in :data:`KL_ESTIMATORS` (an unknown name raises an error listing the valid ones).
        logps: ``(B, T)`` per-token log-probs under the policy that sampled the tokens.
        ref_logps: ``(B, T)`` per-token log-probs under the reference model.
        clamp: if set (> 0), the log-ratio is clamped to ``[-clamp, clamp]`` before the estimator is applied.
            This is a numerical guard, not part of the estimators: ``k3`` contains ``exp(-log r)``, which
            overflows float32 for ``log r < -88``. Clamping changes values (and zeroes the gradient) only where
            ``|log r| > clamp``; ``None`` (default) computes the exact formula.

    Returns:
        ``(B, T)`` per-token estimates in at least float32 (float64 for float64 inputs), not summed or averaged.
        Differentiable through ``logps`` (and ``ref_logps``); detach them if the value is used as a reward.
    """
    fn = KL_ESTIMATORS.get(name)
    if logps.shape != ref_logps.shape:
        raise ValueError(f"logps shape {tuple(logps.shape)} != ref_logps shape {tuple(ref_logps.shape)}")
    dtype = torch.float64 if torch.float64 in (logps.dtype, ref_logps.dtype) else torch.float32
    log_ratio = logps.to(dtype) - ref_logps.to(dtype)
    if clamp is not None:
        if not (clamp > 0 and math.isfinite(clamp)):
            raise ValueError(f"clamp must be a positive finite number or None, got {clamp}")
        log_ratio = log_ratio.clamp(-clamp, clamp)
    return fn(log_ratio)
