"""``--dry-run``: validate a run config and print what the run would ask the cluster for, starting nothing.

The plan is the trainer's (:meth:`rlhf.trainers.kinds.TrainerKind.plan`), the same one the runners size their clusters
and colocate their roles from, packed onto the cluster's nodes by :func:`rlhf.distributed.packing.pack`. The cluster is
``--cluster SHAPE`` (simulated), else the live one at ``ray.address`` / ``RAY_ADDRESS`` (its nodes are read; no actor
starts), else this machine as a local run would size it. Paths that exist only on the cluster (a data set under
``/data``, a model directory) are listed as such, not refused; a hub id (``org/name[@revision]``) is looked up without
downloading anything (the commit it resolves to, from the cache offline, else from the hub), and refused only when the
hub says it does not exist. Every other check a real run makes before its first actor still applies: the run's own
preflight (:func:`rlhf.trainers.preflight.preflight`: model folders and their weights, a contradicting
``strategy.deepspeed_config``, reward functions, environments, reward heads, LoRA targets, batch arithmetic), the
data this machine has read (and, with the model's tokenizer here, tokenized by the trainer's own reader), then
precision / backend / sleep-mode rules.

Exit status (through ``rlhf.cli.common.run_cli``): 0 when the plan fits, 2 with ``error: ...`` naming the placement
group or role that does not fit, or the bad setting.
"""

from __future__ import annotations

import os
from typing import List, Sequence, Tuple

from rlhf.config.schema import ConfigError, RunConfig
from rlhf.distributed.cluster import local_num_cpus
from rlhf.distributed.engine import effective_zero_stage
from rlhf.distributed.packing import (
    NodeShape,
    Packing,
    check_feasible,
    describe_cluster,
    nodes_from_ray,
    pack,
    parse_cluster,
)
from rlhf.distributed.resource_plan import (
    ENVIRONMENT,
    JUDGE,
    REWARD_POOL,
    ROLLOUT,
    ActorPlan,
    Devices,
    GroupPlan,
    ResourcePlan,
    resolve_devices,
)
from rlhf.trainers.kinds import kind_of
from rlhf.trainers.preflight import preflight
from rlhf.utils.metrics import plural


def dry_run(cfg: RunConfig, prog: str, cluster: str = "") -> None:
    """Print the resource plan of ``cfg`` on the cluster; raise when it does not fit or a setting is wrong.

    Args:
        cfg: A validated run config (SFT, reward model, DPO or RL).
        prog: The command, for the header line.
        cluster: ``--cluster`` shape; ``""`` reads the live cluster or this machine.

    Raises:
        ConfigError: A setting a real run would refuse before starting actors (names the key).
        InfeasiblePlan: A placement group or actor that does not fit (names it), after the plan is printed.
    """
    kind = kind_of(cfg)
    name, label, nodes = cluster_nodes(cfg, cluster)
    devices = resolve_devices(cfg.strategy, sum(n.gpus for n in nodes))
    plan = kind.plan(cfg, devices.gpus_per_worker)
    paths = preflight(cfg, kind, here=False, precision=devices.precision)
    rollout = kind.describe(cfg, plan, devices)  # the trainer's own lines (online RL: engines, weight sync, episodes)
    packing = pack(plan, nodes, cluster=name)
    lines = [
        f"dry run: {prog}: the configuration is valid; nothing was started (no Ray actor, no weights loaded)",
        "",
        f"cluster: {label}: {describe_cluster(nodes)}",
    ]
    lines += [f"  node {i}: {n.describe()}" for i, n in enumerate(nodes)]
    lines += ["", "paths:"] + _table(paths)
    lines += ["", _devices_line(cfg, devices, plan)] + rollout
    lines += ["", "placement groups (Ray PACK, in the order the runner creates them):"] + placement_lines(packing)
    lines += ["", "actors:"] + actor_lines(plan)
    lines += ["", "shared devices: " + _sharing(plan, packing)]
    lines += ["", "batch:"] + batch_lines(cfg)
    lines += ["", _verdict(packing, name)]
    print("\n".join(lines), flush=True)
    check_feasible(packing)


