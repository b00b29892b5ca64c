"""Shared entry-point plumbing: parse the config, run, and turn expected failures into one-line errors."""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

# Expected failures print "error: <message>" and exit 2 (bad input) or 1 (a worker failed), no traceback.


def quiet_environment() -> None:
    """Offline hub, no per-file progress bars: the driver prints one line per step instead."""
    for key, value in (("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                       ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")):
        os.environ.setdefault(key, value)


def run_cli(config_cls, train: Callable, prog: str, argv: Optional[Sequence[str]] = None) -> int:
    from rlhf.config.loader import parse_cli
    from rlhf.config.schema import ConfigError
    from rlhf.data.io import DataError
    from rlhf.data.plan import PlanError
    from rlhf.rewards.functions import RewardFunctionError

    quiet_environment()
    cfg = parse_cli(config_cls, argv, prog=prog)
    try:
        train(cfg)
    except (ConfigError, DataError, PlanError, RewardFunctionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a worker failure is reported as one line naming role and rank
        from rlhf.distributed.errors import WorkerError
        from rlhf.trainers.health import TrainingHealthError

        if isinstance(exc, (WorkerError, TrainingHealthError)):
            print(f"error: {exc}", file=sys.stderr)
            return 1
        raise
    return 0
