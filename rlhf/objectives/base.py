"""Protocols shared by the objectives (see the package docstring for the contract)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Protocol, Tuple

import torch

from rlhf.batch import Batch

Sums = Dict[str, float]


class Objective(Protocol):
    """What a worker group trains (docs/custom_loops.md, "Writing an objective").

    ``count(batch)`` is the batch's share of the normalizer (target tokens, sequences, pairs); the group adds it
    over the *whole* global batch before the first backward. ``loss(model, batch)`` returns the micro-batch's
    loss as a *sum* over its units (the group divides it by the global count) and its metric sums.
    ``finalize(sums, normalizer)`` turns metric sums added over any number of micro-batches, ranks and
    optimizer steps into the logged means; it is called once per global quantity.

    ``model`` is typed ``Any`` here: a worker passes its ``torch.nn.Module`` or the ``TrainEngine`` wrapping it
    (called like the model, ``.module`` the model), and an objective may annotate it as the module it uses.
    """

    def count(self, batch: Batch) -> int: ...

    def loss(self, model: Any, batch: Batch) -> Tuple[torch.Tensor, Sums]: ...

    def finalize(self, sums: Sums, normalizer: int) -> Dict[str, float]: ...


class ScoreFn(Protocol):
    """A forward-only computation run on frozen workers (e.g. reference log-probs): ``(model, batch) -> (B, ...)``;
    ``model`` as in :class:`Objective`."""

    def __call__(self, model: Any, batch: Batch) -> torch.Tensor: ...


def add_sums(total: Sums, part: Sums) -> Sums:
    """Element-wise sum of two metric-sum dicts (keys of either)."""
    out = dict(total)
    for key, value in part.items():
        out[key] = out.get(key, 0.0) + float(value)
    return out


@dataclass
class Totals:
    """An objective's metric sums and normalizer added over pieces of one global quantity (the ranks of a step,
    the optimizer steps of an RL step, the chunks of a held-out set), finalized once: a mean of per-piece means
    would weight a short piece like a long one."""

    sums: Sums = field(default_factory=dict)
    normalizer: int = 0

    def add(self, sums: Sums, normalizer: int) -> None:
        self.sums = add_sums(self.sums, sums)
        self.normalizer += normalizer

    def finalize(self, objective: Objective) -> Dict[str, float]:
        return objective.finalize(self.sums, self.normalizer)


def target_count(loss_mask: torch.Tensor) -> int:
    """Number of target tokens; column 0 is never a target (nothing predicts it)."""
    return int(loss_mask[..., 1:].sum())
