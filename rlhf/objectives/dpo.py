"""DPO-family objectives (Rafailov et al. 2023 and the variants in :mod:`rlhf.ops.preference`, the reference-free
SimPO, CPO and ORPO among them).

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
from rlhf.objectives.base import MicroSums, host_sums, target_tokens
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
    """The per-pair loss of :func:`rlhf.ops.preference.dpo_pair_losses` plus ``nll_coef`` x the chosen completion's
    NLL, summed over a micro-batch's pairs. A reference-free loss (SimPO, CPO, ORPO) reads no ``batch.ref_logps``."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    nll_coef: float = 0.0  # RPO's regularizer, CPO's and ORPO's SFT term (rlhf.ops.preference.chosen_nll)
    margin: Optional[float] = None  # SimPO's target margin gamma (for a loss with one, and only then)
    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def __post_init__(self) -> None:
        DPO_LOSSES.get(self.loss_type)  # fail on the driver, with the valid names, not inside a worker

    @property
    def reference_free(self) -> bool:
        """Whether the loss reads no reference log-probs."""
        return not DPO_LOSSES.get(self.loss_type).reference

    def count(self, batch: Batch) -> int:
        self._check_targets(batch)
        return len(batch)

    def _check_targets(self, batch: Batch) -> None:
        """A loss that averages log-probs per token needs a target token in both completions of every pair, RPO's
        NLL one in the chosen. Checked here, on the driver, where the batch is on the host and every micro-batch
        of the step passes before the first backward: on the device each check would make a GPU wait."""
        averages = DPO_LOSSES.get(self.loss_type).average_logps
        columns = [0, 1] if averages else [0] if self.nll_coef else []
        if not columns or batch.loss_mask is None:
            return
        empty = (batch.loss_mask[..., 1:].sum(-1)[:, columns] <= 0).any(-1)
        if bool(empty.any()):
            rows = empty.nonzero().flatten().tolist()
            where = rows if batch.sample_index is None else [int(batch.sample_index[r]) for r in rows]
            which = "a completion" if averages else "a chosen completion"
            why = f"loss {self.loss_type!r} averages log-probs per token" if averages else "nll_coef > 0 (RPO)"
            label = "pairs" if batch.sample_index is None else "data rows"
            raise ValueError(f"DPO {why}: {label} {where[:8]} have {which} with no target token")

    def loss(self, model: torch.nn.Module, batch: Batch) -> Tuple[torch.Tensor, MicroSums]:
        if batch.ref_logps is None and not self.reference_free:
            raise ValueError("DPO micro-batch has no ref_logps: reference log-probs must be computed first")
        policy, lengths = pair_sequence_logps(model, batch, self.packing)
        ref = None if self.reference_free or batch.ref_logps is None else batch.ref_logps.to(policy.dtype)
        losses, chosen_rewards, rejected_rewards = dpo_pair_losses(
            self.loss_type, policy, ref, self.beta, self.label_smoothing, lengths, self.margin
        )
        sums: Dict[str, torch.Tensor] = {}  # detached 0-dim tensors: read back once a step, not here
        if self.nll_coef:
            nll = chosen_nll(policy[:, 0], lengths[:, 0])
            losses = losses + self.nll_coef * nll
            sums["chosen_nll_sum"] = nll.detach().sum()
        total = losses.sum()
        assert batch.loss_mask is not None, "a pair batch carries its loss mask (pair_sequence_logps read it)"
        sums.update(
            {
                "loss_sum": total.detach(),
                "chosen_reward_sum": chosen_rewards.detach().sum(),
                "rejected_reward_sum": rejected_rewards.detach().sum(),
                "correct_pairs": (chosen_rewards > rejected_rewards).sum(),
                "chosen_logp_sum": policy[:, 0].detach().sum(),
                "rejected_logp_sum": policy[:, 1].detach().sum(),
                "num_tokens": target_tokens(batch.loss_mask),
            }
        )
        return total, sums

    def finalize(self, sums: MicroSums, normalizer: int) -> Dict[str, float]:
        sums = host_sums(sums)
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
