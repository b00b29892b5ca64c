"""The offline trainers (SFT, reward modelling, DPO): a task, its steps, and the run around them.

    validate everything -> start actors -> for each optimizer step of the plan (:class:`~rlhf.trainers.run.Run`):
        collate the step's global batch -> (DPO online: reference log-probs) -> ``policy.train_batch`` (cut into
        ranks and micro-batches, normalizer counted over the whole batch) -> log the global metrics
    -> save ``final/`` atomically

Everything that can be wrong with the inputs (config, paths, data rows, a plan with no step) fails before any
actor starts. ``final/`` appears only when the run finished: it is written to a temporary directory and renamed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from rlhf.batch import Batch
from rlhf.config.schema import RunConfig, TrainConfig
from rlhf.data.formats import located
from rlhf.data.io import DataError
from rlhf.data.plan import EpochPlan, StepPlan
from rlhf.data.tokenize import Tokenized, example_lengths
from rlhf.data.vocab import load_tokenizer
from rlhf.distributed.engine import OptimSpec
from rlhf.distributed.group import WorkerGroup
from rlhf.distributed.micro_batches import micro_batch_tokens
from rlhf.hub import pin_run_sources
from rlhf.models.loading import CAUSAL_LM
from rlhf.objectives.base import Objective, Totals
from rlhf.trainers.actors import RoleStarter, frozen_group, holding, start_plan, trained_group
from rlhf.trainers.context import RunContext, optim_spec
from rlhf.trainers.descriptor import TrainerKind
from rlhf.trainers.output_dir import claim_output_dir
from rlhf.trainers.preflight import preflight
from rlhf.trainers.run import Run, RunResult, run_identity, with_restarts
from rlhf.utils.log import get_logger
from rlhf.utils.metrics import Progress, format_row
from rlhf.utils.versions import check_versions

log = get_logger(__name__)

Collate = Callable[[Sequence[int]], Batch]


@dataclass
class OfflineTask:
    """What distinguishes SFT, RM and DPO for the shared loop."""

    objective: Objective
    num_examples: int
    collate: Collate  # dataset row indices -> Batch
    # Optional hook run on every step's global batch before training (DPO online: its reference log-probs).
    prepare: Optional[Callable[[Batch], Batch]] = None
    console_keys: tuple = ("loss", "grad_norm", "lr")
    # Held-out data (data.eval_path): number of examples and their collate.
    eval_num_examples: int = 0
    eval_collate: Optional[Collate] = None
    # Optional hook run once the plan's groups are up, before the first step, given the policy and the frozen
    # reference group (None without one); DPO scores its reference log-probs here.
    attach: Optional[Callable[["OfflineTask", "RunContext", WorkerGroup, Optional[WorkerGroup]], None]] = None


def read_train_and_eval(cfg: RunConfig, tokenizer, read: Callable) -> tuple:
    """``read(cfg, tokenizer, path, split) -> Tokenized`` for ``data.train_path`` and, when set, ``data.eval_path``;
    returns ``(train Tokenized, held-out examples)``. A row the chat template cannot render is reported with its
    source; a training set left without any example (every row's prompt fills ``data.max_length``) is refused."""
    d = cfg.data
    with located("data.train_path", d.train_path):
        train = read(cfg, tokenizer, d.train_path, d.split)
    if not train.examples:
        raise DataError(
            f"data.train_path={d.train_path}: none of its {len(train.skipped_rows)} rows has a token to "
            f"train on within data.max_length={d.max_length} (each prompt fills it); raise "
            f"data.max_length or shorten the prompts"
        )
    _check_token_budget(cfg.train, "data.train_path", d.train_path, train)
    held_out = []
    if d.eval_path:
        with located("data.eval_path", d.eval_path):
            held_out_data = read(cfg, tokenizer, d.eval_path, d.eval_split or d.split)
        _check_token_budget(cfg.train, "data.eval_path", d.eval_path, held_out_data)
        held_out = held_out_data.examples
    return train, held_out


def _check_token_budget(train_cfg: TrainConfig, key: str, path: str, data: Tokenized) -> None:
    """Refuse, before any actor starts, a row that no micro-batch of ``train.max_tokens_per_micro_batch`` can hold
    (naming the longest such row by its position in the file)."""
    budget = train_cfg.max_tokens_per_micro_batch
    if not budget or not data.examples:
        return
    costs = [micro_batch_tokens([example_lengths(e)], train_cfg.packing) for e in data.examples]
    longest = max(range(len(costs)), key=lambda i: (costs[i], -i))
    if costs[longest] > budget:
        skipped = set(data.skipped_rows)
        source_rows = [r for r in range(len(data.examples) + len(skipped)) if r not in skipped]
        raise DataError(
            f"{key}={path}: row {source_rows[longest] + 1} (counting from 1) holds {costs[longest]} tokens "
            f"({_how_counted(train_cfg.packing)}), more than train.max_tokens_per_micro_batch={budget}; "
            f"raise the budget to at least {max(costs)} or lower data.max_length"
        )


def _how_counted(packing: bool) -> str:
    return "the sum of its sequences' lengths, packed" if packing else "its sequences x the longest, padded"


def evaluate(task: OfflineTask, policy: WorkerGroup, rows_per_call: int) -> dict:
    """The objective's metrics over the whole held-out set, normalized once over all of it (collated
    ``rows_per_call`` rows at a time, scored in micro-batch chunks)."""
    n, totals = task.eval_num_examples, Totals()
    for start in range(0, n, rows_per_call):
        assert task.eval_collate is not None, "held-out examples come with their collate"
        batch = task.eval_collate(list(range(start, min(start + rows_per_call, n))))
        if task.prepare is not None:
            batch = task.prepare(batch)
        part = policy.evaluate_batch(batch, task.objective)
        totals.add(part.sums, part.normalizer)
    return totals.finalize(task.objective)


@dataclass
class OfflineSteps:
    """An offline task's :class:`~rlhf.trainers.run.Steps`: one optimizer step per plan step."""

    name: str  # the log prefix: the trainer's run_name (rlhf.trainers.kinds)
    task: OfflineTask
    policy: WorkerGroup
    watched = ("loss", "grad_norm")
    zero_loss_key = "loss"  # a supervised loss of exactly 0 is a bug (rlhf.trainers.health)
    ceilings: Tuple[str, ...] = ()
    flat_key = None
    evaluates_start = False

    @property
    def has_eval(self) -> bool:
        return bool(self.task.eval_num_examples)

    @property
    def eval_console_keys(self) -> tuple:
        return self.task.console_keys

    def resume(self, done: int) -> None:
        """Nothing to do: the restored groups are all there is."""

    def train(self, step: StepPlan) -> dict:
        started = time.perf_counter()
        batch = self.task.collate(step.indices)
        if self.task.prepare is not None:
            batch = self.task.prepare(batch)
        # one optimizer step per plan step: a skipped step's LR is passed over, never shifted onto the next
        result = self.policy.train_batch(batch, self.task.objective, schedule_step=step.step - 1)
        return {
            "step": step.step,
            "epoch": step.epoch,
            **result.metrics,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "num_samples": result.num_samples,
            **result.cut_metrics(),
            "step_time_s": round(time.perf_counter() - started, 4),
            **self.policy.perf_metrics(),
        }

    def evaluate(self, step: Optional[StepPlan]) -> dict:
        metrics = evaluate(self.task, self.policy, self.policy.global_batch_size)
        return {"step": step.step if step else 0, "epoch": step.epoch if step else 0, **metrics}

    def console(self, row: dict, progress: Progress) -> str:
        return (
            f"[{self.name}] step {row['step']}/{progress.total} epoch {row['epoch']} "
            + format_row(row, self.task.console_keys)
            + f" ({progress.eta()})"
        )


def describe_plan(name: str, plan: EpochPlan, train_cfg: TrainConfig, skipped: int) -> str:
    dropped = plan.num_samples - plan.steps_per_epoch * plan.global_batch_size
    return (
        f"[{name}] {plan.num_samples} examples ({skipped} skipped: no token to train on within "
        f"data.max_length), "
        f"{plan.steps_per_epoch} steps/epoch (drop {dropped} per epoch), {plan.total_steps} optimizer steps; "
        f"global batch {train_cfg.global_batch_size} = {train_cfg.describe_batching()}"
    )


# (cfg, tokenizer) -> (task, skipped_rows); reads and tokenizes data, starts nothing.
TaskBuilder = Callable[[Any, Any], tuple]


def data_summary(cfg: RunConfig, tokenizer, build_task: TaskBuilder) -> str:
    """``--dry-run``: the data read and tokenized as the run reads it (the descriptors' ``read_data``), in a line."""
    task, skipped = build_task(cfg, tokenizer)
    held_out = f"; {task.eval_num_examples} held-out" if cfg.data.eval_path else ""
    return (
        f"{task.num_examples} examples tokenized ({len(skipped)} skipped: no token to train on within "
        f"data.max_length){held_out}"
    )


def run_offline(cfg: RunConfig, kind: TrainerKind, build_task: TaskBuilder) -> RunResult:
    """An offline task of the trainer ``kind`` end to end; ``train.on_failure=restart`` restarts from
    checkpoints."""
    # hub ids -> org/name@<sha>: config.yaml and every actor get them
    cfg = pin_run_sources(claim_output_dir(cfg, kind.run_name), kind.model_keys)
    return with_restarts(cfg, lambda c: _run_offline_once(c, kind, build_task))


def _run_offline_once(cfg: RunConfig, kind: TrainerKind, build_task: TaskBuilder) -> RunResult:
    check_versions(kind.packages)
    preflight(cfg, kind)
    tokenizer = load_tokenizer(cfg)
    task, skipped = build_task(cfg, tokenizer)
    t = cfg.train
    plan = EpochPlan(
        num_samples=task.num_examples,
        global_batch_size=t.global_batch_size,
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        seed=t.seed,
    )
    log.info(describe_plan(kind.run_name, plan, t, len(skipped)))
    run = Run(cfg, kind, plan, run_identity(cfg, plan))
    # CPUs do not depend on the GPUs per worker, which are known only once the cluster is joined.
    with run.cluster(needed_cpus=kind.plan(cfg, 0.0).needed_cpus) as ctx:
        groups = start_plan(
            kind.plan(cfg, ctx.gpus_per_worker),
            ctx,
            {
                kind.policy_role: _policy_starter(ctx, kind, optim_spec(t, plan.total_steps)),
                "reference": frozen_group(ctx, cfg.model.ref_path or cfg.model.path, CAUSAL_LM),
            },
            name=kind.run_name,
        )
        policy = groups[kind.policy_role]
        if task.attach is not None:
            task.attach(task, ctx, policy, groups.get("reference"))
        last = run.train(OfflineSteps(kind.run_name, task, policy), trained={"policy": policy})
        return run.finish(policy, tokenizer, last)


def _policy_starter(ctx: RunContext, kind: TrainerKind, optim: OptimSpec) -> RoleStarter:
    """The trained model's starter; when the run's reference is held by its ranks (``kind.reference_held``), they
    load it too."""
    m = ctx.cfg.model
    trained = trained_group(ctx, m.path, kind.policy_kind, optim)
    if not kind.reference_held(ctx.cfg):
        return trained
    return holding(ctx, trained, [("reference", m.ref_path or m.path, CAUSAL_LM)], kind.run_name)


def batch_lines(cfg: RunConfig, lines: List[str]) -> List[str]:
    """``--dry-run``'s batch lines of an offline trainer (``TrainerKind.batch_lines``): ``lines`` (the global batch,
    LoRA), then the optimizer steps the data will give."""
    t = cfg.train
    return lines + [
        f"  optimizer steps: min(train.max_steps={t.max_steps}, train.max_epochs={t.max_epochs} x "
        f"floor(rows / {t.global_batch_size})), rows counted at run time; data.max_length {cfg.data.max_length}"
    ]
