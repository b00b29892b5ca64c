"""Objects named by spec strings, ``path/to/file.py:name`` or ``package.module:name``, with errors that name the spec.

Shared by reward functions (:mod:`rlhf.rewards.functions`) and environments (:mod:`rlhf.envs.loading`); a
:class:`SpecKind` carries what differs between them (the noun in messages, the error class, the private module
prefix), so each keeps its own wording. Light: the standard library only.

* ``path/to/file.py:name``: the file is executed as a fresh module under a unique private name
  (``<prefix><stem>_<hash>_<n>``), so it never shadows a module of the same name; it stays registered under that
  name so pickling, dataclasses and tracebacks inside it work. A file is executed once per process and kind while it
  is unchanged (same modification time and size); an edited file is executed again. A relative path is relative to
  the working directory.
* ``package.module:name``: imported with :func:`importlib.import_module`.

The name may be dotted (``module:Class.method``).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import itertools
import os
import re
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple, Type

__all__ = [
    "SpecKind",
    "clip_plain",
    "split_spec",
    "looks_like_path",
    "absolute_spec",
    "load_module",
    "resolve_attr",
    "public_callables",
    "defined_classes",
]


@dataclass(frozen=True)
class SpecKind:
    """What a family of specs calls itself in error messages.

    Attributes:
        noun: ``"reward function spec"``: messages read ``"{noun} 'x.py:f': ..."``.
        what: the placeholder after the colon in the accepted forms (``"function"``, ``"Class"``).
        error: the exception class raised (a ``ValueError`` subclass taking one message).
        file_prefix: the private ``sys.modules`` name prefix of executed files (``"_rlhf_reward_file_"``).
        listing: what the "available there" list holds (``"Callables"``, ``"Classes"``).
    """

    noun: str
    what: str
    error: Type[Exception]
    file_prefix: str
    listing: str = "Callables"

    @property
    def forms(self) -> str:
        return f"'path/to/file.py:{self.what}' or 'package.module:{self.what}'"


def clip_plain(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more chars)"


def split_spec(spec: Any, kind: SpecKind) -> Tuple[str, str]:
    """``"target:attr"`` -> ``(target, attr)``, checking the form only (nothing is imported)."""
    if not isinstance(spec, str):
        raise kind.error(f"a {kind.noun} must be a string ({kind.forms}), got {type(spec).__name__} {spec!r}")
    target, sep, attr = spec.strip().rpartition(":")
    if not sep or not target or not attr:
        raise kind.error(f"{kind.noun} {spec!r} must look like {kind.forms}")
    if not all(part.isidentifier() for part in attr.split(".")):
        raise kind.error(
            f"{kind.noun} {spec!r}: {attr!r} after the last ':' is not a (dotted) Python name; the "
            f"spec must look like {kind.forms}"
        )
    return target, attr


def looks_like_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target or bool(os.altsep and os.altsep in target)


# (file_prefix, realpath) -> (mtime_ns, size, module): a file is executed once per process and kind while unchanged.
_FILE_MODULES: Dict[Tuple[str, str], Tuple[int, int, types.ModuleType]] = {}
_FILE_COUNTER = itertools.count()


def _load_file(spec: str, target: str, kind: SpecKind) -> types.ModuleType:
    if not target.endswith(".py"):
        raise kind.error(
            f"{kind.noun} {spec!r}: {target!r} looks like a file path but does not end in '.py'; a "
            f"module is named with dots ('package.module:{kind.what}')"
        )
    path = os.path.realpath(os.path.expanduser(target))
    if not os.path.exists(path):
        raise kind.error(
            f"{kind.noun} {spec!r}: file {target!r} not found (resolved to {path}; relative paths are "
            f"relative to the working directory {os.getcwd()})"
        )
    if not os.path.isfile(path):
        raise kind.error(f"{kind.noun} {spec!r}: {path} is not a file")
    stat = os.stat(path)
    cached = _FILE_MODULES.get((kind.file_prefix, path))
    if cached is not None and cached[:2] == (stat.st_mtime_ns, stat.st_size):
        return cached[2]

    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    digest = hashlib.sha1(path.encode("utf-8", "surrogateescape")).hexdigest()[:10]
    name = f"{kind.file_prefix}{stem}_{digest}_{next(_FILE_COUNTER)}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise kind.error(f"{kind.noun} {spec!r}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses, pickle and typing look the module up by name while it executes
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(name, None)
        if isinstance(e, Exception):
            raise kind.error(
                f"{kind.noun} {spec!r}: executing {path} failed: {type(e).__name__}: {clip_plain(str(e), 1000)}"
            ) from e
        raise
    _FILE_MODULES[(kind.file_prefix, path)] = (stat.st_mtime_ns, stat.st_size, module)
    return module


def _import_module(spec: str, target: str, kind: SpecKind) -> types.ModuleType:
    try:
        return importlib.import_module(target)
    except Exception as e:  # ImportError, or anything the module raises at import time (SyntaxError, ...)
        raise kind.error(
            f"{kind.noun} {spec!r}: cannot import module {target!r}: {type(e).__name__}: {clip_plain(str(e), 1000)}"
        ) from e


def absolute_spec(spec: str, kind: SpecKind) -> str:
    """``spec`` with a relative file path made absolute (against this process's working directory), so another
    process (a Ray actor) loads the same file; a module spec is returned as is. Checks the form only."""
    target, attr = split_spec(spec, kind)
    if looks_like_path(target) and not os.path.isabs(os.path.expanduser(target)):
        return f"{os.path.abspath(target)}:{attr}"
    return spec


def load_module(spec: str, target: str, kind: SpecKind) -> types.ModuleType:
    """The module ``target`` of ``spec``: a file executed privately, or an imported module."""
    return _load_file(spec, target, kind) if looks_like_path(target) else _import_module(spec, target, kind)


def public_callables(owner: Any) -> List[str]:
    """Public callables of ``owner``; for a module, those defined in it (not imported), if it defines any."""
    if isinstance(owner, types.ModuleType):
        public = {n: v for n, v in vars(owner).items() if not n.startswith("_") and callable(v)}
        defined = [n for n, v in public.items() if getattr(v, "__module__", None) == owner.__name__]
        return sorted(defined or public)
    return sorted(n for n in dir(owner) if not n.startswith("_") and callable(getattr(owner, n, None)))


def defined_classes(owner: Any) -> List[str]:
    """Public classes of ``owner``; for a module, those defined in it (not imported), if it defines any."""
    if isinstance(owner, types.ModuleType):
        public = {n: v for n, v in vars(owner).items() if not n.startswith("_") and isinstance(v, type)}
        defined = [n for n, v in public.items() if getattr(v, "__module__", None) == owner.__name__]
        return sorted(defined or public)
    return sorted(n for n in dir(owner) if not n.startswith("_") and isinstance(getattr(owner, n, None), type))


def resolve_attr(
    spec: str,
    target: str,
    attr: str,
    module: types.ModuleType,
    kind: SpecKind,
    available: Callable[[Any], List[str]] = public_callables,
) -> Any:
    """``module.<attr>`` (dotted), or ``kind.error`` naming what is missing, the close matches among
    ``available(owner)`` and that whole list."""
    obj: Any = module
    parts = attr.split(".")
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            owner = target if i == 0 else f"{target}:{'.'.join(parts[:i])}"
            names = available(obj)
            close = difflib.get_close_matches(part, names, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            listing = ", ".join(names) if names else "none"
            raise kind.error(
                f"{kind.noun} {spec!r}: {owner} has no attribute {part!r}.{hint} "
                f"{kind.listing} available there: {listing}"
            ) from None
    return obj
