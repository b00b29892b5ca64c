"""The house: no import circles, no arrow running back up the layers, every in-function import of ``rlhf``
says why it is not at the top of its file, and every in-package string path names what exists.

Read from the source with ``ast`` (nothing is imported), so a violation is named by file and line:

* the arrows between ``rlhf`` modules form no cycle (except :data:`ALLOWED_CYCLE_EDGES`, each with its reason). An
  arrow is any import of the package: at module level, inside a function, under ``TYPE_CHECKING``; and any string
  literal ``"rlhf.a.b:function"`` (a trainer descriptor's ``train_path``: imported when called). An in-function
  import breaks no circle, it only hides it until the call, and a ``TYPE_CHECKING`` one is a circle in the types.
  An import of ``rlhf.a.b`` runs ``rlhf/a/__init__.py`` too, so that edge is counted;
* a string literal that is an in-package path (``"rlhf.a.b"``, ``"rlhf.a.b:name"``, ``"rlhf.a.b.Name"``) names a
  module that exists, and the name is bound at the top of it: a descriptor string is not followed by a module's
  move as an import is;
* no import, at module level, inside a function or under ``TYPE_CHECKING``, goes from a lower layer of
  :data:`LAYERS` to a higher one (except :data:`ALLOWED_UPWARD`, each with its reason);
* an import of ``rlhf`` inside a function carries a comment on its line or the line above (above its block of such
  imports), saying why it is not at module level (``# lazy: pulls in torch``). The rule: in-function only to keep
  ``import rlhf`` or a light command-line path light; not to break a cycle (the cycle check counts it).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "rlhf"

#: The layers of the package, lowest first: a module may import its own layer and those below, never one above.
#: Each name is a subpackage or top-level module of ``rlhf``. The order is what the imports say today:
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("registry", "batch", "atomic"),  # name -> callable registries; the one batch type; atomic file writes.
    # Import nothing of rlhf.
    ("ops",),  # the math: log-probs, losses, advantages, KL; each family registers its names.
    ("config",),  # the run-config schema and loader; validates names against ops' registries.
    ("utils",),  # device, LR schedule, versions, metric writers (which read the run config).
    ("hub", "synthetic", "rewards", "envs"),  # hub references, the synthetic task, reward functions, environments.
    ("data", "models"),  # rows -> token batches; loading and scoring HF models.
    ("objectives",),  # per-micro-batch losses over a model's outputs.
    ("distributed",),  # Ray cluster, placement, DeepSpeed engines, worker actors and groups.
    ("rollout",),  # vLLM engines and the weight sync into them.
    ("rl",),  # what a custom RL loop needs, in one place (over the layers below).
    ("eval", "trainers"),  # the training loops; evaluation of a trained model.
    ("audit", "reports"),  # checks of a config by running the trainers; plots of runs.
    ("cli",),  # entry points.
)

#: ``(importing module, imported module) -> reason`` for an arrow allowed to run back up. Keep it empty.
ALLOWED_UPWARD: Dict[Tuple[str, str], str] = {}

#: ``(importing module, imported module) -> reason`` for an arrow allowed to close an import circle: it is left out
#: of the graph the cycle test reads. An entry whose arrow is gone, or closes no circle any more, fails the test.
#: Keep it empty.
ALLOWED_CYCLE_EDGES: Dict[Tuple[str, str], str] = {}

MODULE, FUNCTION, TYPE_CHECKING = "module level", "in a function", "under TYPE_CHECKING"
STRING = 'a "module:function" string'
_PRAGMA = re.compile(r"#\s*(noqa\b|type:|pragma\b|pylint:|fmt:|isort:)")
#: A string literal that is an in-package path: ``rlhf.a.b`` (a module, or ``module.Name``) or ``rlhf.a.b:name``.
_STRING_PATH = re.compile(rf"{PACKAGE}(\.\w+)+(:\w+)?")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # the rlhf module it imports (a submodule when ``from pkg import submodule``)
    where: str  # MODULE, FUNCTION, TYPE_CHECKING, or STRING (a "module:function" literal)
    path: str  # file, relative to the repository
    line: int
    end_line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} -> {self.target} ({self.where})"


# --------------------------------------------------------------------------------------------- reading the source


def package_modules(root: Path = ROOT) -> Dict[str, Path]:
    """``dotted name -> file`` of every module of the package (``rlhf.x`` for ``rlhf/x/__init__.py``)."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: Iterable[str]) -> Optional[str]:
    """``name`` or its longest prefix that is a module of the package."""
    modules = set(modules)
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(
    source: str, module: str, modules: Iterable[str], path: str = "", is_package: bool = False
) -> List[Import]:
    """The imports of package modules in ``source`` (the text of ``module``), each with where it sits."""
    modules = set(modules)
    found: List[Import] = []
    package = module if is_package else module.rpartition(".")[0]

    def targets(node) -> List[str]:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out = []
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                resolved = _known(name, modules)
                if resolved and resolved not in out:
                    out.append(resolved)
        return out

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(
                    Import(module, t, where, path, child.lineno, child.end_lineno or child.lineno)
                    for t in targets(child)
                )
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, FUNCTION)
            elif isinstance(child, ast.If) and _is_type_checking(child.test) and where == MODULE:
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), TYPE_CHECKING)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), MODULE)
            else:
                visit(child, where)

    visit(ast.parse(source), MODULE)
    return found


