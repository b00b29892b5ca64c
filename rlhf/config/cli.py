"""The command-line and documentation side of the run configs: ``parse_cli``, ``--help`` and ``describe_keys``.

``parse_cli`` is the shared front end of the training commands (``prog [--config FILE_OR_PRESET]
[KEY=VALUE ...]``); its ``--help`` lists every dotted key with its type, default and the field's trailing
``# comment`` from :mod:`rlhf.config.schema`. :func:`describe_keys` exposes the same rows, for the generated
configuration reference (``docs/gen_config_reference.py``). Loading and validation live in
:mod:`rlhf.config.loader`, which this module builds on (and which imports nothing from here).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import sys
import textwrap
import tokenize
from typing import Any, Generic, Sequence, TypeVar, cast

from rlhf.config.loader import available_presets, load_config, type_name, walk_fields
from rlhf.config.schema import ConfigError
from rlhf.config.suggest import suggest_keys

T = TypeVar("T")


# --------------------------------------------------------------------------------------------- public API


@dataclasses.dataclass(frozen=True)
class CliRequest(Generic[T]):
    """What a training command was asked to do: the validated config, and whether only to plan it."""

    config: T
    dry_run: bool = False  # --dry-run: validate and print the resource plan; start nothing
    cluster: str = ""  # --cluster SHAPE: the simulated cluster a dry run plans against


def parse_cli(cls: type[T], argv: Sequence[str] | None = None, prog: str | None = None) -> T:
    """The shared command-line front end: ``prog [--config FILE_OR_PRESET] [KEY=VALUE ...]``.

    ``--help`` lists every dotted key with its type, default and help text. A configuration error is
    printed as ``error: <message>`` on stderr and exits with status 2, without a traceback, as does an override
    written as an option (``--train.lr 1e-4``, ``--lr``), naming its ``KEY=VALUE`` form. ``--dry-run`` and
    ``--cluster`` are accepted and ignored here; :func:`parse_cli_args` returns them (``rlhf.cli.common.run_cli``).

    Args:
        cls: The run config dataclass to build.
        argv: Arguments without the program name; None reads ``sys.argv[1:]``.
        prog: Program name shown in the usage line.

    Returns:
        The validated run config.

    Raises:
        SystemExit: Status 2 on a bad argument or configuration, 0 after ``--help``.
    """
    return parse_cli_args(cls, argv, prog).config


def parse_cli_args(cls: type[T], argv: Sequence[str] | None = None, prog: str | None = None) -> CliRequest[T]:
    """:func:`parse_cli`, also returning ``--dry-run`` and ``--cluster``.

    Raises:
        SystemExit: As :func:`parse_cli`; also status 2 for ``--cluster`` without ``--dry-run``.
    """
    parser = _build_parser(cls, prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    dashed = dashed_overrides(cls, argv)
    if dashed:
        written, corrected = " ".join(w for w, _ in dashed), " ".join(c for _, c in dashed)
        parser.error(f"unrecognized arguments {written!r}: overrides are KEY=VALUE without dashes; write: {corrected}")
    args = parser.parse_intermixed_args(argv)
    if args.cluster and not args.dry_run:
        parser.error("--cluster only applies to a --dry-run (a real run uses the cluster it joins)")
    try:
        config = load_config(cls, args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)  # a usage error, printed as argparse prints its own
        raise SystemExit(2) from None
    return CliRequest(config=config, dry_run=args.dry_run, cluster=args.cluster)


def describe_keys(cls: type) -> list[tuple[str, str, object, str]]:
    """List every leaf key of a config dataclass, for ``--help`` and the configuration reference.

    Args:
        cls: A config dataclass (a run config or a single section).

    Returns:
        ``(dotted key, type, default, help)`` rows in declaration order. The default is
        ``dataclasses.MISSING`` for a key without one; the help is the field's trailing ``# comment`` in the
        source, or ``""``.
    """
    rows: list[tuple[str, str, object, str]] = []
    sections: dict[str, Any] = {}  # dotted section -> its default instance (None: none), whose values are defaults
    for key, owner, f, tp, section in walk_fields(cls):
        parent = sections.get(key.rpartition(".")[0])
        default = getattr(parent, f.name) if parent is not None else _field_default(f)
        if section is not None:
            sections[key] = default if isinstance(default, section) else None
        else:
            rows.append((key, type_name(tp), default, _field_help(owner, f.name)))
    return rows


def dashed_overrides(cls: type, argv: Sequence[str]) -> list[tuple[str, str]]:
    """Arguments written as options but meant as overrides (``--train.lr 1e-4``, ``--train.lr=1e-4``, ``--lr``),
    each with its corrected ``KEY=VALUE`` form (a name that is not a key becomes the key it probably means).

    Args:
        cls: The run config dataclass.
        argv: The command line without the program name.

    Returns:
        ``(as written, corrected)`` pairs in order; empty when every option is one the commands know.
    """
    types: dict[str, str] = {}  # every leaf key -> its type name, read at the first override found
    found: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            break
        if arg in _OPTIONS_WITH_VALUE:
            i += 1  # its value, whatever it looks like
            continue
        if not arg.startswith("-") or arg == "-" or _is_number(arg) or _known_option(arg):
            continue
        written = arg
        name, eq, value = arg.lstrip("-").partition("=")
        if not eq and i < len(argv) and _is_value(argv[i]):  # --key value
            value, eq, written = argv[i], "=", f"{arg} {argv[i]}"
            i += 1
        types = types or {key: type_name for key, type_name, _, _ in describe_keys(cls)}
        key = ".".join(part.replace("-", "_") for part in name.split("."))  # --train.max-steps: train.max_steps
        if key not in types:
            key = next(iter(suggest_keys(key, list(types))[0]), key)
        placeholder = "true" if types.get(key) == "bool" else "VALUE"  # a flag written without its value
        found.append((written, f"{key}={value if eq else placeholder}"))
    return found


def _is_value(arg: str) -> bool:
    """The value of a ``--key value`` pair rather than the next option or override."""
    return "=" not in arg and (not arg.startswith("-") or _is_number(arg))


_OPTIONS_WITH_VALUE = ("--config", "-c", "--cluster")
_OPTIONS = ("--config", "-c", "--cluster", "--dry-run", "--help", "-h")


def _known_option(arg: str) -> bool:
    """One of the commands' own options (``--config=x`` and ``-cx`` forms included)."""
    return arg.split("=", 1)[0] in _OPTIONS or (arg.startswith("-c") and not arg.startswith("--"))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------- docs and --help


