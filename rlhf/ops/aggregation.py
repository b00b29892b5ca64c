"""Loss aggregation modes, split into a numerator per micro-batch and a denominator counted over the train batch.

A mode defines how per-token losses ``l[b, t]`` (response tokens ``mask[b, t] == 1``, ``n_b`` of them in row
``b``) of the whole train batch become one scalar (the names are verl's ``loss_agg_mode`` values):

=======================  ==============================================  ==================================
mode                     whole-batch value                               numerator / denominator per piece
=======================  ==============================================  ==================================
``token-mean``           ``sum_{b,t} l / sum_b n_b``                     masked sum / tokens
``seq-mean-token-mean``  ``mean over rows with n_b > 0 of``              ``sum_b (sum_t l) / n_b`` / rows
                         ``(sum_t l[b, t]) / n_b``                       with ``n_b > 0``
``seq-mean-token-sum``   ``mean over rows with n_b > 0 of sum_t l``      ``sum_b sum_t l`` / rows with
                                                                         ``n_b > 0``
``seq-mean-token-sum-    ``mean over rows with n_b > 0 of sum_t l / L``  ``sum_b sum_t l / L`` / rows with
norm``                   (``L``: a constant, the generation budget)      ``n_b > 0``
=======================  ==============================================  ==================================

Both parts are additive over rows and a row's contribution does not depend on its padding width or on the other
rows of its micro-batch, so for ANY partition of the rows into micro-batches (and ranks), with any padding,
``sum(aggregate_sum(piece)) / sum(aggregate_count(piece))`` is the whole-batch value. The trainer therefore sums
:func:`aggregate_count` over every micro-batch of every rank before the first backward, and each micro-batch
backpropagates ``rlhf.ops.losses.normalize(aggregate_sum(...), total_count, world_size)``. Per-token statistics
(clip fractions, KL) are reduced the same way.

Rows without response tokens (``n_b = 0``; e.g. an empty or fully filtered response) contribute 0 to every
numerator and are not counted in any denominator: they are not samples of the loss. (verl's
``seq-mean-token-sum`` divides by all rows, so empty rows dilute its mean; ``seq-mean-token-mean`` would divide 0
by 0 for them.) A train batch in which no row has a token has count 0, which ``normalize`` rejects.

``token-mean`` weights every token of the train batch equally, so a long response counts more than a short one:
that is DAPO's token-level policy-gradient loss (Yu et al. 2025, sec. 3.3), not GRPO's per-sequence mean
(``seq-mean-token-mean``, DeepSeekMath sec. 4.1). Each estimator's and sequence-level policy loss's registry entry
says which mode its paper uses (:func:`rlhf.ops.algorithms.paper_aggregation`); ``algo.loss_agg_mode=auto`` picks it.

The two token-sum modes. Dr. GRPO (Liu et al. 2025) divides each response's token sum by a constant, the
generation budget ``L``, instead of by its length ``n_b``: ``seq-mean-token-sum-norm`` with ``L`` the longest
response a sample can have (``rollout.max_new_tokens``; multi-turn: the episode's policy-token budget). RLOO
(Ahmadian et al. 2024) scores the whole completion, ``log pi(y|x) = sum_t``: ``seq-mean-token-sum``, the same
objective times ``L``. A constant factor is invisible to AdamW, *but not to gradient clipping*: the plain sum's
gradient norm is ~``L`` times the per-token scale the default ``train.max_grad_norm=1.0`` was chosen for, so the
clip binds at almost every step, and a clipped step's size no longer follows its gradient (Adam's moments then
average gradients rescaled by a different factor at each step). The ``-norm`` mode's gradient is ``token-mean``'s
times (mean response length / ``L``) <= 1, so the clip binds no more often than under ``token-mean``: it is what
``auto`` picks for both. (Measured on the demo's RLOO, ``L = 6``, mean length 2.8: grad norms 11.9 / 1.98 / 4.35 at
step 1 for the sum / ``-norm`` / ``token-mean``, the sum exactly ``L`` times the ``-norm``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlhf.registry import Registry

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossAggregation:
    """One aggregation mode.

    Attributes:
        numerator: ``fn(per_token (B, T), mask (B, T) bool) -> 0-dim`` this micro-batch's share of the numerator.
        denominator: ``fn(mask (B, T) bool) -> int`` this micro-batch's share of the denominator.
        per_length: the numerator is divided by a constant length ``L`` (the caller's ``length``; a constant of
            the run, never of a micro-batch, or the split would change the value).
    """

    numerator: Callable[[Tensor, Tensor], Tensor]
    denominator: Callable[[Tensor], int]
    per_length: bool = False


LOSS_AGGREGATIONS = Registry[LossAggregation]("loss aggregation")


def _row_sums(per_token: Tensor, mask: Tensor) -> Tensor:
    """``(B,)`` masked row sums in at least float32 (entries outside the mask ignored even if inf/NaN)."""
    if per_token.dtype in (torch.float16, torch.bfloat16):
        per_token = per_token.float()  # a sum over thousands of tokens in bf16 loses whole units
    return torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device)).sum(-1)


def _token_count(mask: Tensor) -> int:
    return int(mask.sum())


def _row_count(mask: Tensor) -> int:
    return int(mask.any(-1).sum())


def _token_mean_sum(per_token: Tensor, mask: Tensor) -> Tensor:
    return _row_sums(per_token, mask).sum()


def _seq_mean_token_mean_sum(per_token: Tensor, mask: Tensor) -> Tensor:
    sums = _row_sums(per_token, mask)
    n = mask.sum(-1).to(sums.dtype)
    # Rows without tokens have sum 0; dividing by max(n, 1) keeps them (and their gradient) at exactly 0.
    return (sums / n.clamp(min=1)).sum()


def _seq_mean_token_sum_sum(per_token: Tensor, mask: Tensor) -> Tensor:
    return _row_sums(per_token, mask).sum()


LOSS_AGGREGATIONS.register("token-mean")(LossAggregation(_token_mean_sum, _token_count))
LOSS_AGGREGATIONS.register("seq-mean-token-mean")(LossAggregation(_seq_mean_token_mean_sum, _row_count))
LOSS_AGGREGATIONS.register("seq-mean-token-sum")(LossAggregation(_seq_mean_token_sum_sum, _row_count))
LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")(
    LossAggregation(_seq_mean_token_sum_sum, _row_count, per_length=True)
)


def _bool_mask(mask: Tensor, shape: torch.Size | None = None) -> Tensor:
    if mask.dim() != 2:
        raise ValueError(f"mask must be (B, T), got shape {tuple(mask.shape)}")
    if shape is not None and mask.shape != shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != per_token shape {tuple(shape)}")
    if mask.dtype != torch.bool:
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("mask must be 0/1: the aggregation counts tokens, it does not weight them")
        mask = mask != 0
    return mask


def aggregate_sum(mode: str, per_token: Tensor, mask: Tensor, length: Optional[int] = None) -> Tensor:
    """This micro-batch's contribution to the numerator of aggregation ``mode``.

    * ``token-mean``: ``sum_{b,t} mask * per_token``;
    * ``seq-mean-token-mean``: ``sum_b (sum_t mask * per_token) / n_b`` over rows with ``n_b > 0``;
    * ``seq-mean-token-sum``: ``sum_b sum_t mask * per_token``;
    * ``seq-mean-token-sum-norm``: ``sum_b sum_t mask * per_token / length``.

    Args:
        mode: a name in :data:`LOSS_AGGREGATIONS` (an unknown name raises an error listing the valid ones).
        per_token: ``(B, T)`` per-token values (losses or statistics); entries outside the mask are ignored,
            even inf/NaN, and receive zero gradient.
        mask: ``(B, T)`` 0/1 or bool, 1 on the tokens that count.
        length: the constant ``L`` of a ``per_length`` mode (>= 1; the same for every micro-batch of the run);
            ignored by the others.

    Returns:
        0-dim tensor (at least float32), differentiable; NOT divided by anything. Divide by the sum of
        :func:`aggregate_count` over the whole train batch (see :func:`rlhf.ops.losses.normalize`).
    """
    agg = LOSS_AGGREGATIONS.get(mode)
    total = agg.numerator(per_token, _bool_mask(mask, per_token.shape))
    if not agg.per_length:
        return total
    if length is None or length < 1:
        raise ValueError(
            f"loss aggregation {mode!r} divides by a constant length (the generation budget): pass "
            f"length >= 1, got {length}"
        )
    return total / length


def aggregate_count(mode: str, mask: Tensor) -> int:
    """This micro-batch's contribution to the denominator of aggregation ``mode``: the number of masked tokens
    (``token-mean``) or of rows with at least one masked token (the two ``seq-mean`` modes).

    Args:
        mode: a name in :data:`LOSS_AGGREGATIONS`.
        mask: ``(B, T)`` 0/1 or bool.

    Returns:
        A non-negative Python int (summable across micro-batches and, after an all-reduce, ranks).
    """
    agg = LOSS_AGGREGATIONS.get(mode)
    return agg.denominator(_bool_mask(mask))