def all_imports(root: Path = ROOT) -> List[Import]:
    modules = package_modules(root)
    out = []
    for name, path in modules.items():
        out += imports_of(
            path.read_text(encoding="utf-8"),
            name,
            modules,
            str(path.relative_to(root)),
            is_package=path.name == "__init__.py",
        )
    return out


@dataclass(frozen=True)
class StringPath:
    module: str  # the module whose source holds the literal
    value: str  # the literal: rlhf.a.b, rlhf.a.b.Name or rlhf.a.b:name
    path: str  # file, relative to the repository
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module}: {self.value!r}"


def string_paths_of(source: str, module: str, path: str = "") -> List[StringPath]:
    """The string literals of ``source`` (the text of ``module``) that are, whole, an in-package path."""
    return [
        StringPath(module, node.value, path, node.lineno)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _STRING_PATH.fullmatch(node.value)
    ]


def all_string_paths(root: Path = ROOT) -> List[StringPath]:
    out = []
    for name, path in package_modules(root).items():
        out += string_paths_of(path.read_text(encoding="utf-8"), name, str(path.relative_to(root)))
    return out


def string_imports(strings: Sequence[StringPath], modules: Iterable[str]) -> List[Import]:
    """The arrows of the ``"module:function"`` strings: their module is imported when the function is called."""
    modules = set(modules)
    out = []
    for s in strings:
        if ":" not in s.value:
            continue
        target = _known(s.value.partition(":")[0], modules)
        if target:
            out.append(Import(s.module, target, STRING, s.path, s.line, s.line))
    return out


