"""read_rows on real JSON-lines, Parquet and save_to_disk data, and its error messages."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlhf.data.io import DataError, read_rows

PREF = ("prompt", "chosen", "rejected")
MARGIN_TYPES = {"margin": (int, float)}


def _write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def _pair(i: int, **extra) -> dict:
    return {"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2), **extra}


# --------------------------------------------------------------------------- valid inputs


def test_jsonl_with_blank_lines_optional_and_extra_fields(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "pref.jsonl",
        [
            json.dumps(_pair(0, margin=1.0, source="a")),
            "",
            "   ",
            json.dumps(_pair(1)),  # no margin: stays absent, not None
            json.dumps(_pair(2, margin=2, source=7)),  # an unrequested field of another type is ignored
        ],
    )
    rows = read_rows(path, PREF, optional=["margin"], types=MARGIN_TYPES)
    assert rows == [_pair(0, margin=1.0), _pair(1), _pair(2, margin=2)]
    assert all(type(r) is dict for r in rows)


def test_json_extension_and_optional_null_is_absent(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "sft.json", [json.dumps({"prompt": "1+1=", "response": "2", "margin": None})])
    assert read_rows(path, ["prompt", "response"], optional=["margin"]) == [{"prompt": "1+1=", "response": "2"}]


def test_jsonl_rows_are_the_json_as_written(tmp_path: Path) -> None:
    # An Arrow round trip would unify each column's type across rows: the text "3" beside a row whose field holds
    # messages came back as the int 3, and every message dict got every key seen in any message.
    rows = [
        {"prompt": "1+2=", "response": "007"},
        {
            "prompt": [{"role": "user", "content": "a", "name": "x"}],
            "response": [{"role": "assistant", "content": "b"}],
        },
    ]
    path = _write_lines(tmp_path / "mixed.jsonl", [json.dumps(r) for r in rows])
    assert (
        read_rows(path, (), optional=["prompt", "response"], types={"prompt": (str, list), "response": (str, list)})
        == rows
    )


def test_parquet(tmp_path: Path) -> None:
    import datasets

    path = str(tmp_path / "pref.parquet")
    datasets.Dataset.from_list([_pair(0, margin=1.5, other="x"), _pair(1, margin=None, other="y")]).to_parquet(path)
    rows = read_rows(path, PREF, optional=["margin"], types=MARGIN_TYPES)
    assert rows == [_pair(0, margin=1.5), _pair(1)]


def test_saved_dataset_dir(tmp_path: Path) -> None:
    import datasets

    path = str(tmp_path / "ds")
    datasets.Dataset.from_list([{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2=", "response": "4"}]).save_to_disk(
        path
    )
    assert read_rows(path, ["prompt", "response"]) == [
        {"prompt": "1+1=", "response": "2"},
        {"prompt": "2+2=", "response": "4"},
    ]
    with pytest.raises(DataError, match=re.escape("split 'test' was requested")):
        read_rows(path, ["prompt", "response"], split="test")


def test_saved_dataset_dict_picks_split(tmp_path: Path) -> None:
    import datasets

    path = str(tmp_path / "dd")
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "train", "answer": "1"}]),
            "eval": datasets.Dataset.from_list([{"prompt": "eval", "answer": "2"}]),
        }
    ).save_to_disk(path)
    assert read_rows(path, ["prompt", "answer"]) == [{"prompt": "train", "answer": "1"}]
    assert read_rows(path, ["prompt", "answer"], split="eval") == [{"prompt": "eval", "answer": "2"}]
    with pytest.raises(DataError) as err:
        read_rows(path, ["prompt", "answer"], split="test")
    assert str(err.value) == f"{path}: no split 'test' (available splits: eval, train)"


# --------------------------------------------------------------------------- JSON-lines errors


def test_invalid_json_names_the_line(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "bad.jsonl", [json.dumps(_pair(0)), "", '{"prompt": "x",'])
    with pytest.raises(DataError) as err:
        read_rows(path, PREF)
    assert str(err.value).startswith(f"{path}:3: invalid JSON: ")


def test_missing_field_names_field_line_and_present_fields(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "pref.jsonl", [json.dumps(_pair(0)), json.dumps({"prompt": "p", "rejected": "r"})])
    with pytest.raises(DataError) as err:
        read_rows(path, PREF)
    assert str(err.value) == f"{path}:2: missing field 'chosen' (row has: prompt, rejected)"


def test_wrong_type_names_field_and_types(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "pref.jsonl", [json.dumps(_pair(0)), json.dumps(_pair(1) | {"prompt": 5})])
    with pytest.raises(DataError) as err:
        read_rows(path, PREF)
    assert str(err.value) == f"{path}:2: field 'prompt' must be str, got int"


def test_optional_field_type_is_checked_and_bool_is_not_a_number(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "pref.jsonl", [json.dumps(_pair(0, margin="big"))])
    with pytest.raises(DataError, match=re.escape(":1: field 'margin' must be int or float, got str")):
        read_rows(path, PREF, optional=["margin"], types=MARGIN_TYPES)
    path = _write_lines(tmp_path / "pref2.jsonl", [json.dumps(_pair(0, margin=True))])
    with pytest.raises(DataError, match=re.escape(":1: field 'margin' must be int or float, got bool")):
        read_rows(path, PREF, optional=["margin"], types=MARGIN_TYPES)


def test_required_null_is_a_type_error(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "sft.jsonl", [json.dumps({"prompt": None, "response": "2"})])
    with pytest.raises(DataError, match=re.escape(":1: field 'prompt' must be str, got null")):
        read_rows(path, ["prompt", "response"])


def test_non_object_row(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "rows.jsonl", [json.dumps(_pair(0)), json.dumps(["a", "b"])])
    with pytest.raises(DataError) as err:
        read_rows(path, PREF)
    assert str(err.value) == f"{path}:2: expected a JSON object, got list"


def test_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(_pair(0)).encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:2: not valid UTF-8")):
        read_rows(str(path), PREF)


# --------------------------------------------------------------------------- other errors


def test_missing_path(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError) as err:
        read_rows(path, PREF)
    assert str(err.value) == f"{path}: no such file or directory"


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_empty_jsonl(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_rows(str(path), PREF)
    assert str(err.value) == f"{path}: no rows"


def test_empty_saved_dataset(tmp_path: Path) -> None:
    import datasets

    path = str(tmp_path / "empty_ds")
    datasets.Dataset.from_dict({"prompt": [], "response": []}).save_to_disk(path)
    with pytest.raises(DataError) as err:
        read_rows(path, ["prompt", "response"])
    assert str(err.value) == f"{path}: no rows"


def test_unknown_extension_lists_formats(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("prompt,response\n1+1=,2\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_rows(str(path), ["prompt", "response"])
    message = str(err.value)
    assert message.startswith(f"{path}: unsupported format '.csv'")
    for fmt in (".jsonl", ".json", ".parquet", "save_to_disk"):
        assert fmt in message


def test_directory_that_is_not_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not a dataset written by save_to_disk"):
        read_rows(str(tmp_path / "plain"), PREF)


def test_parquet_errors_name_the_row(tmp_path: Path) -> None:
    import datasets

    path = str(tmp_path / "missing.parquet")
    datasets.Dataset.from_list([{"prompt": "p", "rejected": "r"}]).to_parquet(path)
    with pytest.raises(DataError) as err:
        read_rows(path, PREF)
    assert str(err.value) == f"{path}: row 0: missing field 'chosen' (row has: prompt, rejected)"

    path = str(tmp_path / "typed.parquet")
    datasets.Dataset.from_list([{"prompt": "a", "response": "1"}, {"prompt": None, "response": "2"}]).to_parquet(path)
    with pytest.raises(DataError) as err:
        read_rows(path, ["prompt", "response"])
    assert str(err.value) == f"{path}: row 1: field 'prompt' must be str, got null"


def test_saved_dataset_wrong_type_names_the_row(tmp_path: Path) -> None:
    import datasets

    path = str(tmp_path / "ds")
    datasets.Dataset.from_list([{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]).save_to_disk(path)
    with pytest.raises(DataError) as err:
        read_rows(path, ["prompt", "answer"])
    assert str(err.value) == f"{path}: row 0: field 'answer' must be str, got int"


def test_data_error_is_a_value_error() -> None:
    assert issubclass(DataError, ValueError)


def test_saved_dataset_dict_with_an_empty_split(tmp_path: Path) -> None:
    # datasets cannot load back a zero-row split it saved; that must not break the other split, and the empty
    # one must be reported as empty rather than as an IndexError.
    import datasets

    path = str(tmp_path / "dd")
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "p", "answer": "1"}]),
            "eval": datasets.Dataset.from_dict({"prompt": [], "answer": []}),
        }
    ).save_to_disk(path)
    assert read_rows(path, ["prompt", "answer"]) == [{"prompt": "p", "answer": "1"}]
    with pytest.raises(DataError) as err:
        read_rows(path, ["prompt", "answer"], split="eval")
    assert str(err.value) == f"{path}: no rows"


# --------------------------------------------------------------------------- JSON arrays


def test_json_array_of_objects_is_read(tmp_path: Path) -> None:
    rows = [_pair(0, margin=1.0), _pair(1), _pair(2, margin=None)]
    pretty = tmp_path / "pairs.json"
    pretty.write_text("\ufeff" + json.dumps(rows, indent=2), encoding="utf-8")  # an editor's byte-order mark too
    expected = [_pair(0, margin=1.0), _pair(1), _pair(2)]
    assert read_rows(str(pretty), PREF, optional=["margin"], types=MARGIN_TYPES) == expected
    one_line = _write_lines(tmp_path / "pairs_one_line.jsonl", [json.dumps(rows)])
    assert read_rows(one_line, PREF, optional=["margin"], types=MARGIN_TYPES) == expected


def test_json_array_errors_name_the_row(tmp_path: Path) -> None:
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([_pair(0), {"prompt": "p", "rejected": "r"}], indent=2), encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_rows(str(path), PREF)
    assert str(err.value) == f"{path}: row 1: missing field 'chosen' (row has: prompt, rejected)"
    path.write_text(json.dumps([_pair(0), ["a", "b"]]), encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_rows(str(path), PREF)
    assert str(err.value) == f"{path}: row 1: expected a JSON object, got list"


def test_json_array_with_a_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "pairs.json"
    path.write_text(
        '[\n  {"prompt": "1+1=", "chosen": "2", "rejected": "3"},\n  {"prompt": "2+2=",\n]\n', encoding="utf-8"
    )
    with pytest.raises(DataError) as err:
        read_rows(str(path), PREF)
    assert str(err.value).startswith(f"{path}:4: invalid JSON: ")


def test_empty_json_array(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text("[]\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_rows(str(path), PREF)
    assert str(err.value) == f"{path}: no rows"


def test_json_lines_starting_with_an_array_stay_json_lines(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "rows.jsonl", [json.dumps(["a", "b"]), json.dumps(_pair(0))])
    with pytest.raises(DataError) as err:
        read_rows(path, PREF)
    assert str(err.value) == f"{path}:1: expected a JSON object, got list"
