"""The rollout engines as one group: start them (own resources, or on the policy's bundles for the hybrid
engine), spread a batch of prompts over them, sleep/wake them, and name the engine when one fails."""

from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence

from rlhf.distributed.errors import gather
from rlhf.distributed.packing import InfeasiblePlan, check_actors_fit, nodes_from_available
from rlhf.distributed.placement import Placement
from rlhf.distributed.rendezvous import DRIVER_GRACE_S
from rlhf.distributed.resource_plan import ROLLOUT, ActorPlan
from rlhf.rollout.backend import RolloutBackend
from rlhf.rollout.types import Generation, SamplingSpec
from rlhf.rollout.vllm.engine import VLLMEngine, VLLMSpec, request_samplings
from rlhf.rollout.weights.group import SyncTimeouts
from rlhf.rollout.weights.senders import make_senders

ROLE = "rollout engine"
ROOM_GRACE_S = 5.0  # how long a failing room check (check_room) is re-read before it counts


def check_room(num_engines: int, cpus_per_engine: float, gpus_per_engine: float, tensor_parallel_size: int) -> None:
    """Engines with resources of their own: fail within seconds, naming the ``rollout.*`` keys, when the live
    cluster's free resources cannot hold all of them.

    Ray keeps an actor it cannot place pending (no error), so the start-up below would wait for ever. This is the
    ``--dry-run`` simulation (:func:`rlhf.distributed.packing.check_actors_fit`) on what each node has left once the
    policy's placement group holds its bundles. Ray's view of free resources lags actors that were just killed (a
    restart, a previous run in the same process), so a failing check is re-read for ``ROOM_GRACE_S`` before it
    counts. A cluster that autoscales would add nodes instead: it is checked as it is now.

    Raises:
        InfeasiblePlan: The first engine that does not fit, its request, and each node's free resources.
    """
    try:
        # Ray's DeveloperAPI, per live node; ray._private: no public API gives a node's free resources
        from ray._private.state import available_resources_per_node  # noqa: PLC2701
    except ImportError:  # a Ray without this API: no check, the start-up waits as it did before the check
        return

    hint = (
        f"rollout.num_engines={num_engines} engines x rollout.cpus_per_engine={cpus_per_engine:g} CPUs"
        + (f" + rollout.tensor_parallel_size={tensor_parallel_size} GPUs" if gpus_per_engine > 0 else "")
        + " each: lower them, or add nodes"
    )
    engines = ActorPlan(ROLLOUT, num_engines, cpus_per_engine, gpus_per_engine)
    deadline = time.monotonic() + ROOM_GRACE_S
    while True:
        try:
            return check_actors_fit(engines, nodes_from_available(available_resources_per_node()), hint)
        except InfeasiblePlan:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


