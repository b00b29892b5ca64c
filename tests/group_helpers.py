"""An in-process stand-in for a worker group's actors, for unit tests of the group's own logic (no Ray)."""
from __future__ import annotations

import torch

from rlhf.distributed.engine import EngineSpec
from rlhf.distributed.group import WorkerGroup
from rlhf.distributed.worker import RankStepResult
from rlhf.objectives.base import add_sums


class LocalGroup(WorkerGroup):
    """A WorkerGroup whose ranks run here, forward only; records what each rank was given."""

    def __init__(self, model, spec: EngineSpec, ranks: int, norms=None):  # no actors: WorkerGroup.__init__ unused
        self.model, self.role, self.size, self.trainable = model, "policy", ranks, True
        self.engine_spec, self.given, self.norms = spec, None, norms

    def train_step(self, per_rank, objective, normalizer, schedule_step=None):
        self.given = (per_rank, normalizer, schedule_step)
        results = []
        with torch.no_grad():
            for r, micro_batches in enumerate(per_rank):
                sums = {}
                for mb in micro_batches:
                    sums = add_sums(sums, objective.loss(self.model, mb)[1])
                norm = self.norms[r] if self.norms else 1.5
                results.append(RankStepResult(sums=sums, grad_norm=norm, lr=0.1))
        return results

    def score(self, batches, fn):
        with torch.no_grad():
            return [fn(self.model, b) for b in batches]
