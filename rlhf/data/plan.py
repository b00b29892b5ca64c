"""Which samples each optimizer step consumes: the global-batch plan.

Pure arithmetic, shared by every offline trainer (and PPO's epochs over a rollout batch):

* Each epoch is a fresh permutation of the dataset seeded by ``(seed, epoch)``.
* Steps per epoch = ``floor(N / global_batch_size)``: drop_last at *global-batch* granularity, after the
  shuffle, so a step never mixes epochs and never runs a partial accumulation window (OpenRLHF dropped at
  micro-batch granularity and let the partial window leak into the next epoch).
* ``max_steps`` counts optimizer steps of the whole run; the run is ``min(max_steps, epochs x steps_per_epoch)``
  steps and the LR schedule uses that same number.
* A step's samples are cut into ``num_workers`` contiguous rank shards, each into ``grad_accum_steps`` micro-batches
  of ``micro_batch_size``: every factorisation of one global batch covers the same samples.

Step ``k`` is a function of ``(seed, k)`` alone, so resuming at any step replays exactly the same data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class StepPlan:
    step: int  # 1-based optimizer step of the run
    epoch: int  # 1-based epoch this step belongs to
    indices: List[int]  # dataset rows, len == global_batch_size

    def shards(self, num_workers: int, micro_batch_size: int) -> List[List[List[int]]]:
        """``[rank][micro] -> row indices``: contiguous rank shards cut into micro-batches."""
        per_rank = len(self.indices) // num_workers
        out = []
        for rank in range(num_workers):
            rows = self.indices[rank * per_rank : (rank + 1) * per_rank]
            out.append([rows[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)])
        return out


@dataclass(frozen=True)
class EpochPlan:
    num_samples: int
    global_batch_size: int
    max_epochs: int
    max_steps: int = -1
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.num_samples < self.global_batch_size:
            raise PlanError(
                f"the data has {self.num_samples} usable rows, fewer than train.global_batch_size="
                f"{self.global_batch_size}: not a single optimizer step fits"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def total_steps(self) -> int:
        full = self.steps_per_epoch * self.max_epochs
        return full if self.max_steps < 0 else min(full, self.max_steps)

    def permutation(self, epoch: int) -> List[int]:
        """Row order of 1-based ``epoch``; depends only on ``(seed, epoch)``."""
        if not self.shuffle:
            return list(range(self.num_samples))
        import torch  # only for its seeded permutation: the plan (and PlanError) stays importable without torch

        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def step(self, step: int) -> StepPlan:
        """The plan of 1-based optimizer ``step``."""
        if not 1 <= step <= self.total_steps:
            raise PlanError(f"step {step} outside 1..{self.total_steps}")
        return self._cut(step, self.permutation(self._epoch_of(step)))

    def steps(self, start: int = 1) -> Iterator[StepPlan]:
        """Steps ``start..total_steps``, computing each epoch's permutation once."""
        cached_epoch, order = None, []
        for step in range(start, self.total_steps + 1):
            if self._epoch_of(step) != cached_epoch:
                cached_epoch = self._epoch_of(step)
                order = self.permutation(cached_epoch)
            yield self._cut(step, order)

    def _epoch_of(self, step: int) -> int:
        return (step - 1) // self.steps_per_epoch + 1

    def _cut(self, step: int, order: List[int]) -> StepPlan:
        offset = ((step - 1) % self.steps_per_epoch) * self.global_batch_size
        return StepPlan(step=step, epoch=self._epoch_of(step), indices=order[offset : offset + self.global_batch_size])
