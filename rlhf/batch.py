"""The one batch type that crosses actor boundaries.

``Batch`` is a frozen dataclass of named tensors whose first dimension is the sample dimension. Every field is
documented with its shape; a field that a stage does not use is ``None``. Slicing, splitting and concatenation
act on every present field at once, so a batch can be cut into per-rank and per-micro-batch pieces without
the caller knowing which fields it carries.

Shapes use ``B`` for samples, ``T`` for padded sequence length. Preference data keeps the two completions of a
pair together in a second dimension of size 2 (index 0 = chosen, 1 = rejected) so that cutting along ``B``
never separates a pair; the model forward flattens ``(B, 2, T)`` to ``(2B, T)`` to score chosen and rejected
in one pass.

Token conventions: ``loss_mask[b, t] == 1`` means token ``t`` is a target whose log-probability (predicted at
position ``t - 1``) enters the loss; position 0 is never a target. Padding is on the right.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Sequence, cast

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Batch:
    """Named tensors for one (micro-)batch. See the module docstring for conventions.

    Attributes:
        input_ids: ``(B, T)`` or ``(B, 2, T)`` token ids, right-padded with the pad id.
        attention_mask: same shape as ``input_ids``; 1 on real tokens, 0 on padding.
        loss_mask: same shape as ``input_ids``; 1 on target tokens (response tokens for SFT/DPO/RL).
        ref_logps: ``(B,)`` or ``(B, 2)`` summed reference log-probs over target tokens (DPO), or
            ``(B, T)`` per-token reference log-probs (RL).
        margin: ``(B,)`` optional reward-model margin per pair.
        sample_index: ``(B,)`` int64 index of each row in its dataset (bookkeeping, never in the maths).
        old_logps: ``(B, T)`` per-token log-probs under the policy that generated the rollout (RL), computed by
            the trainer before the update (PPO's pi_old).
        rollout_logps: ``(B, T)`` per-token log-probs reported by the rollout engine (vLLM) for the same tokens.
        values: ``(B, T)`` critic values before the update (PPO value clipping, GAE).
        advantages: ``(B, T)`` per-token advantages (0 outside ``loss_mask``).
        returns: ``(B, T)`` per-token value targets.
        teacher_logps: ``(B, T)`` per-token log-probs of the sampled tokens under a distillation teacher (RL,
            ``algo.teacher.path``), scored like ``ref_logps``.
        teacher_topk_logps: ``(B, T, K)`` the teacher's log-probs of the K most likely tokens of the distribution
            that predicts each token (``algo.teacher.divergence`` forward_kl / jsd); ``teacher_topk_ids``: ``(B, T,
            K)`` int64, those tokens. Per-token fields with a trailing axis: the time axis is dim 1.
        desirable: ``(B,)`` bool, unpaired preference rows (KTO): whether the row's completion is desirable.
        kl_baseline: ``(B,)`` KTO's reference point ``z_0``, the KL estimate of the whole global batch repeated on
            every row (so any cut of the batch carries it), detached.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Optional[Tensor] = None
    ref_logps: Optional[Tensor] = None
    margin: Optional[Tensor] = None
    sample_index: Optional[Tensor] = None
    old_logps: Optional[Tensor] = None
    rollout_logps: Optional[Tensor] = None
    values: Optional[Tensor] = None
    advantages: Optional[Tensor] = None
    returns: Optional[Tensor] = None
    teacher_logps: Optional[Tensor] = None
    teacher_topk_logps: Optional[Tensor] = None
    teacher_topk_ids: Optional[Tensor] = None
    desirable: Optional[Tensor] = None
    kl_baseline: Optional[Tensor] = None

    def __post_init__(self) -> None:
        n = self.input_ids.shape[0]
        for name, value in self.present().items():
            if value.shape[0] != n:
                raise ValueError(f"Batch.{name} has {value.shape[0]} rows, input_ids has {n}")
        for name in ("attention_mask", "loss_mask"):
            value = getattr(self, name)
            if value is not None and value.shape != self.input_ids.shape:
                raise ValueError(f"Batch.{name} shape {tuple(value.shape)} != input_ids {tuple(self.input_ids.shape)}")
        for name in _TOKEN_TRAILING:
            value = getattr(self, name)
            if value is not None and (value.dim() != 3 or value.shape[:2] != self.input_ids.shape):
                over = tuple(self.input_ids.shape)
                raise ValueError(f"Batch.{name} must be (B, T, K) over input_ids {over}, got {tuple(value.shape)}")

    # ------------------------------------------------------------------ views
    def present(self) -> dict[str, Tensor]:
        """The fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def row_lengths(self) -> List[int]:
        """Real tokens of every sequence (both of a pair), non-empty ones only (a lockstep pad row counts nothing)."""
        lengths = self.attention_mask.reshape(-1, self.attention_mask.shape[-1]).sum(-1)
        return [int(n) for n in lengths.tolist() if n > 0]

    @property
    def is_pairwise(self) -> bool:
        """True for preference batches, ``input_ids`` of shape ``(B, 2, T)``."""
        return self.input_ids.dim() == 3

    def replace(self, **fields: Optional[Tensor]) -> "Batch":
        # cast: mypy would check every field against the one value type of **fields; replace checks names at run time.
        return dataclasses.replace(self, **cast("dict[str, Any]", fields))

    # ------------------------------------------------------------------ cutting
    def slice(self, start: int, stop: int) -> "Batch":
        """Rows ``start:stop`` of every field."""
        return Batch(**{k: v[start:stop] for k, v in self.present().items()})

    def select(self, rows: Sequence[int]) -> "Batch":
        """The given rows (in that order) of every field."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return Batch(**{k: v[index] for k, v in self.present().items()})

    def split(self, size: int) -> List["Batch"]:
        """Consecutive pieces of ``size`` rows; ``len(self)`` must be a multiple of ``size``."""
        if size <= 0 or len(self) % size:
            raise ValueError(f"cannot split {len(self)} rows into pieces of {size}")
        return [self.slice(i, i + size) for i in range(0, len(self), size)]

    def chunk(self, n: int) -> List["Batch"]:
        """``n`` equal consecutive pieces; ``len(self)`` must be a multiple of ``n``."""
        if n <= 0 or len(self) % n:
            raise ValueError(f"cannot cut {len(self)} rows into {n} equal pieces")
        return self.split(len(self) // n)

    def trim(self) -> "Batch":
        """Drop trailing columns that are padding in every row (keeps at least one column)."""
        length = int(self.attention_mask.reshape(-1, self.attention_mask.shape[-1]).sum(-1).max().clamp(min=1))
        out = {}
        for name, value in self.present().items():
            axis = self._time_axis(name, value)
            out[name] = value if axis is None else value.narrow(axis, 0, length)
        return Batch(**out)

    def _time_axis(self, name: str, value: Tensor) -> Optional[int]:
        """The axis a per-token field runs along time on: dim 1 for the ``(B, T, K)`` fields, the last for fields of
        ``input_ids``' rank and last dimension; ``None`` for per-sample fields."""
        if name in _TOKEN_TRAILING:
            return 1
        if value.dim() == self.input_ids.dim() and value.shape[-1] == self.input_ids.shape[-1]:
            return value.dim() - 1
        return None

    def contiguous(self) -> "Batch":
        """Every field in its own compact memory: a slice or a trimmed view would otherwise carry (and send to
        another process) the storage of the whole batch it was cut from."""
        return Batch(**{k: v.contiguous() for k, v in self.present().items()})

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(**{k: v.to(device) for k, v in self.present().items()})

    @staticmethod
    def concat(batches: Sequence["Batch"], pad_id: int = 0) -> "Batch":
        """Stack batches along rows, right-padding sequence fields to the longest (``input_ids`` with ``pad_id``,
        masks and per-token fields with 0)."""
        if not batches:
            raise ValueError("Batch.concat of nothing")
        names = list(batches[0].present())
        for b in batches[1:]:
            if list(b.present()) != names:
                raise ValueError(f"Batch.concat: fields differ ({names} vs {list(b.present())})")
        width = max(b.input_ids.shape[-1] for b in batches)
        out = {}
        for name in names:
            parts = [getattr(b, name) for b in batches]
            axis = batches[0]._time_axis(name, parts[0])
            if axis is not None:
                fill = pad_id if name == "input_ids" else 0
                parts = [pad_along(p, width, axis, fill) for p in parts]
            out[name] = torch.cat(parts, dim=0)
        return Batch(**out)


#: per-token fields with a trailing axis, ``(B, T, K)``: cut and padded along dim 1, not the last
_TOKEN_TRAILING = ("teacher_topk_logps", "teacher_topk_ids")


def pad_along(x: Tensor, width: int, axis: int, value: float = 0) -> Tensor:
    """``x`` right-padded with ``value`` along ``axis`` to ``width`` (a per-token tensor's time axis)."""
    if x.shape[axis] == width:
        return x
    shape = list(x.shape)
    shape[axis] = width - x.shape[axis]
    return torch.cat([x, x.new_full(shape, value)], dim=axis)


def pad_sequences(seqs: Iterable[Sequence[int]], pad_value: int, width: Optional[int] = None) -> Tensor:
    """Right-pad integer sequences into a ``(len(seqs), width)`` int64 tensor (``width`` defaults to the longest)."""
    seqs = [list(s) for s in seqs]
    width = width or max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out