# ------------------------------------------------------------------------------------------------- the cluster


def cluster_nodes(cfg: RunConfig, cluster: str) -> Tuple[str, str, Tuple[NodeShape, ...]]:
    """``(name, description, nodes)`` of the simulated ``cluster``, else of the live one at the run's address, else
    of this machine."""
    if cluster:
        try:
            return cluster, f"{cluster} (simulated)", parse_cluster(cluster)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        return "the live cluster", f"live cluster at {address}", _live_nodes(address)
    cpus = local_num_cpus(cfg.ray.num_cpus, kind_of(cfg).plan(cfg, 0.0).needed_cpus)
    return (
        "this machine",
        f"this machine (the local Ray cluster a run here would start: {cpus} logical CPUs)",
        (NodeShape(cpus=float(cpus), gpus=_local_gpus()),),
    )


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _live_nodes(address: str) -> Tuple[NodeShape, ...]:
    """The alive nodes of a running cluster: connect as a driver, read ``ray.nodes()``, disconnect."""
    import ray

    joined = not ray.is_initialized()
    try:
        if joined:
            # ignore: ray annotates logging_level as int, yet its own default (LOGGER_LEVEL) is the name "info"
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")  # type: ignore[arg-type]
        nodes = nodes_from_ray(ray.nodes())
    except Exception as exc:  # noqa: BLE001 - any failure to reach the cluster is reported as one line
        raise ConfigError(
            f"cannot read the Ray cluster at {address} ({type(exc).__name__}: {exc}); give "
            f"--cluster SHAPE to plan against a simulated one"
        ) from None
    finally:
        if joined and ray.is_initialized():
            ray.shutdown()
    if not nodes:
        raise ConfigError(f"the Ray cluster at {address} has no alive node")
    return nodes


# ---------------------------------------------------------------------------------------------------- rollout


# ------------------------------------------------------------------------------------------------- rendering


def _table(rows: Sequence[Tuple[str, ...]], indent: str = "  ") -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)] if rows else []
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _res(actor: ActorPlan) -> str:
    return "{" + ", ".join(f"{k}: {v:.3g}" for k, v in actor.request.items()) + "}"


def _ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out: List[Tuple[int, int]] = []
    for v in sorted(values):
        if out and out[-1][1] == v - 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def _devices_line(cfg: RunConfig, devices: Devices, plan: ResourcePlan) -> str:
    s = cfg.strategy
    gpus = f"{devices.gpus_per_worker:g} GPU per rank" if devices.gpus_per_worker else "CPU ranks"
    auto = " (auto)" if s.gpus_per_worker < 0 else ""
    extras = ", gradient checkpointing" if cfg.model.gradient_checkpointing else ""
    extras += ", compiled decoder layers" if cfg.model.compile else ""
    extras += ", optimizer offloaded to CPU" if s.offload_optimizer else ""
    # a sequence group is at least 2 ranks
    single = [g.name for g in plan.groups if g.num_bundles == 1] if s.sequence_parallel_size == 1 else []
    if single and effective_zero_stage(s.zero_stage, 1, s.offload_optimizer) != s.zero_stage:
        extras += f" (ZeRO-1 on the one-rank {', '.join(single)}: nothing to partition)"
    return (
        f"devices: {gpus}{auto}; {devices.precision} (strategy.precision={s.precision}), "
        f"{devices.backend} (strategy.backend={s.backend}); DeepSpeed ZeRO-{s.zero_stage}{extras}"
    )


