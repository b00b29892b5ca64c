"""Shared entry-point plumbing: parse the config, run, and turn expected failures into one-line errors."""

from __future__ import annotations

import os
import tempfile
import traceback
from typing import Callable, Optional, Sequence

from rlhf.cli.dry_run import dry_run
from rlhf.config.cli import parse_cli_args
from rlhf.config.schema import ConfigError
from rlhf.data.io import DataError
from rlhf.data.plan import PlanError
from rlhf.distributed.errors import WorkerError, cause_line
from rlhf.distributed.packing import InfeasiblePlan
from rlhf.hub import HubError
from rlhf.trainers.health import TrainingHealthError
from rlhf.trainers.interrupt import RunInterrupted
from rlhf.utils.log import get_logger
from rlhf.utils.versions import UnsupportedVersionError

log = get_logger(__name__)

# Expected failures print "error: <message>" and exit 2 (bad input); a run-time failure (a worker, an engine, an
# environment or agent, anything else) prints one line and exits 1, its traceback in train.output_dir/error.log.


def quiet_environment() -> None:
    """No per-file progress bars: the driver prints one line per step instead.

    The hub is left as the user set it: online, a hub id (``model.path=Qwen/Qwen2.5-0.5B-Instruct``) is downloaded
    into the HF cache; with ``HF_HUB_OFFLINE=1`` only cached ones resolve (``rlhf.hub``). Local paths never reach
    the network either way.
    """
    for key, value in (
        ("TOKENIZERS_PARALLELISM", "false"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"),
    ):
        os.environ.setdefault(key, value)


def run_cli(config_cls, train: Callable, prog: str, argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` into ``config_cls`` and ``train`` it, or with ``--dry-run`` print its resource plan.

    Returns:
        The exit status: 0, 2 for bad input (config, data, an infeasible plan), 1 for a run-time failure, 130 / 143 for
        a run stopped by SIGINT / SIGTERM (checkpointed; the last line says how to resume).
    """
    # lazy: pulls in torch; the audit, doctor and demo import this module and stay light until they train
    from rlhf.envs.base import EnvError
    from rlhf.rewards.functions import RewardFunctionError

    quiet_environment()
    request = parse_cli_args(config_cls, argv, prog=prog)
    try:
        if request.dry_run:
            dry_run(request.config, prog=prog, cluster=request.cluster)
        else:
            train(request.config)
    except (
        ConfigError,
        DataError,
        HubError,
        PlanError,
        RewardFunctionError,
        InfeasiblePlan,
        UnsupportedVersionError,
    ) as exc:
        log.error(f"error: {exc}")
        return 2
    except EnvError as exc:
        if exc.episode is not None:  # an episode failed at run time: below
            log.error(failure_line(exc, save_traceback(exc, request.config)))
            return 1
        log.error(f"error: {exc}")  # a spec that does not load: bad input
        return 2
    except TrainingHealthError as exc:  # the guard's own verdict, with the step and the last good checkpoint
        log.error(f"error: {exc}")
        return 1
    except RunInterrupted as exc:  # SIGINT / SIGTERM: checkpointed (rlhf.trainers.interrupt); 128 + the signal
        log.warning(str(exc))
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - a run-time failure is one line; its traceback goes to a file
        log.error(failure_line(exc, save_traceback(exc, request.config)))
        return 1
    return 0


def failure_line(exc: BaseException, traceback_path: Optional[str]) -> str:
    """The one line a run-time failure prints: a failure the run names (a worker's role, rank and call; an
    environment's or agent's step, episode and turn) as its message, anything else as its type
    and cause (:func:`rlhf.distributed.errors.cause_line`); then the step it happened at (the run's note) and where
    its traceback is."""
    from rlhf.envs.base import EnvError  # lazy: the CLI stays light until it trains
    from rlhf.rollout.episodes import EpisodeError

    named = isinstance(exc, (WorkerError, EnvError, EpisodeError))
    text = str(exc).strip() if named else f"{type(exc).__name__}: {cause_line(exc)}"
    where = [note for note in getattr(exc, "__notes__", ()) if note not in text]
    details = where + ([f"traceback: {traceback_path}"] if traceback_path else [])
    return f"error: {text.splitlines()[0] if text else type(exc).__name__}" + (
        f" ({'; '.join(details)})" if details else ""
    )


def save_traceback(exc: BaseException, cfg) -> Optional[str]:
    """The failure's whole traceback (every chained cause: a dead actor's creation-task traceback) in
    ``train.output_dir/error.log``, else a temporary file; its path, or ``None`` when nothing could be written."""
    text = "".join(traceback.format_exception(exc))
    out = cfg.train.output_dir  # every run config has train.output_dir (rlhf.config.schema.RunConfig)
    try:
        if out and os.path.isdir(out):
            path = os.path.join(out, "error.log")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            return path
        fd, path = tempfile.mkstemp(prefix="rlhf-error-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    except OSError:
        return None
