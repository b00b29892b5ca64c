"""What a run asks Ray for, as data: placement groups, their bundles, and every role's actors, in creation order.

The runners size their clusters from these plans and start their actors from them
(:func:`rlhf.trainers.actors.start_plan`), and ``--dry-run`` prints the same plans and packs them onto a cluster's
nodes (:mod:`rlhf.distributed.packing`), so a dry run cannot drift from what a real run starts.

Pure: no Ray, no torch; the config objects are only read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from rlhf.config.rl_schema import ColocateConfig, RLRunConfig
from rlhf.config.schema import ConfigError, RunConfig, StrategyConfig

ROLLOUT = "rollout"  # the vLLM engines' role name in plans and shared placement groups
ENVIRONMENT = "environment"  # the multi-turn environment pool's actors (rlhf.envs.EnvironmentPool)
REWARD_POOL = "reward_pool"  # the reward-function actors (rlhf.rewards.pool.RewardPool, reward.num_workers)
JUDGE = "judge"  # the LLM judge's vLLM engines (reward.judge.*)
TEACHER = "teacher"  # an on-policy distillation teacher's frozen group (algo.teacher.path)


@dataclass(frozen=True)
class Devices:
    """The device settings of a run once the cluster is known (``strategy.*=auto`` resolved)."""

    gpus_per_worker: float  # GPUs of one trainer rank's bundle (0: CPU workers)
    precision: str  # fp32 | bf16 | fp64
    backend: str  # gloo | nccl


def resolve_devices(strategy: StrategyConfig, cluster_gpus: float) -> Devices:
    """``strategy.gpus_per_worker`` / ``precision`` / ``backend`` with ``auto`` (-1) resolved for a cluster.

    The driver may have no GPU, so ``auto`` follows the cluster: one GPU per rank and bf16 + NCCL when the cluster
    has any GPU, else CPU workers with fp32 + gloo.

    Args:
        strategy: The run's :class:`~rlhf.config.schema.StrategyConfig`.
        cluster_gpus: GPUs in the whole cluster.

    Raises:
        ConfigError: ``strategy.backend=nccl`` without GPU workers.
    """
    gpus = strategy.gpus_per_worker if strategy.gpus_per_worker >= 0 else (1.0 if cluster_gpus > 0 else 0.0)
    precision = strategy.precision if strategy.precision != "auto" else ("bf16" if gpus > 0 else "fp32")
    backend = strategy.backend if strategy.backend != "auto" else ("nccl" if gpus > 0 else "gloo")
    if backend == "nccl" and gpus <= 0:
        raise ConfigError("strategy.backend=nccl needs GPU workers (strategy.gpus_per_worker > 0)")
    return Devices(gpus_per_worker=gpus, precision=precision, backend=backend)


def bundle_resources(cpus: float, gpus: float) -> Dict[str, float]:
    """One bundle as Ray takes it: ``{"CPU": cpus}`` plus ``"GPU"`` only when there are GPUs."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}


def engine_gpus(tensor_parallel_size: int, gpus_per_worker: float) -> float:
    """GPUs of a vLLM engine with resources of its own: one per tensor-parallel rank on a GPU run, else none."""
    return float(tensor_parallel_size) if gpus_per_worker > 0 else 0.0


@dataclass(frozen=True)
class GroupPlan:
    """One placement group: ``num_bundles`` bundles of ``cpus`` (+ ``gpus``), shared by ``roles``.

    Rank ``r`` of every role in ``roles`` sits on bundle ``r`` and asks for ``1/len(roles)`` of it.
    """

    roles: Tuple[str, ...]
    num_bundles: int
    cpus: float
    gpus: float

    @property
    def name(self) -> str:
        """The name the runner gives the placement group (``policy``, ``policy+reference``, ...)."""
        return "+".join(self.roles)

    @property
    def share(self) -> int:
        return len(self.roles)

    @property
    def bundle(self) -> Dict[str, float]:
        return bundle_resources(self.cpus, self.gpus)


@dataclass(frozen=True)
class ActorPlan:
    """``count`` actors of one role, each asking for ``cpus`` / ``gpus``.

    ``group`` names the placement group they sit on (actor ``i`` on bundle ``i``); ``None`` means resources of
    their own, placed by Ray's default scheduler (the vLLM engines unless the hybrid engine is on).
    """

    role: str
    count: int
    cpus: float
    gpus: float
    group: Optional[str] = None

    @property
    def request(self) -> Dict[str, float]:
        return bundle_resources(self.cpus, self.gpus)


Request = Union[GroupPlan, ActorPlan]  # what the runner asks Ray for, one after another