class RolloutEngines:
    """``num_engines`` :class:`~rlhf.rollout.vllm.engine.VLLMEngine` actors: the vLLM
    :class:`~rlhf.rollout.backend.RolloutBackend`.

    Args:
        spec: How each engine starts.
        num_engines: Engine count (data parallel across engines; ``spec.tensor_parallel_size`` within one).
        cpus_per_engine, gpus_per_engine: Resources of an engine with its own placement.
        env_vars: Actor environment.
        placement: Hybrid engine: engine ``e`` goes on bundle ``e`` of the policy's placement group (with
            ``tensor_parallel_size=1``); ``None`` gives the engines resources of their own.
        sleep: Release weights and KV cache between rollouts (vLLM sleep mode; GPU only).
    """

    def __init__(
        self,
        spec: VLLMSpec,
        num_engines: int,
        cpus_per_engine: float = 1.0,
        gpus_per_engine: float = 0.0,
        env_vars: Optional[dict] = None,
        placement: Optional[Placement] = None,
        sleep: bool = False,
    ) -> None:
        import ray

        self.size, self.sleeps = num_engines, sleep
        self.tensor_parallel_size = spec.tensor_parallel_size
        self.gpus_per_engine = gpus_per_engine if placement is None else placement.gpus / placement.share
        self.placement = placement
        actor = ray.remote(VLLMEngine)
        runtime_env = {"env_vars": dict(env_vars or {})}
        if placement is not None:
            options = [placement.actor_options(e) for e in range(num_engines)]
        else:
            check_room(num_engines, cpus_per_engine, gpus_per_engine, spec.tensor_parallel_size)
            options = [{"num_cpus": cpus_per_engine, "num_gpus": gpus_per_engine}] * num_engines
        # Any: Ray's stubs cannot type an actor handle's remote methods (each is an ActorMethod found at run time)
        self.handles: List[Any] = [
            actor.options(**opts, runtime_env=runtime_env).remote(spec, e) for e, opts in enumerate(options)
        ]
        self._gather([h.ready.remote() for h in self.handles], "start-up")

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSpec) -> List[Generation]:
        """One completion per entry of ``prompt_ids`` (repeat a prompt for several samples); results in prompt order.

        Each engine takes a contiguous equal share. With ``sampling.seed`` set, completion ``j`` is drawn with seed
        ``sampling.seed + j`` whichever engine serves it: the rollout does not depend on the number of engines.
        """
        return self.generate_each(prompt_ids, request_samplings(sampling, len(prompt_ids)))

    def generate_each(self, prompt_ids: Sequence[Sequence[int]], samplings: Sequence[SamplingSpec]) -> List[Generation]:
        """Completion ``j`` of ``prompt_ids[j]`` drawn as ``samplings[j]`` says (its own seed and length); each engine
        takes a contiguous equal share, results in prompt order."""
        if len(samplings) != len(prompt_ids):
            raise ValueError(f"{len(samplings)} sampling specs for {len(prompt_ids)} prompts")
        per_engine = max(1, -(-len(prompt_ids) // self.size))
        refs = [
            self.handles[e].generate_each.remote(
                list(prompt_ids[s : s + per_engine]), list(samplings[s : s + per_engine])
            )
            for e, s in enumerate(range(0, len(prompt_ids), per_engine))
        ]
        return [g for chunk in self._gather(refs, "generate") for g in chunk]

    def sleep(self) -> None:
        """Hybrid engine on GPUs: free the devices for training (weights and KV cache discarded,
        :data:`~rlhf.rollout.vllm.engine.SLEEP_LEVEL`). A no-op unless sleep mode is on."""
        if self.sleeps:
            self._gather([h.sleep.remote() for h in self.handles], "sleep")

    def wake_weights(self) -> None:
        """First half of a wake-up: the weights' memory only, whose contents the weight sync that must follow
        overwrites. The trainers on the same devices have emptied their CUDA caches first (RLTrainer.push_weights).
        A no-op unless sleep mode is on."""
        if self.sleeps:
            self._gather([h.wake_weights.remote() for h in self.handles], "wake_weights")

    def wake_kv_cache(self) -> None:
        """Second half, after the weight sync: the KV cache. A no-op unless sleep mode is on."""
        if self.sleeps:
            self._gather([h.wake_kv_cache.remote() for h in self.handles], "wake_kv_cache")

    def connect_weight_sync(
        self,
        policy,
        method: str,
        bucket_bytes: int,
        backend: str,
        timeouts: Optional[SyncTimeouts] = None,
        adapter_only: bool = False,
    ) -> None:
        """Attach a sender per policy rank (``policy``: the trainable ``WorkerGroup``) and connect it to these
        engines by ``method`` (``broadcast`` | ``ipc`` | ``object_store``, already resolved); ``adapter_only``:
        every sync sends the policy's LoRA adapter alone (engines started with a ``max_lora_rank``); for a broadcast,
        the policy's rank 0 and every engine worker form the weight-sync process group here, within
        ``timeouts.connect_s`` (default: ``rollout.weight_sync_connect_timeout_s``'s and ``weight_sync_timeout_s``'s
        defaults).

        Raises :class:`WorkerError` naming the rank or engine when the transport cannot be set up
        (:class:`~rlhf.distributed.errors.WorkerTimeout` when one did not answer at all).
        """
        timeouts = timeouts or SyncTimeouts.of()
        workers = [self.tensor_parallel_size] * self.size
        senders = make_senders(method, self.handles, workers, policy.size, bucket_bytes, backend, timeouts)
        addresses = policy.attach_weight_senders(senders, adapter_only)
        joins = []
        if method == "broadcast":
            wire = addresses[0].to_wire()
            offsets = [1 + sum(workers[:e]) for e in range(self.size)]
            joins = [h.join_weight_group.remote(wire, offset) for h, offset in zip(self.handles, offsets)]
        refs = policy.connect_weight_senders_async() + joins
        names = [f"{policy.role} rank {r}" for r in range(policy.size)] + [f"{ROLE} {e}" for e in range(len(joins))]
        # the members' own bound (connect_s) names a member that never arrived; the driver's, one stuck elsewhere
        gather(refs, names, "connect_weight_sync", timeouts.connect_s + DRIVER_GRACE_S)

    def ping(self) -> List[bool]:
        return self._gather([h.ready.remote() for h in self.handles], "ping")

    def versions(self) -> List[Optional[int]]:
        """The weight version each engine holds (0: the model it started from)."""
        return self._gather([h.version.remote() for h in self.handles], "version")

    def placements(self) -> List[dict]:
        return self._gather([h.placement.remote() for h in self.handles], "placement")

    def shutdown(self) -> None:
        import ray

        for handle in self.handles:
            ray.kill(handle)
        self.handles = []

    def _gather(self, refs, call: str):
        return gather(refs, [f"{ROLE} {e}" for e in range(len(refs))], call)


def as_backend(engines: RolloutEngines) -> RolloutBackend:
    """The engines as the RL loop sees them; mypy (``make test``) checks here that they implement the protocol."""
    return engines
