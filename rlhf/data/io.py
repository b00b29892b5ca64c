"""Reading training rows from disk, with errors that say where the data is wrong.

The HF ``datasets`` library is the reader; this module adds the validation it does not do. A JSON-lines file is
first scanned line by line so that a bad row is reported as ``file:line``, which ``datasets`` cannot do (its
errors name an Arrow block, not a line). Parquet files and ``save_to_disk`` directories have no lines, so their
errors name the 0-based row index instead.

Rows come back as plain dicts holding only the requested fields that are present; a ``null`` in an optional
field counts as absent, so downstream code only has to test ``"margin" in row``.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any, Iterable, Mapping, Sequence

logger = logging.getLogger(__name__)

_JSON_EXTS = (".jsonl", ".json")
_PARQUET_EXTS = (".parquet",)
_SUPPORTED = ".jsonl, .json (JSON lines), .parquet, or a directory written by datasets' save_to_disk"


class DataError(ValueError):
    """A dataset file is missing, unreadable, or has a row that does not fit the expected fields."""


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_instance(value: Any, allowed: tuple[type, ...]) -> bool:
    # bool is a subclass of int, but `"margin": true` is a data bug, not a margin of 1.
    if isinstance(value, bool) and bool not in allowed:
        return False
    return isinstance(value, allowed)


def _expected(allowed: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in allowed)


def _resolve_types(
    required: Sequence[str], optional: Sequence[str], types: Mapping[str, tuple[type, ...]] | None
) -> dict[str, tuple[type, ...]]:
    """Required fields default to ``str``; optional fields are unchecked unless ``types`` names them."""
    resolved: dict[str, tuple[type, ...]] = {name: (str,) for name in required}
    for name, allowed in (types or {}).items():
        resolved[name] = tuple(allowed) if isinstance(allowed, (tuple, list)) else (allowed,)
    return resolved


def _validate_row(
    row: Any,
    where: str,
    required: Sequence[str],
    optional: Sequence[str],
    types: Mapping[str, tuple[type, ...]],
) -> dict:
    """Check one row and return the dict of requested fields that are present.

    Args:
        row: The decoded row.
        where: Location prefix for error messages (``"file:3"`` or ``"dir: row 2"``).
        required: Fields that must be present.
        optional: Fields that are kept when present.
        types: Allowed Python types per field.

    Raises:
        DataError: If the row is not an object, lacks a required field, or has a field of the wrong type.
    """
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {_type_name(row)}")
    for name in required:
        if name not in row:
            has = ", ".join(sorted(row)) or "no fields"
            raise DataError(f"{where}: missing field {name!r} (row has: {has})")
    out: dict = {}
    for name in list(required) + [n for n in optional if n not in required]:
        if name not in row:
            continue
        value = row[name]
        if value is None and name not in required:
            continue  # an explicit null in an optional field means "not given"
        allowed = types.get(name)
        if allowed is not None and not _is_instance(value, allowed):
            raise DataError(f"{where}: field {name!r} must be {_expected(allowed)}, got {_type_name(value)}")
        out[name] = value
    return out


def _scan_jsonl(path: str) -> list[tuple[int, Any]]:
    """Parse a JSON-lines file ourselves, so that errors carry 1-based line numbers.

    Returns:
        ``(line number, decoded value)`` for each non-blank line, in file order.
    """
    values: list[tuple[int, Any]] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                # utf-8-sig on the first line tolerates a byte-order mark written by some editors.
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid UTF-8: {e}") from None
            if not text.strip():
                continue
            try:
                values.append((lineno, json.loads(text)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    return values


def _set_offline_env() -> None:
    # Reading local files never needs the network; without these, datasets may still try to reach the Hub.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _load_with_datasets(builder: str, path: str) -> list[dict]:
    """Read a local file with ``datasets.load_dataset`` and return its rows as dicts.

    The Arrow cache goes to a temporary directory that is removed afterwards: the rows are copied into Python
    objects anyway, and a shared cache keyed on file fingerprints can serve stale data after an in-place edit.
    """
    _set_offline_env()
    import datasets

    with tempfile.TemporaryDirectory(prefix="rlhf-datasets-") as cache_dir:
        ds = datasets.load_dataset(builder, data_files=path, split="train", cache_dir=cache_dir)
        rows = ds.to_list()
        del ds  # drop the memory map before the cache directory goes away
    return rows


def _read_jsonl(
    path: str, required: Sequence[str], optional: Sequence[str], types: Mapping[str, tuple[type, ...]]
) -> list[dict]:
    scanned = _scan_jsonl(path)
    if not scanned:
        raise DataError(f"{path}: no rows")
    # Validate on our own parse: it is the one that knows line numbers and which keys each row really had.
    checked = [_validate_row(value, f"{path}:{lineno}", required, optional, types) for lineno, value in scanned]
    try:
        loaded = _load_with_datasets("json", path)
    except Exception as e:  # noqa: BLE001 - any schema-inference failure means "use our parse instead"
        # datasets infers one Arrow schema for the whole file; columns whose type varies between rows (an
        # unrequested field that is a string here and a number there) make it fail on data that is fine for us.
        logger.warning("%s: datasets could not load the file (%s: %s); using the plain JSON parse",
                       path, type(e).__name__, e)
        return checked
    if len(loaded) != len(checked):
        logger.warning("%s: datasets read %d rows but the file has %d; using the plain JSON parse",
                       path, len(loaded), len(checked))
        return checked
    # Arrow gives every row every column (missing -> None); keep only the keys the row actually had.
    try:
        return [{k: row[k] for k in mine} for row, mine in zip(loaded, checked)]
    except KeyError as e:  # datasets dropped or renamed a column; our parse is the authority on content
        logger.warning("%s: datasets returned no column %s; using the plain JSON parse", path, e)
        return checked


def _validate_table(
    path: str,
    rows: Iterable[dict],
    required: Sequence[str],
    optional: Sequence[str],
    types: Mapping[str, tuple[type, ...]],
) -> list[dict]:
    out = [_validate_row(row, f"{path}: row {i}", required, optional, types) for i, row in enumerate(rows)]
    if not out:
        raise DataError(f"{path}: no rows")
    return out


def _saved_without_data(target: str) -> bool:
    """Whether ``target`` is a ``save_to_disk`` Dataset directory that lists no data files.

    ``datasets`` writes such a directory for a zero-row Dataset but cannot load it back (it fails with an
    IndexError), so an empty dataset has to be recognised from its state file instead.
    """
    import datasets

    state = os.path.join(target, datasets.config.DATASET_STATE_JSON_FILENAME)
    try:
        with open(state, encoding="utf-8") as f:
            return json.load(f).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


def _read_saved_dir(path: str, split: str) -> list[dict]:
    """Rows of a ``Dataset``/``DatasetDict`` directory written by ``save_to_disk``."""
    _set_offline_env()
    import datasets

    splits_file = os.path.join(path, datasets.config.DATASETDICT_JSON_FILENAME)
    if os.path.isfile(splits_file):
        # Load only the requested split (each lives in a subdirectory named after it): faster, and a broken or
        # empty other split cannot stop us reading this one.
        try:
            with open(splits_file, encoding="utf-8") as f:
                available = list(json.load(f)["splits"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: unreadable {os.path.basename(splits_file)}: {e}") from None
        if split not in available:
            names = ", ".join(sorted(available)) or "none"
            raise DataError(f"{path}: no split {split!r} (available splits: {names})")
        target = os.path.join(path, split)
    else:
        # A plain Dataset has no split names. Accept the default request, but refuse an explicit other split
        # rather than silently serving the only data there is (e.g. training rows as an eval set).
        if split != "train":
            raise DataError(
                f"{path}: is a single Dataset without splits, but split {split!r} was requested "
                "(save a DatasetDict, or read it with split='train')"
            )
        target = path
    if _saved_without_data(target):
        return []
    try:
        loaded = datasets.load_from_disk(target)
    except FileNotFoundError as e:
        raise DataError(
            f"{path}: directory is not a dataset written by save_to_disk ({e}); supported: {_SUPPORTED}"
        ) from None
    except Exception as e:  # noqa: BLE001 - surface any reader failure as a data error on this path
        raise DataError(f"{path}: could not load saved dataset: {type(e).__name__}: {e}") from e
    if not isinstance(loaded, datasets.Dataset):
        raise DataError(f"{target}: expected a Dataset, found {type(loaded).__name__}")
    return loaded.to_list()


def read_rows(
    path: str,
    required: Sequence[str],
    optional: Sequence[str] = (),
    split: str = "train",
    types: Mapping[str, tuple[type, ...]] | None = None,
) -> list[dict]:
    """Read and validate training rows.

    Args:
        path: A ``.jsonl``/``.json`` JSON-lines file, a ``.parquet`` file, or a directory written by
            ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.
        required: Fields every row must have. Unless ``types`` says otherwise they must be strings.
        optional: Fields kept when present (and not null).
        split: Split to read from a saved ``DatasetDict``.
        types: Allowed Python types per field, e.g. ``{"margin": (int, float)}``; overrides the ``str`` default
            for required fields. ``bool`` is not accepted as ``int`` unless listed.

    Returns:
        One plain dict per row with the required fields and whichever optional fields are present.

    Raises:
        DataError: With the file and line (JSON lines) or row index (other formats) of the first bad row, or
            for a missing path, an empty dataset, an unknown split or an unsupported format.
    """
    path = os.fspath(path)
    resolved = _resolve_types(required, optional, types)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        return _validate_table(path, _read_saved_dir(path, split), required, optional, resolved)
    ext = os.path.splitext(path)[1].lower()
    if ext in _JSON_EXTS:
        return _read_jsonl(path, required, optional, resolved)
    if ext in _PARQUET_EXTS:
        try:
            rows = _load_with_datasets("parquet", path)
        except Exception as e:  # noqa: BLE001 - report any reader failure as a data error on this file
            raise DataError(f"{path}: could not read Parquet file: {type(e).__name__}: {e}") from e
        return _validate_table(path, rows, required, optional, resolved)
    raise DataError(f"{path}: unsupported format {ext or '(no extension)'!r}; supported: {_SUPPORTED}")