def top_level_names(source: str) -> Set[str]:
    """The names bound at the top of a module: definitions, assignments and imports (also under ``if``/``try``)."""
    names: Set[str] = set()

    def visit(body: Sequence[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
            elif isinstance(stmt, ast.If):
                visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                for part in (stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)):
                    visit(part)

    visit(ast.parse(source).body)
    return names


# ---------------------------------------------------------------------------------------------------- the checks


def module_graph(imports: Sequence[Import]) -> Dict[str, Dict[str, Import]]:
    """``importer -> {imported: the first import of it}`` of every import given (module level, in a function, under
    ``TYPE_CHECKING``, a string), with the packages an import runs (``rlhf.a`` for ``rlhf.a.b``; not the importer's
    own packages, which are being imported already)."""
    graph: Dict[str, Dict[str, Import]] = {}
    for imp in imports:
        edges = graph.setdefault(imp.importer, {})
        parts = imp.target.split(".")
        for i in range(2, len(parts) + 1):
            target = ".".join(parts[:i])
            own_package = imp.importer.startswith(target + ".")
            if target != imp.importer and not own_package:
                edges.setdefault(target, imp)
    return graph


def find_cycles(graph: Dict[str, Iterable[str]]) -> List[List[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected component that has one (Tarjan, then a walk)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})

    def connect(v: str) -> None:  # iterative would be longer; the package is ~100 modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(sorted(component))

    for v in nodes:
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        members, start = set(component), component[0]
        path, seen = [start], {start}
        while True:  # every member has an edge into the component; follow them until one closes the loop
            step = next(w for w in sorted(graph.get(path[-1], ())) if w in members)
            if step in seen:
                cycles.append(path[path.index(step) :] + [step])
                break
            path.append(step)
            seen.add(step)
    return cycles


def reaches(graph: Dict[str, Iterable[str]], start: str, goal: str) -> bool:
    """Whether a path of arrows leads from ``start`` to ``goal``."""
    seen, todo = {start}, [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        for w in graph.get(v, ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return False


def import_cycles(
    imports: Sequence[Import], allowed: Dict[Tuple[str, str], str]
) -> Tuple[List[str], List[Tuple[str, str]]]:
    """``(the circles, each with the imports that close it; the stale entries of allowed)``. The arrows of
    ``allowed`` are left out; an entry is stale when its arrow is not in the graph or lies on no circle."""
    full = module_graph(imports)
    graph = {a: {b: imp for b, imp in edges.items() if (a, b) not in allowed} for a, edges in full.items()}
    described = [
        "  " + " -> ".join(cycle) + "\n" + "\n".join(f"      {graph[a][b]}" for a, b in zip(cycle, cycle[1:]))
        for cycle in find_cycles(graph)
    ]
    stale = sorted((a, b) for a, b in allowed if b not in full.get(a, {}) or not reaches(full, b, a))
    return described, stale


def missing_string_paths(strings: Sequence[StringPath], sources: Dict[str, str]) -> List[str]:
    """The in-package string paths naming no module, or a name its module does not bind at the top.
    ``sources``: ``dotted module name -> its text``."""
    out, names = [], {}
    for s in sorted(strings, key=lambda s: (s.path, s.line, s.value)):
        module, _, name = s.value.partition(":")
        if not name and module not in sources:  # rlhf.a.b.Name: a module's top-level name
            module, _, name = module.rpartition(".")
        if module not in sources:
            out.append(f"{s}: no module {module}")
            continue
        if name and f"{module}.{name}" not in sources:
            if module not in names:
                names[module] = top_level_names(sources[module])
            if name not in names[module]:
                module_too = "" if ":" in s.value else f"no module {module}.{name}, and "
                out.append(f"{s}: {module_too}{module} binds no {name} at its top")
    return out


def layer_of(module: str) -> Optional[int]:
    """The index in :data:`LAYERS` of ``module``'s top-level name; the package itself is above them all."""
    if module == PACKAGE:
        return len(LAYERS)
    top = module.split(".")[1]
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def upward_imports(imports: Sequence[Import]) -> List[str]:
    out = []
    for imp in sorted(imports, key=lambda i: (i.path, i.line, i.target)):
        low, high = layer_of(imp.importer), layer_of(imp.target)
        if low is None or high is None or high <= low or (imp.importer, imp.target) in ALLOWED_UPWARD:
            continue
        out.append(
            f"{imp}: layer {low} {LAYERS[low]} imports layer {high} {LAYERS[high] if high < len(LAYERS) else PACKAGE}"
        )
    return out


def comment_lines(source: str) -> Tuple[Set[int], Set[int]]:
    """``(lines with a comment, lines that are only a comment)``; pragmas (``# noqa``, ``# type:``) are no reason."""
    anywhere, alone = set(), set()
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not _PRAGMA.match(tok.string):
            line = tok.start[0]
            anywhere.add(line)
            if lines[line - 1].lstrip().startswith("#"):
                alone.add(line)
    return anywhere, alone


def uncommented_function_imports(imports: Sequence[Import], sources: Dict[str, str]) -> List[str]:
    """In-function imports of the package with no comment on their lines or a comment line just above. A comment
    line above a block of such imports (one statement per line, nothing between them) speaks for the block."""
    out, comments = [], {}
    said: Set[Tuple[str, int]] = set()  # (file, last line) of the in-function imports that say why
    for imp in sorted(imports, key=lambda i: (i.path, i.line, i.target)):
        if imp.where != FUNCTION:
            continue
        if imp.path not in comments:
            comments[imp.path] = comment_lines(sources[imp.path])
        anywhere, alone = comments[imp.path]
        if (
            imp.line - 1 in alone
            or (imp.path, imp.line - 1) in said
            or (imp.path, imp.end_line) in said
            or any(line in anywhere for line in range(imp.line, imp.end_line + 1))
        ):
            said.add((imp.path, imp.end_line))
        else:
            out.append(str(imp))
    return out


# ----------------------------------------------------------------------------------------------------- the tests


def _package():
    modules = package_modules()
    sources = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in modules.values()}
    return modules, sources, all_imports()


def test_the_reader_sees_the_package():
    modules, _, imports = _package()
    assert len(modules) > 50 and f"{PACKAGE}.utils.metrics" in modules
    wheres = {imp.where for imp in imports}
    assert MODULE in wheres and FUNCTION in wheres


def test_imports_form_no_cycle():
    modules, _, imports = _package()
    cycles, stale = import_cycles(imports + string_imports(all_string_paths(), modules), ALLOWED_CYCLE_EDGES)
    assert not cycles, (
        'import cycles (imports at module level, in functions, under TYPE_CHECKING, and "module:function" '
        "strings; break each where its arrow does not belong, e.g. move the shared part down):\n" + "\n".join(cycles)
    )
    assert not stale, f"ALLOWED_CYCLE_EDGES entries whose arrow is gone or closes no cycle (remove them): {stale}"


#: Files whose string paths name modules that are gone on purpose: the moves an old checkpoint's pickles follow.
GONE_ON_PURPOSE = ("rlhf/trainers/moved.py",)


def test_in_package_string_paths_name_what_exists():
    modules, _, _ = _package()
    sources = {name: path.read_text(encoding="utf-8") for name, path in modules.items()}
    missing = [m for m in missing_string_paths(all_string_paths(), sources) if not m.startswith(GONE_ON_PURPOSE)]
    assert not missing, "string paths naming what the package does not have (moved or renamed?):\n" + "\n".join(missing)


def test_every_module_has_a_layer():
    modules, _, _ = _package()
    named = [name for names in LAYERS for name in names]
    assert len(named) == len(set(named)), "a name in two layers"
    missing = sorted({m.split(".")[1] for m in modules if m != PACKAGE and layer_of(m) is None})
    assert not missing, f"top-level names of {PACKAGE} in no layer of LAYERS (add them where they belong): {missing}"
    unused = sorted(set(named) - {m.split(".")[1] for m in modules if m != PACKAGE})
    assert not unused, f"LAYERS names what the package no longer has: {unused}"
    stale = sorted(k for k in ALLOWED_UPWARD if not (k[0] in modules and k[1] in modules))
    assert not stale, f"ALLOWED_UPWARD entries for modules that no longer exist: {stale}"


def test_no_import_runs_back_up_the_layers():
    _, _, imports = _package()
    upward = upward_imports(imports)
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_every_in_function_import_of_the_package_says_why():
    _, sources, imports = _package()
    bare = uncommented_function_imports(imports, sources)
    assert not bare, (
        "in-function imports of rlhf without a comment saying why they are not at module level "
        "(move them up, or say e.g. `# lazy: pulls in torch`):\n" + "\n".join(bare)
    )


# ------------------------------------------------------------------------------ the checks can fail (planted faults)


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"x": {"x"}}) == [["x", "x"]]
    two = find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}})
    assert two == [["a", "b", "a"], ["c", "d", "e", "c"]]


