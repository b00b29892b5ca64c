"""Check a run config against the accumulation contract before spending GPU hours on it:
``python -m rlhf.cli.audit --config RUN.yaml [--trainer sft|rm|dpo|ppo] [--steps N] [--precision fp64] [KEY=VALUE ...]``

1. Lint (no run): the known hazards of the config, each naming its key (:mod:`rlhf.audit.lint`). An error stops
   here with exit code 1; ``--lint-only`` stops here anyway.
2. Runs: the first N steps under the configured (micro x accumulation x ranks) and two other factorisations of the
   same global batch, through the real trainers on one Ray cluster (``RAY_ADDRESS`` / ``ray.address``, else a
   local one), each in a temporary directory removed afterwards unless ``--keep``.
3. A table of loss, grad-norm and every other logged number per step, the final weights' worst difference and a
   verdict (:mod:`rlhf.audit.compare`).

Exit status: 0 the run keeps the contract; 1 a lint error or a step / the weights past tolerance (named), or a
failed worker; 2 a usage or configuration error (as the training commands). docs/audit.md has the details.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import List, Optional, Sequence, Tuple

from rlhf.audit import compare
from rlhf.audit.factorizations import factorizations, parse_factorizations, with_configured
from rlhf.audit.lint import ERROR, from_config_error, lint
from rlhf.audit.runner import (
    RunFailed,
    audit_overrides,
    cluster,
    log_tail,
    run_one,
    runs_deepspeed_config,
    split_fits,
    split_overrides,
    weights_diff,
)
from rlhf.audit.trainers import TRAINERS, infer_trainer
from rlhf.cli.common import quiet_environment
from rlhf.config.deepspeed_check import read_user_config
from rlhf.config.loader import load_config
from rlhf.config.schema import ConfigError, RunConfig
from rlhf.data.io import DataError, read_rows
from rlhf.data.plan import PlanError
from rlhf.distributed.errors import WorkerError
from rlhf.hub import HubError
from rlhf.trainers.health import TrainingHealthError
from rlhf.trainers.interrupt import RunInterrupted
from rlhf.trainers.preflight import preflight
from rlhf.utils.log import get_logger

log = get_logger(__name__)
PROG = "python -m rlhf.cli.audit"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 contract kept; 1 a lint error or a difference past tolerance "
        "(the key, or the step and metric, named); 2 a usage or config error.",
    )
    p.add_argument("--config", "-c", metavar="FILE_OR_PRESET", default=None, help="the run's YAML config or preset")
    p.add_argument(
        "--trainer",
        choices=("sft", "rm", "dpo", "ppo"),
        default=None,
        help="the trainer the config is for (default: told by its sections, saved-config line or preset)",
    )
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run (RL: RL steps); default 3")
    p.add_argument(
        "--precision",
        choices=("as-configured", "fp64"),
        default="as-configured",
        help="fp64: train every run in float64 (strategy.precision=fp64, on ZeRO 0: the only stage "
        "DeepSpeed trains float64 on), so that rounding is ~1e-16 and tolerances can be 1e-10",
    )
    p.add_argument(
        "--factorizations",
        metavar="MxAxR,...",
        default="",
        help="the other splits to run (micro x accumulation x ranks), e.g. 1x8x1,2x2x2; default: micro 1 on "
        "the configured ranks and the configured micro on one rank",
    )
    p.add_argument(
        "--tol-first",
        type=float,
        default=None,
        help="relative tolerance at step 1 (default fp32 1e-5, bf16 3e-3, fp64 1e-10)",
    )
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        help="relative tolerance from step 2 on (default fp32 1e-3, bf16 1e-2, fp64 1e-10)",
    )
    p.add_argument(
        "--tol-weights",
        type=float,
        default=None,
        help="relative L2 tolerance per tensor of the final weights (default fp32 1e-3, bf16 1e-2, fp64 1e-8)",
    )
    p.add_argument(
        "--atol",
        type=float,
        default=None,
        help="absolute floor for numbers near 0 (default fp32 1e-5, bf16 5e-4, fp64 1e-12)",
    )
    p.add_argument("--lint-only", action="store_true", help="only lint the config; start nothing")
    p.add_argument("--keep", action="store_true", help="keep the runs' directories and logs")
    p.add_argument(
        "--workdir",
        default="",
        help="where the runs write (default: a new temporary directory next to train.output_dir, "
        "else in the system's temporary directory); on a multi-node cluster, storage every node "
        "writes",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, as for the training commands")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    quiet_environment()
    parser = _parser()
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    try:
        return _audit(args)
    except ConfigError as exc:
        log.error(f"error: {exc}")
        return 2
    except _Failed as exc:
        return exc.code
    except RunInterrupted as exc:  # SIGINT / SIGTERM during a run (rlhf.trainers.interrupt)
        log.warning(str(exc))
        return exc.exit_code


class _Failed(Exception):
    """A run failed and was reported; ``code`` is the exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _audit(args) -> int:
    trainer = TRAINERS[args.trainer or infer_trainer(args.config, args.overrides)]
    log.info(
        f"audit: {trainer.name} config {args.config or '(defaults)'}"
        + (f" with {' '.join(args.overrides)}" if args.overrides else "")
    )
    cfg, user_ds, findings = _lint(trainer, args)
    errors = [f for f in findings if f.level == ERROR]
    if errors:
        print(f"VERDICT: FAIL (lint): {', '.join(f.name() for f in errors)}")
        return 1
    if args.lint_only:
        print("VERDICT: lint ok (--lint-only: no run)")
        return 0
    return _run_and_compare(trainer, cfg, user_ds, args)


