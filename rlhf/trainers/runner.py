"""Running an offline task end to end: validation, actors, the step loop, the final save."""
from __future__ import annotations

from typing import Callable, Dict, FrozenSet, Optional

from rlhf.config.deepspeed_check import check_user_config
from rlhf.config.schema import ConfigError
from rlhf.data.plan import EpochPlan
from rlhf.distributed.resource_plan import offline_plan, resolve_devices
from rlhf.hub import pin_run_sources
from rlhf.trainers.offline import (RunContext, RunResult, check_paths, describe_plan, load_tokenizer,
                                   run_steps, save_final)
from rlhf.trainers.checkpoint import RunCheckpoints
from rlhf.trainers.health import HealthGuard, TrainingHealthError, check_health, guard_from_config
from rlhf.trainers.output_dir import claim_output_dir, prepare_output_dir
from rlhf.utils.metrics import RunWriters, progress_bar_setting, read_metrics
from rlhf.utils.versions import check_versions

# (cfg, tokenizer) -> (task, skipped_rows); reads and tokenizes data, starts nothing.
TaskBuilder = Callable[[object, object], tuple]


def run_offline(cfg, build_task: TaskBuilder, policy_role: str) -> RunResult:
    cfg = pin_run_sources(claim_output_dir(cfg))  # hub ids -> org/name@<sha>: config.yaml and every actor get them
    return with_restarts(cfg, lambda c: _run_offline_once(c, build_task, policy_role))


def with_restarts(cfg, run: Callable[[object], RunResult]) -> RunResult:
    """``run(cfg)``; with ``train.on_failure=restart``, a dead or failing actor (:class:`WorkerError`) tears the
    actors down and runs again from the newest checkpoint, at most ``train.max_restarts`` times."""
    import dataclasses

    from rlhf.distributed.errors import WorkerError

    restarts = 0
    while True:
        try:
            return run(cfg)
        except WorkerError as exc:
            t = cfg.train
            if t.on_failure != "restart" or restarts >= t.max_restarts:
                raise
            restarts += 1
            print(f"[restart {restarts}/{t.max_restarts}] {exc}; restarting from the newest checkpoint",
                  flush=True)
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, resume=True))


def _run_offline_once(cfg, build_task: TaskBuilder, policy_role: str) -> RunResult:
    check_versions()
    check_paths(cfg)
    tokenizer = load_tokenizer(cfg)
    task, skipped = build_task(cfg, tokenizer)
    t = cfg.train
    plan = EpochPlan(num_samples=task.num_examples, global_batch_size=t.global_batch_size, max_epochs=t.max_epochs,
                     max_steps=t.max_steps, seed=t.seed)
    print(describe_plan(task, plan, t, len(skipped)), flush=True)
    check_skip_steps(t, plan.total_steps)
    checkpoints = RunCheckpoints(t, run_identity(cfg, plan), task.name)
    checkpoints.prepare()  # a checkpoint of another run fails here, before anything is written or started
    prepare_output_dir(cfg, checkpoints)  # an old run there is refused, or deleted (train.overwrite); config.yaml

    # CPUs do not depend on the GPUs per worker, which are known only once the cluster is joined.
    ctx = start_cluster(cfg, needed_cpus=offline_plan(cfg, 0.0, policy_role).needed_cpus)
    writers: Optional[RunWriters] = None
    try:
        policy = ctx.make_group(policy_role, t.num_workers)
        policy.build(ctx.model_spec(cfg.model.path, task.model_kind),
                     ctx.engine_spec(t.micro_batch_size, t.grad_accum_steps), optim_spec(t, plan.total_steps))
        if task.attach is not None:
            task.attach(task, ctx)
        trained = {"policy": policy}
        done = checkpoints.restore(trained)
        writers = RunWriters(cfg, resume_after=done or None, with_eval=bool(task.eval_num_examples))

        def train_from(start_after: int, skip_steps, check_row) -> dict:
            return run_steps(task, policy, plan, t, writers.metrics, cfg.logging.print_every, writers.eval,
                             start_after=start_after, progress_bar=progress_bar_setting(cfg.logging.progress_bar),
                             check_row=check_row, skip_steps=skip_steps,
                             after_step=lambda step: checkpoints.after_step(step.step, plan.total_steps, trained))

        guard = lambda: guard_from_config(cfg.health, ("loss", "grad_norm"), zero_loss_key="loss")  # noqa: E731
        last = train_with_rewinds(cfg, checkpoints, trained, writers, done, guard, train_from)
        return finish_run(checkpoints, policy, tokenizer, t, plan.total_steps, last, task.name)
    finally:
        if writers is not None:
            writers.close()
        ctx.shutdown()


