"""A trainer rank copies every batch of a call to its device before its first pass (``TrainerWorker._upload``): on a
GPU a copy from host memory waits until the device has run what it was given, so one copy before each micro-batch
would hold the host back behind the previous backward. The order of copies, passes and backwards is what is tested,
with a recording engine and objective (the real engines' steps: test_flat_grads.py, test_unfused_step.py)."""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from rlhf.batch import Batch
from rlhf.distributed.engine import EngineSpec
from rlhf.distributed.worker import TrainerWorker
from rlhf.models.host_layout import row_lengths
from rlhf.utils.flops import ModelFlops

MICRO_BATCHES = 3


class _Engine:
    """What ``train_step`` asks of a ``TrainEngine``, recording each backward."""

    def __init__(self, events: List[str]) -> None:
        self.events = events
        self.spec = EngineSpec(zero_stage=1, precision="fp32", micro_batch_size=2, grad_accum_steps=MICRO_BATCHES)
        self.last_grad_norm = 1.0

    def position_schedule(self, step: int) -> None:
        pass

    def current_lr(self) -> float:
        return 0.1

    def micro_step(self, loss: torch.Tensor, is_last: bool) -> None:
        self.events.append("backward")


class _Objective:
    def __init__(self, events: List[str]) -> None:
        self.events = events
        self.lengths: List[Optional[List[int]]] = []  # what each pass finds known on the host

    def loss(self, model, batch: Batch):
        self.events.append("pass")
        self.lengths.append(row_lengths(batch.attention_mask))
        tokens = batch.attention_mask.sum().to(torch.float64)
        return tokens, {"tokens": tokens}


@pytest.fixture
def recorded(monkeypatch):
    events: List[str] = []
    to = Batch.to

    def recording_to(self, device):
        events.append("upload")
        return to(self, device)

    monkeypatch.setattr(Batch, "to", recording_to)
    worker = TrainerWorker("policy", 0, 1)
    worker.model = torch.nn.Linear(1, 1)
    worker.engine = _Engine(events)  # type: ignore[assignment]
    worker.model_flops = ModelFlops(matmul_params=1, layers=1, attention_width=1)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    batches = [Batch(input_ids=mask.clone(), attention_mask=mask.clone()) for _ in range(MICRO_BATCHES)]
    return worker, events, batches


def test_a_training_step_copies_every_micro_batch_before_the_first_forward(recorded):
    worker, events, batches = recorded
    objective = _Objective(events)
    result = worker.train_step(batches, objective, normalizer=18.0)
    assert events == ["upload"] * MICRO_BATCHES + ["pass", "backward"] * MICRO_BATCHES
    assert result.sums == {"tokens": 18.0}
    assert objective.lengths == [[4, 2]] * MICRO_BATCHES  # each copy's row lengths, from the host


def test_scoring_and_evaluation_copy_every_batch_before_the_first_pass(recorded):
    worker, events, batches = recorded
    objective = _Objective(events)
    scores = worker.score(batches, lambda model, batch: objective.loss(model, batch)[0])
    assert events == ["upload"] * MICRO_BATCHES + ["pass"] * MICRO_BATCHES
    assert [float(s) for s in scores] == [6.0] * MICRO_BATCHES
    events.clear()
    assert worker.evaluate(batches, objective, [True, True, False]) == {"tokens": 12.0}
    assert events == ["upload"] * MICRO_BATCHES + ["pass"] * MICRO_BATCHES
    assert objective.lengths == [[4, 2]] * 2 * MICRO_BATCHES
