"""One builder at a time for a torch JIT extension, with every wait bounded and a dead builder's lock cleared.

torch's ``cpp_extension.load`` creates ``<build dir>/lock`` (``FileBaton``) before it runs ninja and removes it
after; every other process that loads the extension meanwhile spins, without a bound and without a word, until the
file is gone, even when the op is already built (each load takes the lock for its ninja check). A process killed
in between (Ctrl-C during the first build, an OOM kill) leaves the file for ever, and every later run hangs.

The lock file itself cannot say whether its maker is alive, so every build and load this package makes runs under
a guard: an exclusive ``flock`` on ``<build dir>/lock.owner``, which records the holder's pid and host. The kernel
drops a ``flock`` when its process ends, however it ends, so:

* guard free and torch's lock present: no build of this package is running, the lock is a dead builder's. It is
  removed, saying so, unless a process of this machine still works in the build directory (the orphaned ninja or
  compiler of a killed builder, or a build started outside this package, e.g. plain DeepSpeed with the same
  ``TORCH_EXTENSIONS_DIR``) or the lock is younger than ``LOCK_GRACE_S`` (such a build between creating the lock
  and starting ninja): then it is waited on, bounded like any other wait;
* guard held: a live build or load; the waiter says whom it waits for and gives up after ``wait_s``.

Builds started outside this package on another node of a shared file system are not seen by the process check;
their lock is younger than a build takes only for as long as the build lasts, and clearing it there costs a second
concurrent build, not a hang.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from typing import Callable, Iterator, List

LOCK_GRACE_S = 10.0  # torch creates its lock well under a second before ninja starts working in the directory
_POLL_S = 0.2


class OpLockTimeout(TimeoutError):
    """Waited ``wait_s`` for another process's build or load of the op; the message names it and the lock."""


@contextlib.contextmanager
def build_guard(
    build_dir: str, wait_s: float, what: str, say: Callable[[str], None], announce_after_s: float = 2.0
) -> Iterator[None]:
    """Hold the guard of ``build_dir`` (torch's build directory of one extension) for the block, after clearing a
    lock that a dead builder left; ``what`` names the op in messages, ``say`` prints them.

    A wait longer than ``announce_after_s`` (sibling ranks take turns loading a built op in ~0.1 s each) is
    announced once, naming the holder and the lock.

    Raises:
        OpLockTimeout: the guard or torch's lock stayed taken for ``wait_s`` seconds.
    """
    os.makedirs(build_dir, exist_ok=True)
    owner = os.path.join(build_dir, "lock.owner")
    fd = os.open(owner, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        _acquire(fd, owner, wait_s, what, say, announce_after_s)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            _clear_dead_lock(build_dir, wait_s - (time.monotonic() - start), what, say)
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(fd: int, owner: str, wait_s: float, what: str, say: Callable[[str], None], announce_s: float) -> None:
    lock = os.path.join(os.path.dirname(owner), "lock")
    start, announced = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        holder = _read(owner) or "another process"
        if waited >= wait_s:
            raise OpLockTimeout(
                f"gave up after {wait_s:.0f} s waiting for {holder}, which is compiling or loading {what} "
                f"(lock {lock}, guard {owner}): stop that process or let it finish, then run again"
            )
        if not announced and waited >= announce_s:
            say(
                f"waiting for another process compiling or loading {what}: {holder} holds {lock} (up to {wait_s:.0f} s)"
            )
            announced = True
        time.sleep(_POLL_S)


def _clear_dead_lock(build_dir: str, wait_s: float, what: str, say: Callable[[str], None]) -> None:
    """With the guard held: remove torch's lock if its maker is gone, else wait (bounded) for it to go."""
    lock = os.path.join(build_dir, "lock")
    deadline, announced = time.monotonic() + wait_s, False
    while True:
        try:
            age = time.time() - os.path.getmtime(lock)
        except FileNotFoundError:
            return
        workers = processes_in(build_dir)
        if not workers and age >= LOCK_GRACE_S:
            say(
                f"removing {lock}: a build of {what} that no longer runs left it (killed while compiling?); "
                "no process holds the guard or works in that directory"
            )
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)
            return
        if time.monotonic() >= deadline:
            raise OpLockTimeout(
                f"gave up waiting for {lock} to go: no build of this package holds it, but "
                f"{'processes ' + ', '.join(map(str, workers)) + ' work in ' + build_dir if workers else 'it is new'}; "
                f"if no build of {what} is running, delete {lock}"
            )
        if not announced:
            why = (
                f"processes {', '.join(map(str, workers))} still build in {build_dir}"
                if workers
                else f"it is {age:.0f} s old: a build may be starting"
            )
            say(f"waiting for {lock} ({why}; up to {wait_s:.0f} s)")
            announced = True
        time.sleep(_POLL_S)


def processes_in(directory: str) -> List[int]:
    """Pids of this machine's processes whose working directory is ``directory`` (torch runs ninja, and ninja the
    compiler, there); those not readable (another user's) are not seen."""
    target = os.path.realpath(directory)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/cwd") == target:
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""
