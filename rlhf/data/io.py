"""Reading training rows from disk, with errors that say where the data is wrong.

A JSON-lines file is parsed here, line by line, so that a bad row is reported as ``file:line`` (``datasets``
names an Arrow block, not a line) and each row is the JSON as written (an Arrow round trip unifies a column's type
across rows). Parquet, CSV and Arrow files and ``save_to_disk`` directories are read with the HF ``datasets``
library; they, like a ``.json`` file holding one JSON array of objects, have no row per line, so their errors name
the 0-based row index instead (``file: row 3``). A hub dataset id (``org/name[@revision]``, see :mod:`rlhf.hub`)
is read file by file from its snapshot in the HF cache, each data file as a local one would be.

Rows come back as plain dicts holding only the requested fields that are present; a ``null`` in an optional
field counts as absent, so downstream code only has to test ``"margin" in row``.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import tempfile
from typing import Any, Callable, Iterable, Mapping, Sequence

from rlhf.hub import DATASET, HubError, dataset_dir, is_hub_ref

_JSON_EXTS = (".jsonl", ".json")
_PARQUET_EXTS = (".parquet",)
# datasets' reader of a hub dataset's data file by extension (JSON is read here, with line numbers)
_READERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
_SUPPORTED = (
    ".jsonl, .json (JSON lines, or one JSON array of objects), .parquet, a directory written by datasets' "
    "save_to_disk, or a hub dataset id (org/name[@revision])"
)


class DataError(ValueError):
    """A dataset file is missing, unreadable, or has a row that does not fit the expected fields."""


class FieldsError(ValueError):
    """Raised by a row ``check``: the row lacks the fields its layout needs. The reader adds every field the row
    has (not only the requested ones, which are all a check sees) and, for ``missing``, the close matches among
    them; ``advice`` (the config key to set) closes the message."""

    def __init__(self, message: str, missing: str | Sequence[str] = (), advice: str = "") -> None:
        super().__init__(message)
        self.missing = (missing,) if isinstance(missing, str) else tuple(missing)
        self.advice = advice

    def located(self, where: str, row: dict) -> DataError:
        """The :class:`DataError` for this row at ``where``."""
        keys = sorted(str(k) for k in row)
        close = [k for name in self.missing if name for k in difflib.get_close_matches(name, keys, n=3)]
        close = [k for k in dict.fromkeys(close) if k not in self.missing]
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        advice = f" {self.advice}" if self.advice else ""
        return DataError(f"{where}: {self} (the row's fields: {', '.join(keys) or 'none'}).{hint}{advice}")


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


#: ``check(row)`` validates a row beyond field presence and types (e.g. its conversational format); it raises
#: ``ValueError`` with a message that the reader prefixes with the row's location.
RowCheck = Callable[[dict], None]


def _validate_row(
    row: Any,
    where: str,
    required: Sequence[str],
    optional: Sequence[str],
    types: Mapping[str, tuple[type, ...]],
    check: RowCheck | None = None,
) -> dict:
    """Check one row and return the dict of requested fields that are present.

    Args:
        row: The decoded row.
        where: Location prefix for error messages (``"file:3"`` or ``"dir: row 2"``).
        required: Fields that must be present.
        optional: Fields that are kept when present.
        types: Allowed Python types per field.
        check: Optional further validation of the kept fields.

    Raises:
        DataError: If the row is not an object, lacks a required field, has a field of the wrong type, or fails
            ``check``.
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
    if check is not None:
        try:
            check(out)
        except FieldsError as e:
            raise e.located(where, row) from None
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
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


@contextlib.contextmanager
def _offline_datasets():
    """``datasets`` (yielded) with its hub access off while it reads local files.

    Only its own flag, and only meanwhile: the process environment (``HF_HUB_OFFLINE``), which huggingface_hub
    reads once when imported, stays the user's, so that a hub download later in the run is not silently refused.
    """
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield datasets
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def _load_with_datasets(builder: str, path: str) -> list[dict]:
    """Read a local file with ``datasets.load_dataset`` and return its rows as dicts.

    The Arrow cache goes to a temporary directory that is removed afterwards: the rows are copied into Python
    objects anyway, and a shared cache keyed on file fingerprints can serve stale data after an in-place edit.
    """
    with _offline_datasets() as datasets, tempfile.TemporaryDirectory(prefix="rlhf-datasets-") as cache_dir:
        ds = datasets.load_dataset(builder, data_files=path, split="train", cache_dir=cache_dir)
        rows = ds.to_list()
        del ds  # drop the memory map before the cache directory goes away
    return rows


def _read_jsonl(
    path: str,
    required: Sequence[str],
    optional: Sequence[str],
    types: Mapping[str, tuple[type, ...]],
    check: RowCheck | None = None,
) -> list[dict]:
    scanned = _scan_jsonl(path)
    if not scanned:
        raise DataError(f"{path}: no rows")
    # Validate on our own parse: it is the one that knows line numbers and which keys each row really had.
    # The rows are our parse, not an Arrow round trip: Arrow unifies a column's type across rows, which turns a
    # text "3" into 3 beside rows whose field holds messages, and gives every message dict every key seen anywhere.
    return [_validate_row(value, f"{path}:{lineno}", required, optional, types, check) for lineno, value in scanned]


def _validate_table(
    path: str,
    rows: Iterable[dict],
    required: Sequence[str],
    optional: Sequence[str],
    types: Mapping[str, tuple[type, ...]],
    check: RowCheck | None = None,
) -> list[dict]:
    out = [_validate_row(row, f"{path}: row {i}", required, optional, types, check) for i, row in enumerate(rows)]
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
        with _offline_datasets():
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


