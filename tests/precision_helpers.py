"""Shared by the precision test files (bf16: test_precision.py, fp64: test_fp64.py): worker groups trained in
lockstep under several (ranks x micro-batch) layouts of the same global batch, each step through
``WorkerGroup.train_batch``: the batch cut exactly as the trainers cut it and the normalizer counted once over every
micro-batch of every rank."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from rlhf.batch import Batch


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
    """One optimizer step over ``batch`` through ``WorkerGroup.train_batch`` (the trainers' path): the global loss
    and grad norm. ``ranks`` and ``micro`` are the layout the group was built with (checked)."""
    assert (group.size, group.engine_spec.micro_batch_size) == (ranks, micro)
    result = group.train_batch(batch, objective)
    return {"loss": result.metrics["loss"], "grad_norm": result.grad_norm}


def score_rows(group, ranks: int, micro: int, batch: Batch, fn) -> torch.Tensor:
    """``fn`` over ``batch`` in this layout's micro-batches (spread over its ranks), re-padded to the batch width:
    ``(B, T)``, as the RL driver builds old log-probs (``WorkerGroup.score_batch``)."""
    assert (group.size, group.engine_spec.micro_batch_size) == (ranks, micro)
    return group.score_batch(batch, fn)
