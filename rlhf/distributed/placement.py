"""Placement groups, optionally shared by colocated roles.

Every role gets one bundle per rank. Colocated roles (policy + reference, critic + reward model, policy + vLLM
engines for the hybrid engine) share one placement group: rank ``r`` of each role lands on bundle ``r`` and
takes ``1/share`` of it, so e.g. on a GPU cluster the policy and the reference rank 0 sit on the same device
with ``num_gpus=0.5`` each (Ray's fractional resources), the arrangement OpenRLHF calls ``colocate_actor_ref``.
"""

from __future__ import annotations

import os
from typing import Dict

from rlhf.distributed.errors import WorkerError
from rlhf.distributed.resource_plan import bundle_resources

PLACEMENT_TIMEOUT_S = float(os.environ.get("RLHF_PLACEMENT_TIMEOUT_S", "600"))


def _check_feasible(name: str, bundle: Dict[str, float], count: int) -> None:
    """Fail at once when the whole cluster could never hold the group (waiting would only time out)."""
    import ray

    total = ray.cluster_resources()
    for resource, amount in bundle.items():
        if amount * count > total.get(resource, 0.0) + 1e-9:
            raise WorkerError(
                f"{name}: {count} workers x {amount:g} {resource} exceed the cluster's total "
                f"{total.get(resource, 0.0):g} {resource}"
            )


class Placement:
    """``num_bundles`` bundles of ``cpus`` (+ ``gpus``), shared by ``share`` colocated roles.

    Args:
        name: The role(s) it is for, used in errors (e.g. ``"policy+reference"``).
        num_bundles: Ranks per role.
        cpus, gpus: Resources of one bundle (one rank of every sharing role together).
        share: How many roles put one actor on each bundle; each actor asks for ``1/share`` of it.
    """

    def __init__(self, name: str, num_bundles: int, cpus: float, gpus: float = 0.0, share: int = 1) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if share < 1:
            raise ValueError(f"{name}: share must be >= 1, got {share}")
        self.name, self.num_bundles, self.share = name, num_bundles, share
        self.cpus, self.gpus = cpus, gpus
        bundle = bundle_resources(cpus, gpus)  # the shape --dry-run packs (rlhf.distributed.resource_plan)
        _check_feasible(name, bundle, num_bundles)
        self.group = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.group)  # do not leave a pending request holding the queue
            raise WorkerError(
                f"{name}: could not place {num_bundles} workers x {bundle} within "
                f"{PLACEMENT_TIMEOUT_S:.0f}s; cluster has {ray.cluster_resources()}"
            )

    def actor_options(self, bundle_index: int) -> dict:
        """``.options(...)`` for an actor of one of the sharing roles on bundle ``bundle_index``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= bundle_index < self.num_bundles:
            raise ValueError(f"{self.name}: bundle {bundle_index} of {self.num_bundles}")
        return {
            "num_cpus": self.cpus / self.share,
            "num_gpus": self.gpus / self.share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=bundle_index
            ),
        }

    @property
    def threads_per_actor(self) -> int:
        """Torch threads for one actor: colocated roles take turns, so each may use the whole bundle."""
        return max(1, int(self.cpus))

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)