def _lint(trainer, args):
    """Print the lint section; returns ``(cfg or None, the user DeepSpeed JSON, findings)``."""
    cfg, user_ds, notes = None, None, []
    try:
        cfg = load_config(trainer.config_cls, args.config, args.overrides)
    except ConfigError as exc:
        finding = from_config_error(str(exc))
        if finding is None:
            raise
        findings = [finding]
        notes.append("the other checks need a config that validates: fix this first")
    else:
        user_ds = read_user_config(cfg.strategy.deepspeed_config)
        rows, note = _count_rows(cfg)
        notes += [note] if note else []
        findings = lint(cfg, user_ds, rows)
    errors = sum(f.level == "error" for f in findings)
    print(f"lint: {errors} error(s), {len(findings) - errors} warning(s)")
    for f in findings:
        print(f"  {f.level:<7}  {f}")
    for note in notes:
        print(f"  note     {note}")
    return cfg, user_ds, findings


def _count_rows(cfg: RunConfig) -> Tuple[Optional[int], str]:
    """Rows of ``data.train_path`` (RL: prompts), read as the trainer reads them; ``(None, why)`` when they cannot
    be read here (a path only the cluster sees, a hub dataset offline)."""
    d = cfg.data
    try:
        return len(read_rows(d.train_path, required=(), split=d.split, config_name=d.config_name)), ""
    except (DataError, HubError, OSError) as exc:
        return None, f"data.train_path not read here, its rows not checked: {exc}"


