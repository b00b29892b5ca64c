"""DPO-family objectives (Rafailov et al. 2023 and the variants in :mod:`rlhf.ops.preference`).

Chosen and rejected completions of a pair are scored in one forward: the ``(B, 2, T)`` pair batch is viewed as
``(2B, T)``. The loss is a per-pair quantity normalized by the number of pairs in the global batch, so any split
over micro-batches and ranks gives the same gradient (TRL and OpenRLHF average per micro-batch instead, which is
exact only when every micro-batch has the same number of pairs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from rlhf.batch import Batch
from rlhf.objectives.base import Sums, target_count
from rlhf.objectives.sft import causal_lm_token_logps
from rlhf.ops.logprobs import at_least_float32, sequence_logprobs
from rlhf.ops.preference import DPO_LOSSES, chosen_nll, dpo_pair_losses


def pair_sequence_logps(
    model: torch.nn.Module, batch: Batch, packing: Optional[bool] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Summed target log-probs and target lengths of a pair batch, both ``(B, 2)`` (column 0 = chosen); the
    ``2B`` sequences run packed per :func:`rlhf.models.packing.runs_packed`."""
    pairs, width = batch.input_ids.shape[0], batch.input_ids.shape[-1]
    flat_ids = batch.input_ids.reshape(2 * pairs, width)
    assert batch.loss_mask is not None, "a pair batch carries its loss mask"
    flat_mask = batch.loss_mask.reshape(2 * pairs, width)
    token_logps = causal_lm_token_logps(model, flat_ids, batch.attention_mask.reshape(2 * pairs, width), packing)
    seq = sequence_logprobs(token_logps, flat_mask.to(token_logps.dtype))
    lengths = flat_mask[:, 1:].sum(-1)
    return seq.view(pairs, 2), lengths.view(pairs, 2)


@dataclass(frozen=True)
class ReferenceLogps:
    """Score function for the frozen reference: summed target log-probs ``(B, 2)`` of a pair batch, float32
    (float64 from a float64 model: an fp64 run's DPO loss then sees no float32 rounding)."""

    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return at_least_float32(pair_sequence_logps(model, batch, self.packing)[0])


@dataclass(frozen=True)
class DPOObjective:
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    nll_coef: float = 0.0  # RPO regularizer (see rlhf.ops.preference.chosen_nll)
    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def __post_init__(self) -> None:
        DPO_LOSSES.get(self.loss_type)  # fail on the driver, with the valid names, not inside a worker

    def count(self, batch: Batch) -> int:
        return len(batch)

    def loss(self, model: torch.nn.Module, batch: Batch) -> Tuple[torch.Tensor, Sums]:
        if batch.ref_logps is None:
            raise ValueError("DPO micro-batch has no ref_logps: reference log-probs must be computed first")
        policy, lengths = pair_sequence_logps(model, batch, self.packing)
        losses, chosen_rewards, rejected_rewards = dpo_pair_losses(
            self.loss_type, policy, batch.ref_logps.to(policy.dtype), self.beta, self.label_smoothing, lengths
        )
        sums = {}
        if self.nll_coef:
            nll = chosen_nll(policy[:, 0], lengths[:, 0])
            losses = losses + self.nll_coef * nll
            sums["chosen_nll_sum"] = nll.detach().sum().item()
        total = losses.sum()
        assert batch.loss_mask is not None, "a pair batch carries its loss mask (pair_sequence_logps read it)"
        sums.update(
            {
                "loss_sum": total.item(),
                "chosen_reward_sum": chosen_rewards.sum().item(),
                "rejected_reward_sum": rejected_rewards.sum().item(),
                "correct_pairs": (chosen_rewards > rejected_rewards).sum().item(),
                "chosen_logp_sum": policy[:, 0].detach().sum().item(),
                "rejected_logp_sum": policy[:, 1].detach().sum().item(),
                "num_tokens": float(target_count(batch.loss_mask)),
            }
        )
        return total, sums

    def finalize(self, sums: Sums, normalizer: int) -> Dict[str, float]:
        pairs = normalizer
        chosen, rejected = sums["chosen_reward_sum"] / pairs, sums["rejected_reward_sum"] / pairs
        extra = {"nll/chosen": sums["chosen_nll_sum"] / pairs} if "chosen_nll_sum" in sums else {}
        return {
            "loss": sums["loss_sum"] / pairs,
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margin": chosen - rejected,
            "rewards/accuracy": sums["correct_pairs"] / pairs,
            "logps/chosen": sums["chosen_logp_sum"] / pairs,
            "logps/rejected": sums["rejected_logp_sum"] / pairs,
            "num_tokens": int(sums["num_tokens"]),
            **extra,
        }
