"""What the environment pool and the reward pool share: user code run on a set of Ray actors.

Both host code they did not write (an environment, an agent, a reward function) on ``n`` actors. Each actor loads
that code when it starts and reports a load error from ``ready()`` rather than dying, so the error reaches the
user as it was raised. A call that hangs cannot be stopped (Python cannot kill a thread), so the call runs in a
thread with a timeout (:func:`timed_call`) and the actor is replaced (:meth:`ActorSet.replace`). Ray is imported
lazily, so ``import rlhf`` stays light.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Sequence, Tuple


class Hung(Exception):
    """:func:`timed_call`'s call was still running when its time was up."""


def timed_call(fn: Callable[[], Any], timeout_s: float, thread_name: str) -> Any:
    """``fn()`` in a daemon thread, waited for ``timeout_s`` seconds: its value, or its exception re-raised here.

    Raises:
        Hung: if ``fn`` is still running; the thread goes on in the background, so the caller should retire the
            process it runs in (its actor).
    """
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name=thread_name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Hung()
    if "error" in box:
        raise box["error"]
    return box["value"]


class ActorSet:
    """``n`` actors of one Ray actor class, started, checked ready, replaced and killed together.

    The actor class has a ``ready()`` method that returns ``None``, or the exception its start-up caught (loading
    the user's code); that exception is raised here as it is.

    Args:
        remote: the ``ray.remote(...)``-wrapped actor class.
        args_of: the constructor arguments of actor ``i``.
        n: how many actors.
        start_timeout_s: the longest the actors may take to start and answer ``ready()``.
        error: builds the exception raised when an actor does not start, from a sentence saying why (the pool's
            own error class, naming what the pool hosts).

    Raises:
        What ``error`` builds, or what an actor's ``ready()`` returned; the actors already started are killed.
    """

    def __init__(
        self,
        remote: Any,
        args_of: Callable[[int], Tuple[Any, ...]],
        n: int,
        start_timeout_s: float,
        error: Callable[[str], BaseException],
    ) -> None:
        self._remote, self._args_of = remote, args_of
        self.start_timeout_s, self._error = float(start_timeout_s), error
        self._actors: List[Any] = [None] * n
        try:
            for i in range(n):
                self._actors[i] = self._remote.remote(*args_of(i))
            self._check_ready(range(n))
        except BaseException:
            self.kill_all()
            raise

    def __len__(self) -> int:
        return len(self._actors)

    def __getitem__(self, index: int) -> Any:
        return self._actors[index]

    @property
    def closed(self) -> bool:
        """Whether :meth:`kill_all` has run (the set cannot be used afterwards)."""
        return any(actor is None for actor in self._actors)

    def _check_ready(self, indices: Sequence[int]) -> None:
        import ray

        try:
            errors = ray.get([self._actors[i].ready.remote() for i in indices], timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self._error(f"the pool's actors did not start within {self.start_timeout_s:g} s") from None
        except ray.exceptions.RayError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise self._error(f"a pool actor failed to start: {type(e).__name__}: {first}") from None
        for error in errors:
            if error is not None:
                raise error

    def replace(self, index: int) -> None:
        """Kill actor ``index`` (hung or dead) and start a fresh one in its place, waiting until it is ready."""
        import ray

        try:
            ray.kill(self._actors[index], no_restart=True)
        except Exception:  # already dead
            pass
        self._actors[index] = self._remote.remote(*self._args_of(index))
        self._check_ready([index])

    def kill_all(self) -> None:
        """Kill every actor (idempotent)."""
        import ray

        for actor in self._actors:
            if actor is not None and ray.is_initialized():
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already dead
                    pass
        self._actors = [None] * len(self._actors)