@dataclass(frozen=True)
class ResourcePlan:
    """Every request of a run in the order the runner makes it, and every role's actors.

    ``requests`` holds the placement groups, then the actors with resources of their own (these take cluster
    resources): the runner reserves every placement group before it starts any actor
    (:func:`rlhf.trainers.actors.start_plan`). ``actors`` lists every role in the order the builder added them,
    including those sitting on a placement group's bundles.
    """

    requests: Tuple[Request, ...]
    actors: Tuple[ActorPlan, ...]

    @property
    def groups(self) -> Tuple[GroupPlan, ...]:
        return tuple(r for r in self.requests if isinstance(r, GroupPlan))

    @property
    def needed_cpus(self) -> float:
        """CPUs the run holds at once: every bundle plus every actor with resources of its own."""
        return sum(_total(r, "CPU") for r in self.requests)

    @property
    def needed_gpus(self) -> float:
        return sum(_total(r, "GPU") for r in self.requests)

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no placement group {name!r} in the plan (groups: {[g.name for g in self.groups]})")


def _total(request: Request, resource: str) -> float:
    count = request.num_bundles if isinstance(request, GroupPlan) else request.count
    per = request.bundle if isinstance(request, GroupPlan) else request.request
    return count * per.get(resource, 0.0)


class _Builder:
    """Collects requests and actors in creation order; trainer ranks all get the same bundle shape."""

    def __init__(self, cpus_per_worker: float, gpus_per_worker: float) -> None:
        self.cpus, self.gpus = cpus_per_worker, gpus_per_worker
        self.requests: List[Request] = []
        self.actors: List[ActorPlan] = []

    def group(self, roles: Tuple[str, ...], num_bundles: int) -> GroupPlan:
        group = GroupPlan(roles=tuple(roles), num_bundles=num_bundles, cpus=self.cpus, gpus=self.gpus)
        self.requests.append(group)
        return group

    def on(self, group: GroupPlan, role: str, count: int) -> None:
        """``count`` actors of ``role`` on ``group``'s bundles, each with its share of a bundle."""
        if role not in group.roles or count != group.num_bundles:
            raise ValueError(f"{role}: {count} actors cannot share {group.name}'s {group.num_bundles} bundles")
        self.actors.append(ActorPlan(role, count, group.cpus / group.share, group.gpus / group.share, group.name))

    def own(self, role: str, count: int, cpus: float, gpus: float) -> None:
        actors = ActorPlan(role, count, cpus, gpus, group=None)
        self.requests.append(actors)
        self.actors.append(actors)

    def build(self) -> ResourcePlan:
        groups = [r for r in self.requests if isinstance(r, GroupPlan)]  # reserved first, in their order
        return ResourcePlan(
            requests=tuple(groups + [r for r in self.requests if not isinstance(r, GroupPlan)]),
            actors=tuple(self.actors),
        )


def offline_plan(
    cfg: RunConfig, gpus_per_worker: float, policy_role: str = "policy", reference_ranks: int = 0
) -> ResourcePlan:
    """SFT, reward model and DPO: the trained model's group, then (DPO) the reference's.

    Both groups hold their resources at once, even with ``dpo.ref_mode=precompute``, whose reference group is
    released after scoring, before the first step (``rlhf.trainers.offline.reference.attach_reference``).

    Args:
        cfg: An SFT / reward-model / DPO run config.
        gpus_per_worker: Resolved GPUs per rank (:func:`resolve_devices`).
        policy_role: The trained model's role name (``policy``; ``reward_model`` for reward modelling).
        reference_ranks: The frozen reference's ranks (DPO's ``dpo.ref_num_workers``); 0 for none (SFT, reward
            modelling, or a reference the policy's workers score: LoRA's base with the adapters off, or the
            starting policy precomputed before the first step).
    """
    b = _Builder(cfg.strategy.cpus_per_worker, gpus_per_worker)
    sp = cfg.strategy.sequence_parallel_size  # every trainer role: its data-parallel ranks x sp (one per rank)
    n = cfg.train.num_workers * sp
    b.on(b.group((policy_role,), n), policy_role, n)
    if reference_ranks:
        b.on(b.group(("reference",), reference_ranks * sp), "reference", reference_ranks * sp)
    return b.build()


def policy_side_roles(colocate: ColocateConfig) -> Tuple[str, ...]:
    """The roles sharing the policy's bundles: ``policy`` plus a colocated reference, distillation teacher and
    hybrid-engine engines."""
    return (
        ("policy",)
        + (("reference",) if colocate.policy_reference else ())
        + ((TEACHER,) if colocate.policy_teacher else ())
        + ((ROLLOUT,) if colocate.hybrid_engine else ())
    )


