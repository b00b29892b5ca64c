"""KTO on unpaired preference rows (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization"; the loss in :mod:`rlhf.ops.preference`).

A row is a prompt, one completion and a label (desirable or not). Its batch uses the pair layout ``(B, 2, T)``:
column 0 is the row's own sequence, column 1 the *mismatched* one, its prompt with another row's completion
(:func:`rlhf.data.tokenize.tokenize_unpaired`). The reference scores both columns (``ReferenceLogps``, as for DPO).

The reference point ``z_0``, the policy's KL from the reference estimated on the mismatched sequences, is a
global-batch quantity here: before each step the policy scores column 1 of the whole global batch
(:class:`MismatchedLogps`, no gradient), the driver averages it (:func:`with_kl_baseline`) and writes it on every
row. The loss then runs column 0 only and is a per-row quantity normalized by the rows of the global batch, so any
split over micro-batches, ranks, packing or token budgets gives the same loss and gradient. (The paper and TRL
average ``z_0`` over the micro-batch, TRL then over processes, which a split changes.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from rlhf.batch import Batch
from rlhf.objectives.base import MicroSums, host_sums, target_tokens
from rlhf.objectives.sft import causal_lm_token_logps
from rlhf.ops.logprobs import at_least_float32, sequence_logprobs
from rlhf.ops.preference import UNPAIRED_LOSSES, kto_kl_baseline, unpaired_losses

OWN, MISMATCHED = 0, 1  # the columns of an unpaired batch


def column_logps(model: torch.nn.Module, batch: Batch, column: int, packing: Optional[bool]) -> torch.Tensor:
    """Summed target log-probs ``(B,)`` of one column of an unpaired (pair-layout) batch."""
    assert batch.loss_mask is not None, "an unpaired batch carries its loss mask"
    ids, mask = batch.input_ids[:, column], batch.loss_mask[:, column]
    token_logps = causal_lm_token_logps(model, ids, batch.attention_mask[:, column], packing)
    return sequence_logprobs(token_logps, mask.to(token_logps.dtype))


@dataclass(frozen=True)
class MismatchedLogps:
    """Score function for the policy before a step: summed log-probs ``(B,)`` of the mismatched sequences, at least
    float32 (float64 from a float64 model)."""

    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return at_least_float32(column_logps(model, batch, MISMATCHED, self.packing))


def with_kl_baseline(batch: Batch, policy_mismatched: torch.Tensor) -> Batch:
    """``batch`` with ``kl_baseline``: ``z_0`` of the whole batch (:func:`rlhf.ops.preference.kto_kl_baseline`)
    on every row.

    Args:
        batch: an unpaired global batch with ``ref_logps`` ``(B, 2)``.
        policy_mismatched: ``(B,)`` the policy's :class:`MismatchedLogps` of the same rows.
    """
    if batch.ref_logps is None:
        raise ValueError("KTO batch has no ref_logps: reference log-probs must be computed first")
    ref = batch.ref_logps[:, MISMATCHED].to(policy_mismatched.dtype)
    z0 = kto_kl_baseline(policy_mismatched, ref)
    return batch.replace(kl_baseline=z0.expand(len(batch)).clone())


@dataclass(frozen=True)
class KTOObjective:
    """The per-row KTO loss over the global batch's rows; metrics split by label."""

    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def __post_init__(self) -> None:
        UNPAIRED_LOSSES.get(self.loss_type)  # fail on the driver, with the valid names, not inside a worker

    def count(self, batch: Batch) -> int:
        return len(batch)

    def loss(self, model: torch.nn.Module, batch: Batch) -> Tuple[torch.Tensor, MicroSums]:
        if batch.ref_logps is None or batch.kl_baseline is None or batch.desirable is None:
            raise ValueError("KTO micro-batch needs ref_logps, kl_baseline and desirable: score it first")
        policy = column_logps(model, batch, OWN, self.packing)
        losses, rewards = unpaired_losses(
            self.loss_type,
            policy,
            batch.ref_logps[:, OWN].to(policy.dtype),
            batch.kl_baseline,
            batch.desirable,
            self.beta,
            self.desirable_weight,
            self.undesirable_weight,
        )
        total = losses.sum()
        good = batch.desirable.to(torch.bool)
        assert batch.loss_mask is not None, "an unpaired batch carries its loss mask (column_logps read it)"
        logps, rewards = policy.detach(), rewards.detach()
        # detached 0-dim tensors, read back once a step; a masked_fill, not x[good], whose size is data the
        # host would have to wait for
        sums = {
            "loss_sum": total.detach(),
            "desirable_rows": good.sum(),
            "undesirable_rows": (~good).sum(),
            "desirable_reward_sum": rewards.masked_fill(~good, 0).sum(),
            "undesirable_reward_sum": rewards.masked_fill(good, 0).sum(),
            "desirable_logp_sum": logps.masked_fill(~good, 0).sum(),
            "undesirable_logp_sum": logps.masked_fill(good, 0).sum(),
            "kl_sum": batch.kl_baseline.sum(),
            "num_tokens": target_tokens(batch.loss_mask[:, OWN]),
        }
        return total, sums

    def finalize(self, sums: MicroSums, normalizer: int) -> Dict[str, float]:
        sums = host_sums(sums)
        rows = normalizer
        out = {"loss": sums["loss_sum"] / rows, "kl": sums["kl_sum"] / rows, "num_tokens": int(sums["num_tokens"])}
        for label in ("desirable", "undesirable"):
            n = sums[f"{label}_rows"]
            if n:  # a batch of one label has no mean for the other
                out[f"rewards/{label}"] = sums[f"{label}_reward_sum"] / n
                out[f"logps/{label}"] = sums[f"{label}_logp_sum"] / n
        if "rewards/desirable" in out and "rewards/undesirable" in out:
            out["rewards/margin"] = out["rewards/desirable"] - out["rewards/undesirable"]
        return out
