"""Worker groups on real Ray actors: placement, the process group, and failures named by role and rank."""

from __future__ import annotations

import sys
import time

import pytest
from shared_helpers import live_placement_groups, wait_until, wait_until_dead

from rlhf.distributed.cluster import actor_env
from rlhf.distributed.errors import WorkerTimeout, gather
from rlhf.distributed.group import GroupResources, WorkerError, WorkerGroup
from rlhf.distributed.worker import TrainerWorker

pytestmark = pytest.mark.usefixtures("ray_session")


def _group(role="policy", n=2):
    return WorkerGroup(role, GroupResources(num_workers=n, cpus_per_worker=0.5, env_vars=actor_env(0)), "gloo")


def test_dead_actor_is_reported_with_role_rank_and_call():
    import ray

    group = _group("critic", 2)
    try:
        assert group.ping() == [0, 1]
        ray.kill(group.workers[1])
        wait_until_dead(group.workers[1])
        with pytest.raises(WorkerError, match=r"critic rank 1 died during ping"):
            group.ping()
    finally:
        group.shutdown()


def test_colocated_roles_share_bundles_rank_by_rank():
    """policy + reference on one placement group: rank r of each sits on bundle r with half of it, so two
    2-rank roles hold 2 bundles' worth of CPUs, not 4."""
    from rlhf.distributed.placement import Placement

    shared = Placement("policy+reference", num_bundles=2, cpus=1.0, share=2)
    res = GroupResources(num_workers=2, cpus_per_worker=1.0, env_vars=actor_env(0))
    policy = WorkerGroup("policy", res, "gloo", placement=shared)
    reference = WorkerGroup("reference", res, "gloo", placement=shared)
    try:
        where_policy, where_ref = policy.placements(), reference.placements()
        assert {w["placement_group"] for w in where_policy + where_ref} == {shared.group.id.hex()}
        assert all(w["resources"]["CPU"] == pytest.approx(0.5) for w in where_policy + where_ref)
        assert policy.ping() == reference.ping() == [0, 1]  # two process groups, side by side
    finally:
        policy.shutdown()
        reference.shutdown()
        shared.remove()
    own = _group("critic", 2)
    try:
        groups = {w["placement_group"] for w in own.placements()}
        assert len(groups) == 1 and shared.group.id.hex() not in groups
    finally:
        own.shutdown()


def test_sharing_a_placement_needs_one_bundle_per_rank():
    from rlhf.distributed.placement import Placement

    shared = Placement("policy+reference", num_bundles=1, cpus=1.0, share=2)
    try:
        with pytest.raises(ValueError, match=r"reference: 2 workers cannot share policy\+reference's 1 bundles"):
            WorkerGroup("reference", GroupResources(num_workers=2, env_vars=actor_env(0)), "gloo", placement=shared)
    finally:
        shared.remove()


def test_worker_exception_is_reported_with_role_rank_and_cause():
    group = _group("policy", 1)
    try:
        with pytest.raises(WorkerError, match=r"policy rank 0 failed in train_step: RuntimeError: .*frozen"):
            group.train_step([[]], objective=None, normalizer=1)
    finally:
        group.shutdown()


class _RankOneNeverArrives(TrainerWorker):
    """Rank 1 is stuck before it reaches the rendezvous (a slow import, a hung filesystem): it never arrives."""

    def init_process_group(self, master_addr, master_port, backend, timeout_s):
        if self.rank == 1:
            time.sleep(3600)
        super().init_process_group(master_addr, master_port, backend, timeout_s)


class _NeverArrivingGroup(WorkerGroup):
    worker_class = _RankOneNeverArrives


def test_a_rank_that_never_arrives_is_named_and_nothing_stays_blocked():
    """The gloo twin of a GPU group whose peer never comes: rank 0 gives up after strategy.init_timeout_s naming
    rank 1 (not torch's 30 minutes), the group stops its actors (rank 1's stuck call too) and its placement."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stand-in class travels by value
    before = live_placement_groups()
    with pytest.raises(
        WorkerError,
        match=r"^policy rank 0 failed in init_process_group: RendezvousTimeout: the "
        r"policy's process group: policy rank 1 did not arrive within 3 s",
    ):
        _NeverArrivingGroup(
            "policy",
            GroupResources(num_workers=2, cpus_per_worker=0.5, env_vars=actor_env(0)),
            "gloo",
            init_timeout_s=3.0,
        )
    assert live_placement_groups() == before  # the group's own placement group is gone
    wait_until(lambda: {a["State"] for a in _actors("_RankOneNeverArrives")} == {"DEAD"})  # rank 1's call too


def _actors(class_name: str) -> list:
    from ray._private import state

    return [a for a in state.actors().values() if a["ActorClassName"] == class_name]


def test_an_actor_that_does_not_answer_is_named_when_the_call_has_a_bound():
    """The driver's own bound (past the members' bounds): a call still running is named, not waited for."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    stuck = ray.remote(num_cpus=0)(_sleep).remote(3600)
    try:
        with pytest.raises(WorkerTimeout, match=r"^rollout engine 3 did not answer connect_weight_sync within 1 s$"):
            gather([stuck], ["rollout engine 3"], "connect_weight_sync", timeout_s=1.0)
    finally:
        ray.cancel(stuck, force=True)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_impossible_placement_fails_naming_the_role():
    with pytest.raises(WorkerError, match=r"reward: 2 workers x 64 CPU exceed the cluster's total"):
        WorkerGroup("reward", GroupResources(num_workers=2, cpus_per_worker=64.0), "gloo")


def test_placement_that_does_not_fit_now_times_out_naming_the_role(monkeypatch):
    import rlhf.distributed.placement as placement_mod

    monkeypatch.setattr(placement_mod, "PLACEMENT_TIMEOUT_S", 3.0)
    hog = _group("hog", 1)  # holds CPUs so that a feasible request cannot be placed right now
    try:
        import ray

        cpus = ray.cluster_resources()["CPU"]
        with pytest.raises(WorkerError, match=r"reward: could not place 1 workers"):
            WorkerGroup("reward", GroupResources(num_workers=1, cpus_per_worker=cpus), "gloo")
    finally:
        hog.shutdown()


def test_partial_accumulation_window_is_refused(tiny_model):
    """A train_step is exactly one accumulation window: fewer micro-batches than grad_accum_steps is an error,
    never a silent step on a partial window."""
    from transformers import AutoTokenizer

    from rlhf.data.tokenize import collate_sft, tokenize_sft
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.models.loading import ModelSpec
    from rlhf.objectives.sft import SFTObjective

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    examples = tokenize_sft(
        [{"prompt": "1+2=", "response": "3"}] * 2,
        tokenizer,
        max_length=32,
        prompt_key="prompt",
        response_key="response",
    ).examples
    micro = collate_sft(examples, tokenizer.pad_token_id)
    group = _group("policy", 1)
    try:
        group.build(
            ModelSpec(path=tiny_model),
            EngineSpec(zero_stage=0, precision="fp32", micro_batch_size=2, grad_accum_steps=2),
            OptimSpec(lr=1e-3, total_steps=1),
        )
        with pytest.raises(
            WorkerError,
            match=r"policy rank 0 failed in train_step: .*got 1 micro-batches, "
            r"expected grad_accum_steps=2",
        ):
            group.train_step([[micro]], SFTObjective(), normalizer=SFTObjective().count(micro))
        (result,) = group.train_step([[micro, micro]], SFTObjective(), normalizer=2 * SFTObjective().count(micro))
        assert result.grad_norm is not None and result.grad_norm > 0
    finally:
        group.shutdown()
