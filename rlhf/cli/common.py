"""Shared entry-point plumbing: parse the config, run, and turn expected failures into one-line errors."""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

from rlhf.cli.dry_run import dry_run
from rlhf.config.cli import parse_cli_args
from rlhf.config.schema import ConfigError
from rlhf.data.io import DataError
from rlhf.data.plan import PlanError
from rlhf.distributed.errors import WorkerError
from rlhf.distributed.packing import InfeasiblePlan
from rlhf.hub import HubError
from rlhf.trainers.health import TrainingHealthError
from rlhf.trainers.interrupt import RunInterrupted
from rlhf.utils.log import get_logger
from rlhf.utils.versions import UnsupportedVersionError

log = get_logger(__name__)

# Expected failures print "error: <message>" and exit 2 (bad input) or 1 (a worker failed), no traceback.


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
        The exit status: 0, 2 for bad input (config, data, an infeasible plan), 1 for a failed worker, 130 / 143 for
        a run stopped by SIGINT / SIGTERM (checkpointed; the last line says how to resume).
    """
    # lazy: pulls in torch; the audit, doctor and demo import this module and stay light until they train
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
    except RunInterrupted as exc:  # SIGINT / SIGTERM: checkpointed (rlhf.trainers.interrupt); 128 + the signal
        log.warning(str(exc))
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - a worker failure is reported as one line naming role and rank
        if isinstance(exc, (WorkerError, TrainingHealthError)):
            log.error(f"error: {exc}")
            return 1
        raise
    return 0
