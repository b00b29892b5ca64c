"""Worker groups: one Ray actor per data-parallel rank of a role, in one placement group, one process group.

The group is the only place that talks to the actors. It splits work across ranks, gathers results in rank
order, and turns any actor failure into a :class:`WorkerError` naming the role, the rank and the call.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from rlhf.batch import Batch
from rlhf.distributed.engine import EngineSpec, OptimSpec
from rlhf.distributed.worker import StepResult, TrainerWorker
from rlhf.models.loading import ModelSpec
from rlhf.objectives.base import Objective, ScoreFn

PLACEMENT_TIMEOUT_S = float(os.environ.get("RLHF_PLACEMENT_TIMEOUT_S", "600"))


class WorkerError(RuntimeError):
    """An actor of a worker group failed or died; the message names the role, rank and call."""


@dataclass(frozen=True)
class GroupResources:
    num_workers: int
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    env_vars: Dict[str, str] = field(default_factory=dict)


def _check_feasible(role: str, bundle: Dict[str, float], count: int) -> None:
    """Fail at once when the whole cluster could never hold the group (waiting would only time out)."""
    import ray

    total = ray.cluster_resources()
    for resource, amount in bundle.items():
        if amount * count > total.get(resource, 0.0) + 1e-9:
            raise WorkerError(f"{role}: {count} workers x {amount:g} {resource} exceed the cluster's total "
                              f"{total.get(resource, 0.0):g} {resource}")


class WorkerGroup:
    """``resources.num_workers`` :class:`TrainerWorker` actors for one ``role``."""

    def __init__(self, role: str, resources: GroupResources, backend: str) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role = role
        self.size = resources.num_workers
        bundle = {"CPU": resources.cpus_per_worker}
        if resources.gpus_per_worker > 0:
            bundle["GPU"] = resources.gpus_per_worker
        _check_feasible(role, bundle, self.size)
        self._pg = placement_group([dict(bundle) for _ in range(self.size)], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self._pg)  # do not leave a pending request holding the queue
            raise WorkerError(
                f"{role}: could not place {self.size} workers x {bundle} within {PLACEMENT_TIMEOUT_S:.0f}s; "
                f"cluster has {ray.cluster_resources()}"
            )
        actor_cls = ray.remote(TrainerWorker)
        threads = max(1, int(resources.cpus_per_worker))
        self.workers = [
            actor_cls.options(
                num_cpus=resources.cpus_per_worker,
                num_gpus=resources.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": dict(resources.env_vars)},
            ).remote(role, rank, self.size, threads)
            for rank in range(self.size)
        ]
        addr, port = self._gather([self.workers[0].rendezvous_address.remote()], "rendezvous_address")[0]
        self._gather([w.init_process_group.remote(addr, port, backend) for w in self.workers], "init_process_group")

    # ------------------------------------------------------------------ calls
    def build(self, model: ModelSpec, engine: EngineSpec, optim: Optional[OptimSpec]) -> List[Dict[str, int]]:
        return self._gather([w.build.remote(model, engine, optim) for w in self.workers], "build")

    def train_step(self, per_rank: Sequence[List[Batch]], objective: Objective, normalizer: int) -> List[StepResult]:
        """One optimizer step; ``per_rank[r]`` holds rank r's micro-batches of the global batch."""
        if len(per_rank) != self.size:
            raise ValueError(f"{self.role}: {len(per_rank)} rank shards for {self.size} workers")
        refs = [w.train_step.remote(mb, objective, normalizer) for w, mb in zip(self.workers, per_rank)]
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

    def push_weights(self, engines: Sequence[Any], bucket_bytes: int = 64 << 20) -> Dict[str, float]:
        """Full weights -> every vLLM engine actor, bucketed; returns rank 0's transfer stats."""
        return self._gather([w.push_weights.remote(list(engines), bucket_bytes) for w in self.workers],
                            "push_weights")[0]

    def ping(self) -> List[int]:
        """Every rank's number, in order: a liveness check."""
        return self._gather([w.ping.remote() for w in self.workers], "ping")

    def save_pretrained(self, path: str) -> None:
        self._gather([w.save_pretrained.remote(path) for w in self.workers], "save_pretrained")

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self._pg)
        self.workers = []

    # ------------------------------------------------------------------ errors
    def _gather(self, refs: List[Any], call: str) -> List[Any]:
        """``ray.get`` in rank order, failing fast on the first rank that errors (a collective peer of a dead
        rank would otherwise wait forever)."""
        import ray

        index = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                raise WorkerError(f"{self.role} rank {index[ready[0]]} died during {call}: {exc}") from exc
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise WorkerError(
                    f"{self.role} rank {index[ready[0]]} failed in {call}: {type(cause).__name__}: {cause}"
                ) from exc
        return ray.get(refs)