def rl_plan(cfg: RLRunConfig, gpus_per_worker: float, reference: bool) -> ResourcePlan:
    """Online RL: policy side, engines, reference, critic side, environment actors (multi-turn), reward actors,
    judge engines.

    Args:
        cfg: An :class:`~rlhf.config.rl_schema.RLRunConfig`.
        gpus_per_worker: Resolved GPUs per trainer rank (:func:`resolve_devices`); CPU counts do not depend on it.
        reference: Whether a frozen reference group is started (the trainer's descriptor says:
            ``rlhf.trainers.kinds``; not with a KL-free algorithm, nor under LoRA, where the policy's workers score
            the reference with the adapters off).
    """
    t, r, c = cfg.train, cfg.rollout, cfg.colocate
    b = _Builder(cfg.strategy.cpus_per_worker, gpus_per_worker)
    sp = cfg.strategy.sequence_parallel_size  # every trainer role: its data-parallel ranks x sp (one per rank)
    ranks = t.num_workers * sp
    policy_side = b.group(policy_side_roles(c), ranks)
    b.on(policy_side, "policy", ranks)
    if c.hybrid_engine:
        b.on(policy_side, ROLLOUT, r.num_engines)
    else:
        b.own(ROLLOUT, r.num_engines, r.cpus_per_engine, engine_gpus(r.tensor_parallel_size, gpus_per_worker))
    if reference:
        b.on(policy_side if c.policy_reference else b.group(("reference",), ranks), "reference", ranks)
    if cfg.algo.teacher.path and not c.teacher_in_policy:  # on-policy distillation: a frozen teacher
        n = (cfg.algo.teacher.num_workers or t.num_workers) * sp
        b.on(policy_side if c.policy_teacher else b.group((TEACHER,), n), TEACHER, n)
    critic_side = b.group(("critic", "reward_model"), cfg.critic.num_workers * sp) if c.critic_reward else None
    if cfg.algo.needs_critic:
        n = cfg.critic.num_workers * sp
        b.on(critic_side or b.group(("critic",), n), "critic", n)
    if cfg.reward.model_path:
        n = cfg.reward.model_num_workers * sp
        b.on(critic_side or b.group(("reward_model",), n), "reward_model", n)
    if cfg.env.spec:
        b.own(ENVIRONMENT, cfg.env.num_actors, cfg.env.cpus_per_actor, 0.0)
    if cfg.reward.functions and cfg.reward.num_workers:
        b.own(REWARD_POOL, cfg.reward.num_workers, cfg.reward.cpus_per_worker, 0.0)
    if cfg.reward.judge.path:
        j = cfg.reward.judge
        b.own(JUDGE, j.num_engines, j.cpus_per_engine, engine_gpus(1, gpus_per_worker))
    return b.build()


def trainer_sleep(colocate: ColocateConfig, gpus_per_worker: float) -> bool:
    """Whether the trainer ranks on the engines' devices sleep while they generate (``colocate.trainer_sleep``):
    ``auto`` turns it on for the hybrid engine on GPUs; ``on`` runs it anywhere (the CPU twin moves host memory);
    ``off``, the default until it is measured on a GPU."""
    c = colocate
    return c.trainer_sleep == "on" or (c.trainer_sleep == "auto" and c.hybrid_engine and gpus_per_worker > 0)


def sleeping_roles(colocate: ColocateConfig, gpus_per_worker: float) -> Tuple[str, ...]:
    """The trainer roles on the engines' devices, which sleep while the engines generate when
    ``colocate.trainer_sleep`` resolves on (:func:`trainer_sleep`): the policy's side of the hybrid engine (a
    reference or teacher the policy's ranks hold sleeps with them)."""
    if not trainer_sleep(colocate, gpus_per_worker):
        return ()
    return tuple(role for role in policy_side_roles(colocate) if role != ROLLOUT)


def offloaded_roles(cfg: RLRunConfig, gpus_per_worker: float) -> Tuple[str, ...]:
    """The frozen models (:attr:`~rlhf.config.rl_schema.RLRunConfig.frozen_models`) that wait in host memory between
    their scoring passes (``colocate.offload_frozen``): ``on``, all of them (anywhere: the CPU twin moves host
    memory); ``auto``, on GPUs, those sharing a device with a trained model (a reference or teacher on the policy's
    bundles or held in its ranks, a reward model on the critic's); ``off``, none."""
    c = cfg.colocate
    shares_a_device = {
        "reference": c.policy_reference or c.reference_in_policy,
        TEACHER: c.policy_teacher or c.teacher_in_policy,
        "reward_model": c.critic_reward,
    }
    if c.offload_frozen == "on":
        return cfg.frozen_models
    if c.offload_frozen == "auto" and gpus_per_worker > 0:
        return tuple(role for role in cfg.frozen_models if shares_a_device[role])
    return ()


def engine_sleep(colocate: ColocateConfig, gpus_per_engine: float) -> bool:
    """Whether the engines use vLLM sleep mode (``colocate.engine_sleep``): CUDA-only, so ``on`` without GPU engines
    is refused; ``auto`` turns it on for the hybrid engine on GPUs."""
    c = colocate
    if c.engine_sleep == "on" and gpus_per_engine <= 0:
        raise ConfigError("colocate.engine_sleep=on needs GPU engines (vLLM sleep mode is CUDA-only); use auto")
    return c.engine_sleep == "on" or (c.engine_sleep == "auto" and c.hybrid_engine and gpus_per_engine > 0)
