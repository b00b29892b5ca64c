"""RewardPool in this process (num_workers=0): the chunking, the per-sample isolation of a function that raises,
hangs or returns a bad value, the three failure policies, and results equal to compute_rewards whatever the chunk
size. The same logic on real Ray actors: tests/integration/test_reward_pool_actors.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf.rewards.functions import RewardFunctionError, compute_rewards, parse_reward_specs
from rlhf.rewards.pool import RewardPool, absolute_reward_specs
from rlhf.rewards.results import ScoreResult

REWARDS = '''
import time

def length(prompts, responses, answers):
    """Per-sample and distinct: a mixed-up order or chunk boundary changes the numbers."""
    return [len(r) / 3 + (1.0 if r == a else 0.0) for r, a in zip(responses, answers)]

def parity(prompts, responses):
    return [float(len(p) % 2) - 0.1 for p in prompts]

def raises_on_bad(prompts, responses):
    if "bad" in prompts:
        raise ZeroDivisionError("cannot score " + prompts[prompts.index("bad")])
    return [0.5] * len(prompts)

def hangs_on_hang(prompts, responses):
    if "hang" in prompts:
        time.sleep(3)
    return [0.25] * len(prompts)

def nan_on_nan(prompts, responses):
    return [float("nan") if p == "nan" else 1.0 for p in prompts]

def only_small_batches(prompts, responses):
    if len(prompts) > 2:
        raise RuntimeError("batch too large")
    return [2.0] * len(prompts)
'''

PROMPTS = ["one", "three", "bad", "seven", "hang", "eleven", "nan", "x", "twenty"]
RESPONSES = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g", "hh", "iii"]
ANSWERS = ["a", "x", "ccc", "x", "eeeee", "x", "x", "hh", "x"]


@pytest.fixture(scope="module")
def rfile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "pool_rewards.py"
    path.write_text(REWARDS)
    return path


def specs(rfile: Path, *names: str):
    return [f"{rfile}:{name}" for name in names]


def score(rfile: Path, names, prompts=PROMPTS, responses=RESPONSES, answers=ANSWERS, **kw) -> ScoreResult:
    # Generous unless a test wants a timeout: a loaded CPU must not turn a trivial call into a failure.
    kw = {"num_workers": 0, "chunk_size": 4, "timeout_s": 5.0, **kw}
    return RewardPool(specs(rfile, *names), **kw).score(prompts, responses, {"answer": answers})


@pytest.mark.parametrize("chunk_size", [1, 2, 4, 5, 100])
def test_equals_compute_rewards_whatever_the_chunk_size(rfile, chunk_size, capsys):
    names = ("length@0.5", "parity@-2", "only_small_batches@0.25")
    got = score(rfile, names[:2], chunk_size=chunk_size)
    total, per_source = compute_rewards(parse_reward_specs(specs(rfile, *names[:2])), PROMPTS, RESPONSES,
                                        {"answer": ANSWERS})  # fmt: skip
    assert torch.equal(got.total, total) and list(got.per_source) == list(per_source)
    assert all(torch.equal(got.per_source[k], v) for k, v in per_source.items())
    assert (got.errors, got.timeouts, got.failed.any().item()) == (0, 0, False)
    # a function that fails only on batches larger than 2 still scores every sample once isolated: no failure
    small = score(rfile, names, chunk_size=chunk_size, on_error="fail")
    assert small.per_source[f"{rfile}:only_small_batches"].tolist() == [2.0] * len(PROMPTS)
    said = "raised RuntimeError: batch too large on samples 0..{} together but scored each of them alone"
    assert (said.format(min(chunk_size, len(PROMPTS)) - 1) in capsys.readouterr().err) == (chunk_size > 2)


def test_a_raising_function_fails_only_its_sample_and_the_message_names_it(rfile):
    result = score(rfile, ["length", "raises_on_bad"], on_error="drop")
    assert result.failed.tolist() == [p == "bad" for p in PROMPTS]
    assert (result.errors, result.timeouts) == (1, 0)
    (failure,) = result.failures
    assert failure.index == 2 and failure.kind == "error" and failure.source == f"{rfile}:raises_on_bad"
    assert f"reward function '{rfile}:raises_on_bad' raised ZeroDivisionError: cannot score bad on sample 2" in (
        failure.message
    )
    assert "prompt='bad'; response='ccc'" in failure.message
    good = [i for i, p in enumerate(PROMPTS) if p != "bad"]
    total, _ = compute_rewards(
        parse_reward_specs(specs(rfile, "length", "raises_on_bad")),
        [PROMPTS[i] for i in good],
        [RESPONSES[i] for i in good],
        {"answer": [ANSWERS[i] for i in good]},
    )
    assert torch.equal(result.total[good], total) and result.total[2].item() == 0.0


def test_a_hanging_function_times_out_on_its_sample_only(rfile):
    result = score(rfile, ["hangs_on_hang"], on_error="drop", timeout_s=0.3)
    assert result.failed.tolist() == [p == "hang" for p in PROMPTS]
    assert (result.errors, result.timeouts) == (0, 1)
    assert "hung (> 0.3 s) on sample 4: prompt='hang'" in result.failures[0].message
    assert result.total.tolist() == [0.0 if p == "hang" else 0.25 for p in PROMPTS]


def test_a_bad_value_is_a_counted_error_on_its_sample(rfile):
    result = score(rfile, ["nan_on_nan"], on_error=-1.0)
    assert result.substituted.tolist() == [p == "nan" for p in PROMPTS] and not result.failed.any()
    assert result.total.tolist() == [-1.0 if p == "nan" else 1.0 for p in PROMPTS] and result.errors == 1
    assert "returned a bad result" in result.failures[0].message and "non-finite" in result.failures[0].message


def test_fixed_value_stands_in_for_the_failed_source_only(rfile):
    result = score(rfile, ["length@0.5", "raises_on_bad@2"], on_error=-1.0)
    length = result.per_source[f"{rfile}:length"]
    assert result.per_source[f"{rfile}:raises_on_bad"].tolist() == [-1.0 if p == "bad" else 0.5 for p in PROMPTS]
    want = 0.5 * length.double() + 2 * result.per_source[f"{rfile}:raises_on_bad"].double()
    assert torch.equal(result.total, want.float()) and result.substituted.sum().item() == 1 and result.errors == 1
    assert length[2].item() == pytest.approx(1 + 1.0)  # the good source keeps its value on the failed sample


def test_fail_raises_the_first_failure_naming_the_sample(rfile):
    with pytest.raises(RewardFunctionError) as caught:
        score(rfile, ["raises_on_bad", "nan_on_nan"], on_error="fail")
    message = str(caught.value)
    assert message.startswith(f"reward function '{rfile}:raises_on_bad' raised ZeroDivisionError")
    assert "on sample 2" in message and "(and 1 more failed samples/functions)" in message


def test_misconfiguration_raises_whatever_the_policy(rfile):
    pool = RewardPool(specs(rfile, "length"), num_workers=0, on_error="drop")
    with pytest.raises(RewardFunctionError, match="needs parameter 'answers'"):
        pool.score(["p"], ["r"], {"other": ["x"]})
    with pytest.raises(RewardFunctionError, match="got 2 prompts, 1 responses"):
        pool.score(["p", "q"], ["r"], {"answer": ["x", "y"]})


def test_bad_arguments_are_named(rfile):
    for kw, name in (
        ({"chunk_size": 0}, "chunk_size"),
        ({"on_error": "skip"}, "on_error"),
        ({"timeout_s": 0}, "timeout_s"),
    ):
        with pytest.raises(ValueError, match=name):
            RewardPool(specs(rfile, "length"), num_workers=0, **kw)


def test_merge_adds_totals_and_counts(rfile):
    a = score(rfile, ["length"], on_error="drop")
    b = score(rfile, ["raises_on_bad@2"], on_error="drop")
    merged = ScoreResult.merge([a, b])
    assert torch.equal(merged.failed, b.failed) and merged.errors == 1
    want = (a.total.double() + b.total.double()).masked_fill(b.failed, 0.0).float()
    assert torch.equal(merged.total, want) and list(merged.per_source) == [f"{rfile}:length", f"{rfile}:raises_on_bad"]
    assert merged.metrics()["reward/failed_samples"] == 1.0


def test_actors_get_absolute_paths_and_the_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = absolute_reward_specs(["sub/r.py:fn@0.5", "pkg.mod:fn", "/abs/r.py:Cls.fn@-2"])
    assert got == (f"{tmp_path}/sub/r.py:fn@0.5", "pkg.mod:fn@1.0", "/abs/r.py:Cls.fn@-2.0")
