"""Where a :class:`~rlhf.distributed.resource_plan.ResourcePlan` lands on a cluster, simulated without Ray.

Cluster shapes are written ``NxGgpu[:Ccpu]`` or ``NxCcpu`` (``N`` nodes of ``G`` GPUs and ``C`` CPUs), several joined
with ``+``: ``2x8gpu``, ``2x8gpu:96cpu``, ``1x4cpu``, ``1x16cpu+2x8gpu`` (a CPU head and two GPU nodes). A GPU node
written without ``:Ccpu`` has :data:`DEFAULT_CPUS_PER_GPU` CPUs per GPU.

The requests are placed one after another, as the runner makes them, each taking resources from the nodes:

* A placement group follows Ray's PACK policy (``BundlePackSchedulingPolicy`` in Ray's raylet): bundles sorted
  GPU-first (ours are identical, so the order stays); the first unplaced bundle goes to the node Ray's
  ``LeastResourceScorer`` rates best (the largest free fraction of the requested resources, summed), then every
  other unplaced bundle that still fits joins it on that node; a node is used once per group. A group that does
  not fit whole is not placed at all (Ray leaves it pending).
* An actor with resources of its own goes to the first node with room. Ray's default scheduler may pick another
  node with room (it prefers the driver's node while that is less than half used); whether it fits is the same.
* GPUs are tracked per device: a whole-GPU request takes free devices, a fraction takes the device with the least
  room that fits it (Ray's best fit for fractional instances), which is how two ranks of a
  ``strategy.gpus_per_worker=0.5`` group end up on one device.

Ties go to the lower node index; Ray breaks them by hash order, so on identical nodes the node numbers may differ
from a real run's, never the counts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, cast

from rlhf.distributed.resource_plan import ActorPlan, GroupPlan, ResourcePlan

DEFAULT_CPUS_PER_GPU = 8  # typical 8-GPU servers have 64-256 logical CPUs; say :Ccpu for the real number
CLUSTER_SYNTAX = "NxGgpu[:Ccpu] or NxCcpu, several joined with '+' (e.g. 2x8gpu, 2x8gpu:96cpu, 1x4cpu)"
_EPS = 1e-9
_TERM = re.compile(r"^(\d+)x(?:(\d+)gpu(?::(\d+(?:\.\d+)?)cpu)?|(\d+(?:\.\d+)?)cpu)$")


class InfeasiblePlan(ValueError):
    """A request the cluster cannot hold; the message names the placement group or role."""


@dataclass(frozen=True)
class NodeShape:
    """One node's schedulable resources."""

    cpus: float
    gpus: int
    name: str = ""

    def describe(self) -> str:
        gpus = f"{self.gpus} GPU, " if self.gpus else ""
        return f"{gpus}{self.cpus:g} CPU" + (f" ({self.name})" if self.name else "")


def parse_cluster(spec: str) -> Tuple[NodeShape, ...]:
    """Nodes of a cluster shape (see the module docstring).

    Raises:
        ValueError: A term that does not match the syntax, or a cluster without nodes; the message shows the syntax.
    """
    nodes: List[NodeShape] = []
    for term in spec.replace(" ", "").lower().split("+"):
        m = _TERM.match(term)
        if m is None:
            raise ValueError(f"--cluster {spec!r}: cannot read {term!r}; expected {CLUSTER_SYNTAX}")
        count, gpus, gpu_node_cpus, cpu_node_cpus = m.groups()
        gpus_n = int(gpus or 0)
        cpus = float(gpu_node_cpus or cpu_node_cpus or DEFAULT_CPUS_PER_GPU * gpus_n)
        if gpus is not None and gpus_n == 0 or cpus <= 0:
            raise ValueError(f"--cluster {spec!r}: {term!r} has no GPU or no CPU; expected {CLUSTER_SYNTAX}")
        nodes += [NodeShape(cpus=cpus, gpus=gpus_n)] * int(count)
    if not nodes:
        raise ValueError(f"--cluster {spec!r}: no nodes; expected {CLUSTER_SYNTAX}")
    return tuple(nodes)


def nodes_from_ray(rows: Sequence[dict]) -> Tuple[NodeShape, ...]:
    """The alive nodes of ``ray.nodes()`` rows (``Alive``, ``Resources``, ``NodeManagerAddress``), in its order."""
    return tuple(
        NodeShape(
            cpus=float(row.get("Resources", {}).get("CPU", 0.0)),
            gpus=int(row.get("Resources", {}).get("GPU", 0.0)),
            name=str(row.get("NodeManagerAddress", "")),
        )
        for row in rows
        if row.get("Alive", False)
    )


