"""Running an offline task end to end: validation, actors, the step loop, the final save."""
from __future__ import annotations

import os
from typing import Callable, Optional

from rlhf.config.deepspeed_check import check_user_config
from rlhf.config.loader import save_config
from rlhf.config.schema import ConfigError
from rlhf.data.plan import EpochPlan
from rlhf.trainers.offline import (RunContext, RunResult, check_paths, describe_plan, load_tokenizer,
                                   run_steps, save_final)
from rlhf.trainers.checkpoint import RunCheckpoints
from rlhf.trainers.health import check_health, guard_from_config
from rlhf.utils.metrics import RunWriters, progress_bar_setting

# (cfg, tokenizer) -> (task, skipped_rows); reads and tokenizes data, starts nothing.
TaskBuilder = Callable[[object, object], tuple]


def run_offline(cfg, build_task: TaskBuilder, policy_role: str) -> RunResult:
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
    check_paths(cfg)
    tokenizer = load_tokenizer(cfg)
    task, skipped = build_task(cfg, tokenizer)
    t = cfg.train
    plan = EpochPlan(num_samples=task.num_examples, global_batch_size=t.global_batch_size, max_epochs=t.max_epochs,
                     max_steps=t.max_steps, seed=t.seed)
    print(describe_plan(task, plan, t, len(skipped)), flush=True)
    checkpoints = RunCheckpoints(t, run_identity(cfg, plan), task.name)
    checkpoints.prepare()  # a checkpoint of another run fails here, before anything is written or started
    os.makedirs(t.output_dir, exist_ok=True)
    save_config(cfg, os.path.join(t.output_dir, "config.yaml"))

    workers = cfg.train.num_workers + getattr(getattr(cfg, "dpo", None), "ref_num_workers", 0)
    ctx = start_cluster(cfg, needed_cpus=workers * cfg.strategy.cpus_per_worker)
    writers: Optional[RunWriters] = None
    try:
        policy = ctx.make_group(policy_role, t.num_workers)
        policy.build(ctx.model_spec(cfg.model.path, task.model_kind),
                     ctx.engine_spec(t.micro_batch_size, t.grad_accum_steps), optim_spec(t, plan.total_steps))
        if task.attach is not None:
            task.attach(task, ctx)
        trained = {"policy": policy}
        done = checkpoints.restore(trained)
        writers = RunWriters(cfg, append=done > 0, with_eval=bool(task.eval_num_examples))
        last = run_steps(task, policy, plan, t, writers.metrics, cfg.logging.print_every, writers.eval,
                         start_after=done, progress_bar=progress_bar_setting(cfg.logging.progress_bar),
                         check_row=health_check(cfg, watch=("loss", "grad_norm"), zero_loss_key="loss"),
                         after_step=lambda step: checkpoints.after_step(step.step, plan.total_steps, trained))
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


def health_check(cfg, watch, zero_loss_key):
    """The health guard of ``cfg.health`` as a row check (``None`` when off)."""
    guard = guard_from_config(cfg.health, watch, zero_loss_key)
    return None if guard is None else (lambda row: check_health(guard, cfg.health.action, row))


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

    s = cfg.strategy
    init_ray(cfg.ray.address, cfg.ray.num_cpus, needed_cpus=needed_cpus)
    gpus = s.gpus_per_worker if s.gpus_per_worker >= 0 else (1.0 if cluster_gpus() > 0 else 0.0)
    precision = s.precision if s.precision != "auto" else ("bf16" if gpus > 0 else "fp32")
    backend = s.backend if s.backend != "auto" else ("nccl" if gpus > 0 else "gloo")
    if backend == "nccl" and gpus <= 0:
        raise ConfigError("strategy.backend=nccl needs GPU workers (strategy.gpus_per_worker > 0)")
    user_ds_config = check_user_config(cfg, precision)  # before any actor starts
    return RunContext(cfg=cfg, precision=precision, backend=backend, gpus_per_worker=gpus,
                      user_ds_config=user_ds_config)