def _run_and_compare(trainer, cfg: RunConfig, user_ds, args) -> int:
    preflight(cfg, trainer)  # what each run checks before its actors start, once before the audit's cluster starts
    t = cfg.train
    fits = split_fits(cfg)
    # under a token budget the configured run is 1 row a micro-batch to DeepSpeed (rlhf.audit.runner.split_overrides)
    splits = factorizations(
        t.global_batch_size,
        t.engine_micro_batch_size,
        t.num_workers,
        fits=fits,
        sequence=cfg.strategy.sequence_parallel_size,
    )
    if args.factorizations:
        try:
            splits = with_configured(splits[0], parse_factorizations(args.factorizations, t.global_batch_size, fits))
        except ValueError as exc:
            log.error(f"error: --factorizations {exc}")
            return 2
    if len(splits) < 2:
        log.error(
            f"error: train.global_batch_size={t.global_batch_size} has no other factorisation than "
            f"{splits[0].label} on at most {t.num_workers} rank(s): nothing to compare"
        )
        return 2
    workdir = _workdir(cfg, args.workdir)
    try:
        outcomes, precision = _runs(trainer, cfg, user_ds, splits, workdir, args)
        tol = compare.tolerances_for(precision, args.tol_first, args.tol, args.tol_weights, args.atol)
        return _report(trainer, outcomes, tol, precision)
    finally:
        if args.keep:
            log.info(f"runs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _workdir(cfg: RunConfig, given: str) -> str:
    """``--workdir``, else a new directory next to ``train.output_dir`` (storage the cluster's nodes write, as the
    run needs), else in the system's temporary directory."""
    if given:
        os.makedirs(given, exist_ok=True)
        return tempfile.mkdtemp(prefix="audit-", dir=given)
    parent = os.path.dirname(os.path.abspath(cfg.train.output_dir)) if cfg.train.output_dir else None
    return tempfile.mkdtemp(prefix="rlhf-audit-", dir=parent if parent and os.path.isdir(parent) else None)


def _runs(trainer, cfg: RunConfig, user_ds, splits, workdir: str, args):
    """Every factorisation's run: ``(outcomes, the precision they trained in)``.

    Raises:
        _Failed: A run failed (reported here).
    """
    precision = "fp64" if args.precision == "fp64" else ""
    ds_copy = runs_deepspeed_config(user_ds, workdir, fp64=precision == "fp64")
    cfgs = [
        load_config(
            trainer.config_cls,
            args.config,
            [
                *args.overrides,
                *audit_overrides(cfg, args.steps, os.path.join(workdir, f.label), precision, ds_copy),
                *split_overrides(cfg, f),
            ],
        )
        for f in splits
    ]
    what = {"configured": "the configured split"}
    log.info(
        f"runs: {len(splits)} factorisations of the global batch {cfg.train.global_batch_size} "
        f"(micro x accumulation x ranks), {args.steps} {'RL ' if trainer.online else ''}step(s) each: "
        + ", ".join(f"{f.label} ({what.get(f.why, f.why)})" for f in splits)
    )
    if precision == "fp64" and cfg.strategy.zero_stage != 0:
        log.info(
            f"  in fp64 on ZeRO 0 (the only stage DeepSpeed trains float64 on; the run's is "
            f"strategy.zero_stage={cfg.strategy.zero_stage})"
        )
    outcomes = []
    with cluster(cfgs) as resolved:
        for f, run_cfg in zip(splits, cfgs):
            try:
                outcome = run_one(trainer.train, run_cfg, f, os.path.join(workdir, f.label + ".log"))
            except RunFailed as exc:
                raise _Failed(_failed(exc, args.keep)) from None
            outcomes.append(outcome)
            short = f" (the run has only {len(outcome.rows)})" if len(outcome.rows) < args.steps else ""
            log.info(f"  {f.label}: {len(outcome.rows)} steps{short} in {outcome.seconds:.0f} s")
    return outcomes, precision or resolved


def _failed(exc, keep: bool) -> int:
    """Report a failed run like the training commands do: 2 for bad input, 1 for a failed worker."""
    from rlhf.rewards.functions import RewardFunctionError  # lazy: pulls in torch (--help and the lint need none)

    bad_input = (ConfigError, DataError, HubError, PlanError, RewardFunctionError)
    expected = isinstance(exc.cause, bad_input + (WorkerError, TrainingHealthError))
    if expected:
        log.error(f"error: {exc}")
    tail = log_tail(exc.log)
    if tail:
        log.error(
            f"--- the end of the {exc.label} run's log ({exc.log}{'' if keep else ', removed: --keep keeps it'}):"
            f"\n{tail}"
        )
    if not expected:  # a bug: its traceback, as the training commands give one
        raise exc.cause
    return 2 if isinstance(exc.cause, bad_input) else 1


def _report(trainer, outcomes: List, tol, precision: str) -> int:
    labels = {o.factorization.label: f"{o.factorization.label} ({o.factorization.why})" for o in outcomes}
    steps = compare.compare_steps({o.factorization.label: o.rows for o in outcomes}, tol, rl=trainer.online)
    print(
        f"\n{precision}; tolerance: relative {tol.first:.0e} at step 1, {tol.later:.0e} later, absolute "
        f"{tol.atol:.0e} for numbers near 0; reference: {next(iter(labels.values()))}"
    )
    for line in compare.table(steps, trainer.primary_loss, list(labels)):
        print(line)
    weights = []
    if all(s.status == compare.OK for s in steps):
        ref = outcomes[0]
        weights = [weights_diff(ref.final_dir, o.final_dir, o.factorization.label) for o in outcomes[1:]]
        worst = max(weights, key=lambda w: w.worst if w.worst == w.worst else float("inf"))
        print(
            f"\nfinal weights: worst relative L2 difference {worst.worst:.1e}"
            + (f" ({worst.tensor}, {labels[worst.run]} vs {labels[ref.factorization.label]})" if worst.tensor else "")
            + f"; tolerance {tol.weights:.0e}"
        )
    result = compare.verdict(steps, weights, tol, labels)
    print(result.line)
    return result.code


if __name__ == "__main__":
    sys.exit(main())
