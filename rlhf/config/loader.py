"""Load run configs from dataclass defaults, YAML files or presets, and dotted ``key=value`` overrides.

Precedence, lowest first::

    dataclass defaults  <  YAML file (after the files in its ``defaults:`` list)  <  overrides

A YAML file is a nested mapping mirroring the run config (``train: {micro_batch_size: 2}``); a dotted key
(``train.micro_batch_size: 2``, at any level) is read as its nested form. ``config_file``
may be a path or the name of a preset shipped in ``rlhf/config/presets`` (``sft_tiny``). A file may start with
``defaults: [base, ../other.yaml]``: those files (presets or paths relative to the including file) are merged
first, in order, then the file itself on top.

Overrides look like ``train.micro_batch_size=2``, ``train.adam_betas=[0.9,0.99]`` or
``strategy.deepspeed_config=`` (empty string). Their values are parsed with ``yaml.safe_load`` and coerced to
the annotated type of the field; a ``str`` field keeps the override's text as written (``model.path=123``
gives ``"123"``, ``reward.judge.template={prompt}`` the template, not a mapping).

Every error is a :class:`~rlhf.config.schema.ConfigError` whose message names the dotted key (or the file and
line of bad YAML). The sections are built bottom-up so each one's ``__post_init__`` validation runs, and its
message is passed on unchanged.

The command line (``parse_cli``, ``--help``, :func:`~rlhf.config.cli.describe_keys`) is :mod:`rlhf.config.cli`,
which builds on this module; this module imports nothing from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, TypeVar, Union, cast

import yaml

from rlhf.atomic import write_text_atomic
from rlhf.config.schema import ConfigError
from rlhf.config.suggest import suggest_keys

T = TypeVar("T")

#: Directory of the YAML presets shipped with the package (``--config sft_tiny``).
PRESET_DIR = Path(__file__).resolve().parent / "presets"

_DEFAULTS_KEY = "defaults"
_NONE_TYPE = type(None)
_TRUE = frozenset({"true", "yes", "y", "on", "1"})
_FALSE = frozenset({"false", "no", "n", "off", "0"})
_OVERRIDE_FORM = "expected KEY=VALUE with a dotted key, e.g. train.micro_batch_size=2"
_SAVED_MARK = "resolved (reload with --config "  # in the header line save_config writes
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class _Override:
    """A value from the command line: the text as written and its YAML parse."""

    raw: str
    parsed: Any


# --------------------------------------------------------------------------------------------- public API


def load_config(
    cls: type[T],
    config_file: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Build a validated run config from defaults, an optional YAML file or preset, and overrides.

    Args:
        cls: The run config dataclass, e.g. ``SFTRunConfig``.
        config_file: A YAML path or the name of a preset in ``rlhf/config/presets``; None for none.
        overrides: Dotted ``key=value`` strings applied last, in order (a later one wins).

    Returns:
        An instance of ``cls``; every section has run its own validation.

    Raises:
        ConfigError: For a missing file, bad YAML, an unknown key, a value of the wrong type, or a value the
            sections' validation rejects. The message names the dotted key.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"load_config expects a dataclass type, got {cls!r}")
    tree = _load_yaml_tree(config_file) if config_file not in (None, "") else {}
    if isinstance(overrides, str):  # a lone "k=v" rather than a list of them
        overrides = (overrides,)
    for text in overrides:
        key, value = _parse_override(text)
        _apply_override(tree, cls, key, value)
    return _build(cls, tree, "", cls)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Convert a config dataclass instance to plain nested dicts (tuples become lists).

    Args:
        cfg: A config dataclass instance.

    Returns:
        A dict that ``yaml.safe_dump`` can write and :func:`load_config` can read back.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"config_to_dict expects a dataclass instance, got {cfg!r}")
    return _to_plain(cfg)


def save_config(cfg: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``cfg`` as YAML, atomically (a temporary file in the same directory, then ``os.replace``).

    Args:
        cfg: A config dataclass instance.
        path: Destination file; missing parent directories are created.

    Returns:
        The path written.
    """
    path = Path(path)
    header = f"# {type(cfg).__name__}, {_SAVED_MARK}{path.name})\n"
    text = header + yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
    write_text_atomic(path, text)
    return path


