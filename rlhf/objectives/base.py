"""Protocols shared by the objectives (see the package docstring for the contract)."""
from __future__ import annotations

from typing import Dict, Protocol, Tuple

import torch

from rlhf.batch import Batch

Sums = Dict[str, float]


class Objective(Protocol):
    def count(self, batch: Batch) -> int: ...

    def loss(self, model: torch.nn.Module, batch: Batch) -> Tuple[torch.Tensor, Sums]: ...

    def finalize(self, sums: Sums, normalizer: int) -> Dict[str, float]: ...


class ScoreFn(Protocol):
    """A forward-only computation run on frozen workers (e.g. reference log-probs): ``(model, batch) -> (B, ...)``."""

    def __call__(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor: ...


def add_sums(total: Sums, part: Sums) -> Sums:
    """Element-wise sum of two metric-sum dicts (keys of either)."""
    out = dict(total)
    for key, value in part.items():
        out[key] = out.get(key, 0.0) + float(value)
    return out


def target_count(loss_mask: torch.Tensor) -> int:
    """Number of target tokens; column 0 is never a target (nothing predicts it)."""
    return int(loss_mask[..., 1:].sum())
