"""Worker groups on real Ray actors: placement, the process group, and failures named by role and rank."""
from __future__ import annotations

import pytest

from rlhf.distributed.cluster import actor_env
from rlhf.distributed.group import GroupResources, WorkerError, WorkerGroup

pytestmark = pytest.mark.usefixtures("ray_session")


def _group(role="policy", n=2):
    return WorkerGroup(role, GroupResources(num_workers=n, cpus_per_worker=0.5, env_vars=actor_env(0)), "gloo")


def test_dead_actor_is_reported_with_role_rank_and_call():
    import ray

    group = _group("critic", 2)
    try:
        assert group.ping() == [0, 1]
        ray.kill(group.workers[1])
        with pytest.raises(WorkerError, match=r"critic rank 1 died during ping"):
            group.ping()
    finally:
        group.shutdown()


def test_worker_exception_is_reported_with_role_rank_and_cause():
    group = _group("policy", 1)
    try:
        with pytest.raises(WorkerError, match=r"policy rank 0 failed in train_step: RuntimeError: .*frozen"):
            group.train_step([[]], objective=None, normalizer=1)
    finally:
        group.shutdown()


def test_impossible_placement_fails_naming_the_role(monkeypatch):
    import rlhf.distributed.group as group_mod

    monkeypatch.setattr(group_mod, "PLACEMENT_TIMEOUT_S", 3.0)
    with pytest.raises(WorkerError, match=r"reward: could not place 2 workers"):
        WorkerGroup("reward", GroupResources(num_workers=2, cpus_per_worker=64.0), "gloo")
