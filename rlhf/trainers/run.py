"""One training run's lifecycle, the same for every trainer (SFT, RM, DPO, online RL).

A trainer gives the run its :class:`Steps` (how to train one step, evaluate, and print a row); the run owns the
rest::

    run = Run(cfg, kind, plan, identity)            # checkpoints and output dir checked: before any actor starts
    with run.cluster(needed_cpus) as ctx:           # Ray joined; every group and placement shut down on exit
        ... build the worker groups through ctx ...
        last = run.train(steps, trained)             # restore -> the step loop under the health guard
        return run.finish(policy, tokenizer, last)   # final/ saved atomically

The step loop is the only one: for each step of the plan after the restored one, a step in ``train.skip_steps``
logs a ``skipped`` row; any other logs ``steps.train(step)``'s row, which the health guard then checks (before the
step is checkpointed); held-out evaluation follows when due; then the checkpoint, which may end the run
(``train.stop_after_steps``). With ``health.action=skip`` a tripped guard rewinds to the newest checkpoint and
the loop runs again with the tripping step skipped (:meth:`Run._train_with_rewinds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import (
    Callable,
    FrozenSet,
    Iterator,
    Mapping,
    NoReturn,
    Optional,
    Protocol,
    Tuple,
)

from rlhf.config.schema import ConfigError, RunConfig, RunConfigT
from rlhf.data.plan import EpochPlan, StepPlan
from rlhf.distributed.errors import WorkerError
from rlhf.trainers.checkpoint import Checkpointable, RunCheckpoints
from rlhf.trainers.context import RunContext, start_cluster
from rlhf.trainers.descriptor import TrainerKind
from rlhf.trainers.health import TrainingHealthError, check_health, guard_from_config
from rlhf.trainers.interrupt import RunInterrupted, StopSignals, signal_name
from rlhf.trainers.output_dir import prepare_output_dir
from rlhf.utils.log import get_logger
from rlhf.utils.metrics import (
    SKIPPED_NOTE,
    Progress,
    RunWriters,
    format_row,
    progress_bar_setting,
    read_metrics,
    skipped_row,
)

log = get_logger(__name__)


@dataclass(frozen=True)
class RunResult:
    output_dir: str
    steps: int
    final_metrics: dict
    final_dir: Optional[str]
    stopped_at: Optional[int] = None  # train.stop_after_steps ended the run here (a checkpoint is there)


class Steps(Protocol):
    """What a trainer gives :class:`Run`: one step, held-out evaluation, and how its rows read on the console."""

    name: str  # the run's name in console lines and checkpoints: sft | rm | dpo | rl
    # read-only (properties) so that a trainer may give each as a class attribute, a field or a property

    @property
    def watched(self) -> Tuple[str, ...]:
        """Row keys the health guard keeps finite."""

    @property
    def zero_loss_key(self) -> Optional[str]:
        """A row key whose exact 0 the guard reports (None: a zero loss can be legitimate)."""

    @property
    def ceilings(self) -> Tuple[str, ...]:
        """Row keys the health guard keeps below their ``health.max_*`` (rlhf.trainers.health.CEILINGS)."""

    @property
    def flat_key(self) -> Optional[str]:
        """A row key whose exact zero, ``health.flat_reward_steps`` steps in a row, trips the guard (None: off)."""

    @property
    def eval_console_keys(self) -> Tuple[str, ...]:
        """The evaluation row's keys printed on the console."""

    @property
    def evaluates_start(self) -> bool:
        """Evaluate the starting model (step 0) before the first step of a fresh run."""

    @property
    def has_eval(self) -> bool:
        """Held-out data is set: evaluate every train.eval_every steps and after the last."""

    def resume(self, done: int) -> None:
        """Called before training continues from restored state (a resume or a rewind): the state after step
        ``done``."""

    def train(self, step: StepPlan) -> dict:
        """Train ``step``; returns its row (``step``, ``epoch`` and the metrics)."""

    def evaluate(self, step: Optional[StepPlan]) -> dict:
        """The held-out row after ``step`` (``None``: the starting model)."""

    def console(self, row: dict, progress: Progress) -> str:
        """The console line of a trained step's row."""


