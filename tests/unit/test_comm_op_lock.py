"""A lock that a killed build of DeepSpeed's CPU communication op left never hangs a run, and every wait on a build
is bounded and names what it waits for (``rlhf.distributed.op_lock``, used by the driver's ``ensure_cpu_comm_op``
and by every CPU trainer rank's ``load_cpu_comm_op``). No compiler runs here: the op's build directory is faked
the way torch leaves it, and a rank's DeepSpeed load is replaced by a recorder.

* torch's lock (``<dir>/deepspeed_shm_comm/lock``) with no live holder is removed, saying so, by the driver and by
  a rank, and the rank loads only after it is gone (torch would spin on it for ever, even with the op built);
* a build of this package still running (its guard held) is waited on, named (pid, lock), and given up on at the
  bound; so is a lock whose build still works in the directory (an orphaned ninja) or that is seconds old;
* the compiler line of torch's build file is part of "built": another ``CXX`` or a ``ccache`` wrapper would rebuild.
"""

from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import time
from pathlib import Path

import pytest

from rlhf.distributed import cluster, op_lock
from rlhf.distributed.cluster import SHM_COMM_OP, _comm_op_inputs, cpu_comm_op_built, ensure_cpu_comm_op
from rlhf.distributed.op_lock import LOCK_GRACE_S, OpLockTimeout

pytestmark = pytest.mark.skipif(_comm_op_inputs() is None, reason="DeepSpeed builds the op on Linux only")


def _fake_built(root: Path, cxx: str = "c++") -> Path:
    """The op's build directory as torch leaves it after a build in this environment; returns that directory."""
    inputs = _comm_op_inputs()
    build = root / SHM_COMM_OP
    build.mkdir(parents=True)
    rules = ["ninja_required_version = 1.3", f"cxx = {cxx}"]
    rules += [f"cflags = -DTORCH_EXTENSION_NAME={SHM_COMM_OP} -isystem {inputs['torch_include']} -fPIC"]
    rules += [f"build {Path(src).stem}.o: compile {src}" for src in inputs["sources"]]
    (build / "build.ninja").write_text("\n".join(rules) + "\n")
    lib = build / f"{SHM_COMM_OP}.so"
    lib.write_bytes(b"")
    later = os.path.getmtime(build / "build.ninja") + 1
    os.utime(lib, (later, later))
    return build


def _lock(build: Path, age_s: float) -> Path:
    lock = build / "lock"
    lock.write_bytes(b"")
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


@pytest.fixture(autouse=True)
def _no_cxx(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)  # torch's default compiler, as the fake build file names it


def test_the_driver_removes_a_dead_builds_lock_and_says_so(tmp_path, capsys):
    build = _fake_built(tmp_path)
    lock = _lock(build, age_s=LOCK_GRACE_S + 50)
    assert cpu_comm_op_built(str(tmp_path))  # built: before, the driver returned here and every rank hung
    assert ensure_cpu_comm_op(str(tmp_path), wait_s=5) is False  # nothing to compile
    assert not lock.exists()
    assert f"removing {lock}" in capsys.readouterr().err


def test_a_rank_removes_a_dead_builds_lock_before_deepspeed_loads(tmp_path, monkeypatch, capsys):
    build = _fake_built(tmp_path)
    lock = _lock(build, age_s=LOCK_GRACE_S + 50)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("TORCH_NO_COMPILER_WRAPPER", "1")
    loads = []
    monkeypatch.setattr(cluster, "_deepspeed_load", lambda: loads.append(lock.exists()))
    cluster.load_cpu_comm_op(str(tmp_path), wait_s=5)
    assert loads == [False], "DeepSpeed loaded with the lock still there (torch's FileBaton would spin for ever)"
    err = capsys.readouterr().err
    assert f"removing {lock}" in err and cluster.BUILD_MESSAGE not in err  # built: no build announced


