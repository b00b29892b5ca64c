"""Every ``from rlhf... import ...`` in the docs' Python blocks names something that exists: a page that tells a
reader where a name comes from must stay right when the code moves."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _imports():
    for page in sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]):
        for block in BLOCK.findall(page.read_text(encoding="utf-8")):
            lines = [line.split("#")[0].rstrip() for line in block.splitlines()]
            for i, line in enumerate(lines):
                if line.startswith("from rlhf") and " import " in line:
                    statement, j = line, i
                    while statement.count("(") > statement.count(")"):  # a parenthesised list goes on
                        j += 1
                        statement += " " + lines[j].strip()
                    yield page.relative_to(ROOT), statement


IMPORTS = list(_imports())


def test_the_docs_show_imports():
    assert len(IMPORTS) >= 8, IMPORTS  # custom_loops.md alone lists eight: the parse must find them


@pytest.mark.parametrize("page, statement", IMPORTS, ids=[f"{p}:{s[:60]}" for p, s in IMPORTS])
def test_every_imported_name_exists(page, statement):
    tree = ast.parse(statement)
    node = tree.body[0]
    assert isinstance(node, ast.ImportFrom) and node.module
    module = importlib.import_module(node.module)
    missing = [alias.name for alias in node.names if not hasattr(module, alias.name)]
    assert not missing, f"{page}: {node.module} has no {missing}"
