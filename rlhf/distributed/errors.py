"""Turning a failed or dead Ray actor into an error that names who failed: the role, the rank and the call."""

from __future__ import annotations

import re
import time
from typing import Any, List, Optional, Sequence

# the line of a Python traceback that states the error: "ValueError: ...", "torch.OutOfMemoryError: ..."
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Timeout)\b[^:]*:\s*\S")


class WorkerError(RuntimeError):
    """An actor of a worker group or a rollout engine failed or died; the message names the role, rank and call."""


class WorkerTimeout(WorkerError):
    """Some actors did not answer a call within its bound (``unanswered`` names them): stuck, not failed. A call
    sent to them now would queue behind the stuck one."""

    def __init__(self, message: str, unanswered: Sequence[str]) -> None:
        super().__init__(message)
        self.unanswered = list(unanswered)


def gather(refs: List[Any], names: Sequence[str], call: str, timeout_s: Optional[float] = None) -> List[Any]:
    """``ray.get(refs)`` in order, failing fast on the first that errors.

    ``names[i]`` names the actor behind ``refs[i]`` (e.g. ``"policy rank 1"``, ``"rollout engine 0"``). Waiting
    on all refs at once instead would hang: the collective peers of a dead rank wait for it forever.
    ``timeout_s``: a bound on the whole call; past it, :class:`WorkerTimeout` names the actors that have not
    answered (the members' own bounds, shorter, usually answer first with the peer they waited for).
    """
    import ray

    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            unanswered = [names[index[ref]] for ref in pending]
            raise WorkerTimeout(f"{', '.join(unanswered)} did not answer {call} within {timeout_s:g} s", unanswered)
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as exc:
            raise WorkerError(f"{names[index[ready[0]]]} died during {call}: {cause_line(exc)}") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            failed = f"{names[index[ready[0]]]} failed in {call}: {type(cause).__name__}: {cause}"
            dead = _dead_peer(pending, index, names, call)
            if dead is not None:  # a collective peer's death is the cause; this rank's error is its echo
                raise WorkerError(f"{dead[0]}; then {failed}") from dead[1]
            raise WorkerError(failed) from exc
    return ray.get(refs)


def _dead_peer(pending: List[Any], index: dict, names: Sequence[str], call: str, wait_s: float = 5.0):
    """``(message, error)`` for the first of ``pending`` whose actor died within ``wait_s``, else ``None``."""
    import ray

    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            return f"{names[index[ref]]} died during {call}: {cause_line(exc)}", exc
        except Exception:  # noqa: BLE001 - another echo; keep looking for a death
            continue
    return None


def cause_line(exc: BaseException, limit: int = 400) -> str:
    """An error's cause in one line: the last line of its text that states an error (``ValueError: ...``, as the
    creation-task traceback Ray puts in a dead actor's message ends with vLLM's reason), else its first line;
    clipped to ``limit`` characters. The whole text stays on the exception (``raise ... from exc``)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    stated = [line for line in lines if _ERROR_LINE.match(line)]
    line = stated[-1] if stated else lines[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."