def test_the_reader_and_the_rules_catch_planted_faults():
    modules = {"rlhf", "rlhf.utils", "rlhf.utils.metrics", "rlhf.utils.sink", "rlhf.cli", "rlhf.cli.main"}
    metrics = (
        "from rlhf.utils import sink\n"
        "def log():\n"
        "    from rlhf.cli.main import run\n"  # up a layer, and no comment
        "    # lazy: a planted reason\n"
        "    from rlhf.utils.sink import write\n"
        "    from rlhf.utils import sink as s\n"  # the comment above its block speaks for it
        "    run()\n"
        "    import rlhf.utils.sink  # noqa: F401\n"
    )  # a pragma is no reason
    sink = (
        "from typing import TYPE_CHECKING\n"
        "from . import metrics\n"  # relative: the other half of a cycle
        "if TYPE_CHECKING:\n"
        "    from rlhf.cli import main\n"
    )
    imports = imports_of(metrics, "rlhf.utils.metrics", modules, "metrics.py") + imports_of(
        sink, "rlhf.utils.sink", modules, "sink.py"
    )
    assert [(i.target, i.where, i.line) for i in imports] == [
        ("rlhf.utils.sink", MODULE, 1),
        ("rlhf.cli.main", FUNCTION, 3),
        ("rlhf.utils.sink", FUNCTION, 5),
        ("rlhf.utils.sink", FUNCTION, 6),
        ("rlhf.utils.sink", FUNCTION, 8),
        ("rlhf.utils.metrics", MODULE, 2),
        ("rlhf.cli.main", TYPE_CHECKING, 4),
    ]
    assert find_cycles({k: set(v) for k, v in module_graph(imports).items()}) == [
        ["rlhf.utils.metrics", "rlhf.utils.sink", "rlhf.utils.metrics"]
    ]
    assert [u.split(":")[0:2] for u in upward_imports(imports)] == [["metrics.py", "3"], ["sink.py", "4"]]
    assert uncommented_function_imports(imports, {"metrics.py": metrics, "sink.py": sink}) == [
        "metrics.py:3: rlhf.utils.metrics -> rlhf.cli.main (in a function)",
        "metrics.py:8: rlhf.utils.metrics -> rlhf.utils.sink (in a function)",
    ]