def placement_lines(packing: Packing) -> List[str]:
    """One line per request, then where its bundles (or actors) landed, node by node."""
    lines = []
    for i, (request, slots) in enumerate(zip(packing.plan.requests, packing.slots), 1):
        if isinstance(request, GroupPlan):
            bundle = "{" + ", ".join(f"{k}: {v:g}" for k, v in request.bundle.items()) + "}"
            shared = f", shared by {request.share} roles" if request.share > 1 else ""
            lines.append(f"  {i}. {request.name}: {plural(request.num_bundles, 'bundle')} x {bundle}{shared}")
            what = "bundles"
        else:
            lines.append(
                f"  {i}. {request.role}: {plural(request.count, 'actor')} x {_res(request)}, no placement "
                f"group (Ray's default scheduler)"
            )
            what = "actors"
        if slots is None:
            lines.append(
                "       NOT PLACED"
                if packing.failure and _first_failed(packing) == i - 1
                else "       (not tried: an earlier request did not fit)"
            )
            continue
        by_node: dict = {}
        for index, slot in enumerate(slots):
            by_node.setdefault(slot.node, ([], set()))[0].append(index)
            by_node[slot.node][1].update(slot.gpu_ids)
        lines.append(
            "       "
            + "; ".join(
                f"node {node}: {what} {_ranges(ix)}" + (f" (GPUs {_ranges(sorted(g))})" if g else "")
                for node, (ix, g) in sorted(by_node.items())
            )
        )
    return lines


def _first_failed(packing: Packing) -> int:
    return next(i for i, s in enumerate(packing.slots) if s is None)


def actor_lines(plan: ResourcePlan) -> List[str]:
    rows = []
    for a in plan.actors:
        unit = {ROLLOUT: "engine", JUDGE: "engine", ENVIRONMENT: "actor", REWARD_POOL: "actor"}.get(a.role, "rank")
        where = f"{unit} r on bundle r of {a.group}" if a.group else "own resources"
        rows.append((a.role, plural(a.count, unit), f"{_res(a)} each", where))
    return _table(rows)


def _sharing(plan: ResourcePlan, packing: Packing) -> str:
    shared = [
        f"{' + '.join(g.roles)} (rank r of each on bundle r, 1/{g.share} of it each)"
        for g in plan.groups
        if g.share > 1
    ]
    text = "; ".join(shared) if shared else "none (every role on its own bundles)"
    crowded = packing.shared_devices()
    if crowded:
        text += "; WARNING, ranks of one role on one device: " + "; ".join(crowded)
    return text


def batch_lines(cfg: RunConfig) -> List[str]:
    """The global-batch arithmetic: offline, global = micro x accumulation x ranks; RL, the rollout batch and the
    optimizer steps it makes (the trainer's ``batch_lines``)."""
    t, lora, kind = cfg.train, cfg.model.lora, kind_of(cfg)
    lines = [f"  train.global_batch_size {t.global_batch_size} = {t.describe_batching()} (samples per optimizer step)"]
    sp = cfg.strategy.sequence_parallel_size
    if sp > 1:
        budget = (
            f"; a micro-batch holds up to {sp} x {t.max_tokens_per_micro_batch} tokens"
            if t.max_tokens_per_micro_batch
            else ""
        )
        lines.append(
            f"  sequence parallel {sp}: each data-parallel rank is {sp} ranks sharing every row (1/{sp} of its "
            f"positions each, attention heads split {sp} ways); every trainer role starts its ranks x {sp}{budget}"
        )
    if lora.enabled:
        lines.append(
            f"  LoRA: r {lora.r}, alpha {lora.alpha:g} on {', '.join(lora.target_modules)}"
            + (
                "; the reference is the frozen base under the adapters (no reference workers)"
                if kind.reference_on_base(cfg)
                else ""
            )
            + (
                "; RL weight syncs send the adapter alone (model.lora.sync=adapter)"
                if lora.adapter_only and kind.online
                else ""
            )
        )
    return kind.batch_lines(cfg, lines)  # the trainer's own: DPO's reference, RL's rollout batch and algorithm


def _verdict(packing: Packing, cluster: str) -> str:
    if not packing.feasible:
        return f"result: does NOT fit on {cluster} (see the error below)"
    used = []
    for i, (node, (cpus, gpus)) in enumerate(zip(packing.nodes, packing.free)):
        gpu_text = f"{node.gpus - sum(gpus):g}/{node.gpus} GPU, " if node.gpus else ""
        used.append(f"node {i} {gpu_text}{node.cpus - cpus:g}/{node.cpus:g} CPU")
    return f"result: fits on {cluster}; held: " + "; ".join(used)