def nodes_from_available(per_node: Mapping[str, Mapping[str, float]]) -> Tuple[NodeShape, ...]:
    """What each live node has free (``ray._private.state.available_resources_per_node()``: node id -> resources).

    Resources held by placement groups are already subtracted. Free GPUs are rounded down to whole devices: an
    actor with resources of its own asks for whole GPUs, and Ray reports only the node's summed free fraction
    (two half-free devices count as one here, which can overstate the room, never understate it).
    """
    return tuple(
        NodeShape(
            cpus=float(free.get("CPU", 0.0)), gpus=int(math.floor(free.get("GPU", 0.0) + _EPS)), name=str(node_id)[:8]
        )
        for node_id, free in sorted(per_node.items())
    )


def check_actors_fit(
    actors: ActorPlan, free: Sequence[NodeShape], hint: str = "", cluster: str = "the running cluster"
) -> None:
    """Fail at once when ``actors`` (resources of their own) cannot all be placed on the nodes' free resources.

    The same first-node-with-room simulation as :func:`pack` (and ``--dry-run``), on what a live cluster has left:
    Ray would otherwise keep the actors pending, and a caller waiting on them would wait for ever.

    Args:
        actors: The actors about to be created.
        free: Each node's free resources (:func:`nodes_from_available`).
        hint: Appended to the message: the config keys that size the request.
        cluster: How to name the cluster in the message.

    Raises:
        InfeasiblePlan: Naming the role, the first actor that does not fit, its request and what each node had.
    """
    packing = pack(ResourcePlan(requests=(actors,), actors=(actors,)), free, cluster)
    if packing.failure:
        raise InfeasiblePlan(packing.failure + (f"; {hint}" if hint else ""))


def describe_cluster(nodes: Sequence[NodeShape]) -> str:
    """``2 nodes, 16 GPU, 128 CPU``."""
    gpus = sum(n.gpus for n in nodes)
    return (
        f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}, "
        + (f"{gpus} GPU, " if gpus else "")
        + f"{sum(n.cpus for n in nodes):g} CPU"
    )


@dataclass(frozen=True)
class Slot:
    """Where one bundle (or one actor with resources of its own) landed: node index and GPU device indices."""

    node: int
    gpu_ids: Tuple[int, ...] = ()


@dataclass(frozen=True)
class Packing:
    """The simulated placement of a plan, request by request.

    ``slots[i]`` holds the slots of ``plan.requests[i]`` (one per bundle or actor), or ``None`` for a request that
    did not fit (``failure`` says why, naming it); requests after a failure are not tried, as the real run stops
    there. ``free`` is what each node has left as ``(cpus, per-device free GPU fraction)``.
    """

    plan: ResourcePlan
    nodes: Tuple[NodeShape, ...]
    slots: Tuple[Optional[Tuple[Slot, ...]], ...]
    free: Tuple[Tuple[float, Tuple[float, ...]], ...]
    failure: str = ""

    @property
    def feasible(self) -> bool:
        return not self.failure

    def shared_devices(self) -> List[str]:
        """Devices holding bundles of two ranks of one group, e.g. from ``strategy.gpus_per_worker=0.5``."""
        found = []
        for request, slots in zip(self.plan.requests, self.slots):
            if not isinstance(request, GroupPlan) or not slots:
                continue
            owners: Dict[Tuple[int, int], List[int]] = {}
            for rank, slot in enumerate(slots):
                for gpu in slot.gpu_ids:
                    owners.setdefault((slot.node, gpu), []).append(rank)
            found += [
                f"{request.name} ranks {', '.join(map(str, ranks))} share GPU {gpu} of node {node}"
                for (node, gpu), ranks in sorted(owners.items())
                if len(ranks) > 1
            ]
        return found


class _Nodes:
    """Free resources while the simulation runs (internal; :func:`pack` is pure to its callers)."""

    def __init__(self, nodes: Sequence[NodeShape]) -> None:
        self.cpus = [n.cpus for n in nodes]
        self.gpus = [[1.0] * n.gpus for n in nodes]

    def copy(self) -> "_Nodes":
        twin = _Nodes([])
        twin.cpus, twin.gpus = list(self.cpus), [list(g) for g in self.gpus]
        return twin

    def gpu_fit(self, node: int, gpus: float) -> Optional[Tuple[int, ...]]:
        """The devices a request of ``gpus`` would take on ``node``, or None."""
        free = self.gpus[node]
        if gpus <= _EPS:
            return ()
        if gpus >= 1 - _EPS:
            whole = [i for i, f in enumerate(free) if f >= 1 - _EPS]
            return tuple(whole[: round(gpus)]) if len(whole) >= round(gpus) else None
        fits = [(f, i) for i, f in enumerate(free) if f >= gpus - _EPS]
        return (min(fits)[1],) if fits else None

    def score(self, node: int, request: Dict[str, float]) -> float:
        """Ray's LeastResourceScorer: -1 when it does not fit, else the summed free fraction left after it."""
        devices = self.gpu_fit(node, request.get("GPU", 0.0))
        if devices is None or self.cpus[node] < request["CPU"] - _EPS:
            return -1.0
        score = 0.0
        for have, want in ((self.cpus[node], request["CPU"]), (sum(self.gpus[node]), request.get("GPU", 0.0))):
            if want > 0 and have > 0:
                score += (have - want) / have
        return score

    def take(self, node: int, request: Dict[str, float]) -> Slot:
        devices = self.gpu_fit(node, request.get("GPU", 0.0))
        assert devices is not None, "take() after a failed fit"
        self.cpus[node] -= request["CPU"]
        for i in devices:
            self.gpus[node][i] -= min(1.0, request["GPU"])
        return Slot(node, devices)


