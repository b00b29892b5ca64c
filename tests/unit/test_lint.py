"""ruff's lint over the whole tree, with the rules ``pyproject.toml`` selects (``[tool.ruff.lint]``: pyflakes,
pycodestyle, bugbear, import order, private names imported from another package outside tests/unit and
tests/integration), and its formatter's layout. Pyflakes' rules catch, on the CPU, errors that
live in code only a GPU reaches: a function-level ``import torch.multiprocessing.reductions`` made ``torch`` a
local name of ``rlhf.rollout.weights.ipc.open_shared``, and the CUDA branch above it failed with UnboundLocalError on
the first real GPU run (ruff F823)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("rlhf", "bench", "examples", "tests", "docs", "ray_cluster")


def test_the_lint_passes_on_the_whole_tree():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--quiet", *CHECKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"ruff check (fix, or `ruff check --fix`):\n{done.stdout}{done.stderr}"


def test_the_tree_is_in_ruffs_format():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *CHECKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"ruff format --check (run `make format`):\n{done.stdout}{done.stderr}"


def test_the_rule_that_found_the_gpu_bug_is_among_them(tmp_path):
    """The check can fail: the shape of the ipc bug, in a scratch file, is reported as F823."""
    sample = tmp_path / "shadowed.py"
    sample.write_text(
        "import torch\n\n\ndef f(kind):\n    if kind:\n        return torch.zeros(1)\n"
        "    import torch.nn\n    return torch.nn\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache", str(sample)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "F823" in done.stdout


def test_a_private_import_is_reported(tmp_path):
    """The check can fail: the project's config selects the preview rule PLC2701 (``from rlhf.x import _y`` outside
    the package; a scratch file is under no per-file ignore)."""
    sample = tmp_path / "private.py"
    sample.write_text("from rlhf.config.cli import _help_epilog\n\nprint(_help_epilog)\n")
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(sample)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "PLC2701" in done.stdout, done.stdout + done.stderr
