"""Ulysses sequence parallelism: the ``N`` ranks of a sequence group share every row of a micro-batch.

Jacobs et al. 2023, "DeepSpeed Ulysses" (arXiv:2309.14509), as DeepSpeed's Arctic Long Sequence Training ships it
for HF models (Bekman et al. 2025, arXiv:2506.13996; ``deepspeed.runtime.sequence_parallel.ulysses_sp``).

Each rank of a group runs the model on one contiguous ``1/N`` of the positions of the same rows, so every
projection, MLP, norm and the LM head hold ``T / N`` positions. Attention needs the whole sequence: in each layer
an all-to-all turns ``(B, H, T/N, D)`` queries, keys and values (this rank's positions, every head) into
``(B, H/N, T, D)`` (every position, this rank's heads), the core attention runs on whole rows, and a second
all-to-all turns the result back. That exchange is DeepSpeed's ``UlyssesSPAttentionHF``, one per micro-batch row
count (it checks fixed shapes), run under an attention implementation registered here (:data:`ULYSSES`) whose core
is the one the worker would run unsharded: sdpa (causal; rows are right-padded, so no real token sees a pad), the
project's variable-length kernel for packed rows (:mod:`rlhf.models.packing`, given the whole packed sequence's
boundaries), or flash-attention on a GPU. The heads must divide by ``N``; key/value heads divide by ``N`` or are
replicated when ``N`` divides by them (:func:`check_heads`).

What is the project's own (DeepSpeed's recipe shards the labels and the loss; here the loss stays whole):

* **Inputs.** :func:`shard_inputs` pads the ``(B, T)`` rows, or the ``(1, N)`` packed sequence (the padding as one
  more packed row), to a multiple of ``N`` positions and gives each rank its slice, with the global position ids
  and the token each of its positions predicts (the next shard's first token for its last position).
* **Outputs.** Per-position results of the shard (log-probs, entropies, values; ``(B, T/N)``, never the
  ``(B, T/N, V)`` logits) are all-gathered into whole rows (:meth:`SequenceShard.gather`), so every objective,
  its per-token terms and its sequence-level ones (a sequence's log-prob sum, GSPO's sequence ratio, a seq-mean
  aggregation, a sequence mask) runs unchanged on whole rows: a sequence's sum is the sum over its shards by
  construction. Every rank of the group holds the same loss; the gather's backward hands each rank the gradient of
  its own positions only, so the group's ranks together backpropagate the loss exactly once, and the data-parallel
  gradient reduction over all ranks (:func:`rlhf.ops.losses.normalize` scales by the world size) adds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from rlhf.models.packing import CORE_ATTENTION, VARLEN_TORCH, PackedRows, register_varlen_attention, unread_mask

Tensor = torch.Tensor

ULYSSES = "rlhf_ulysses"  # the transformers attn_implementation name of the sharded attention
SEQUENCE_KWARG = "rlhf_sequence"  # the model-call keyword that carries the group down to the attention layers
_GROUP_ATTR = "_rlhf_sequence_group"  # set on the HF module a worker shards


def check_heads(heads: int, kv_heads: int, size: int) -> Optional[str]:
    """Why ``size`` ranks cannot share the attention heads of a model, or None when they can: the query heads must
    divide by ``size``, the key/value heads divide by it or it by them (they are then replicated)."""
    if heads % size:
        return f"the model's {heads} attention heads do not divide by {size}"
    if kv_heads % size and size % kv_heads:
        return f"the model's {kv_heads} key/value heads neither divide by {size} nor divide it"
    return None


@dataclass
class SequenceGroup:
    """This rank's sequence group: ``size`` ranks, this one at ``rank``, communicating over ``group``.

    ``core`` is the attention implementation that runs on whole rows after the all-to-all. The DeepSpeed exchange
    objects are made per micro-batch row count on first use (they check fixed shapes)."""

    size: int
    rank: int
    group: Any  # torch.distributed.ProcessGroup
    core: str
    _exchanges: Dict[Tuple[int, int], Any] = field(default_factory=dict, repr=False)

    def exchange(self, rows: int, config: Any) -> Any:
        """DeepSpeed's ``UlyssesSPAttentionHF`` for ``rows``-row micro-batches of ``config``'s model."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        key = (rows, id(config))
        if key not in self._exchanges:
            text = config.get_text_config()
            self._exchanges[key] = UlyssesSPAttentionHF(
                attn=ALL_ATTENTION_FUNCTIONS[self.core],
                batch_size=rows,
                attn_head_count=text.num_attention_heads,
                attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                kv_head_count=text.num_key_value_heads,
                num_hidden_layers=text.num_hidden_layers,
                process_group=self.group,
                seq_length_is_variable=True,
            )
        return self._exchanges[key]