def finish_run(checkpoints: RunCheckpoints, policy, tokenizer, t, total_steps: int, last: dict,
               name: str) -> RunResult:
    """The run's result: ``final/`` saved unless ``train.stop_after_steps`` ended it early (then its checkpoint is
    what there is) or ``train.save_final`` is off."""
    if checkpoints.stopped_early:
        return RunResult(output_dir=t.output_dir, steps=total_steps, final_metrics=last, final_dir=None,
                         stopped_at=last.get("step"))
    final_dir = save_final(policy, tokenizer, t.output_dir) if t.save_final else None
    if final_dir:
        print(f"[{name}] saved {final_dir}", flush=True)
    return RunResult(output_dir=t.output_dir, steps=total_steps, final_metrics=last, final_dir=final_dir)


def train_with_rewinds(cfg, checkpoints: RunCheckpoints, trained: Dict[str, object], writers: RunWriters,
                       done: int, make_guard: Callable[[], Optional[HealthGuard]],
                       train_from: Callable[[int, FrozenSet[int], Optional[Callable[[dict], None]]], dict]) -> dict:
    """``train_from(start_after, skip_steps, check_row)`` from step ``done + 1``, under the health guard; returns
    the last step's row.

    With ``health.action=skip``, a guard that trips at step ``k`` does not end the run: the ``trained`` groups are
    loaded from the newest checkpoint (step ``c < k``: the guard runs before a step's checkpoint), the metric
    files go back to ``c``, ``k`` joins the skipped steps, and training goes on from ``c + 1``. Steps ``c+1 ..
    k-1`` replay exactly, so the run ends as one started with ``k`` in ``train.skip_steps`` (the large-run recipe
    of rewinding past a loss spike and skipping its data, Chowdhery et al. 2022, PaLM sec. 5.1).
    """
    h = cfg.health
    skip_steps = set(cfg.train.skip_steps)
    if h.action == "skip":
        checkpoints.save_start(trained)  # a trip before the first save_every checkpoint rewinds to the start
    skipped_here = 0
    while True:
        guard = make_guard()
        if guard is not None:  # decide as the uninterrupted run would: its statistics from the rows kept
            guard.observe([row for row in read_metrics(writers.metrics.path) if row["step"] <= done])
        check_row = None if guard is None else (lambda row, g=guard: check_health(g, h.action, row))
        try:
            return train_from(done, frozenset(skip_steps), check_row)
        except TrainingHealthError as exc:
            if h.action != "skip" or exc.step is None:
                raise
            if skipped_here >= h.max_skips:
                raise TrainingHealthError(f"{exc}; stopped: health.max_skips={h.max_skips} steps were skipped "
                                          f"already", step=exc.step) from None
            skipped_here += 1
            done = checkpoints.rewind(trained)
            writers.rewind(done)
            skip_steps.add(exc.step)
            print(f"[health] {exc}; rewound to the checkpoint of step {done}, step {exc.step} will be skipped "
                  f"(health.action=skip, {skipped_here}/{h.max_skips})", flush=True)


def check_skip_steps(t, total_steps: int) -> None:
    """``train.skip_steps`` must name steps of the run (before any actor starts)."""
    beyond = sorted(s for s in t.skip_steps if s > total_steps)
    if beyond:
        raise ConfigError(f"train.skip_steps: {beyond} past the run's last step ({total_steps})")


def run_identity(cfg, plan: EpochPlan) -> dict:
    """What a checkpoint must share with the run that resumes it (see ``RunCheckpoints``)."""
    t = cfg.train
    return {"train.seed": t.seed, "train.global_batch_size": t.global_batch_size, "train.num_workers": t.num_workers,
            "strategy.zero_stage": cfg.strategy.zero_stage, "steps in the run": plan.total_steps,
            "examples in data.train_path": plan.num_samples}


def optim_spec(t, total_steps: int):
    """AdamW + schedule from ``train.*``; the schedule's horizon is the run's exact optimizer-step count."""
    from rlhf.distributed.engine import OptimSpec

    return OptimSpec(lr=t.lr, total_steps=total_steps, betas=tuple(t.adam_betas), eps=t.adam_eps,
                     weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, scheduler=t.lr_scheduler,
                     warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio)


def start_cluster(cfg, needed_cpus: float) -> RunContext:
    """Join or start Ray; precision and backend follow the cluster's workers (the driver may have no GPU)."""
    from rlhf.distributed.cluster import cluster_gpus, init_ray

    init_ray(cfg.ray.address, cfg.ray.num_cpus, needed_cpus=needed_cpus)
    devices = resolve_devices(cfg.strategy, cluster_gpus())  # what --dry-run resolves for its cluster too
    user_ds_config = check_user_config(cfg, devices.precision)  # before any actor starts
    return RunContext(cfg=cfg, precision=devices.precision, backend=devices.backend,
                      gpus_per_worker=devices.gpus_per_worker, user_ds_config=user_ds_config)
