"""The house: no import circles, no arrow running back up the layers, and every in-function import of ``rlhf``
says why it is not at the top of its file.

Read from the source with ``ast`` (nothing is imported), so a violation is named by file and line:

* the module-level imports of ``rlhf`` modules form no cycle (an import of ``rlhf.a.b`` runs ``rlhf/a/__init__.py``
  too, so that edge is counted);
* no import, at module level, inside a function or under ``TYPE_CHECKING``, goes from a lower layer of
  :data:`LAYERS` to a higher one (except :data:`ALLOWED_UPWARD`, each with its reason);
* an import of ``rlhf`` inside a function carries a comment on its line or the line above (above its block of such
  imports), saying why it is not at module level (``# lazy: pulls in torch``, a cycle it breaks). The rule:
  in-function only to keep ``import rlhf`` or a light command-line path light, or to break a real cycle.
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

MODULE, FUNCTION, TYPE_CHECKING = "module level", "in a function", "under TYPE_CHECKING"
_PRAGMA = re.compile(r"#\s*(noqa\b|type:|pragma\b|pylint:|fmt:|isort:)")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # the rlhf module it imports (a submodule when ``from pkg import submodule``)
    where: str  # MODULE, FUNCTION or TYPE_CHECKING
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


# ---------------------------------------------------------------------------------------------------- the checks


def module_graph(imports: Sequence[Import]) -> Dict[str, Dict[str, Import]]:
    """``importer -> {imported: the import}`` of the module-level imports, with the packages an import runs
    (``rlhf.a`` for ``rlhf.a.b``; not the importer's own packages, which are being imported already)."""
    graph: Dict[str, Dict[str, Import]] = {}
    for imp in imports:
        if imp.where != MODULE:
            continue
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


def test_module_level_imports_form_no_cycle():
    _, _, imports = _package()
    graph = module_graph(imports)
    cycles = find_cycles(graph)
    described = [
        "  " + " -> ".join(cycle) + "\n" + "\n".join(f"      {graph[a][b]}" for a, b in zip(cycle, cycle[1:]))
        for cycle in cycles
    ]
    assert not cycles, "import cycles at module level:\n" + "\n".join(described)


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


def test_no_test_module_name_is_in_both_test_folders():
    """pytest imports test modules by basename (the test folders are not packages): a name in both tests/unit and
    tests/integration fails to collect in a whole-suite run (`make test`), though each folder alone passes."""
    unit = {p.name for p in (ROOT / "tests" / "unit").glob("test_*.py")}
    integration = {p.name for p in (ROOT / "tests" / "integration").glob("test_*.py")}
    assert not unit & integration, f"rename one of each: {sorted(unit & integration)}"