def is_saved_config(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file :func:`save_config` wrote (its header line), as opposed to one a user wrote."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline(400)
    except (OSError, UnicodeDecodeError):
        return False
    return first.startswith("# ") and _SAVED_MARK in first


def available_presets() -> list[str]:
    """Names of the presets shipped in ``rlhf/config/presets`` (usable as ``--config NAME``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


# ------------------------------------------------------------------------------------- files and presets


def _preset_path(name: str) -> Path | None:
    """The preset file called ``name`` (with or without ``.yaml``), or None."""
    stem = name.removesuffix(".yaml")
    if not stem or "/" in stem or os.sep in stem:
        return None
    path = PRESET_DIR / f"{stem}.yaml"
    return path if path.is_file() else None


def _resolve_config_path(ref: str | os.PathLike[str], base_dir: Path | None = None) -> Path:
    """Find a config file: a path (relative to ``base_dir`` if given, else the CWD), then a preset name."""
    text = os.fspath(ref)
    path = Path(text).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if path.is_file():
        return path.resolve()
    preset = _preset_path(text)
    if preset is not None:
        return preset.resolve()
    where = f" (looked relative to {base_dir})" if base_dir is not None else ""
    presets = ", ".join(available_presets()) or "(none)"
    raise ConfigError(f"config file {text!r} not found{where}: not a file nor a preset. Available presets: {presets}")


def _read_yaml(path: Path) -> dict[str, Any]:
    """Parse one YAML file whose top level is a mapping (an empty file is an empty mapping)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except yaml.MarkedYAMLError as e:  # e.g. "expected ',' or ']', but got ':'" (while parsing a flow sequence)
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        context = f" ({e.context}, line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
        raise ConfigError(f"{where}: invalid YAML: {e.problem or e.context}{context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of config sections, got {type(data).__name__}")
    return dict(data)


def _pop_defaults(data: dict[str, Any], path: Path) -> list[str]:
    """Remove and return the file's ``defaults:`` list (a single string is a list of one)."""
    refs = data.pop(_DEFAULTS_KEY, None)
    if refs is None:
        return []
    if isinstance(refs, str):
        refs = [refs]
    if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
        raise ConfigError(f"{path}: 'defaults' must be a list of preset names or file paths, got {refs!r}")
    return refs


def _load_yaml_tree(
    ref: str | os.PathLike[str], base_dir: Path | None = None, _stack: tuple[Path, ...] = ()
) -> dict[str, Any]:
    """Read a config file with its ``defaults`` merged underneath it, refusing cycles."""
    path = _resolve_config_path(ref, base_dir)
    if path in _stack:
        chain = " -> ".join(str(p) for p in (*_stack, path))
        raise ConfigError(f"cycle in config 'defaults': {chain}")
    data = _read_yaml(path)
    parents = _pop_defaults(data, path)
    data = _expand_dotted(data, str(path))
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = _deep_merge(merged, _load_yaml_tree(parent, path.parent, (*_stack, path)))
    return _deep_merge(merged, data)


def _expand_dotted(data: Mapping[Any, Any], where: str, prefix: str = "") -> dict[Any, Any]:
    """Dotted keys in nested form, at every level: ``{"model.path": x}`` -> ``{"model": {"path": x}}``.

    A key given both ways in one mapping (``train.lr`` and ``train: {lr: ...}``) is an error naming it, as is
    a dotted key below one set to a plain value. Keys with an empty part (``train..lr``) stay as written and
    are reported as unknown keys.
    """
    out: dict[Any, Any] = {}
    for key, value in data.items():
        parts = key.split(".") if isinstance(key, str) else [key]
        if not all(isinstance(p, str) and p.strip() for p in parts):
            parts = [key]
        if isinstance(value, Mapping):
            value = _expand_dotted(value, where, _join(prefix, str(key)))
        for part in reversed(parts[1:]):
            value = {part: value}
        _put_once(out, parts[0], value, _join(prefix, str(parts[0])), where)
    return out


def _put_once(node: dict[Any, Any], name: Any, value: Any, key: str, where: str) -> None:
    """``node[name] = value``, merging two mappings that set different keys; the same key twice is an error."""
    old = node.get(name, _MISSING)
    if old is _MISSING or (old is None and isinstance(value, Mapping)):
        node[name] = value
    elif value is None and isinstance(old, Mapping):
        return  # a section whose keys are all commented out adds nothing
    elif isinstance(old, Mapping) and isinstance(value, Mapping):
        merged = dict(old)
        for sub, sub_value in value.items():
            _put_once(merged, sub, sub_value, _join(key, str(sub)), where)
        node[name] = merged
    else:
        raise ConfigError(f"{where}: {key!r} is set twice (as a dotted key and inside its section); keep one")


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``; mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            out[key] = _deep_merge(old, value)
        elif isinstance(old, Mapping) and value is None:
            continue  # a section whose keys are all commented out keeps the inherited ones
        else:
            out[key] = value
    return out


# ------------------------------------------------------------------------------------------- overrides


def _parse_override(text: str) -> tuple[str, _Override]:
    """Split ``key=value`` and YAML-parse the value (text YAML cannot parse stays text)."""
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(f"invalid override {text!r}: {_OVERRIDE_FORM}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"invalid override {text!r}: {_OVERRIDE_FORM}")
    try:
        parsed = yaml.safe_load(raw)
    except yaml.YAMLError:
        parsed = raw
    return key, _Override(raw, parsed)


def _apply_override(tree: dict[str, Any], root: type, key: str, value: _Override) -> None:
    """Set ``key`` in the raw nested dict, checking the path against the dataclasses as it goes. A mapping for a
    section (``train={lr: 0.1}``) merges into it; a scalar for a section is an error."""
    parts = key.split(".")
    node, section = tree, root
    for depth, part in enumerate(parts):
        prefix, dotted, last = ".".join(parts[:depth]), ".".join(parts[: depth + 1]), depth == len(parts) - 1
        fields = _init_fields(section)
        sub = _section_type(_hints(section)[part]) if part in fields else None
        if part not in fields or (sub is None and not last):  # not a key, or a path past a leaf (train.lr.x)
            raise _unknown_key(root, key, section, prefix)
        if sub is None:
            node[part] = value
            return
        if last and not isinstance(value.parsed, Mapping):
            raise _section_scalar_error(dotted, sub, value.parsed)
        node[part] = _as_section(node.get(part), dotted, sub)
        if last:
            node[part] = _deep_merge(node[part], _expand_dotted(value.parsed, f"override {dotted}"))
        node, section = node[part], sub


def _as_section(value: Any, key: str, section: type) -> dict[str, Any]:
    """A (copied) mapping for a section; None is an empty section, anything else an error."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    raise _section_scalar_error(key, section, value)


# -------------------------------------------------------------------------------------------- building


def _build(cls: type[T], data: Any, prefix: str, root: type) -> T:
    """Construct ``cls`` (and its sections, first) from a raw nested mapping."""
    data = _as_section(data, prefix, cls) if prefix else data
    fields = _init_fields(cls)
    for name in data:
        if name not in fields:
            raise _unknown_key(root, _join(prefix, str(name)), cls, prefix)
    hints = _hints(cast(type, cls))  # cast: mypy does not see that type[T] is Hashable (lru_cache's key)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key, tp = _join(prefix, name), hints[name]
        if name in data:
            kwargs[name] = _coerce(data[name], tp, key, root)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            section = _section_type(tp)
            if section is None:
                raise ConfigError(f"{key} is required")
            kwargs[name] = _build(section, {}, key, root)  # its own validation names the missing keys
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a section's own validation: its message, as a ConfigError
        raise ConfigError(str(e)) from e


def _coerce(value: Any, tp: Any, key: str, root: type) -> Any:
    """Convert a YAML or override value to the annotated type ``tp``."""
    inner, optional = _unwrap_optional(tp)
    override = value if isinstance(value, _Override) else None
    plain = override.parsed if override is not None else value
    empty_str = override is not None and inner is str and not override.raw.strip()
    section = _section_type(inner)
    if plain is None and not empty_str and (optional or section is None):
        if optional:
            return None
        raise ConfigError(f"{key}: expected {type_name(inner)}, got null")
    if section is not None:
        return _build(section, plain, key, root)  # a null section (keys all commented out) is an empty one
    if inner is str:
        return _to_str(plain, key, override)
    if inner in _SCALARS:
        return _SCALARS[inner](plain, key)
    origin = typing.get_origin(inner)
    if origin is tuple:
        return _to_tuple(plain, inner, key, root)
    if origin is list:
        return _to_list(plain, inner, key, root)
    return plain


def _type_error(key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{key}: expected {expected}, got {value!r}")


def _to_str(value: Any, key: str, override: _Override | None) -> str:
    """Strings pass; an override keeps its text as written, whatever YAML would make of it (a judge template
    ``{prompt}`` or ``Score: {response}`` is text, not a mapping); YAML numbers are converted."""
    if isinstance(value, str):
        return value
    if override is not None:
        return override.raw.strip()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise _type_error(key, "str", value)


def _to_int(value: Any, key: str) -> int:
    """ints, integral floats (``2.0``) and their text; never bools."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value.strip())
        with contextlib.suppress(ValueError):
            number = float(value)
            if number.is_integer():
                return int(number)
    raise _type_error(key, "int", value)


def _to_float(value: Any, key: str) -> float:
    """ints, floats and numeric text (PyYAML reads ``1e-3`` without a dot as a string); never bools."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return float(value)
    raise _type_error(key, "float", value)


def _to_bool(value: Any, key: str) -> bool:
    """bools, 0/1, and true/false/yes/no/on/off text."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _type_error(key, "bool", value)


_SCALARS = {int: _to_int, float: _to_float, bool: _to_bool}


def _to_tuple(value: Any, tp: Any, key: str, root: type) -> tuple[Any, ...]:
    """A list (or ``a,b`` text) to a tuple, each item coerced; fixed-length tuples check the length."""
    if isinstance(value, str):
        value = [item.strip() for item in value.split(",")]
    if not isinstance(value, (list, tuple)):
        raise _type_error(key, type_name(tp), value)
    args = typing.get_args(tp)
    if not args:
        return tuple(value)
    if len(args) == 2 and args[1] is Ellipsis:
        args = (args[0],) * len(value)
    if len(value) != len(args):
        raise ConfigError(f"{key}: expected a list of {len(args)} values ({type_name(tp)}), got {list(value)!r}")
    return tuple(_coerce(v, a, f"{key}[{i}]", root) for i, (v, a) in enumerate(zip(value, args)))


def _to_list(value: Any, tp: Any, key: str, root: type) -> list[Any]:
    """A list with each item coerced to the element type."""
    if not isinstance(value, (list, tuple)):
        raise _type_error(key, type_name(tp), value)
    args = typing.get_args(tp)
    if not args:
        return list(value)
    return [_coerce(v, args[0], f"{key}[{i}]", root) for i, v in enumerate(value)]


# ---------------------------------------------------------------------------------------------- errors


def _unknown_key(root: type, key: str, section: type, prefix: str) -> ConfigError:
    """Name the bad key; suggest what it probably meant (:func:`~rlhf.config.suggest.suggest_keys`: other
    toolkits' names, the same name in another section, close spellings), else list the section's valid keys."""
    close, note = suggest_keys(key, _all_keys(root))
    if close:
        hint = f"did you mean {' or '.join(repr(c) for c in close)}?" + (f" ({note})" if note else "")
    else:
        where = f"in '{prefix}'" if prefix else "at the top level"
        hint = f"valid keys {where}: {', '.join(_init_fields(section))}"
    return ConfigError(f"unknown config key {key!r}; {hint}")


def _section_scalar_error(key: str, section: type, value: Any) -> ConfigError:
    example = next(iter(_init_fields(section)), "key")
    return ConfigError(
        f"{key}: is a config section; expected a mapping of its keys (e.g. {key}.{example}=...), got {value!r}"
    )


# ---------------------------------------------------------------------------------- dataclass introspection


def _init_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations (the schema uses ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``Optional[X]`` -> ``(X, True)``; anything else -> ``(tp, False)``."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return tp, False
    args = typing.get_args(tp)
    rest = tuple(a for a in args if a is not _NONE_TYPE)
    if len(rest) == len(args):
        return tp, False
    return (rest[0] if len(rest) == 1 else Union[rest]), True


def _section_type(tp: Any) -> type | None:
    """The dataclass type of a section field (also through Optional), else None."""
    inner, _ = _unwrap_optional(tp)
    return inner if isinstance(inner, type) and dataclasses.is_dataclass(inner) else None


def walk_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, type, dataclasses.Field[Any], Any, type | None]]:
    """``(dotted key, owner, field, type, section dataclass or None)`` for every key of ``cls``, in declaration
    order, each section followed by its own keys. The owner is the dataclass the field belongs to."""
    for name, f in _init_fields(cls).items():
        key, tp = _join(prefix, name), _hints(cls)[name]
        section = _section_type(tp)
        yield key, cls, f, tp, section
        if section is not None:
            yield from walk_fields(section, key)


@functools.lru_cache(maxsize=None)
def _all_keys(cls: type) -> tuple[str, ...]:
    """Every valid dotted key, sections included (for suggestions)."""
    return tuple(key for key, *_ in walk_fields(cls))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: _to_plain(getattr(value, name)) for name in _init_fields(type(value))}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def type_name(tp: Any) -> str:
    """Readable type: ``int``, ``tuple[float, float]``, ``str | None``."""
    if tp is _NONE_TYPE:
        return "None"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{name}[{inner}]" if args else name
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")