def _planted(sources: Dict[str, str]) -> List[Import]:
    """The imports and ``"module:function"`` arrows of planted modules (``name -> source``)."""
    modules = set(sources) | {"rlhf", "rlhf.x"}
    out: List[Import] = []
    for name, source in sources.items():
        path = name.rpartition(".")[2] + ".py"
        out += imports_of(source, name, modules, path)
        out += string_imports(string_paths_of(source, name, path), modules)
    return out


#: ``a`` imports ``b`` at module level; each ``b`` imports ``a`` back in its own way.
_PLANTED_A = "from rlhf.x import b\ndef train(cfg):\n    return b.run(cfg)\n"
_PLANTED_B = {
    FUNCTION: "def run(cfg):\n    # lazy: a planted reason\n    from rlhf.x.a import train\n    return train\n",
    TYPE_CHECKING: "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhf.x import a\n",
    STRING: 'import os\nTRAIN = "rlhf.x.a:train"\nDOC = "not a path: rlhf.x.a:train"\n',
}


def test_the_cycle_check_counts_every_kind_of_import_and_descriptor_strings():
    line = {FUNCTION: 3, TYPE_CHECKING: 3, STRING: 2}
    for where, b in _PLANTED_B.items():
        imports = _planted({"rlhf.x.a": _PLANTED_A, "rlhf.x.b": b})
        cycles, stale = import_cycles(imports, {})
        assert cycles == [
            "  rlhf.x.a -> rlhf.x.b -> rlhf.x.a\n"
            "      a.py:1: rlhf.x.a -> rlhf.x.b (module level)\n"
            f"      b.py:{line[where]}: rlhf.x.b -> rlhf.x.a ({where})"
        ], where
        assert stale == []
    no_arrow_back = _planted({"rlhf.x.a": _PLANTED_A, "rlhf.x.b": "import os\n"})
    assert import_cycles(no_arrow_back, {}) == ([], [])