class Run:
    """Checkpoints, metric writers, the health guard, progress and rewinds around a trainer's :class:`Steps`."""

    def __init__(self, cfg: RunConfig, kind: TrainerKind, plan: EpochPlan, identity: dict) -> None:
        """``kind``: the trainer's descriptor (its name in log lines, its resume command, its libraries). Checks
        ``train.skip_steps`` against the plan, that a checkpoint in ``train.output_dir`` belongs to this run
        (``identity``: what a resumed run must share with it), and claims the output directory. Nothing starts."""
        self.cfg, self.kind, self.name, self.plan = cfg, kind, kind.run_name, plan
        name = kind.run_name
        check_skip_steps(cfg.train, plan.total_steps)
        self.checkpoints = RunCheckpoints(cfg.train, identity, name)
        self.checkpoints.prepare()  # a checkpoint of another run fails here, before anything is written or started
        prepare_output_dir(cfg, self.checkpoints)  # an old run there is refused, or deleted; config.yaml written
        self.writers: Optional[RunWriters] = None
        # what checkpoints hold: the trainable groups by role, and driver state (RL: samples generated ahead)
        self.trained: Mapping[str, Checkpointable] = {}
        self.stop = StopSignals(name)  # SIGINT / SIGTERM while the cluster is up: a checkpoint, then a clean exit

    @contextlib.contextmanager
    def cluster(self, needed_cpus: float) -> Iterator["RunContext"]:
        """Join or start Ray for ``needed_cpus``; on exit the metric files are closed and every group shut down."""
        with self.stop:
            ctx = start_cluster(self.cfg, self.kind.packages, needed_cpus)
            try:
                yield ctx
            finally:
                if self.writers is not None:
                    self.writers.close()
                ctx.shutdown()

    def train(self, steps: Steps, trained: Mapping[str, Checkpointable]) -> dict:
        """Restore the ``trained`` groups (by role) from the newest checkpoint, then train the rest of the plan;
        returns the last step's row."""
        self.trained = trained
        done = self.checkpoints.restore(trained)
        self.writers = RunWriters(self.cfg, resume_after=done or None, with_eval=steps.has_eval)
        return self._train_with_rewinds(steps, trained, done)

    def finish(self, policy, tokenizer, last: dict) -> RunResult:
        """The run's result: ``final/`` saved unless ``train.stop_after_steps`` ended it early (its checkpoint is
        what there is then) or ``train.save_final`` is off."""
        t, total = self.cfg.train, self.plan.total_steps
        if self.checkpoints.stopped_early:
            return RunResult(
                output_dir=t.output_dir, steps=total, final_metrics=last, final_dir=None, stopped_at=last.get("step")
            )
        final_dir = (
            save_final(policy, tokenizer, t.output_dir, self.cfg.model.lora.save_merged) if t.save_final else None
        )
        if final_dir:
            log.info(f"[{self.name}] saved {final_dir}")
        return RunResult(output_dir=t.output_dir, steps=total, final_metrics=last, final_dir=final_dir)

    # ------------------------------------------------------------------ the loop
    def _train_with_rewinds(self, steps: Steps, trained: Mapping[str, Checkpointable], done: int) -> dict:
        """The step loop from step ``done + 1`` under the health guard.

        With ``health.action=skip``, a guard that trips at step ``k`` does not end the run: the ``trained`` groups
        are loaded from the newest checkpoint (step ``c < k``: the guard runs before a step's checkpoint), the
        metric files go back to ``c``, ``k`` joins the skipped steps, and training goes on from ``c + 1``. Steps
        ``c+1 .. k-1`` replay exactly, so the run ends as one started with ``k`` in ``train.skip_steps`` (the
        large-run recipe of rewinding past a loss spike and skipping its data, Chowdhery et al. 2022, PaLM
        sec. 5.1).
        """
        h = self.cfg.health
        skip_steps = set(self.cfg.train.skip_steps)
        if h.action == "skip":
            self.checkpoints.save_start(trained)  # a trip before the first save_every checkpoint rewinds to the start
        skipped_here, first = 0, True
        while True:
            guard = guard_from_config(
                h, steps.watched, steps.zero_loss_key, ceilings=steps.ceilings, flat_key=steps.flat_key
            )
            if guard is not None:  # decide as the uninterrupted run would: its statistics from the rows kept
                assert self.writers is not None, "train() opens the writers before this loop"
                guard.observe([row for row in read_metrics(self.writers.metrics.path) if row["step"] <= done])
            try:
                return self._fit(steps, done, frozenset(skip_steps), guard, first)
            except TrainingHealthError as exc:
                if h.action != "skip" or exc.step is None:
                    raise
                if skipped_here >= h.max_skips:
                    raise TrainingHealthError(
                        f"{exc}; stopped: health.max_skips={h.max_skips} steps were skipped already", step=exc.step
                    ) from None
                skipped_here, first = skipped_here + 1, False
                done = self.checkpoints.rewind(trained)
                assert self.writers is not None, "train() opens the writers before this loop"
                self.writers.rewind(done)
                skip_steps.add(exc.step)
                log.info(
                    f"[health] {exc}; rewound to the checkpoint of step {done}, step {exc.step} will be skipped "
                    f"(health.action=skip, {skipped_here}/{h.max_skips})"
                )

    def _fit(self, steps: Steps, start_after: int, skip_steps: FrozenSet[int], guard, first: bool) -> dict:
        """Steps ``start_after + 1 ..`` of the plan (each a pure function of the seed and its number, so a resume
        or a rewind replays exactly); returns the last step's row."""
        total = self.plan.total_steps
        progress = Progress(total, start_after, progress_bar_setting(self.cfg.logging.progress_bar), desc=self.name)
        try:
            if first and start_after == 0:
                if steps.evaluates_start and steps.has_eval:
                    self._evaluate(steps, None, progress)
            else:
                steps.resume(start_after)
            last: dict = {}
            for step in self.plan.steps(start=start_after + 1):
                if self.stop.requested:
                    self._stop(step.step - 1, trained_here=step.step - 1 > start_after)
                if step.step in skip_steps:
                    last = skipped_row(step.step, step.epoch)
                    self._log(
                        last,
                        progress,
                        f"[{self.name}] step {step.step}/{total} epoch {step.epoch} {SKIPPED_NOTE} ({progress.eta()})",
                    )
                else:
                    with failure_at(f"{self.name} step {step.step}"):
                        last = steps.train(step)
                    self._log(last, progress, steps.console(last, progress), quiet=not self._prints(step.step))
                    if guard is not None:
                        check_health(guard, self.cfg.health.action, last)
                if steps.has_eval and self._evaluation_due(step.step):
                    self._evaluate(steps, step, progress)
                if self.checkpoints.after_step(step.step, total, self.trained):
                    break
            return last
        except RunInterrupted as exc:
            if not exc.at_once:
                raise
            raise self._stopped_at_once(exc.signum) from None
        finally:
            progress.close()

    def _stop(self, done: int, trained_here: bool) -> NoReturn:
        """A signal asked the run to stop (:mod:`rlhf.trainers.interrupt`): checkpoint step ``done`` (when this
        invocation trained it) and raise :class:`RunInterrupted` naming the checkpoint and the resume command."""
        assert self.stop.signum is not None, "called once a stop was requested"
        signame = signal_name(self.stop.signum)
        resume = self.kind.resume_command(self.cfg.train.output_dir)
        if trained_here:
            path = self.checkpoints.save_stopped(done, self.trained)
            message = f"[{self.name}] stopped by {signame} after step {done}: checkpoint {path}; resume with: {resume}"
        else:
            message = f"[{self.name}] stopped by {signame} before training a step; run it again with: {resume}"
        raise RunInterrupted(message, self.stop.signum)

    def _stopped_at_once(self, signum: int) -> RunInterrupted:
        """A second signal abandoned the step in progress: the message names the newest checkpoint."""
        found = self.checkpoints.store.latest()
        resume = self.kind.resume_command(self.cfg.train.output_dir)
        saved = (
            f"the newest checkpoint is step {found[1]['step']} ({found[0]})" if found else "no checkpoint was written"
        )
        return RunInterrupted(
            f"[{self.name}] stopped at once by a second {signal_name(signum)}, the step in progress lost; {saved}; "
            f"resume with: {resume}",
            signum,
            at_once=True,
        )

    def _log(self, row: dict, progress: Progress, line: str, quiet: bool = False) -> None:
        assert self.writers is not None, "train() opens the writers before any step is logged"
        self.writers.metrics.log(row)
        progress.advance(row["step"])
        if not quiet:
            progress.print(line)

    def _prints(self, step: int) -> bool:
        return step % self.cfg.logging.print_every == 0 or step == self.plan.total_steps

    def _evaluation_due(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return step == self.plan.total_steps or bool(every and step % every == 0)

    def _evaluate(self, steps: Steps, step: Optional[StepPlan], progress: Progress) -> None:
        row = steps.evaluate(step)
        # only called with steps.has_eval, which train() passed as with_eval: the eval writer is open
        assert self.writers is not None and self.writers.eval is not None, "train() opens the eval writer"
        self.writers.eval.log(row)
        progress.print(f"[{self.name}] eval at step {row['step']}: " + format_row(row, steps.eval_console_keys))


def check_skip_steps(t, total_steps: int) -> None:
    """``train.skip_steps`` must name steps of the run (before any actor starts)."""
    beyond = sorted(s for s in t.skip_steps if s > total_steps)
    if beyond:
        raise ConfigError(f"train.skip_steps: {beyond} past the run's last step ({total_steps})")


@contextlib.contextmanager
def failure_at(where: str):
    """An exception raised inside carries ``where`` (``rl step 3``) as a note (PEP 678): the CLI's one-line error
    says at which step a worker died (rlhf.cli.common.run_cli); the message itself is unchanged."""
    try:
        yield
    except Exception as exc:
        notes = exc.__dict__.setdefault("__notes__", [])  # what add_note does (Python >= 3.11), on any version
        if where not in notes:
            notes.append(where)
        raise


def with_restarts(cfg: RunConfigT, run: Callable[[RunConfigT], RunResult]) -> RunResult:
    """``run(cfg)``; with ``train.on_failure=restart``, a dead or failing actor (:class:`WorkerError`) tears the
    actors down and runs again from the newest checkpoint, at most ``train.max_restarts`` times."""
    restarts = 0
    while True:
        try:
            return run(cfg)
        except WorkerError as exc:
            t = cfg.train
            if t.on_failure != "restart" or restarts >= t.max_restarts:
                raise
            restarts += 1
            log.info(f"[restart {restarts}/{t.max_restarts}] {exc}; restarting from the newest checkpoint")
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, resume=True))


def save_final(policy, tokenizer, output_dir: str, merged: bool = True) -> str:
    """Write ``output_dir/final`` atomically: a failed or interrupted save never leaves a ``final/``. With LoRA,
    ``merged`` (``model.lora.save_merged``): the merged model plus ``final/adapter/``; else the adapter alone."""
    final = os.path.join(output_dir, "final")
    staging = os.path.join(output_dir, f".final.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    policy.save_pretrained(staging, merged)
    tokenizer.save_pretrained(staging)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(staging, final)
    return final


def run_identity(cfg: RunConfig, plan: EpochPlan) -> dict:
    """What a checkpoint must share with the run that resumes it (see ``RunCheckpoints``)."""
    t = cfg.train
    return {
        "train.seed": t.seed,
        "train.global_batch_size": t.global_batch_size,
        "train.num_workers": t.num_workers,
        "strategy.zero_stage": cfg.strategy.zero_stage,
        "steps in the run": plan.total_steps,
        "examples in data.train_path": plan.num_samples,
    }