def test_a_live_build_is_waited_on_named_and_bounded(tmp_path, monkeypatch, capsys):
    """Another process's build holds the guard (a second open file: flock excludes it as it excludes a process). The
    wait is announced after 0.2 s here, not the 2 s of a run (sibling ranks' turns), so the bound can be 1 s."""
    monkeypatch.setattr(cluster, "build_guard", functools.partial(op_lock.build_guard, announce_after_s=0.2))
    build = _fake_built(tmp_path)
    lock = _lock(build, age_s=0)
    holder = os.open(build / "lock.owner", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        os.write(holder, b"pid 4242 on node-a\n")
        start = time.monotonic()
        with pytest.raises(OpLockTimeout) as err:
            ensure_cpu_comm_op(str(tmp_path), wait_s=1.0)
        assert 1.0 <= time.monotonic() - start < 30
        assert str(lock) in str(err.value) and "pid 4242 on node-a" in str(err.value)
        said = capsys.readouterr().err
        assert "waiting for another process compiling or loading DeepSpeed's CPU communication op" in said
        assert f"pid 4242 on node-a holds {lock}" in said

        monkeypatch.setattr(cluster, "_deepspeed_load", lambda: pytest.fail("loaded while another build ran"))
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        monkeypatch.setenv("TORCH_NO_COMPILER_WRAPPER", "1")
        with pytest.raises(OpLockTimeout, match=str(lock)):
            cluster.load_cpu_comm_op(str(tmp_path), wait_s=0.5)  # a rank too
    finally:
        os.close(holder)
    assert lock.exists()  # a live holder's lock is never removed


def test_a_lock_whose_build_still_works_in_the_directory_is_kept(tmp_path, capsys):
    """No guard held, but a process still works in the build directory (a killed builder's ninja or compiler, or a
    build started outside this package): its lock is waited on, not removed."""
    build = _fake_built(tmp_path)
    lock = _lock(build, age_s=LOCK_GRACE_S + 50)
    worker = subprocess.Popen(["sleep", "60"], cwd=build)
    try:
        with pytest.raises(OpLockTimeout) as err:
            ensure_cpu_comm_op(str(tmp_path), wait_s=0.5)
        assert str(worker.pid) in str(err.value) and str(lock) in str(err.value)
        said = capsys.readouterr()
        assert f"processes {worker.pid} still build in {build}" in said.out + said.err
    finally:
        worker.kill()
        worker.wait()
    assert lock.exists()


def test_a_lock_seconds_old_is_waited_on_then_removed(tmp_path, capsys):
    """torch creates its lock just before it starts ninja: a lock younger than the grace is not yet judged, and the
    wait says why (its age, not a process list)."""
    build = _fake_built(tmp_path)
    lock = _lock(build, age_s=0)
    with pytest.raises(OpLockTimeout, match=str(lock)):
        ensure_cpu_comm_op(str(tmp_path), wait_s=0.5)
    assert lock.exists()
    said = capsys.readouterr()
    assert f"waiting for {lock} (it is 0 s old: a build may be starting" in said.out + said.err
    assert "processes" not in said.out + said.err
    _lock(build, age_s=LOCK_GRACE_S - 0.5)
    start = time.monotonic()
    assert ensure_cpu_comm_op(str(tmp_path), wait_s=30) is False
    assert not lock.exists() and time.monotonic() - start < 10


def test_the_compiler_line_is_part_of_built(tmp_path, monkeypatch):
    """ninja recompiles when torch's build file names another compiler: another CXX, or ccache/sccache in front of
    it (torch adds the wrapper it finds on PATH unless TORCH_NO_COMPILER_WRAPPER is set, as every build here does).
    """
    _fake_built(tmp_path / "plain")
    _fake_built(tmp_path / "wrapped", cxx="ccache c++")
    assert cpu_comm_op_built(str(tmp_path / "plain"))
    assert not cpu_comm_op_built(str(tmp_path / "wrapped"))
    monkeypatch.setenv("CXX", "clang++")
    assert not cpu_comm_op_built(str(tmp_path / "plain"))
    assert cluster.ACTOR_ENV["TORCH_NO_COMPILER_WRAPPER"] == "1"  # ranks load what the driver built