def test_an_allowed_cycle_edge_is_left_out_and_a_stale_one_fails():
    imports = _planted({"rlhf.x.a": _PLANTED_A, "rlhf.x.b": _PLANTED_B[FUNCTION], "rlhf.x.c": "from rlhf.x import a\n"})
    allowed = {("rlhf.x.b", "rlhf.x.a"): "a planted reason"}
    assert import_cycles(imports, allowed) == ([], [])
    gone = {("rlhf.x.a", "rlhf.x.c"): "no such arrow"}  # a imports no c
    on_no_circle = {("rlhf.x.c", "rlhf.x.a"): "an arrow, but nothing leads back to c"}
    assert import_cycles(imports, {**allowed, **gone, **on_no_circle})[1] == [
        ("rlhf.x.a", "rlhf.x.c"),
        ("rlhf.x.c", "rlhf.x.a"),
    ]


def test_the_string_path_check_catches_planted_faults():
    sources = {
        "rlhf.x": "",
        "rlhf.x.a": "from os import path as join\ntry:\n    import yaml\nexcept ImportError:\n    yaml = None\n"
        "def train(cfg): ...\nclass Extension: ...\nLIMIT: int = 3\n",
        "rlhf.x.b": 'KIND = dict(\n    train="rlhf.x.a:train",\n    ext="rlhf.x.a.Extension",\n    cli="rlhf.x.a",\n'
        '    sub="rlhf.x:a",\n    moved="rlhf.x.gone:train",\n    renamed="rlhf.x.a:train_sft",\n'
        '    ext_gone="rlhf.x.a.Gone",\n    names=["rlhf.x.a:LIMIT", "rlhf.x.a:yaml", "rlhf.x.a:join"],\n'
        '    cli_gone="rlhf.x.gone",\n)\n',
    }
    strings = [s for name, source in sources.items() for s in string_paths_of(source, name, name + ".py")]
    assert len(strings) == 11
    assert missing_string_paths(strings, sources) == [
        "rlhf.x.b.py:6: rlhf.x.b: 'rlhf.x.gone:train': no module rlhf.x.gone",
        "rlhf.x.b.py:7: rlhf.x.b: 'rlhf.x.a:train_sft': rlhf.x.a binds no train_sft at its top",
        "rlhf.x.b.py:8: rlhf.x.b: 'rlhf.x.a.Gone': no module rlhf.x.a.Gone, and rlhf.x.a binds no Gone at its top",
        "rlhf.x.b.py:10: rlhf.x.b: 'rlhf.x.gone': no module rlhf.x.gone, and rlhf.x binds no gone at its top",
    ]


def test_no_test_module_name_is_in_both_test_folders():
    """pytest imports test modules by basename (the test folders are not packages): a name in both tests/unit and
    tests/integration fails to collect in a whole-suite run (`make test`), though each folder alone passes."""
    unit = {p.name for p in (ROOT / "tests" / "unit").glob("test_*.py")}
    integration = {p.name for p in (ROOT / "tests" / "integration").glob("test_*.py")}
    assert not unit & integration, f"rename one of each: {sorted(unit & integration)}"


def private_imports(source: str, path: str) -> List[str]:
    """``from rlhf.x import _name`` in ``source``: another module's private name (ruff's PLC2701 leaves imports
    within the first-party package alone, so this test holds the package to it)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            out += [f"{path}:{node.lineno}: {a.name} from {node.module}" for a in node.names if a.name.startswith("_")]
    return out


def test_no_module_imports_another_modules_private_name():
    _, sources, _ = _package()
    found = [hit for path, source in sorted(sources.items()) for hit in private_imports(source, path)]
    assert not found, "make the name public where it lives, or move it where it belongs:\n" + "\n".join(found)


def test_the_private_import_finder_finds_one():
    assert private_imports("from rlhf.x import a, _b\nfrom os import _exit\n", "m.py") == ["m.py:1: _b from rlhf.x"]
