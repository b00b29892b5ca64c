"""Scripts no test runs end to end (bench/, the examples' launchers) still import only names the package has: a
rename in rlhf (EngineSpec -> VLLMSpec once broke bench/bench_rl.py silently) fails here, without running them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("examples/**/*.py")])


def _rlhf_imports(path: Path):
    """``(line, module, name)`` of every ``from rlhf... import name`` in the file, in functions too."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rlhf":
            for alias in node.names:
                yield node.lineno, node.module, alias.name


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_rlhf_name_a_script_imports_exists(path: Path):
    missing = []
    for line, module, name in _rlhf_imports(path):
        found = importlib.import_module(module)
        if not hasattr(found, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"{path.name}:{line}: {module}.{name}")
    assert not missing, missing


def test_the_scripts_were_found():
    assert {"bench_rl.py", "bench_offline.py", "custom_rl_loop.py"} <= {p.name for p in SCRIPTS}
