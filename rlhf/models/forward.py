"""One forward of a model over ``(B, T)`` right-padded rows, in whichever layout the worker runs it: padded, packed
(:mod:`rlhf.models.packing`) or sharded across a sequence group (:mod:`rlhf.models.sequence_parallel`).

Every per-position result goes back to the padded ``(B, T)`` layout through :class:`LMLogits` or
:func:`hidden_forward`, so the objectives never see the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from rlhf.models.packing import PackedRows, packed_forward, runs_packed
from rlhf.models.sequence_parallel import SequenceShard, sequence_group_of, shard_inputs
from rlhf.ops.logprobs import align_to_tokens

Tensor = torch.Tensor


@dataclass(frozen=True)
class LMLogits:
    """A causal LM's logits over a batch and the ids they score, in the forward's layout.

    Attributes:
        logits: ``(B, T, V)``; ``(1, N, V)`` packed; this rank's ``(R, T/n, V)`` positions sharded.
        input_ids: the ids in the same layout; ``next_ids``: the token each position predicts (the next one; at
            the very last position a dummy whose value :meth:`per_token` drops).
        packed: how the rows were packed (``None``: the padded layout); ``shard``: this rank's positions when
            sharded across a sequence group.
    """

    logits: Tensor
    input_ids: Tensor
    next_ids: Tensor
    packed: Optional[PackedRows] = None
    shard: Optional[SequenceShard] = None

    def per_token(self, per_position: Tensor) -> Tensor:
        """Values computed at the prediction positions of :attr:`logits` (``next_ids=`` of
        :func:`rlhf.ops.logprobs.token_logprobs`) on the tokens they predict, in the padded ``(B, T)`` layout,
        column 0 = 0 (the group's shards gathered first, differentiably)."""
        whole = per_position if self.shard is None else self.shard.gather(per_position)
        aligned = align_to_tokens(whole)
        return aligned if self.packed is None else self.packed.unpack(aligned, token_aligned=True)


def lm_logits(model: Any, input_ids: Tensor, attention_mask: Tensor, packing: Optional[bool] = None) -> LMLogits:
    """A causal LM's forward over ``(B, T)`` right-padded rows, packed per
    :func:`rlhf.models.packing.runs_packed`, sharded when the model runs across a sequence group."""
    packed = runs_packed(model, packing)
    sequence = sequence_group_of(model)
    if sequence is not None:
        inputs = shard_inputs(sequence, input_ids, attention_mask, packed)
        logits = model(**inputs.model_inputs).logits
        return LMLogits(logits, inputs.input_ids, inputs.next_ids, inputs.packed, inputs.shard)
    if not packed:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return LMLogits(logits, input_ids, input_ids.roll(-1, dims=1))
    out, rows = packed_forward(model, input_ids, attention_mask)
    return LMLogits(out.logits, rows.input_ids, rows.input_ids.roll(-1, dims=1), rows)


def hidden_forward(model: Any, input_ids: Tensor, attention_mask: Tensor, head: Any, packing: Optional[bool]) -> Tensor:
    """``head`` on the model's last hidden states at every position of ``(B, T)`` right-padded rows -> ``(B, T,
    ...)`` in the padded layout (0 at padding when packed), laid out as :func:`lm_logits` lays out its forward."""
    packed = runs_packed(model, packing)
    sequence = sequence_group_of(model)
    if sequence is not None:
        inputs = shard_inputs(sequence, input_ids, attention_mask, packed)
        out = model(**inputs.model_inputs, output_hidden_states=True)
        whole = inputs.shard.gather(head(out.hidden_states[-1]))
        return whole if inputs.packed is None else inputs.packed.unpack(whole, token_aligned=False)
    if not packed:
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return head(out.hidden_states[-1])
    out, rows = packed_forward(model, input_ids, attention_mask, output_hidden_states=True)
    return rows.unpack(head(out.hidden_states[-1]), token_aligned=False)
