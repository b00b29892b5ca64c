"""The long-tailed synthetic data (rlhf.synthetic.long_tail): deterministic, within bounds, really long-tailed, and
its token arithmetic agrees with the tiny tokenizer as the SFT / DPO pipeline tokenizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf.synthetic import long_tail
from rlhf.synthetic.long_tail import (
    UNIFORM_72,
    LengthSpec,
    length_report,
    make_preference_rows,
    make_sft_rows,
    pair_lengths,
    percentile,
    row_tokens,
    sample_lengths,
    sft_lengths,
    write_datasets,
)


def test_same_seed_same_rows_other_seed_other_rows():
    assert make_sft_rows(300, 7) == make_sft_rows(300, 7)
    assert make_preference_rows(300, 7) == make_preference_rows(300, 7)
    assert make_sft_rows(300, 7) != make_sft_rows(300, 8)
    assert make_preference_rows(300, 7) != make_preference_rows(300, 8)


def test_rows_have_exactly_the_sampled_lengths_within_bounds():
    spec = LengthSpec(min_tokens=16, max_tokens=1024)
    rows = make_sft_rows(2000, 3, spec)
    lengths = sft_lengths(rows)
    assert lengths == sample_lengths(2000, 3, spec)
    assert min(lengths) >= 16 and max(lengths) <= 1024
    assert all(r["prompt"].endswith("=") and r["response"] for r in rows)
    pairs = pair_lengths(make_preference_rows(2000, 3, spec))
    assert min(pairs) >= 16 and max(pairs) <= 1024


def test_the_distribution_has_a_long_tail_around_the_median():
    report = length_report(sft_lengths(make_sft_rows(4000, 0)))
    assert 60 <= report["p50"] <= 100
    assert report["p99_over_p50"] >= 5  # the tail is there: p99 ~ 10x the median by default
    assert report["max"] == 1024  # some rows reach the clip
    assert report["top10pct_token_share"] > 0.3  # the longest tenth holds about a third of the tokens
    assert sum(report["histogram"].values()) == report["count"] == 4000


def test_uniform_spec_gives_constant_rows():
    assert set(sft_lengths(make_sft_rows(50, 1, UNIFORM_72))) == {72}
    assert set(sample_lengths(10, 0, LengthSpec(sigma=0.0, median=40))) == {40}


def test_pairs_share_a_prompt_and_differ_in_the_answer():
    for row in make_preference_rows(200, 5):
        a, b = (int(x) for x in row["prompt"].split(" ")[-1].rstrip("=").split("+"))
        assert row["chosen"].startswith(str(a + b))
        assert row["chosen"].split(" ")[0] != row["rejected"].split(" ")[0]


def test_percentile_interpolates_like_numpy():
    values = [1, 2, 3, 4, 10]
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10
    assert percentile(values, 50) == 3
    assert percentile(values, 90) == pytest.approx(7.6)
    with pytest.raises(ValueError):
        length_report([])


def test_bad_specs_are_refused():
    with pytest.raises(ValueError):
        LengthSpec(min_tokens=3)
    with pytest.raises(ValueError):
        LengthSpec(min_tokens=100, max_tokens=50)
    with pytest.raises(ValueError):
        LengthSpec(prompt_share=(0.5, 1.0))


def test_token_counts_match_the_tiny_tokenizer_through_the_pipeline():
    from rlhf.data.tokenize import tokenize_pairs, tokenize_sft
    from rlhf.models.tiny import build_tokenizer

    tok = build_tokenizer()
    rows = make_sft_rows(300, 11)
    examples = tokenize_sft(rows, tok, max_length=4096, prompt_key="prompt", response_key="response").examples
    assert [len(e.input_ids) for e in examples] == [row_tokens(r) for r in rows]
    pairs = make_preference_rows(150, 11)
    pair_examples = tokenize_pairs(
        pairs, tok, max_length=4096, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected"
    ).examples
    assert len(pair_examples) == len(pairs)
    got = [len(side.input_ids) for e in pair_examples for side in (e.chosen, e.rejected)]
    assert got == pair_lengths(pairs)


def test_written_files_and_the_command_line(tmp_path):
    paths = write_datasets(str(tmp_path / "a"), 64, 2)
    with open(paths["sft"]) as f:
        assert [json.loads(line) for line in f] == make_sft_rows(64, 2)
    with open(paths["pairs"]) as f:
        assert [json.loads(line) for line in f] == make_preference_rows(64, 2)
    out = subprocess.run(
        [sys.executable, "-m", "rlhf.synthetic.long_tail", str(tmp_path / "b"), "--rows", "64", "--seed", "2"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "p99/p50" in out
    with open(tmp_path / "b" / "sft.jsonl") as f:
        assert [json.loads(line) for line in f] == make_sft_rows(64, 2)


def test_the_module_imports_no_heavy_framework():
    code = (
        f"import sys, {long_tail.__name__}; "
        "print([m for m in ('torch', 'ray', 'transformers', 'deepspeed') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