def new_sequence_group(rank: int, world_size: int, size: int, core: str) -> SequenceGroup:
    """Cut the default process group's ``world_size`` ranks into groups of ``size`` consecutive ranks and return
    ``rank``'s. Collective: every rank calls it, and makes every group, in the same order."""
    if size < 1 or world_size % size:
        raise ValueError(f"{world_size} ranks do not cut into sequence groups of {size}")
    groups = [torch.distributed.new_group(list(range(g, g + size))) for g in range(0, world_size, size)]
    return SequenceGroup(size=size, rank=rank % size, group=groups[rank // size], core=core)


def enable_sequence_parallel(module: torch.nn.Module, sequence: SequenceGroup) -> None:
    """Make ``module`` (an HF model) run sharded across ``sequence``: its attention becomes :data:`ULYSSES` around
    ``sequence.core`` (which :func:`rlhf.models.packing.attention_of` still reports), and the forwards of
    :mod:`rlhf.models.forward` shard their inputs.

    Raises:
        ValueError: heads that do not divide (:func:`check_heads`).
    """
    text = module.config.get_text_config()  # type: ignore[union-attr, operator]
    why = check_heads(text.num_attention_heads, text.num_key_value_heads, sequence.size)
    if why:
        raise ValueError(f"strategy.sequence_parallel_size={sequence.size}: {why}")
    register_ulysses_attention()
    if sequence.core == VARLEN_TORCH:
        register_varlen_attention()
    setattr(module, CORE_ATTENTION, sequence.core)
    setattr(module, _GROUP_ATTR, sequence)
    module.config._attn_implementation = ULYSSES  # type: ignore[union-attr]


def sequence_group_of(model: Any) -> Optional[SequenceGroup]:
    """The sequence group ``model`` (an HF module or a DeepSpeed engine around one) runs sharded across, if any."""
    return getattr(getattr(model, "module", model), _GROUP_ATTR, None)


def register_ulysses_attention() -> None:
    """Make :data:`ULYSSES` a transformers attention implementation (idempotent; per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ULYSSES, _ulysses_attention)
    AttentionMaskInterface.register(ULYSSES, _no_mask)


def window_problem(core: str, window: Optional[int], length: int, attention_kwargs: Dict[str, Any]) -> Optional[str]:
    """Why a sharded forward of ``length`` positions cannot keep a layer's sliding ``window``, or None. The window
    lives in the mask, which a sharded forward of padded rows has not: flash-attention applies it itself, and packed
    rows go to ``rlhf_varlen``, which refuses a row longer than the window on its own."""
    if window is None or length <= window or core.startswith("flash") or "cu_seq_lens_q" in attention_kwargs:
        return None
    return (
        f"{ULYSSES} over {core} has no sliding window: a {length}-position row exceeds the model's {window}-token "
        f"window (use flash_attention_2, which applies it, or shorter rows)"
    )


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """No mask: a shard's mask would be ``(T/N, T/N)``; the core attention is causal on whole right-padded rows, or
    kept within packed rows by their boundaries."""
    return None


def _ulysses_attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, **kwargs: Any
):
    """The attention of one layer of a sharded forward: ``(B, H, T/N, D)`` in, ``(B, T/N, H, D)`` out."""
    sequence: Optional[SequenceGroup] = kwargs.pop(SEQUENCE_KWARG, None)
    if sequence is None:
        raise RuntimeError(f"{ULYSSES} attention called outside a sharded forward (rlhf.models.forward)")
    why = window_problem(sequence.core, kwargs.get("sliding_window"), query.shape[2] * sequence.size, kwargs)
    if why:
        raise NotImplementedError(why)
    return sequence.exchange(query.shape[0], module.config)(module, query, key, value, None, **kwargs)


class _GatherPositions(torch.autograd.Function):
    """All-gather ``(R, L, ...)`` shards along dim 1 into ``(R, N * L, ...)``. Backward: this rank's slice of the
    gradient, not a sum, because every rank of the group computes the same loss of the gathered values."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, sequence: SequenceGroup) -> Tensor:
        parts = [torch.empty_like(local) for _ in range(sequence.size)]
        torch.distributed.all_gather(parts, local.contiguous(), group=sequence.group)
        ctx.start, ctx.length = sequence.rank * local.shape[1], local.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        return grad[:, ctx.start : ctx.start + ctx.length].contiguous(), None


@dataclass(frozen=True)
class SequenceShard:
    """This rank's positions of a ``(R, width)`` layout padded to ``N * length`` positions: ``[start, start +
    length)``."""

    sequence: SequenceGroup
    width: int
    length: int

    @property
    def start(self) -> int:
        return self.sequence.rank * self.length

    def gather(self, local: Tensor) -> Tensor:
        """The group's ``(R, length, ...)`` per-position results as whole ``(R, width, ...)`` rows, differentiable."""
        return _GatherPositions.apply(local, self.sequence)[:, : self.width]


@dataclass(frozen=True)
class ShardedInputs:
    """What one rank feeds a sharded forward, and how to put its per-position results back together.

    Attributes:
        model_inputs: the model call's keyword arguments (ids, global position ids, packed boundaries, the group).
        input_ids: ``(R, length)`` this rank's ids; ``next_ids``: the token each of its positions predicts.
        shard: the slice; ``packed``: the packing of the rows (None: the padded layout).
    """

    model_inputs: Dict[str, Any]
    input_ids: Tensor
    next_ids: Tensor
    shard: SequenceShard
    packed: Optional[PackedRows]


def shard_inputs(
    sequence: SequenceGroup,
    input_ids: Tensor,
    attention_mask: Tensor,
    packed: bool,
    host_lengths: Optional[List[int]] = None,
) -> ShardedInputs:
    """This rank's share of ``(B, T)`` right-padded rows, padded or packed (see the module docstring).

    ``host_lengths``: the rows' lengths known on the host (:func:`rlhf.models.host_layout.row_lengths`): laid out
    without reading the device. The model is handed a mask it does not read (the core attention takes none).

    Raises:
        ValueError: rows that are not right-padded (the causal core attention would let real tokens see pads).
    """
    # right padding checked either way (on the host, where the lengths were recorded)
    rows = PackedRows.from_padded(input_ids, attention_mask, host_lengths)
    ids = rows.input_ids if packed else input_ids
    width = ids.shape[1]
    length = max(1, math.ceil(width / sequence.size))
    extra = length * sequence.size - width
    ids = torch.nn.functional.pad(ids, (0, extra))
    if packed:  # the padding is one more packed row, positions from 0
        positions = torch.cat([rows.position_ids, torch.arange(extra, device=ids.device)[None]], dim=1)
    else:  # padded rows: the columns' positions, as an unsharded forward numbers them
        positions = torch.arange(width + extra, device=ids.device).expand_as(ids)
    next_ids = ids.roll(-1, dims=1)
    take = slice(sequence.rank * length, (sequence.rank + 1) * length)
    model_inputs: Dict[str, Any] = dict(
        input_ids=ids[:, take],
        position_ids=positions[:, take],
        attention_mask=unread_mask(ids.device),
        **{SEQUENCE_KWARG: sequence},
    )
    if packed:
        bounds = [*rows.bounds, *([width + extra] if extra else [])]
        cu = torch.tensor(bounds, dtype=torch.int32, device=ids.device)
        longest = max(rows.max_length, extra)
        model_inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return ShardedInputs(
        model_inputs=model_inputs,
        input_ids=ids[:, take],
        next_ids=next_ids[:, take],
        shard=SequenceShard(sequence, width, length),
        packed=rows if packed else None,
    )
