"""Worker groups: one Ray actor per data-parallel rank of a role, in one placement group, one process group.

The group is the only place that talks to the actors. It splits work across ranks, gathers results in rank
order, and turns any actor failure into a :class:`WorkerError` naming the role, the rank and the call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from rlhf.batch import Batch
from rlhf.distributed.engine import EngineSpec, OptimSpec
from rlhf.distributed.errors import WorkerError, gather
from rlhf.distributed.placement import Placement
from rlhf.distributed.worker import StepResult, TrainerWorker
from rlhf.models.loading import ModelSpec
from rlhf.objectives.base import Objective, ScoreFn

__all__ = ["GroupResources", "WorkerError", "WorkerGroup"]


@dataclass(frozen=True)
class GroupResources:
    num_workers: int
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    env_vars: Dict[str, str] = field(default_factory=dict)


class WorkerGroup:
    """``resources.num_workers`` :class:`TrainerWorker` actors for one ``role``."""

    def __init__(self, role: str, resources: GroupResources, backend: str,
                 placement: Optional[Placement] = None) -> None:
        """``placement``: a placement group shared with colocated roles (rank r on its bundle r); by default
        the group makes and owns one of its own."""
        import ray

        self.role = role
        self.size = resources.num_workers
        self._owns_placement = placement is None
        if placement is None:
            placement = Placement(role, self.size, resources.cpus_per_worker, resources.gpus_per_worker)
        elif placement.num_bundles != self.size:
            raise ValueError(f"{role}: {self.size} workers cannot share {placement.name}'s "
                             f"{placement.num_bundles} bundles")
        self.placement = placement
        actor_cls = ray.remote(TrainerWorker)
        self.workers = [
            actor_cls.options(**placement.actor_options(rank), runtime_env={"env_vars": dict(resources.env_vars)})
            .remote(role, rank, self.size, placement.threads_per_actor)
            for rank in range(self.size)
        ]
        addr, port = self._gather([self.workers[0].rendezvous_address.remote()], "rendezvous_address")[0]
        self._gather([w.init_process_group.remote(addr, port, backend) for w in self.workers], "init_process_group")

    # ------------------------------------------------------------------ calls
    def build(self, model: ModelSpec, engine: EngineSpec, optim: Optional[OptimSpec]) -> List[Dict[str, int]]:
        return self._gather([w.build.remote(model, engine, optim) for w in self.workers], "build")

    def train_step(self, per_rank: Sequence[List[Batch]], objective: Objective, normalizer: int,
                   schedule_step: Optional[int] = None) -> List[StepResult]:
        """One optimizer step; ``per_rank[r]`` holds rank r's micro-batches of the global batch, ``schedule_step``
        the run's 0-based optimizer step (its LR; see :meth:`TrainerWorker.train_step`)."""
        if len(per_rank) != self.size:
            raise ValueError(f"{self.role}: {len(per_rank)} rank shards for {self.size} workers")
        refs = [w.train_step.remote(mb, objective, normalizer, schedule_step) for w, mb in zip(self.workers, per_rank)]
        return self._gather(refs, "train_step")

    def score(self, batches: Sequence[Batch], fn: ScoreFn) -> List[Any]:
        """Run ``fn`` over ``batches`` spread across the ranks; results in the order of ``batches``.

        Every rank runs the same number of forwards (see :meth:`_spread`); filler results are dropped.
        """
        if not batches:
            return []
        shards, _ = self._spread(batches)
        results = self._gather([w.score.remote(s, fn) for w, s in zip(self.workers, shards)], "score")
        return [out for shard in results for out in shard][: len(batches)]

    def evaluate(self, batches: Sequence[Batch], objective: Objective) -> Dict[str, float]:
        """Forward-only objective sums over ``batches`` spread across the ranks, added over ranks."""
        from rlhf.objectives.base import add_sums

        shards, counted = self._spread(batches)
        results = self._gather([w.evaluate.remote(s, objective, c) for w, s, c in zip(self.workers, shards, counted)],
                               "evaluate")
        total: Dict[str, float] = {}
        for sums in results:
            total = add_sums(total, sums)
        return total

    def _spread(self, batches: Sequence[Batch]):
        """Contiguous equal shards per rank. Under ZeRO-3 every forward is a collective, so ranks must run the
        same number of them: short shards are topped up with a repeat of the last batch, marked not counted."""
        per_rank = -(-len(batches) // self.size)
        filler = per_rank * self.size - len(batches)
        padded = list(batches) + [batches[-1]] * filler
        counted = [True] * len(batches) + [False] * filler
        cut = lambda xs: [xs[r * per_rank:(r + 1) * per_rank] for r in range(self.size)]  # noqa: E731
        return cut(padded), cut(counted)

    def attach_weight_senders(self, senders: Sequence[Any]) -> List[Any]:
        """Give rank r ``senders[r]`` (a ``WeightSender`` or ``None``); returns what each one's ``listen`` gave."""
        if len(senders) != self.size:
            raise ValueError(f"{self.role}: {len(senders)} weight senders for {self.size} workers")
        return self._gather([w.attach_weight_sender.remote(s) for w, s in zip(self.workers, senders)],
                            "attach_weight_sender")

    def connect_weight_senders_async(self) -> List[Any]:
        """Start every rank's ``connect``; the caller gathers the refs after telling the peers to join."""
        return [w.connect_weight_sender.remote() for w in self.workers]

    def push_weights(self) -> Dict[str, float]:
        """Full weights -> the rollout engines through the attached senders; the sending ranks' stats merged
        (bytes and tensors per engine as rank 0 saw them, seconds of the slowest rank)."""
        stats = [s for s in self._gather([w.push_weights.remote() for w in self.workers], "push_weights") if s]
        if not stats:
            return {}
        return {**stats[0], "seconds": max(s["seconds"] for s in stats)}

    def ping(self) -> List[int]:
        """Every rank's number, in order: a liveness check."""
        return self._gather([w.ping.remote() for w in self.workers], "ping")

    def save_checkpoint(self, directory: str) -> None:
        """Every rank's model / optimizer / schedule / RNG state under ``directory`` (shared storage)."""
        self._gather([w.save_checkpoint.remote(directory) for w in self.workers], "save_checkpoint")

    def load_checkpoint(self, directory: str) -> None:
        self._gather([w.load_checkpoint.remote(directory) for w in self.workers], "load_checkpoint")

    def placements(self) -> List[dict]:
        """Every rank's placement group id and assigned resources, in rank order."""
        return self._gather([w.placement.remote() for w in self.workers], "placement")

    def save_pretrained(self, path: str) -> None:
        self._gather([w.save_pretrained.remote(path) for w in self.workers], "save_pretrained")

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        if self._owns_placement:
            self.placement.remove()
        self.workers = []

    # ------------------------------------------------------------------ errors
    def _gather(self, refs: List[Any], call: str) -> List[Any]:
        """``ray.get`` in rank order; the first failure raises a :class:`WorkerError` naming role and rank."""
        return gather(refs, [f"{self.role} rank {r}" for r in range(len(refs))], call)
