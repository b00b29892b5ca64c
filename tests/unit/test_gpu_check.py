"""``bench/gpu_check.py --device cpu``: the one-GPU check's CPU twin passes, prints its table, and fails (exit 1) on a
mis-normalised gradient. It runs with ``ray`` and ``vllm`` made unimportable (a package of each name that raises on
import, first on ``PYTHONPATH``, so also in its receiver process): the check is for a machine without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = (
    "engine: ZeRO 0 fp32",
    "sft: micro 8xGA1 vs 2xGA4",
    "dpo: micro 8xGA1 vs 2xGA4",
    "packing: sdpa per row",
    "ipc: shared memory",
    "sync group: gloo, arrival bound",
    "sequence parallel 2",
    "head tiles: vocabulary",
    "head tiles: tokens, top-p",
    "sleep: host to host",
    "offload: host to host",
)


@pytest.fixture(scope="module")
def blocked(tmp_path_factory) -> dict:
    """The environment of a run where ``import ray`` / ``import vllm`` raise."""
    shadow = tmp_path_factory.mktemp("no_ray_no_vllm")
    for name in ("ray", "vllm"):
        (shadow / name).mkdir()
        (shadow / name / "__init__.py").write_text(f"raise ImportError('gpu_check must not import {name}')\n")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(shadow), str(ROOT)]),
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _run(env: dict, *args: str) -> subprocess.CompletedProcess:
    # One torch thread a process: next to another busy test process, two threads on two cores made the twin's tiny
    # steps several times slower (OpenMP threads waiting on each other).
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--threads", "1", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _table(stdout: str) -> dict:
    """``{check name: result}`` from the printed table."""
    rows = {}
    for line in stdout.splitlines():
        for name in ROWS:
            if line.startswith(name):
                rows[name] = "PASS" if "  PASS  " in line else "FAIL" if "  FAIL  " in line else "?"
    return rows


def test_the_shadow_packages_do_block_ray_and_vllm(blocked):
    """The guard itself: without it the next tests could not fail on an import of ray or vllm."""
    for name in ("ray", "vllm"):
        done = subprocess.run([sys.executable, "-c", f"import {name}"], env=blocked, capture_output=True, text=True)
        assert done.returncode != 0 and f"gpu_check must not import {name}" in done.stderr


def test_the_cpu_twin_passes_every_check_without_ray_or_vllm(blocked):
    done = _run(blocked)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _table(done.stdout) == dict.fromkeys(ROWS, "PASS"), done.stdout
    assert "ALL PASSED" in done.stdout and "sha256 27/27 tensors" in done.stdout


def test_a_mis_normalised_gradient_fails_the_split_rows_and_the_run(blocked):
    """The split runs' normaliser x1.5 (the class of bug the check exists for: a gradient normalised by the wrong
    count) moves their grad norm by 1/3: both split-vs-whole rows fail, the engine row still passes, exit code 1.
    Only the checks the perturbation reaches run (``--checks``): the others are the test above's."""
    done = _run(blocked, "--perturb-normalizer", "1.5", "--checks", "sft,dpo")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    table = _table(done.stdout)
    assert table == {ROWS[0]: "PASS", ROWS[1]: "FAIL", ROWS[2]: "FAIL"}, done.stdout
    assert "FAILED: sft: micro 8xGA1 vs 2xGA4, dpo: micro 8xGA1 vs 2xGA4" in done.stdout


def test_an_unknown_check_is_refused_with_the_valid_names(blocked):
    done = _run(blocked, "--checks", "sft,packed")
    assert done.returncode == 2
    assert "--checks: unknown packed; valid: sft, dpo, packing, ipc, sync, sp" in done.stderr
