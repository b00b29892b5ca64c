"""An in-process stand-in for a worker group's actors, for unit tests of the group's own logic (no Ray)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from rlhf.batch import Batch
from rlhf.distributed.engine import EngineSpec
from rlhf.distributed.group import WorkerGroup
from rlhf.distributed.worker import RankStepResult
from rlhf.objectives.base import Sums, add_sums


class LocalGroup(WorkerGroup):
    """A WorkerGroup whose ranks run here, forward only (no update): the real cutting and counting of
    :meth:`WorkerGroup.train_batch` / ``score_batch`` over stand-ins for the two actor calls. Records what the last
    step gave each rank (``given``) and every step's LR position (``schedule_steps``).

    ``report(rank, schedule_step) -> (grad_norm, lr)`` is what each rank reports (default: 1.5 and 0.1).
    """

    def __init__(self, model, spec: EngineSpec, ranks: int, report=None, held=None):  # no actors
        self.model, self.role, self.size, self.trainable = model, "policy", ranks, True
        self.held_models = dict(held or {})  # role -> the frozen model the ranks hold (WorkerGroup.hold)
        self.held = set(self.held_models)
        self.engine_spec, self.report = spec, report or (lambda rank, schedule_step: (1.5, 0.1))
        # the last train_step's (per_rank, normalizer, schedule_step) and counted; every train_step's schedule_step
        self.given: Optional[Tuple[Sequence[List[Batch]], int, Optional[int]]] = None
        self.counted: Optional[Sequence[List[bool]]] = None
        self.schedule_steps: List[Optional[int]] = []

    def train_step(self, per_rank, objective, normalizer, schedule_step=None, counted=None):
        self.given = (per_rank, normalizer, schedule_step)
        self.counted = counted
        self.schedule_steps.append(schedule_step)
        results = []
        with torch.no_grad():
            for rank, micro_batches in enumerate(per_rank):
                sums: Sums = {}
                keep = counted[rank] if counted else [True] * len(micro_batches)
                for mb, kept in zip(micro_batches, keep):
                    if kept:  # a filler is dropped, as TrainerWorker.train_step drops it
                        sums = add_sums(sums, objective.loss(self.model, mb)[1])
                grad_norm, lr = self.report(rank, schedule_step)
                results.append(RankStepResult(sums=sums, grad_norm=grad_norm, lr=lr))
        return results

    def evaluate(self, batches, objective):
        sums: Sums = {}
        with torch.no_grad():
            for b in batches:
                sums = add_sums(sums, objective.loss(self.model, b)[1])
        return sums

    def score(self, batches, fn, on=None):
        model = self.held_models[on] if on is not None else self.model
        with torch.no_grad():
            return [fn(model, b) for b in batches]
