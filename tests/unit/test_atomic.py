"""rlhf.atomic.write_text_atomic: the old content or the new, never a part; nothing left behind on an error."""

from __future__ import annotations

import os
import stat

import pytest

from rlhf.atomic import write_text_atomic


def test_writes_replaces_and_creates_parents(tmp_path):
    path = tmp_path / "a" / "b" / "rows.jsonl"
    assert write_text_atomic(path, "one\n") == str(path)
    write_text_atomic(path, (f"{i}\n" for i in range(3)))  # pieces, written in order
    assert path.read_text() == "0\n1\n2\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # not mkstemp's 0600
    assert os.listdir(path.parent) == ["rows.jsonl"]


def test_an_error_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_text_atomic(path, "kept\n")

    def pieces():
        yield "half"
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_text_atomic(path, pieces())
    assert path.read_text() == "kept\n"
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
