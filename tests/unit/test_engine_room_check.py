"""Rollout engines with resources of their own are checked against the live cluster's free resources before they are
created: an engine group that cannot be placed fails at once with the ``--dry-run`` message and the ``rollout.*``
keys, instead of Ray keeping the engines pending while the start-up waits on them (no Ray started here)."""

from __future__ import annotations

import pytest

from rlhf.distributed.packing import (
    InfeasiblePlan,
    NodeShape,
    check_actors_fit,
    nodes_from_available,
    pack,
    parse_cluster,
)
from rlhf.distributed.resource_plan import ActorPlan, GroupPlan, ResourcePlan


def _free_after(groups, cluster: str):
    """Each node's free resources once ``groups`` are placed, as the live cluster reports them (whole GPUs)."""
    packing = pack(ResourcePlan(requests=tuple(groups), actors=()), parse_cluster(cluster))
    assert packing.feasible, packing.failure
    return nodes_from_available(
        {f"node{i}": {"CPU": cpus, "GPU": sum(gpus)} for i, (cpus, gpus) in enumerate(packing.free)}
    )


POLICY_REFERENCE = GroupPlan(roles=("policy", "reference"), num_bundles=8, cpus=6.0, gpus=1.0)  # 2-node engines
ENGINES = ActorPlan("rollout", 4, 8.0, 2.0)


def test_nodes_from_available_reads_free_cpus_and_whole_free_gpus():
    per_node = {
        "b2": {"CPU": 16.0, "GPU": 3.5, "memory": 1e9, "CPU_group_abc": 48.0},
        "a1": {"CPU": 2.0, "node:10.0.0.1": 1.0},
    }
    assert nodes_from_available(per_node) == (NodeShape(2.0, 0, "a1"), NodeShape(16.0, 3, "b2"))


def test_engines_beside_the_policy_on_32_cpu_nodes_fail_naming_the_engine_and_keys():
    """The shipped 2-node engines layout on the old 32-CPU SLURM/KubeRay nodes: the policy + reference group (48
    CPUs) spreads over both nodes, leaving room for one engine of four."""
    free = _free_after([POLICY_REFERENCE], "2x8gpu:32cpu")
    assert sorted((n.cpus, n.gpus) for n in free) == [(2.0, 3), (14.0, 5)]  # 5 + 3 bundles of {CPU: 6, GPU: 1}
    with pytest.raises(InfeasiblePlan) as err:
        check_actors_fit(ENGINES, free, hint="rollout.num_engines=4 engines x rollout.cpus_per_engine=8 CPUs")
    message = str(err.value)
    assert message.startswith(
        "cannot place rollout actor 1 of 4 ({CPU: 8, GPU: 2} each, no placement group) "
        "on the running cluster; free then: "
    )
    assert message.endswith("; rollout.num_engines=4 engines x rollout.cpus_per_engine=8 CPUs")


def test_engines_beside_the_policy_on_64_cpu_nodes_fit():
    check_actors_fit(ENGINES, _free_after([POLICY_REFERENCE], "2x8gpu:64cpu"))  # raises if not


def test_total_resources_are_not_enough_when_no_node_has_room():
    """10 free CPUs in all, but no node has 6 free for the second engine: a cluster-wide total would pass it."""
    free = (NodeShape(6.0, 0), NodeShape(4.0, 0))
    check_actors_fit(ActorPlan("rollout", 1, 6.0, 0.0), free)
    with pytest.raises(InfeasiblePlan, match=r"^cannot place rollout actor 1 of 2 \(\{CPU: 6\} each"):
        check_actors_fit(ActorPlan("rollout", 2, 6.0, 0.0), free)


class _Stop(Exception):
    pass


def test_rollout_engines_check_before_creating_any_engine(monkeypatch):
    """``RolloutEngines`` with resources of their own asks the live cluster (here a stand-in for Ray's per-node
    free resources) before it creates an engine, and creates none when one would not fit."""
    import ray
    import ray._private.state

    from rlhf.rollout.vllm.engine import VLLMSpec
    from rlhf.rollout.vllm.engines import RolloutEngines

    created = []

    class Actor:
        def options(self, **options):
            created.append(options)
            raise _Stop  # past the check: the real class would now create the engine

    monkeypatch.setattr(ray, "remote", lambda cls: Actor())
    monkeypatch.setattr(
        ray._private.state,
        "available_resources_per_node",
        lambda: {"n0": {"CPU": 8.0, "GPU": 2.0}, "n1": {"CPU": 4.0, "GPU": 8.0}},
    )
    monkeypatch.setattr("rlhf.rollout.vllm.engines.ROOM_GRACE_S", 0.0)
    spec = VLLMSpec(model_path="/m", tensor_parallel_size=2)
    with pytest.raises(InfeasiblePlan) as err:
        RolloutEngines(spec, num_engines=2, cpus_per_engine=8, gpus_per_engine=2.0)
    assert created == []
    assert str(err.value).startswith("cannot place rollout actor 1 of 2 ({CPU: 8, GPU: 2} each")
    assert str(err.value).endswith(
        "; rollout.num_engines=2 engines x rollout.cpus_per_engine=8 CPUs + "
        "rollout.tensor_parallel_size=2 GPUs each: lower them, or add nodes"
    )
    with pytest.raises(_Stop):  # one engine fits on n0: creation goes ahead
        RolloutEngines(spec, num_engines=1, cpus_per_engine=8, gpus_per_engine=2.0)
    assert created == [{"num_cpus": 8, "num_gpus": 2.0, "runtime_env": {"env_vars": {}}}]


def test_a_stale_view_of_free_resources_is_read_again(monkeypatch):
    """Ray reports resources of just-killed actors as held for a moment: the check reads again before failing."""
    import ray
    import ray._private.state

    from rlhf.rollout.vllm.engine import VLLMSpec
    from rlhf.rollout.vllm.engines import RolloutEngines

    views = iter([{"n0": {"CPU": 1.0}}, {"n0": {"CPU": 1.0}}, {"n0": {"CPU": 4.0}}])  # released on the third read

    class Actor:
        def options(self, **options):
            raise _Stop

    monkeypatch.setattr(ray, "remote", lambda cls: Actor())
    monkeypatch.setattr(ray._private.state, "available_resources_per_node", lambda: next(views))
    monkeypatch.setattr("rlhf.rollout.vllm.engines.ROOM_GRACE_S", 30.0)
    with pytest.raises(_Stop):
        RolloutEngines(VLLMSpec(model_path="/m"), num_engines=2, cpus_per_engine=2)
    assert next(views, None) is None  # all three views read
