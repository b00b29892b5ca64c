"""A run's actors, started from its resource plan: the plan ``--dry-run`` prints is the object the runners start.

:func:`start_plan` walks a :class:`~rlhf.distributed.resource_plan.ResourcePlan`'s actors in order. A role on a
placement group that several roles share gets that group (made when its first role starts); a role alone on its
group, or with resources of its own, gets none (its actors make their own, of the plan's size). Each role is then
started by the runner's *starter* for it, which reads the count and resources from the plan's
:class:`~rlhf.distributed.resource_plan.ActorPlan`, never from the config. So the actors a run starts cannot drift
from the plan, and a role the plan holds but no starter knows is an error before anything starts.

Starters for the model roles (:func:`trained_group`, :func:`frozen_group`) build a
:class:`~rlhf.distributed.group.WorkerGroup`; the runners add their own for the vLLM engines and the environment
pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional

from rlhf.distributed.resource_plan import ActorPlan, ResourcePlan

if TYPE_CHECKING:
    from rlhf.distributed.engine import OptimSpec
    from rlhf.distributed.group import WorkerGroup
    from rlhf.distributed.placement import Placement
    from rlhf.trainers.context import RunContext

# (the role's actors in the plan, the shared placement group they sit on or None) -> the started role
RoleStarter = Callable[[ActorPlan, Optional["Placement"]], Any]


def start_plan(plan: ResourcePlan, ctx: "RunContext", starters: Mapping[str, RoleStarter]) -> Dict[str, Any]:
    """Start every role of ``plan`` in the plan's order; ``{role: what its starter returned}``.

    Shared placement groups are made through ``ctx`` (removed when the run's context closes).

    Raises:
        ValueError: The plan holds a role ``starters`` has no entry for (checked before anything starts).
    """
    unknown = [a.role for a in plan.actors if a.role not in starters]
    if unknown:
        raise ValueError(f"no starter for the plan's role(s) {unknown}; starters: {sorted(starters)}")
    shared: Dict[str, "Placement"] = {}
    started: Dict[str, Any] = {}
    for actors in plan.actors:
        placement = None
        if actors.group is not None and plan.group(actors.group).share > 1:
            if actors.group not in shared:
                shared[actors.group] = ctx.place(plan.group(actors.group))
            placement = shared[actors.group]
        started[actors.role] = starters[actors.role](actors, placement)
    return started


def trained_group(ctx: "RunContext", model_path: str, kind: str, optim: "OptimSpec") -> RoleStarter:
    """A starter for a trained model's role: ``kind`` (``rlhf.models.loading``) from ``model_path``, its optimizer
    ``optim``, micro-batches and accumulation from ``train.*`` over the plan's ranks."""

    def start(actors: ActorPlan, placement: Optional["Placement"]) -> "WorkerGroup":
        group = ctx.group_of(actors, placement)
        group.build(ctx.model_spec(model_path, kind), ctx.engine_spec(actors.count), optim)
        return group

    return start


def frozen_group(ctx: "RunContext", model_path: str, kind: str) -> RoleStarter:
    """A starter for a frozen model's role (a reference, a reward model): it scores, it never steps."""

    def start(actors: ActorPlan, placement: Optional["Placement"]) -> "WorkerGroup":
        group = ctx.group_of(actors, placement)
        group.build(ctx.model_spec(model_path, kind), ctx.engine_spec(actors.count, trainable=False), None)
        return group

    return start
