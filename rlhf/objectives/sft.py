"""Supervised fine-tuning: negative log-likelihood of the response tokens, normalized by the number of
response tokens in the whole global batch (the same number whatever the micro-batch / rank split)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from rlhf.batch import Batch
from rlhf.models.head import token_logprobs_and_entropy
from rlhf.objectives.base import MicroSums, host_sums, target_count, target_tokens
from rlhf.ops.losses import sft_nll_sum


def causal_lm_token_logps(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, packing: Optional[bool] = None
) -> torch.Tensor:
    """Per-token log-probs ``(B, T)`` of ``input_ids`` under a causal LM (column 0 is 0); the forward runs on the
    packed rows when ``packing`` (:mod:`rlhf.models.packing`), the head in tiles with ``model.tiled_head``
    (:mod:`rlhf.models.head`); the result is the same layout either way."""
    return token_logprobs_and_entropy(model, input_ids, attention_mask, packing)[0]


@dataclass(frozen=True)
class SFTObjective:
    """``packing``: run the forward padding-free (None: as the model was built, ``train.packing``); the loss and
    every count are the same either way."""

    packing: Optional[bool] = None

    def count(self, batch: Batch) -> int:
        assert batch.loss_mask is not None, "an SFT batch carries its loss mask"
        return target_count(batch.loss_mask)

    def loss(self, model: torch.nn.Module, batch: Batch) -> Tuple[torch.Tensor, MicroSums]:
        logps = causal_lm_token_logps(model, batch.input_ids, batch.attention_mask, self.packing)
        assert batch.loss_mask is not None, "an SFT batch carries its loss mask"
        nll = sft_nll_sum(logps, batch.loss_mask.to(logps.dtype))
        return nll, {"loss_sum": nll.detach(), "num_tokens": target_tokens(batch.loss_mask)}

    def finalize(self, sums: MicroSums, normalizer: int) -> Dict[str, float]:
        sums = host_sums(sums)
        loss = sums["loss_sum"] / normalizer
        return {"loss": loss, "num_tokens": int(sums["num_tokens"])}
