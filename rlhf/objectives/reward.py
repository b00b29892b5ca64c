"""Pairwise reward-model objective: Bradley-Terry on the scores of the last real token (Ouyang et al. 2022,
eq. 1), with the optional margin of Llama 2 (Touvron et al. 2023). Normalized by pairs in the global batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, cast

import torch

from rlhf.batch import Batch
from rlhf.models.loading import last_token_values, scalar_head_values
from rlhf.objectives.base import MicroSums, host_sums, target_tokens
from rlhf.ops.preference import bradley_terry_losses, pair_accuracy_count


def pair_scores(model: torch.nn.Module, batch: Batch, packing: Optional[bool] = None) -> torch.Tensor:
    """Scores ``(B, 2)`` (column 0 = chosen) of a pair batch, chosen and rejected in one forward (packed per
    :func:`rlhf.models.packing.runs_packed`)."""
    pairs, width = batch.input_ids.shape[0], batch.input_ids.shape[-1]
    mask = batch.attention_mask.reshape(2 * pairs, width)
    values = scalar_head_values(model, batch.input_ids.reshape(2 * pairs, width), mask, packing)
    return last_token_values(values, mask).view(pairs, 2)


@dataclass(frozen=True)
class RewardObjective:
    use_margin: bool = False
    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def count(self, batch: Batch) -> int:
        return len(batch)

    def loss(self, model: torch.nn.Module, batch: Batch) -> Tuple[torch.Tensor, MicroSums]:
        if self.use_margin and batch.margin is None:
            raise ValueError("rm.use_margin=true but the batch carries no margins (data.margin_key missing?)")
        scores = pair_scores(model, batch, self.packing)
        # cast: with use_margin a batch without margins was refused above
        margin = cast(torch.Tensor, batch.margin).to(scores.dtype) if self.use_margin else None
        losses = bradley_terry_losses(scores[:, 0], scores[:, 1], margin)
        total = losses.sum()
        detached = scores.detach()
        assert batch.loss_mask is not None, "a pair batch carries its loss mask"
        sums = {
            "loss_sum": total.detach(),
            "correct_pairs": pair_accuracy_count(detached[:, 0], detached[:, 1]),
            "chosen_score_sum": detached[:, 0].sum(),
            "rejected_score_sum": detached[:, 1].sum(),
            "num_tokens": target_tokens(batch.loss_mask),
        }
        return total, sums

    def finalize(self, sums: MicroSums, normalizer: int) -> Dict[str, float]:
        sums = host_sums(sums)
        pairs = normalizer
        return {
            "loss": sums["loss_sum"] / pairs,
            "accuracy": sums["correct_pairs"] / pairs,
            "scores/chosen": sums["chosen_score_sum"] / pairs,
            "scores/rejected": sums["rejected_score_sum"] / pairs,
            "scores/margin": (sums["chosen_score_sum"] - sums["rejected_score_sum"]) / pairs,
            "num_tokens": int(sums["num_tokens"]),
        }
