"""A run's cluster and what its worker groups are built from: :func:`start_cluster` joins or starts Ray (every
node's libraries checked, precision and backend resolved), and :class:`RunContext` builds the groups, engines and
placements of a run from its config (:func:`optim_spec`, :func:`lora_spec`); every group it made is shut down with
it. :class:`rlhf.trainers.run.Run` holds one while its steps run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, cast

from rlhf.config.deepspeed_check import check_user_config
from rlhf.config.schema import ConfigError, RunConfig
from rlhf.distributed.cluster import actor_env, cluster_gpus, init_ray, started_here
from rlhf.distributed.engine import EngineSpec, OptimSpec
from rlhf.distributed.group import GroupResources, WorkerGroup
from rlhf.distributed.node_versions import check_node_versions
from rlhf.distributed.placement import Placement
from rlhf.distributed.resource_plan import ActorPlan, GroupPlan, resolve_devices
from rlhf.models.loading import ModelSpec
from rlhf.models.lora import LoraSpec, check_targets


def lora_spec(cfg: RunConfig) -> Optional[LoraSpec]:
    """The adapters ``model.lora.*`` asks for, ``None`` with LoRA off; a bad form is a :class:`ConfigError`."""
    lora = cfg.model.lora
    if not lora.enabled:
        return None
    try:
        return LoraSpec(r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_lora_targets(cfg: RunConfig, models: Sequence[Tuple[str, str]]) -> None:
    """Before any actor starts: ``model.lora.target_modules`` match Linear layers of every ``(path, kind)`` that
    trains with LoRA (read from the model's config on the meta device, no weights loaded)."""
    spec = lora_spec(cfg)
    for path, kind in models if spec is not None else ():
        try:
            check_targets(path, kind, cast(LoraSpec, spec).target_modules)  # no iteration when spec is None
        except ValueError as err:
            raise ConfigError(str(err)) from None


def optim_spec(t, total_steps: int) -> OptimSpec:
    """AdamW + schedule from ``train.*``; the schedule's horizon is the run's exact optimizer-step count."""
    return OptimSpec(
        lr=t.lr,
        total_steps=total_steps,
        betas=tuple(t.adam_betas),
        eps=t.adam_eps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        scheduler=t.lr_scheduler,
        warmup_steps=t.warmup_steps,
        min_lr_ratio=t.min_lr_ratio,
    )


def start_cluster(cfg: RunConfig, packages: Sequence[str], needed_cpus: float) -> "RunContext":
    """Join or start Ray; every node's install of the libraries the trainer needs (``packages``) is checked; precision
    and backend follow the cluster's workers (the driver may have no GPU)."""
    init_ray(cfg.ray.address, cfg.ray.num_cpus, needed_cpus=needed_cpus)
    gpus = cluster_gpus()
    devices = resolve_devices(cfg.strategy, gpus)  # what --dry-run resolves for its cluster too
    check_node_versions(
        packages,
        devices.gpus_per_worker > 0,  # each node's install
        cfg.model.attn_implementation,
        started_here=started_here() and gpus == 0,  # the demo's and the audit's trainings too, after their init_ray
    )
    user_ds_config = check_user_config(cfg, devices.precision)  # before any actor starts
    return RunContext(
        cfg=cfg,
        precision=devices.precision,
        backend=devices.backend,
        gpus_per_worker=devices.gpus_per_worker,
        user_ds_config=user_ds_config,
    )


@dataclass
class RunContext:
    """The resolved run settings once Ray is up, and the factory of the run's worker groups (shut down on exit)."""

    cfg: Any  # the run's config (an rlhf.config *RunConfig of any kind): each method reads the fields it needs
    precision: str
    backend: str
    gpus_per_worker: float
    groups: list = dataclasses.field(default_factory=list)  # every group started, for shutdown
    placements: list = dataclasses.field(default_factory=list)  # shared placement groups, removed last
    user_ds_config: Optional[dict] = None  # strategy.deepspeed_config, read and checked once

    def model_spec(self, path: str, kind: str) -> ModelSpec:
        m = self.cfg.model
        return ModelSpec(
            path=path,
            kind=kind,
            precision=self.precision,
            attn_implementation=m.attn_implementation,
            disable_dropout=m.disable_dropout,
            gradient_checkpointing=m.gradient_checkpointing,
            seed=self.cfg.train.seed,
            packing=self.cfg.train.packing,
            tiled_head=m.tiled_head,
            tiled_mlp=m.tiled_mlp,
            compile=m.compile,
            lora=lora_spec(self.cfg),
        )

    def engine_spec(self, num_workers: int, trainable: bool = True) -> EngineSpec:
        """A group of ``num_workers`` ranks: trainable, its optimizer step takes ``train.global_batch_size`` rows cut
        by ``train.micro_batch_size`` or ``train.max_tokens_per_micro_batch``; frozen, it scores in chunks of the
        same micro-batch size or token budget. Under ``strategy.sequence_parallel_size = n`` the batch is cut over
        ``num_workers / n`` data-parallel ranks (sequence groups)."""
        s, t = self.cfg.strategy, self.cfg.train
        ranks = num_workers // s.sequence_parallel_size
        common = dict(
            zero_stage=s.zero_stage,
            precision=self.precision,
            offload_optimizer=s.offload_optimizer,
            user_config=self.user_ds_config,
            packing=t.packing,
            peak_tflops=s.peak_tflops,
            sequence_parallel_size=s.sequence_parallel_size,
        )
        if t.max_tokens_per_micro_batch:
            rows = t.global_batch_size if trainable else ranks  # frozen: no accumulation window
            return EngineSpec.for_token_budget(rows, t.max_tokens_per_micro_batch, ranks, **common)
        if not trainable:
            return EngineSpec(micro_batch_size=t.micro_batch_size, grad_accum_steps=1, **common)
        return EngineSpec.for_global_batch(t.global_batch_size, t.micro_batch_size, ranks, **common)

    def group_of(self, actors: ActorPlan, placement: Optional[Placement] = None) -> WorkerGroup:
        """A worker group of ``actors.count`` ranks of ``actors.role``: on ``placement`` (a shared placement group,
        :meth:`place`), else on one of its own of the plan's bundle (``actors.cpus`` + ``actors.gpus`` per rank)."""
        resources = GroupResources(
            num_workers=actors.count,
            cpus_per_worker=actors.cpus,
            gpus_per_worker=actors.gpus,
            env_vars=actor_env(self.gpus_per_worker),
        )
        group = WorkerGroup(
            actors.role, resources, self.backend, placement=placement, init_timeout_s=self.cfg.strategy.init_timeout_s
        )
        self.groups.append(group)
        return group

    def make_group(self, role: str, num_workers: int, placement: Optional[Placement] = None) -> WorkerGroup:
        """A worker group for ``role`` outside a plan (custom loops, tests): one ``strategy.cpus_per_worker`` bundle
        per rank."""
        actors = ActorPlan(role, num_workers, self.cfg.strategy.cpus_per_worker, self.gpus_per_worker)
        return self.group_of(actors, placement)

    def place(self, group: GroupPlan) -> Placement:
        """The placement group of a plan's ``group``: one bundle per rank, shared by its roles (each actor takes
        ``1/len(roles)`` of a bundle); removed when the context closes."""
        placement = Placement(group.name, group.num_bundles, group.cpus, group.gpus, share=group.share)
        self.placements.append(placement)
        return placement

    def shutdown(self) -> None:
        while self.groups:
            self.groups.pop().shutdown()
        while self.placements:
            self.placements.pop().remove()