def _read_table(path: str, reader: str) -> list[dict]:
    """The rows of one file read by ``datasets``' ``reader`` (``parquet``, ``csv``, ``arrow``)."""
    try:
        return _load_with_datasets(reader, path)
    except Exception as e:  # noqa: BLE001 - report any reader failure as a data error on this file
        raise DataError(f"{path}: could not read it with datasets' {reader!r} reader: {type(e).__name__}: {e}") from e


def _read_json_file(
    path: str,
    required: Sequence[str],
    optional: Sequence[str],
    types: Mapping[str, tuple[type, ...]],
    check: RowCheck | None = None,
) -> list[dict]:
    """A ``.json``/``.jsonl`` file: JSON lines (errors ``file:line``) or one JSON array of objects (``file: row i``)."""
    array = _json_array(path)
    if array is None:
        return _read_jsonl(path, required, optional, types, check)
    return _validate_table(path, array, required, optional, types, check)


def _json_array(path: str) -> list | None:
    """The elements of a file that holds one JSON array, or None when it does not start like one (JSON lines)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head.startswith(b"["):
        return None
    try:
        with open(path, encoding="utf-8-sig") as f:
            value = json.load(f)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # a first line that is a whole array, then more lines: JSON lines after all
            return None
        raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    return value if isinstance(value, list) else None


def _read_hub_rows(
    ref: str,
    split: str,
    config_name: str,
    required: Sequence[str],
    optional: Sequence[str],
    types: Mapping[str, tuple[type, ...]],
    check: RowCheck | None = None,
) -> list[dict]:
    """Rows of ``split`` of a hub dataset: each data file of the split, read and validated as a local file is."""
    module, files = _hub_split_files(ref, split, config_name)
    rows: list[dict] = []
    for file in files:
        ext = os.path.splitext(file)[1].lower()
        if ext in _JSON_EXTS:
            rows += _read_json_file(file, required, optional, types, check)
            continue
        # datasets picks one reader per repository; a file's own name decides
        table = _read_table(file, _READERS.get(ext, module))
        if table:  # an empty shard among others is no error; an empty split is (below)
            rows += _validate_table(file, table, required, optional, types, check)
    if not rows:
        raise DataError(f"{ref}: split {split!r} has no rows")
    return rows


def _hub_split_files(ref: str, split: str, config_name: str) -> tuple[str, list[str]]:
    """``(datasets reader name, data files)`` of a split of a hub dataset, as ``datasets`` resolves the snapshot's
    configurations (the card's ``configs:``, else its file layout)."""
    try:
        root = dataset_dir(ref, config_name)
    except HubError as e:
        raise DataError(f"{ref}: no such file or directory, and {e}" if e.of_repository else str(e)) from None
    with _offline_datasets() as datasets:
        try:
            names = datasets.get_dataset_config_names(root)
            if config_name and config_name not in names:
                raise DataError(f"{ref}: no config {config_name!r} (available configs: {', '.join(names)})")
            builder = datasets.load_dataset_builder(root, name=config_name or None)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - no data files, a card datasets cannot parse, no default config
            raise DataError(
                f"{ref}: datasets cannot find its data in {root}: {type(e).__name__}: {str(e).strip()}"
            ) from None
    data_files = builder.config.data_files or {}
    if split not in data_files:
        which = f" in config {builder.config.name!r}" if len(names) > 1 else ""
        raise DataError(f"{ref}: no split {split!r}{which} (available splits: {', '.join(data_files) or 'none'})")
    return type(builder).__module__.rsplit(".", 1)[-1], [str(f) for f in data_files[split]]


def read_rows(
    path: str,
    required: Sequence[str],
    optional: Sequence[str] = (),
    split: str = "train",
    types: Mapping[str, tuple[type, ...]] | None = None,
    check: RowCheck | None = None,
    config_name: str = "",
) -> list[dict]:
    """Read and validate training rows.

    Args:
        path: A ``.jsonl``/``.json`` file (JSON lines, or one JSON array of objects), a ``.parquet`` file, a
            directory written by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, or a hub dataset
            id ``org/name[@revision]`` (:mod:`rlhf.hub`; a local path of that name wins).
        required: Fields every row must have. Unless ``types`` says otherwise they must be strings.
        optional: Fields kept when present (and not null).
        split: Split to read from a saved ``DatasetDict`` or a hub dataset.
        types: Allowed Python types per field, e.g. ``{"margin": (int, float)}``; overrides the ``str`` default
            for required fields. ``bool`` is not accepted as ``int`` unless listed.
        check: Optional ``check(row)`` run on each row's kept fields; its ``ValueError`` becomes a
            :class:`DataError` at the row's location.
        config_name: Hub dataset: the configuration to read (its default one when empty).

    Returns:
        One plain dict per row with the required fields and whichever optional fields are present.

    Raises:
        DataError: With the file and line (JSON lines) or row index (other formats) of the first bad row, or
            for a missing path, an unresolvable hub id, an empty dataset, an unknown split or configuration (the
            available ones listed) or an unsupported format.
    """
    path = os.fspath(path)
    resolved = _resolve_types(required, optional, types)
    if not os.path.exists(path):
        if is_hub_ref(path, DATASET):
            return _read_hub_rows(path, split, config_name, required, optional, resolved, check)
        raise DataError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        return _validate_table(path, _read_saved_dir(path, split), required, optional, resolved, check)
    ext = os.path.splitext(path)[1].lower()
    if ext in _JSON_EXTS:
        return _read_json_file(path, required, optional, resolved, check)
    if ext in _PARQUET_EXTS:
        return _validate_table(path, _read_table(path, "parquet"), required, optional, resolved, check)
    raise DataError(f"{path}: unsupported format {ext or '(no extension)'!r}; supported: {_SUPPORTED}")
