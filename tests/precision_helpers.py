"""Shared by the precision test files (bf16: test_precision.py, fp64: test_fp64.py): worker groups trained in
lockstep under several (ranks x micro-batch) layouts of the same global batch, the batch cut exactly as the trainers
cut it (``StepPlan.shards``) and the normalizer counted once over every micro-batch of every rank."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from rlhf.batch import Batch
from rlhf.data.plan import StepPlan


def shards(batch: Batch, ranks: int, micro: int):
    """``[rank][micro]`` pieces of a global batch, cut like the trainers cut it, each padded to its own longest."""
    step = StepPlan(step=1, epoch=1, indices=list(range(len(batch))))
    return [[batch.select(rows).trim() for rows in rank] for rank in step.shards(ranks, micro)]


def in_parallel(calls: dict) -> dict:
    """``name -> result`` of the zero-argument ``calls``, run side by side (the groups' actors share 2 cores;
    one group's waits are the other's turn)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


@contextmanager
def started_groups(layouts: dict, role: str = "policy"):
    """``name -> (WorkerGroup, ranks, micro)`` for ``layouts`` (``name -> (ranks, micro)``), started side by side
    (half a CPU per rank) and shut down on exit."""
    from rlhf.distributed.cluster import actor_env
    from rlhf.distributed.group import GroupResources, WorkerGroup

    def start(ranks):
        return WorkerGroup(role, GroupResources(num_workers=ranks, cpus_per_worker=0.5, env_vars=actor_env(0)), "gloo")

    started = in_parallel({name: (lambda r=ranks: start(r)) for name, (ranks, _) in layouts.items()})
    try:
        yield {name: (group, *layouts[name]) for name, group in started.items()}
    finally:
        for group in started.values():
            group.shutdown()


def step(group, ranks: int, micro: int, objective, batch: Batch) -> dict:
    """One optimizer step over ``batch``; the global loss and grad norm, finalized as the trainers do."""
    from rlhf.objectives.base import add_sums

    pieces = shards(batch, ranks, micro)
    normalizer = sum(objective.count(mb) for rank in pieces for mb in rank)
    results = group.train_step(pieces, objective, normalizer)
    sums: dict = {}
    for result in results:
        sums = add_sums(sums, result.sums)
    assert len({r.grad_norm for r in results}) == 1, "ranks disagree on the grad norm"
    return {"loss": objective.finalize(sums, normalizer)["loss"], "grad_norm": results[0].grad_norm}


def score_rows(group, ranks: int, micro: int, batch: Batch, fn) -> torch.Tensor:
    """``fn`` over ``batch`` in this layout's micro-batches (spread over its ranks), re-padded to the batch width:
    ``(B, T)``, as the RL driver builds old log-probs (``RLTrainer._score_rows``)."""
    pieces = [mb for rank in shards(batch, ranks, micro) for mb in rank]
    width = batch.input_ids.shape[1]
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in group.score(pieces, fn)])
