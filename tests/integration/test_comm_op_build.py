"""DeepSpeed's CPU communication op is compiled once per environment, by the driver, saying so.

* The "is it built" check is file checks only (no DeepSpeed or torch import) and follows what makes torch's
  ninja build recompile: another environment's sources or torch headers in the build file, an older library.
* ``init_ray``, which every runner calls before its first actor, compiles it when the cluster has no GPU.
* ``slow``, one real build (~1 min on 2 cores): two processes asking at once into an empty directory build it
  once (torch's lock file makes the second wait); a later call prints nothing and builds nothing; and DeepSpeed
  loading the op the way a trainer rank does (``build_shm_op``) finds it built and does not recompile.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.distributed.cluster import BUILD_MESSAGE, SHM_COMM_OP, _comm_op_inputs, cpu_comm_op_built

ROOT = Path(__file__).resolve().parents[2]
ENSURE = "import sys; from rlhf.distributed.cluster import ensure_cpu_comm_op; print(ensure_cpu_comm_op(sys.argv[1]))"

pytestmark = pytest.mark.skipif(_comm_op_inputs() is None, reason="DeepSpeed builds the op on Linux only")


def _fake_build(root: Path, sources, torch_include: str) -> Path:
    """A build directory as torch leaves it: build.ninja naming ``sources``, then the library, written after it."""
    build = root / SHM_COMM_OP
    build.mkdir(parents=True)
    rules = [f"cflags = -DTORCH_EXTENSION_NAME={SHM_COMM_OP} -isystem {torch_include} -isystem {torch_include}/x"]
    rules += [f"build {Path(src).stem}.o: compile {src}" for src in sources]
    (build / "build.ninja").write_text("\n".join(rules) + "\n")
    lib = build / f"{SHM_COMM_OP}.so"
    lib.write_bytes(b"")
    ninja_time = os.path.getmtime(build / "build.ninja")
    os.utime(lib, (ninja_time + 1, ninja_time + 1))
    return lib


def _links(extensions_dir: Path) -> int:
    """Builds recorded by ninja in the op's directory: one link of the library per build."""
    log = extensions_dir / SHM_COMM_OP / ".ninja_log"
    if not log.is_file():
        return 0
    return sum(1 for line in log.read_text().splitlines() if line.split("\t")[3:4] == [f"{SHM_COMM_OP}.so"])


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
def test_two_processes_build_it_once_and_deepspeed_then_loads_it_without_rebuilding(tmp_path):
    ext = tmp_path / "torch_extensions"
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
    assert _links(ext) == 1, "the op was compiled more than once"
    # each process says what it does: the first compiles, the second compiles too or waits for the first
    assert errs.count(BUILD_MESSAGE) + errs.count("waiting for another process compiling") == 2, errs
    lib = ext / SHM_COMM_OP / f"{SHM_COMM_OP}.so"
    built_at = os.path.getmtime(lib)
    assert cpu_comm_op_built(str(ext))

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
    assert _links(ext) == 1 and os.path.getmtime(lib) == built_at, "DeepSpeed rebuilt the op the driver built"
