"""`import rlhf` stays light, and every module imports (nothing rots unimported)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import rlhf

HEAVY = ("ray", "vllm", "deepspeed")


def test_import_rlhf_pulls_no_heavy_framework():
    code = f"import sys, rlhf, rlhf.config, rlhf.registry; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"heavy modules imported by `import rlhf`: {out}"


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(rlhf.__path__, prefix="rlhf.")]
    assert len(names) > 20
    for name in names:
        importlib.import_module(name)
