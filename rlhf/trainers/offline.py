"""The offline trainer loop shared by SFT, reward modelling and DPO.

    validate everything -> start actors -> for each optimizer step of the plan:
        cut the global batch into rank x micro-batch pieces -> count the normalizer over all of them
        -> (DPO online: reference log-probs) -> one train_step per rank -> finalize and log the global metrics
    -> save ``final/`` atomically

Everything that can be wrong with the inputs (config, paths, data rows, a plan with no step) fails before any
actor starts. ``final/`` appears only when the run finished: it is written to a temporary directory and renamed.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable, FrozenSet, List, Optional, Sequence

from rlhf.batch import Batch
from rlhf.config.deepspeed_check import check_user_config
from rlhf.config.schema import ConfigError
from rlhf.data.plan import EpochPlan, StepPlan
from rlhf.hub import DATASET, MODEL, is_hub_ref, model_dir
from rlhf.objectives.base import Objective, Sums, add_sums
from rlhf.utils.metrics import SKIPPED_NOTE, MetricsWriter, Progress, format_row, skipped_row

Collate = Callable[[Sequence[int]], Batch]


@dataclass
class OfflineTask:
    """What distinguishes SFT, RM and DPO for the shared loop."""

    name: str
    model_kind: str  # rlhf.models.loading.CAUSAL_LM or SCALAR_HEAD
    objective: Objective
    num_examples: int
    collate: Collate  # dataset row indices -> Batch
    # Optional hook run on every step's micro-batches before training (DPO online reference log-probs).
    prepare: Optional[Callable[[List[List[Batch]]], List[List[Batch]]]] = None
    console_keys: tuple = ("loss", "grad_norm", "lr")
    # Held-out data (data.eval_path): number of examples and their collate.
    eval_num_examples: int = 0
    eval_collate: Optional[Collate] = None
    # Optional hook run once Ray is up, before the first step (DPO starts its reference model here).
    attach: Optional[Callable[["OfflineTask", "RunContext"], None]] = None


@dataclass(frozen=True)
class RunResult:
    output_dir: str
    steps: int
    final_metrics: dict
    final_dir: Optional[str]
    stopped_at: Optional[int] = None  # train.stop_after_steps ended the run here (a checkpoint is there)


def check_paths(cfg) -> None:
    """Fail before Ray starts when a model or data path is wrong, naming the config key.

    Hub references (``org/name@sha``) were resolved, and their repositories checked, by
    :func:`rlhf.hub.pin_run_sources`; local paths are checked here.
    """
    models = (("model.path", cfg.model.path, True), ("model.ref_path", cfg.model.ref_path, True),
              ("model.tokenizer_path", cfg.model.tokenizer_path, False))
    for key, path, needs_config in models:
        if not path or is_hub_ref(path, MODEL):
            continue
        if not os.path.isdir(path):
            raise ConfigError(f"{key}: {path!r} is not a directory")
        if needs_config and not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{key}: {path!r} is not an HF model directory (no config.json)")
    for key, path in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
        if path and not is_hub_ref(path, DATASET) and not os.path.exists(path):
            raise ConfigError(f"{key}: {path!r} does not exist")
    check_user_config(cfg)  # precision-independent fields now; the rest once `auto` is resolved


def read_train_and_eval(cfg, tokenizer, read: Callable) -> tuple:
    """``read(cfg, tokenizer, path, split) -> Tokenized`` for ``data.train_path`` and, when set, ``data.eval_path``;
    returns ``(train Tokenized, held-out examples)``. A row the chat template cannot render is reported with its
    source; a training set left without any example (every row's prompt fills ``data.max_length``) is refused."""
    from rlhf.data.formats import located
    from rlhf.data.io import DataError

    d = cfg.data
    with located("data.train_path", d.train_path):
        train = read(cfg, tokenizer, d.train_path, d.split)
    if not train.examples:
        raise DataError(f"data.train_path={d.train_path}: none of its {len(train.skipped_rows)} rows has a token to "
                        f"train on within data.max_length={d.max_length} (each prompt fills it); raise "
                        f"data.max_length or shorten the prompts")
    held_out = []
    if d.eval_path:
        with located("data.eval_path", d.eval_path):
            held_out = read(cfg, tokenizer, d.eval_path, d.eval_split or d.split).examples
    return train, held_out


def load_tokenizer(cfg):
    """The run's tokenizer (``model.tokenizer_path``, else ``model.path``), checked before anything starts."""
    from transformers import AutoTokenizer

    from rlhf.data.vocab import check_tokenizer, config_vocab_size

    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    ref = cfg.model.tokenizer_path or cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(model_dir(ref))
    return check_tokenizer(tokenizer, key, ref, config_vocab_size(model_dir(cfg.model.path)))


def micro_batches(plan: StepPlan, collate: Collate, num_workers: int, micro_batch_size: int) -> List[List[Batch]]:
    """``[rank][micro]`` batches of one step, each padded to its own longest row."""
    return [[collate(rows) for rows in rank] for rank in plan.shards(num_workers, micro_batch_size)]


def evaluate(task: OfflineTask, policy, micro_batch_size: int) -> dict:
    """The objective's metrics over the whole held-out set, each normalized once over all of it."""
    n = task.eval_num_examples
    batches = [task.eval_collate(list(range(i, min(i + micro_batch_size, n)))) for i in range(0, n, micro_batch_size)]
    if task.prepare is not None:
        batches = task.prepare([batches])[0]
    sums = policy.evaluate(batches, task.objective)
    return task.objective.finalize(sums, sum(task.objective.count(b) for b in batches))


def run_steps(task: OfflineTask, policy, plan: EpochPlan, train_cfg, writer: MetricsWriter,
              print_every: int = 1, eval_writer: Optional[MetricsWriter] = None, start_after: int = 0,
              after_step: Optional[Callable[[StepPlan], bool]] = None, progress_bar: Optional[bool] = None,
              check_row: Optional[Callable[[dict], None]] = None, skip_steps: FrozenSet[int] = frozenset()) -> dict:
    """The optimizer-step loop from step ``start_after + 1``; returns the last step's metrics.

    ``skip_steps`` are passed over (no forward, no update; a ``skipped`` row is logged). ``check_row(row)`` (the
    health guard) sees every trained step's row and may raise before the step is checkpointed;
    ``after_step(step)`` runs next (checkpointing); returning True stops the loop there.
    """
    progress = Progress(plan.total_steps, start_after, progress_bar, desc=task.name)
    loop = _StepLoop(task, policy, plan, train_cfg, writer, print_every, eval_writer, progress)
    try:
        return loop.run(start_after, after_step, check_row, skip_steps)
    finally:
        progress.close()


@dataclass
class _StepLoop:
    task: OfflineTask
    policy: object
    plan: EpochPlan
    train_cfg: object
    writer: MetricsWriter
    print_every: int
    eval_writer: Optional[MetricsWriter]
    progress: Progress

    def run(self, start_after: int, after_step, check_row, skip_steps: FrozenSet[int]) -> dict:
        last: dict = {}
        for step in self.plan.steps():
            if step.step <= start_after:  # done before a resume: the plan is a pure function of the seed
                continue
            if step.step in skip_steps:
                last = self._log(skipped_row(step.step, step.epoch), step, SKIPPED_NOTE)
            else:
                last = self._log(self._train(step), step)
                if check_row is not None:
                    check_row(last)
            self._maybe_evaluate(step)
            if after_step is not None and after_step(step):
                break
        return last

    def _train(self, step: StepPlan) -> dict:
        task, t = self.task, self.train_cfg
        started = time.perf_counter()
        shards = micro_batches(step, task.collate, t.num_workers, t.micro_batch_size)
        if task.prepare is not None:
            shards = task.prepare(shards)
        normalizer = sum(task.objective.count(mb) for rank in shards for mb in rank)
        # one optimizer step per plan step: a skipped step's LR is passed over, never shifted onto the next
        results = self.policy.train_step(shards, task.objective, normalizer, schedule_step=step.step - 1)
        sums: Sums = {}
        for result in results:
            sums = add_sums(sums, result.sums)
        return {"step": step.step, "epoch": step.epoch, **task.objective.finalize(sums, normalizer),
                "grad_norm": results[0].grad_norm, "lr": results[0].lr, "num_samples": len(step.indices),
                "step_time_s": round(time.perf_counter() - started, 4)}

    def _log(self, row: dict, step: StepPlan, note: str = "") -> dict:
        self.writer.log(row)
        self.progress.advance(step.step)
        total = self.plan.total_steps
        if step.step % self.print_every == 0 or step.step == total or note:
            self.progress.print(f"[{self.task.name}] step {step.step}/{total} epoch {step.epoch} "
                                + (note or format_row(row, self.task.console_keys)) + f" ({self.progress.eta()})")
        return row

    def _maybe_evaluate(self, step: StepPlan) -> None:
        every = self.train_cfg.eval_every
        if self.eval_writer is None or not (step.step == self.plan.total_steps or (every and step.step % every == 0)):
            return
        metrics = evaluate(self.task, self.policy, self.train_cfg.micro_batch_size)
        self.eval_writer.log({"step": step.step, "epoch": step.epoch, **metrics})
        self.progress.print(f"[{self.task.name}] eval at step {step.step}: "
                            + format_row(metrics, self.task.console_keys))


def save_final(policy, tokenizer, output_dir: str) -> str:
    """Write ``output_dir/final`` atomically: a failed or interrupted save never leaves a ``final/``."""
    final = os.path.join(output_dir, "final")
    staging = os.path.join(output_dir, f".final.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    policy.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(staging, final)
    return final


def describe_plan(task: OfflineTask, plan: EpochPlan, train_cfg, skipped: int) -> str:
    dropped = plan.num_samples - plan.steps_per_epoch * plan.global_batch_size
    return (f"[{task.name}] {plan.num_samples} examples ({skipped} skipped: no token to train on within "
            f"data.max_length), "
            f"{plan.steps_per_epoch} steps/epoch (drop {dropped} per epoch), {plan.total_steps} optimizer steps; "
            f"global batch {train_cfg.global_batch_size} = micro {train_cfg.micro_batch_size} x "
            f"accumulation {train_cfg.grad_accum_steps} x ranks {train_cfg.num_workers}")


@dataclass
class RunContext:
    """What a task's ``attach`` hook may use once Ray is up: the resolved run settings and a group factory."""

    cfg: object
    precision: str
    backend: str
    gpus_per_worker: float
    groups: list = dataclasses.field(default_factory=list)  # every group started, for shutdown
    placements: list = dataclasses.field(default_factory=list)  # shared placement groups, removed last
    user_ds_config: Optional[dict] = None  # strategy.deepspeed_config, read and checked once

    def model_spec(self, path: str, kind: str):
        from rlhf.models.loading import ModelSpec

        m = self.cfg.model
        return ModelSpec(path=path, kind=kind, precision=self.precision, attn_implementation=m.attn_implementation,
                         disable_dropout=m.disable_dropout, gradient_checkpointing=m.gradient_checkpointing,
                         seed=self.cfg.train.seed)

    def engine_spec(self, micro_batch_size: int, grad_accum_steps: int):
        from rlhf.distributed.engine import EngineSpec

        s = self.cfg.strategy
        return EngineSpec(zero_stage=s.zero_stage, precision=self.precision, micro_batch_size=micro_batch_size,
                          grad_accum_steps=grad_accum_steps, offload_optimizer=s.offload_optimizer,
                          user_config=self.user_ds_config)

    def make_group(self, role: str, num_workers: int, placement=None):
        """A worker group for ``role``; ``placement`` (from :meth:`shared_placement`) colocates it."""
        from rlhf.distributed.cluster import actor_env
        from rlhf.distributed.group import GroupResources, WorkerGroup

        resources = GroupResources(num_workers=num_workers, cpus_per_worker=self.cfg.strategy.cpus_per_worker,
                                   gpus_per_worker=self.gpus_per_worker, env_vars=actor_env(self.gpus_per_worker))
        group = WorkerGroup(role, resources, self.backend, placement=placement)
        self.groups.append(group)
        return group

    def shared_placement(self, roles, num_workers: int):
        """One bundle per rank, shared by ``roles`` (each actor takes ``1/len(roles)`` of a bundle)."""
        from rlhf.distributed.placement import Placement

        placement = Placement("+".join(roles), num_workers, self.cfg.strategy.cpus_per_worker,
                              self.gpus_per_worker, share=len(roles))
        self.placements.append(placement)
        return placement

    def shutdown(self) -> None:
        while self.groups:
            self.groups.pop().shutdown()
        while self.placements:
            self.placements.pop().remove()