def _check_whole(name: str, gpus: float) -> None:
    if gpus > 1 and not math.isclose(gpus, round(gpus)):
        raise InfeasiblePlan(f"{name}: {gpus:g} GPUs per bundle; Ray takes fractions of one GPU or whole GPUs")


def _pack_group(group: GroupPlan, nodes: _Nodes) -> Optional[List[Slot]]:
    """PACK one group on a copy of ``nodes``; the slots per bundle, or None (``nodes`` unchanged then)."""
    trial, bundle = nodes.copy(), group.bundle
    candidates = list(range(len(trial.cpus)))
    slots: List[Optional[Slot]] = [None] * group.num_bundles
    pending = list(range(group.num_bundles))
    while pending:
        scored = [(trial.score(n, bundle), -n) for n in candidates]
        best_score, best = max(scored, default=(-1.0, 0))
        if best_score < 0:
            return None
        node = -best
        for index in list(pending):  # the first always fits; then every other bundle that still does
            if trial.score(node, bundle) >= 0:
                slots[index] = trial.take(node, bundle)
                pending.remove(index)
        candidates.remove(node)
    nodes.cpus, nodes.gpus = trial.cpus, trial.gpus
    return cast(List[Slot], slots)  # cast: the loop ends once no bundle is pending, so every slot is set


def _place_own(actors: ActorPlan, nodes: _Nodes) -> Tuple[List[Slot], Optional[int]]:
    """First node with room, actor by actor; the slots placed and the index of the first that did not fit."""
    slots: List[Slot] = []
    for i in range(actors.count):
        node = next((n for n in range(len(nodes.cpus)) if nodes.score(n, actors.request) >= 0), None)
        if node is None:
            return slots, i
        slots.append(nodes.take(node, actors.request))
    return slots, None


def _resources(request: Dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:.3g}" for k, v in request.items()) + "}"


def _free_text(nodes: _Nodes) -> str:
    return "; ".join(
        f"node {n}: " + (f"{sum(g):g} GPU, " if g else "") + f"{c:g} CPU"
        for n, (c, g) in enumerate(zip(nodes.cpus, nodes.gpus))
    )


def pack(plan: ResourcePlan, nodes: Sequence[NodeShape], cluster: str = "the cluster") -> Packing:
    """Simulate placing ``plan.requests`` in order on ``nodes`` (see the module docstring).

    Args:
        plan: What the run asks for.
        nodes: The cluster's nodes.
        cluster: How to name the cluster in a failure (e.g. ``1x8gpu``).

    Returns:
        The placement; ``failure`` names the first request that does not fit (a one-line reason) and what was
        free when it was tried.
    """
    state = _Nodes(nodes)
    placed: List[Optional[Tuple[Slot, ...]]] = []
    failure = ""
    for request in plan.requests:
        if failure:
            placed.append(None)
            continue
        if isinstance(request, GroupPlan):
            _check_whole(f"placement group {request.name}", request.gpus)
            slots = _pack_group(request, state)
            if slots is None:
                need = {k: v * request.num_bundles for k, v in request.bundle.items()}
                failure = (
                    f"cannot place placement group {request.name} (role{'s' if request.share > 1 else ''} "
                    f"{', '.join(request.roles)}): "
                    f"{request.num_bundles} bundles x {_resources(request.bundle)} (in all "
                    f"{_resources(need)}) do not fit on {cluster}; free before it: {_free_text(state)}"
                )
            placed.append(None if slots is None else tuple(slots))
        else:
            _check_whole(request.role, request.gpus)
            slots, missing = _place_own(request, state)
            if missing is not None:
                failure = (
                    f"cannot place {request.role} actor {missing} of {request.count} "
                    f"({_resources(request.request)} each, no placement group) on {cluster}; free then: "
                    f"{_free_text(state)}"
                )
            placed.append(tuple(slots) if missing is None else None)
    free = tuple((c, tuple(g)) for c, g in zip(state.cpus, state.gpus))
    return Packing(plan=plan, nodes=tuple(nodes), slots=tuple(placed), free=free, failure=failure)


def check_feasible(packing: Packing) -> None:
    """Raise :class:`InfeasiblePlan` with the packing's one-line failure, if any."""
    if packing.failure:
        raise InfeasiblePlan(packing.failure)
