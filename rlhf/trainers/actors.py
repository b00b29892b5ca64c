"""A run's actors, started from its resource plan: the plan ``--dry-run`` prints is the object the runners start.

:func:`start_plan` starts a :class:`~rlhf.distributed.resource_plan.ResourcePlan`. First it reserves every placement
group of the plan, one after another in the plan's order, as ``--dry-run``'s PACK simulation places them; then it
starts the roles, each by the runner's *starter* for it, which reads the count and resources from the plan's
:class:`~rlhf.distributed.resource_plan.ActorPlan`, never from the config, and gets its placement group. So the
actors a run starts cannot drift from the plan, and a role the plan holds but no starter knows is an error before
anything starts.

The roles start at the same time, each placement group's from a thread of the driver (Ray's driver calls are
thread-safe): a run's start-up is its slowest role's (a vLLM engine's, a 7B model's load), not the sum of all of
them, as OpenRLHF and verl start theirs. Roles that share a placement group share its devices, so they start one
after another in the plan's order: a vLLM engine sizes its KV cache from the memory free when it starts, which a
model loading beside it on the same GPU would change under it. The roles with resources of their own (engines
without the hybrid engine, environment and reward actors, judge engines) start one after another too, in one
thread of their own, so that Ray places their actors in the plan's order, as the simulation does.

Starters for the model roles (:func:`trained_group`, :func:`frozen_group`) build a
:class:`~rlhf.distributed.group.WorkerGroup`; the runners add their own for the vLLM engines and the environment
pool.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, cast

from rlhf.distributed.resource_plan import ActorPlan, ResourcePlan
from rlhf.utils.log import get_logger
from rlhf.utils.metrics import plural

if TYPE_CHECKING:
    from rlhf.distributed.engine import OptimSpec
    from rlhf.distributed.group import WorkerGroup
    from rlhf.distributed.placement import Placement
    from rlhf.trainers.context import RunContext

log = get_logger(__name__)
T = TypeVar("T")

# (the role's actors in the plan, their placement group or None for actors with resources of their own) -> the
# started role
RoleStarter = Callable[[ActorPlan, Optional["Placement"]], Any]
# one role's start, ready to call: -> (role, what its starter returned, seconds it took)
RoleStart = Callable[[], Tuple[str, Any, float]]


def start_plan(
    plan: ResourcePlan, ctx: "RunContext", starters: Mapping[str, RoleStarter], name: str = "run"
) -> Dict[str, Any]:
    """Start every role of ``plan``; ``{role: what its starter returned}``, in the plan's order.

    Every placement group of the plan is reserved first through ``ctx``, in the plan's order (removed when the run's
    context closes); then the roles start as the module docstring says (:func:`start_chains`). Logs, under the run's
    ``name``, the start-up's seconds and each role's.

    Raises:
        ValueError: The plan holds a role ``starters`` has no entry for (checked before anything starts).
        Exception: A role's failure to start, once every other role's start has ended (so that whatever did start
            is registered with ``ctx`` and stopped with it); of several, the failure of the chain whose first role
            comes first in the plan.
    """
    unknown = [a.role for a in plan.actors if a.role not in starters]
    if unknown:
        raise ValueError(f"no starter for the plan's role(s) {unknown}; starters: {sorted(starters)}")
    began = time.perf_counter()
    placements = {group.name: ctx.place(group) for group in plan.groups}
    chains: Dict[Optional[str], List[RoleStart]] = {}  # by placement group (None: resources of their own)
    for actors in plan.actors:
        placement = placements[actors.group] if actors.group is not None else None
        chains.setdefault(actors.group, []).append(
            functools.partial(_start_role, starters[actors.role], actors, placement)
        )
    started = {
        role: (value, seconds) for results in start_chains(list(chains.values())) for role, value, seconds in results
    }
    each = ", ".join(f"{a.role} {started[a.role][1]:.1f} s" for a in plan.actors)
    log.info(f"[{name}] roles started in {time.perf_counter() - began:.1f} s ({each})")
    return {a.role: started[a.role][0] for a in plan.actors}


def _start_role(starter: RoleStarter, actors: ActorPlan, placement: Optional["Placement"]) -> Tuple[str, Any, float]:
    """``(role, what its starter returned, seconds it took)``."""
    began = time.perf_counter()
    value = starter(actors, placement)
    return actors.role, value, time.perf_counter() - began


def start_chains(chains: Sequence[Sequence[Callable[[], T]]]) -> List[List[T]]:
    """Run each chain's calls in order, the chains at the same time (one driver thread a chain; the caller's own
    thread when there is only one); each chain's results, in order.

    Every chain runs to its end or its first failure before anything is raised: a chain's calls start actors, which
    must be registered for shutdown before the caller unwinds. Then the first chain's failure, in ``chains``'
    order, is raised (the others are logged).
    """

    def run(chain: Sequence[Callable[[], T]]) -> List[T]:
        return [call() for call in chain]

    if len(chains) <= 1:
        return [run(chain) for chain in chains]
    with ThreadPoolExecutor(max_workers=len(chains), thread_name_prefix="rlhf-start") as pool:
        futures = [pool.submit(run, chain) for chain in chains]
    failures = [error for error in (f.exception() for f in futures) if error is not None]
    for later in failures[1:]:
        log.warning(f"warning: another role failed to start too: {later}")
    if failures:
        raise cast(BaseException, failures[0])
    return [f.result() for f in futures]


def trained_group(ctx: "RunContext", model_path: str, kind: str, optim: "OptimSpec") -> RoleStarter:
    """A starter for a trained model's role: ``kind`` (``rlhf.models.loading``) from ``model_path``, its optimizer
    ``optim``, micro-batches and accumulation from ``train.*`` over the plan's ranks."""

    def start(actors: ActorPlan, placement: Optional["Placement"]) -> "WorkerGroup":
        group = ctx.group_of(actors, placement)
        group.build(ctx.model_spec(model_path, kind), ctx.engine_spec(actors.count), optim)
        return group

    return start


def holding(ctx: "RunContext", trained: RoleStarter, models: Sequence[Tuple[str, str, str]], name: str) -> RoleStarter:
    """``trained``'s role, whose ranks then also load frozen ``models`` (``(role, path, kind)`` each: a reference, a
    teacher) into their own processes beside the model they train (online RL's ``colocate.reference_in_policy`` and
    ``teacher_in_policy``, DPO's ``dpo.ref_num_workers=0``), each shaped as a frozen group of as many ranks would
    be; logged under the run's ``name``."""

    def start(actors: ActorPlan, placement: Optional["Placement"]) -> "WorkerGroup":
        group = trained(actors, placement)
        for role, path, kind in models:
            group.hold(role, ctx.model_spec(path, kind), ctx.engine_spec(actors.count, trainable=False))
            log.info(
                f"[{name}] {role} {path}: a frozen copy held in the {actors.role}'s own processes "
                f"({plural(actors.count, 'rank')}), no {role} workers"
            )
        return group

    return start


def frozen_group(ctx: "RunContext", model_path: str, kind: str) -> RoleStarter:
    """A starter for a frozen model's role (a reference, a reward model): it scores, it never steps."""

    def start(actors: ActorPlan, placement: Optional["Placement"]) -> "WorkerGroup":
        group = ctx.group_of(actors, placement)
        group.build(ctx.model_spec(model_path, kind), ctx.engine_spec(actors.count, trainable=False), None)
        return group

    return start
