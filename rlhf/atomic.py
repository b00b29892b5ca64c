"""Writing a file so that a reader, or a crash, sees the old content or the new, never a part of it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterable, Union

PathLike = Union[str, "os.PathLike[str]"]


def write_text_atomic(path: PathLike, text: Union[str, Iterable[str]]) -> str:
    """Write ``text`` (a string, or pieces written in order) to ``path`` atomically; returns ``path`` as a string.

    The text goes to a temporary file in the same directory (so the rename stays on one filesystem), is flushed and
    fsynced (so the rename cannot land before the data does), made readable like any other output (``mkstemp``
    creates files 0600), and renamed over ``path``. On any error the temporary file is removed and ``path`` is
    untouched. Missing parent directories are created.
    """
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines([text] if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
