"""A graceful stop on SIGINT (Ctrl-C) and SIGTERM (what SLURM, Kubernetes and ``ray job stop`` send before a kill).

While a run holds :class:`StopSignals` (``rlhf.trainers.run.Run.cluster``), the first SIGINT or SIGTERM only records
that a stop was asked for: the step in progress finishes, the run's step loop writes a checkpoint of it and raises
:class:`RunInterrupted`, whose message names the checkpoint and the exact command that resumes the run; the command
lines exit with ``128 + signal`` (130 for SIGINT, 143 for SIGTERM) and no traceback. A second signal stops at once:
:class:`RunInterrupted` is raised where the driver is, the step in progress is lost, and the message names the newest
checkpoint. Either way the run's actors are shut down on the way out.

Signals reach Python's main thread only, so a run driven from another thread is not watched (it stops when its
process is killed, as before).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Callable, Dict, Optional, Union

from rlhf.utils.log import get_logger

log = get_logger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
Handler = Union[Callable[[int, Optional[FrameType]], object], int, signal.Handlers, None]


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by a signal. A ``KeyboardInterrupt``, so that no ``except Exception`` on the way out (a worker
    failure handler, the audit's run wrapper) mistakes it for a failure.

    Args:
        message: What was saved and how to resume (printed by the command lines as the run's last line).
        signum: The signal that stopped it; the exit status is ``128 + signum``.
        at_once: A second signal: the step in progress was abandoned where it stood.
    """

    def __init__(self, message: str, signum: int, at_once: bool = False) -> None:
        super().__init__(message)
        self.message, self.signum, self.at_once = message, signum, at_once

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return self.message


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """A context that turns the first SIGINT / SIGTERM into a stop request (:attr:`requested`) and the second into
    :class:`RunInterrupted` at once; the previous handlers come back on exit. ``name``: the run's log prefix."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.signum: Optional[int] = None  # the first signal received
        self._previous: Dict[int, Handler] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None:
            raise RunInterrupted(
                f"[{self.name}] stopped at once by a second {signal_name(signum)}", signum, at_once=True
            )
        self.signum = signum
        log.warning(
            f"[{self.name}] {signal_name(signum)}: stopping after the step in progress, with a checkpoint "
            f"(send it again to stop at once, losing that step)"
        )