def _field_default(f: dataclasses.Field[Any]) -> Any:
    """The default of a field (its factory called), or MISSING."""
    try:
        return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    except Exception:  # a factory that cannot run without input has no printable default
        return dataclasses.MISSING


def _field_help(cls: type, name: str) -> str:
    """The trailing ``# comment`` of the field in the class (of the MRO) that declares it."""
    for klass in cls.__mro__:
        if name in inspect.get_annotations(klass):
            return _field_comments(klass).get(name, "")
    return ""


@functools.lru_cache(maxsize=None)
def _field_comments(klass: type) -> dict[str, str]:
    """Map each annotated field of ``klass`` to its comment in the source, if any: the comment lines right above
    it followed by the comment on its own line(s)."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
        (node,) = ast.parse(source).body  # the class statement
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, SyntaxError, ValueError, tokenize.TokenError):  # no source: no help text
        return {}
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}
    lines = source.splitlines()
    found: dict[str, str] = {}
    for stmt in cast(ast.ClassDef, node).body:  # cast: inspect.getsource of a class is that one class statement
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            assert stmt.end_lineno is not None, "ast.parse sets end_lineno on every statement"
            rows = range(stmt.lineno, stmt.end_lineno + 1)
            parts = [next((comments[r] for r in rows if r in comments), "")]
            above = stmt.lineno - 1
            while above in comments and lines[above - 1].lstrip().startswith("#"):
                parts.insert(0, comments[above])
                above -= 1
            text = " ".join(p for p in parts if p)
            if text:
                found[stmt.target.id] = text
    return found


def format_default(value: Any) -> str:
    """A default as it would be typed in an override."""
    if value is dataclasses.MISSING:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # a newline shown as \n: one line in --help and the reference table
        return '""' if value == "" else value.replace("\n", "\\n")
    if isinstance(value, tuple):
        return "[" + ", ".join(format_default(v) for v in value) + "]"
    return repr(value)


def _help_epilog(cls: type) -> str:
    """The key reference printed by ``--help``."""
    rows = describe_keys(cls)
    cells = [(key, type_name, format_default(default), text) for key, type_name, default, text in rows]
    widths = [max((len(c[i]) for c in cells), default=0) for i in range(3)]
    lines = ["configuration keys (KEY=VALUE overrides; type, default, notes):"]
    for key, type_text, default, text in cells:
        line = f"  {key:<{widths[0]}}  {type_text:<{widths[1]}}  {default:<{widths[2]}}"
        lines.append(f"{line}  {text}".rstrip())
    lines += ["", f"presets (--config NAME): {', '.join(available_presets()) or '(none)'}"]
    return "\n".join(lines)


def _build_parser(cls: type, prog: str | None) -> argparse.ArgumentParser:
    doc = inspect.getdoc(cls) or ""
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclasses put in place of a missing docstring
        doc = ""
    description = "\n\n".join(filter(None, [doc, "Precedence: defaults < --config file < KEY=VALUE overrides."]))
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=_help_epilog(cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config",
        "-c",
        metavar="FILE_OR_PRESET",
        default=None,
        help="YAML config file, or the name of a shipped preset (see the list below)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and print the resource plan (placement groups, bundles per node, shared devices, "
        "engines, precision, weight sync, batch sizes) without starting Ray or loading weights; exit 0 when "
        "the plan fits the cluster, 2 naming the role that does not",
    )
    parser.add_argument(
        "--cluster",
        metavar="SHAPE",
        default="",
        help="with --dry-run: plan against a simulated cluster, NxGgpu[:Ccpu] or NxCcpu nodes joined with '+' "
        "(2x8gpu, 2x8gpu:96cpu, 1x4cpu, 1x16cpu+2x8gpu; a GPU node without :Ccpu has 8 CPUs per GPU). "
        "Default: the live cluster at ray.address / RAY_ADDRESS (read, nothing started), else this machine",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides applied after the config file, e.g. train.micro_batch_size=2",
    )
    return parser
