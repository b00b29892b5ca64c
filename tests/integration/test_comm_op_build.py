"""DeepSpeed's CPU communication op is compiled once per environment, by the driver, saying so.

* The "is it built" check is file checks only (no DeepSpeed or torch import) and follows what makes torch's
  ninja build recompile: another environment's sources or torch headers in the build file, an older library.
* ``init_ray``, which every runner calls before its first actor, compiles it when the cluster has no GPU.
* ``slow``, one real build (~1 min on 2 cores): a build killed mid-compile leaves torch's lock (what hung every
  later run); two processes asking at once then remove it, saying so, and build once (the second waits on the
  op's guard, saying so); a later call prints nothing and builds nothing; DeepSpeed loading the op the way a
  trainer rank does (``build_shm_op``) finds it built; and a run from another copy of the checkout, as
  ``ray job submit --working-dir .`` runs (its driver's check, then a rank's guarded load and DeepSpeed's), with
  a ``ccache`` on PATH, neither rebuilds nor announces a build.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shared_helpers import comm_op_links

from rlhf.distributed.cluster import BUILD_MESSAGE, SHM_COMM_OP, _comm_op_inputs, actor_env, cpu_comm_op_built
from rlhf.distributed.op_lock import processes_in

ROOT = Path(__file__).resolve().parents[2]
ENSURE = "import sys; from rlhf.distributed.cluster import ensure_cpu_comm_op; print(ensure_cpu_comm_op(sys.argv[1]))"

pytestmark = pytest.mark.skipif(_comm_op_inputs() is None, reason="DeepSpeed builds the op on Linux only")


def _fake_build(root: Path, sources, torch_include: str) -> Path:
    """A build directory as torch leaves it: build.ninja naming ``sources``, then the library, written after it."""
    build = root / SHM_COMM_OP
    build.mkdir(parents=True)
    rules = ["ninja_required_version = 1.3", f"cxx = {_comm_op_inputs()['cxx']}"]
    rules += [f"cflags = -DTORCH_EXTENSION_NAME={SHM_COMM_OP} -isystem {torch_include} -isystem {torch_include}/x"]
    rules += [f"build {Path(src).stem}.o: compile {src}" for src in sources]
    (build / "build.ninja").write_text("\n".join(rules) + "\n")
    lib = build / f"{SHM_COMM_OP}.so"
    lib.write_bytes(b"")
    ninja_time = os.path.getmtime(build / "build.ninja")
    os.utime(lib, (ninja_time + 1, ninja_time + 1))
    return lib


def _env(extensions_dir: Path) -> dict:
    return dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions_dir), DS_ACCELERATOR="cpu")


def test_built_means_this_environments_sources_and_a_newer_library(tmp_path):
    inputs = _comm_op_inputs()
    here = tmp_path / "here"
    lib = _fake_build(here, inputs["sources"], inputs["torch_include"])
    assert cpu_comm_op_built(str(here))

    os.utime(lib, (1, 1))  # older than its build file (a changed build file not yet rebuilt)
    assert not cpu_comm_op_built(str(here))
    assert not cpu_comm_op_built(str(tmp_path / "empty"))

    # another checkout's DeepSpeed (the ~/.cache case), or another torch: ninja would recompile
    other = [src.replace(os.sep + "deepspeed" + os.sep, os.sep + "elsewhere" + os.sep) for src in inputs["sources"]]
    _fake_build(tmp_path / "other_sources", other, inputs["torch_include"])
    assert not cpu_comm_op_built(str(tmp_path / "other_sources"))
    _fake_build(tmp_path / "other_torch", inputs["sources"], "/opt/other/torch/include")
    assert not cpu_comm_op_built(str(tmp_path / "other_torch"))


def test_when_built_the_driver_imports_nothing_and_prints_nothing(tmp_path):
    inputs = _comm_op_inputs()
    _fake_build(tmp_path, inputs["sources"], inputs["torch_include"])
    code = ENSURE + "; assert 'deepspeed' not in sys.modules and 'torch' not in sys.modules"
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False\n" and done.stderr == ""


def test_init_ray_compiles_it_when_the_cluster_has_no_gpus(monkeypatch):
    """Every runner joins or starts Ray through init_ray before its first actor: the place the op is compiled."""
    import ray

    from rlhf.distributed import cluster

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # a cluster already joined (as in these tests)
    monkeypatch.setattr(cluster, "ensure_cpu_comm_op", lambda: calls.append("built"))
    for gpus, expected in ((0.0, ["built"]), (8.0, [])):  # GPU ranks use DeepSpeed's CUDA accelerator instead
        calls.clear()
        monkeypatch.setattr(cluster, "cluster_gpus", lambda gpus=gpus: gpus)
        assert cluster.init_ray() == "existing" and calls == expected


@pytest.mark.slow
def test_a_killed_build_then_two_processes_then_a_run_from_another_copy_build_it_once(tmp_path):
    """The whole life of the op in one real build (~1 min on 2 cores), in a fresh extensions directory."""
    ext = tmp_path / "torch_extensions"
    lock = ext / SHM_COMM_OP / "lock"

    # A build killed mid-compile (Ctrl-C'd terminal, OOM kill) leaves torch's lock: what made every later run hang.
    killed = subprocess.Popen(
        [sys.executable, "-c", ENSURE, str(ext)], env=_env(ext), cwd=ROOT, start_new_session=True, **_QUIET
    )
    deadline = time.monotonic() + 300
    while not (lock.exists() and processes_in(str(ext / SHM_COMM_OP))):  # torch holds the lock, ninja compiles
        assert killed.poll() is None and time.monotonic() < deadline, "the build never started compiling"
        time.sleep(0.2)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    while processes_in(str(ext / SHM_COMM_OP)):  # the killed group's compilers exit
        assert time.monotonic() < deadline, "the killed build's compilers are still running"
        time.sleep(0.2)
    assert lock.exists() and comm_op_links(ext) == 0

    # Two processes at once: the dead build's lock is removed, saying so, and the op is compiled once.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ENSURE, str(ext)],
            env=_env(ext),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=900), *p.communicate()) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), [err[-3000:] for _, _, err in results]
    errs = "".join(err for _, _, err in results)
    assert errs.count(f"removing {lock}") == 1, errs
    assert comm_op_links(ext) == 1, "the op was compiled more than once"
    # each process says what it does: the first compiles, the second compiles too or waits for the first
    assert errs.count(BUILD_MESSAGE) + errs.count("waiting for another process compiling") == 2, errs
    lib = ext / SHM_COMM_OP / f"{SHM_COMM_OP}.so"
    built_at = os.path.getmtime(lib)
    assert cpu_comm_op_built(str(ext)) and not lock.exists()

    again = subprocess.run(
        [sys.executable, "-c", ENSURE, str(ext)], env=_env(ext), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0 and again.stdout == "False\n" and again.stderr == ""

    # what a CPU trainer rank runs in its first DeepSpeed engine (deepspeed/comm/torch.py)
    rank = subprocess.run(
        [sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
        env=_env(ext),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert rank.returncode == 0, rank.stderr[-3000:]
    assert comm_op_links(ext) == 1 and os.path.getmtime(lib) == built_at, "DeepSpeed rebuilt the op the driver built"

    # A run from another copy of the checkout, as a `ray job submit --working-dir .` runs: Ray unpacks the upload
    # under its session directory and starts the job's driver and actors there (cwd and PYTHONPATH the copy), with
    # the head's interpreter, packages and environment; the head's PATH may hold a ccache the user's shell has not.
    copy = _checkout_copy(tmp_path / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "ccache").write_text('#!/bin/sh\nexec "$@"\n')  # a compiler wrapper, as ccache is one
    (fake_bin / "ccache").chmod(0o755)
    job_env = {**_env(ext), **actor_env(0.0), "TORCH_EXTENSIONS_DIR": str(ext), "PYTHONPATH": str(copy)}
    job_env["PATH"] = f"{fake_bin}{os.pathsep}{os.environ['PATH']}"
    where = "import rlhf, sys; assert rlhf.__file__.startswith(sys.argv[2]), rlhf.__file__; "
    driver = subprocess.run(
        [sys.executable, "-c", where + ENSURE.replace("import sys; ", ""), str(ext), str(copy)],
        env=job_env,
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert driver.returncode == 0 and driver.stdout == "False\n" and driver.stderr == "", driver.stderr[-3000:]
    job_rank = subprocess.run(
        [sys.executable, "-c", where + _RANK_LOAD, "-", str(copy)],
        env=job_env,
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert job_rank.returncode == 0, job_rank.stderr[-3000:]
    assert BUILD_MESSAGE not in job_rank.stdout + job_rank.stderr
    assert comm_op_links(ext) == 1 and os.path.getmtime(lib) == built_at, "a run from another directory rebuilt the op"


_QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
# What TrainerWorker.init_process_group does on a CPU rank: the guarded load, then DeepSpeed's own (init_distributed)
_RANK_LOAD = (
    "from rlhf.distributed.cluster import load_cpu_comm_op; load_cpu_comm_op(); "
    "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None"
)


def _checkout_copy(dest: Path) -> Path:
    """This checkout's files but those .gitignore lists (what `--working-dir .` uploads) at ``dest``."""
    listed = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    for name in subprocess.run(listed, cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest
