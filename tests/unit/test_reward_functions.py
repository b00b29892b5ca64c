"""Tests for rlhf.rewards: loading reward functions from specs, column binding, validation and error messages."""

from __future__ import annotations

import math
import os
import pickle
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf.rewards import (
    RewardFunctionError,
    RewardFunctionScorer,
    RewardSource,
    compute_rewards,
    load_reward_function,
    parse_reward_specs,
)

ARITH = "rlhf.synthetic.arithmetic:reward"

REWARD_MODULE = textwrap.dedent('''
    """User reward functions: good ones and broken ones."""
    import math

    import numpy as np
    import torch

    CALLS = []
    THRESHOLD = 3


    def length_bonus(prompts, responses):
        return [float(len(r)) for r in responses]


    def exact(prompts, responses, answer):
        return [1.0 if r.strip() == a else 0.0 for r, a in zip(responses, answer)]


    def ints(prompts, responses):
        return tuple(len(r) for r in responses)


    def as_numpy(prompts, responses):
        return np.array([0.5] * len(responses), dtype=np.float32)


    def as_tensor(prompts, responses):
        return torch.full((len(responses),), -1.0)


    def with_default(prompts, responses, answer, scale=2.0):
        return [scale * (r == a) for r, a in zip(responses, answer)]


    def everything(prompts, responses, **columns):
        CALLS.append(sorted(columns))
        return [float(len(columns))] * len(responses)


    def plural_and_rest(prompts, responses, answers, **rest):
        CALLS.append(sorted(rest))
        return [1.0 if r == a else 0.0 for r, a in zip(responses, answers)]


    def needs_gold(prompts, responses, gold):
        return [0.0] * len(responses)


    def raises_on_bad(prompts, responses):
        out = []
        for r in responses:
            if "BAD" in r:
                raise ValueError("cannot score " + r)
            out.append(1.0)
        return out


    def raises_on_pairs(prompts, responses):
        if len(responses) > 1:
            raise RuntimeError("batch too big")
        return [1.0]


    def wrong_length(prompts, responses):
        return [1.0] * (len(responses) + 1)


    def nan_at_two(prompts, responses):
        return [0.0, 1.0, math.nan, 3.0][: len(responses)]


    def inf_tensor(prompts, responses):
        t = torch.zeros(len(responses))
        t[1] = float("inf")
        return t


    def huge(prompts, responses):
        return [0.0, 1e300][: len(responses)]


    def text_at_one(prompts, responses):
        return [1.0, "high", 0.0][: len(responses)]


    def bools(prompts, responses):
        return [r == "4" for r in responses]


    def scalar(prompts, responses):
        return 1.0


    def matrix(prompts, responses):
        return np.zeros((len(responses), 1))


    def one_arg(responses):
        return [0.0] * len(responses)


    def mutates(prompts, responses, answer):
        answer[0] = "mutated"
        responses.clear()
        return [0.0] * len(prompts)
''')

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
RESPONSES = ["2", "5", "6", "9"]
ANSWERS = ["2", "4", "6", "8"]


@pytest.fixture()
def mod(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_MODULE)
    return path


def _spec(path: Path, fn: str) -> str:
    return f"{path}:{fn}"


def _source(path: Path, fn: str, weight: float = 1.0) -> RewardSource:
    return RewardSource(name=fn, fn=load_reward_function(_spec(path, fn)), weight=weight)


def _err(sources, prompts=PROMPTS, responses=RESPONSES, columns=None) -> str:
    with pytest.raises(RewardFunctionError) as info:
        compute_rewards(sources, prompts, responses, columns)
    return str(info.value)


# ------------------------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------------------------


def test_module_spec_loads_arithmetic_reward():
    from rlhf.synthetic import arithmetic

    assert load_reward_function(ARITH) is arithmetic.reward


def test_file_spec_loads_under_private_name_and_is_cached(mod: Path, tmp_path: Path):
    fn = load_reward_function(_spec(mod, "length_bonus"))
    assert fn(["p"], ["abc"]) == [3.0]
    assert "my_rewards" not in sys.modules  # no colliding public name
    assert fn.__module__.startswith("_rlhf_reward_file_my_rewards_")
    assert sys.modules[fn.__module__].__file__ == os.path.realpath(mod)
    # Two functions of one unchanged file share one module execution.
    other = load_reward_function(_spec(mod, "exact"))
    assert other.__module__ == fn.__module__
    # A same-named file elsewhere is a different module.
    twin = tmp_path / "sub" / "my_rewards.py"
    twin.parent.mkdir()
    twin.write_text("def length_bonus(prompts, responses):\n    return [-1.0] * len(responses)\n")
    twin_fn = load_reward_function(_spec(twin, "length_bonus"))
    assert twin_fn.__module__ != fn.__module__
    assert twin_fn(["p"], ["abc"]) == [-1.0]
    assert fn(["p"], ["abc"]) == [3.0]


def test_edited_file_is_reloaded(tmp_path: Path):
    path = tmp_path / "edit_me.py"
    path.write_text("def r(prompts, responses):\n    return [1.0] * len(responses)\n")
    assert load_reward_function(f"{path}:r")(["p"], ["x"]) == [1.0]
    path.write_text("def r(prompts, responses):\n    return [22.0] * len(responses)\n")
    os.utime(path, ns=(0, 10**18))  # make sure the modification time differs even on coarse clocks
    assert load_reward_function(f"{path}:r")(["p"], ["x"]) == [22.0]


def test_relative_file_spec(mod: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(mod.parent)
    assert load_reward_function("my_rewards.py:ints")(["p"], ["ab"]) == (2,)


def test_missing_file_names_spec_and_path(tmp_path: Path):
    spec = f"{tmp_path}/nope.py:fn"
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function(spec)
    msg = str(info.value)
    assert repr(spec) in msg and "not found" in msg and "nope.py" in msg


def test_file_that_fails_to_execute(tmp_path: Path):
    path = tmp_path / "broken.py"
    path.write_text("import math\nraise RuntimeError('top-level boom')\n")
    with pytest.raises(RewardFunctionError, match=r"executing .*broken\.py failed: RuntimeError: top-level boom"):
        load_reward_function(f"{path}:fn")
    assert not any(name.startswith("_rlhf_reward_file_broken_") for name in sys.modules)


def test_unimportable_module_includes_import_error():
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function("rlhf.synthetic.no_such_module:reward")
    msg = str(info.value)
    assert "'rlhf.synthetic.no_such_module:reward'" in msg
    assert "cannot import module 'rlhf.synthetic.no_such_module'" in msg
    assert "ModuleNotFoundError" in msg


def test_missing_function_lists_available_callables(mod: Path):
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function(_spec(mod, "lenght_bonus"))
    msg = str(info.value)
    assert "has no attribute 'lenght_bonus'" in msg
    assert "Did you mean 'length_bonus'" in msg
    available = msg.split("Callables available there: ")[1].split(", ")
    assert "length_bonus" in available and "exact" in available and "nan_at_two" in available
    assert "THRESHOLD" not in available  # not callable
    assert not {"np", "torch", "math"} & set(available)  # modules are not listed


def test_missing_function_in_module_lists_only_its_own_callables():
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function("rlhf.synthetic.arithmetic:score")
    listing = str(info.value).split("Callables available there: ")[1].split(", ")
    assert "reward" in listing and "is_correct" in listing
    assert "Iterable" not in listing and "Mapping" not in listing  # imported names are left out


def test_not_callable_and_bad_signature(mod: Path):
    with pytest.raises(RewardFunctionError, match=r"THRESHOLD is not callable \(it is int 3\)"):
        load_reward_function(_spec(mod, "THRESHOLD"))
    with pytest.raises(RewardFunctionError, match=r"first two positional parameters.*\(responses\)"):
        load_reward_function(_spec(mod, "one_arg"))


@pytest.mark.parametrize("spec", ["no_colon", "module:", ":fn", "mod:not-a-name", "dir/file.txt:fn"])
def test_malformed_specs(spec: str):
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function(spec)
    assert repr(spec) in str(info.value)


# ------------------------------------------------------------------------------------------------------------------
# Parsing specs with weights
# ------------------------------------------------------------------------------------------------------------------


def test_parse_specs_with_weights(mod: Path):
    sources = parse_reward_specs([f"{ARITH}@1.5", _spec(mod, "length_bonus") + "@-0.1", _spec(mod, "ints")])
    assert [s.name for s in sources] == [ARITH, _spec(mod, "length_bonus"), _spec(mod, "ints")]
    assert [s.weight for s in sources] == [1.5, -0.1, 1.0]
    assert all(isinstance(s.weight, float) for s in sources)


def test_at_sign_in_path_is_not_a_weight(tmp_path: Path):
    folder = tmp_path / "user@host"
    folder.mkdir()
    path = folder / "r.py"
    path.write_text("def r(prompts, responses):\n    return [7.0] * len(responses)\n")
    (source,) = parse_reward_specs([f"{path}:r"])
    assert source.weight == 1.0 and source.name == f"{path}:r"
    (weighted,) = parse_reward_specs([f"{path}:r@3"])
    assert weighted.weight == 3.0 and weighted.fn(["p"], ["x"]) == [7.0]


@pytest.mark.parametrize("weight", ["abc", "", "nan", "inf"])
def test_bad_weight_names_spec(weight: str):
    spec = f"{ARITH}@{weight}"
    with pytest.raises(RewardFunctionError) as info:
        parse_reward_specs([spec])
    assert repr(spec) in str(info.value) and "weight" in str(info.value)


def test_duplicate_specs_and_single_string_are_rejected():
    with pytest.raises(RewardFunctionError, match="same function"):
        parse_reward_specs([ARITH, f"{ARITH}@2"])
    with pytest.raises(RewardFunctionError, match="wrap it in a list"):
        parse_reward_specs(ARITH)


def test_reward_source_validates_fields():
    with pytest.raises(RewardFunctionError, match="weight must be a finite number"):
        RewardSource("r", lambda p, r: [0.0], weight=math.inf)
    with pytest.raises(RewardFunctionError, match="weight must be a finite number"):
        RewardSource("r", lambda p, r: [0.0], weight=True)
    with pytest.raises(RewardFunctionError, match="fn must be callable"):
        RewardSource("r", 3)
    with pytest.raises(RewardFunctionError, match="non-empty string"):
        RewardSource("", lambda p, r: [0.0])


# ------------------------------------------------------------------------------------------------------------------
# Scoring and column binding
# ------------------------------------------------------------------------------------------------------------------


def test_arithmetic_reward_with_answer_column_via_plural_rule():
    sources = parse_reward_specs([ARITH])
    total, per = compute_rewards(sources, PROMPTS, RESPONSES, {"answer": ANSWERS})
    assert total.dtype == torch.float32 and total.shape == (4,)
    assert total.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert per[ARITH].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_exact_column_name_wins_over_plural_rule():
    sources = parse_reward_specs([ARITH])
    columns = {"answer": ["0"] * 4, "answers": ANSWERS}
    total, _ = compute_rewards(sources, PROMPTS, RESPONSES, columns)
    assert total.tolist() == [1.0, 0.0, 1.0, 0.0]  # `answers` was used, not `answer`


def test_weighted_total_and_result_types(mod: Path):
    sources = [
        RewardSource(ARITH, load_reward_function(ARITH), 2.0),
        _source(mod, "length_bonus", 0.5),
        _source(mod, "ints", 1.0),  # ints in a tuple
        _source(mod, "as_numpy", 1.0),
        _source(mod, "as_tensor", 3.0),
    ]
    responses = ["2", "55", "6", "9999"]
    total, per = compute_rewards(sources, PROMPTS, responses, {"answer": ANSWERS})
    lengths = [1.0, 2.0, 1.0, 4.0]
    correct = [1.0, 0.0, 1.0, 0.0]
    expected = [2 * c + 0.5 * n + n + 0.5 - 3.0 for c, n in zip(correct, lengths)]
    assert total.tolist() == pytest.approx(expected)
    assert per["ints"].tolist() == lengths
    assert per["as_tensor"].tolist() == [-1.0] * 4  # unweighted
    assert all(v.dtype == torch.float32 and v.shape == (4,) for v in per.values())


def test_columns_only_declared_ones_plus_kwargs(mod: Path):
    columns = {"answer": ANSWERS, "id": [1, 2, 3, 4], "topic": ["a"] * 4}
    total, _ = compute_rewards([_source(mod, "exact")], PROMPTS, RESPONSES, columns)  # extra columns ignored
    assert total.tolist() == [1.0, 0.0, 1.0, 0.0]
    total, _ = compute_rewards([_source(mod, "with_default")], PROMPTS, RESPONSES, columns)
    assert total.tolist() == [2.0, 0.0, 2.0, 0.0]  # `scale` has no column and keeps its default
    everything = _source(mod, "everything")
    total, _ = compute_rewards([everything], PROMPTS, RESPONSES, columns)
    assert total.tolist() == [3.0] * 4
    calls = sys.modules[everything.fn.__module__].CALLS
    assert calls[-1] == ["answer", "id", "topic"]


def test_kwargs_get_only_columns_not_bound_by_name(mod: Path):
    source = _source(mod, "plural_and_rest")
    total, _ = compute_rewards([source], PROMPTS, RESPONSES, {"answer": ANSWERS, "id": [1, 2, 3, 4]})
    assert total.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert sys.modules[source.fn.__module__].CALLS[-1] == ["id"]  # `answer` went to `answers` only


def test_column_named_like_a_batch_parameter_is_rejected_for_kwargs(mod: Path):
    msg = _err([_source(mod, "everything")], columns={"prompts": ANSWERS})
    assert "'everything'" in msg and "column 'prompts'" in msg


def test_functions_get_copies_of_inputs(mod: Path):
    answers = list(ANSWERS)
    responses = list(RESPONSES)
    sources = [_source(mod, "mutates"), _source(mod, "exact")]
    total, _ = compute_rewards(sources, PROMPTS, responses, {"answer": answers})
    assert total.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert answers == ANSWERS and responses == RESPONSES


def test_empty_batch_returns_empty_tensors_without_calling(mod: Path):
    total, per = compute_rewards([_source(mod, "raises_on_pairs")], [], [], {})
    assert total.shape == (0,) and per["raises_on_pairs"].shape == (0,)


# ------------------------------------------------------------------------------------------------------------------
# Error paths
# ------------------------------------------------------------------------------------------------------------------


def test_missing_required_parameter_names_function_parameter_and_columns(mod: Path):
    msg = _err([_source(mod, "needs_gold")], columns={"answer": ANSWERS, "id": [0, 1, 2, 3]})
    assert "'needs_gold'" in msg and "parameter 'gold'" in msg
    assert "available columns: 'answer', 'id'" in msg


def test_missing_answers_for_arithmetic_mentions_plural_lookup():
    msg = _err(parse_reward_specs([ARITH]), columns={})
    assert "parameter 'answers'" in msg and "'answers' or 'answer'" in msg and "available columns: none" in msg


def test_raising_function_names_first_failing_sample(mod: Path):
    responses = ["ok", "fine", "BAD" + "x" * 500, "BAD again"]
    msg = _err([_source(mod, "raises_on_bad")], responses=responses)
    assert "'raises_on_bad' raised ValueError" in msg
    assert "index 2" in msg and "prompt='3+3='" in msg
    assert "response='BADxxx" in msg and "more chars" in msg  # truncated
    assert len(msg) < 2000


def test_batch_only_failure_says_no_single_sample(mod: Path):
    msg = _err([_source(mod, "raises_on_pairs")])
    assert "'raises_on_pairs' raised RuntimeError: batch too big" in msg
    assert "every sample succeeds on its own" in msg


def test_raise_is_chained(mod: Path):
    with pytest.raises(RewardFunctionError) as info:
        compute_rewards([_source(mod, "raises_on_bad")], ["p"], ["BAD"], {})
    assert isinstance(info.value.__cause__, ValueError)


def test_wrong_length(mod: Path):
    msg = _err([_source(mod, "wrong_length")])
    assert "'wrong_length'" in msg and "expected 4, got 5" in msg


def test_nan_at_index(mod: Path):
    msg = _err([_source(mod, "nan_at_two")])
    assert "'nan_at_two' returned a non-finite value at index 2 of 4: nan" in msg
    assert "prompt='3+3='" in msg and "response='6'" in msg


def test_inf_in_tensor(mod: Path):
    msg = _err([_source(mod, "inf_tensor")])
    assert "non-finite value at index 1 of 4: inf" in msg and "prompt='2+2='" in msg


def test_float32_overflow(mod: Path):
    msg = _err([_source(mod, "huge")], prompts=PROMPTS[:2], responses=RESPONSES[:2])
    assert "overflows float32 at index 1 of 2: 1e+300" in msg


def test_non_numeric_at_index(mod: Path):
    msg = _err([_source(mod, "text_at_one")], prompts=PROMPTS[:3], responses=RESPONSES[:3])
    assert "'text_at_one' returned a non-numeric value (str) at index 1 of 3: 'high'" in msg
    assert "prompt='2+2='" in msg and "response='5'" in msg


def test_bools_are_rejected(mod: Path):
    msg = _err([_source(mod, "bools")])
    assert "returned a bool" in msg and "index 0" in msg and "float(...)" in msg
    bool_tensor = RewardSource("t", lambda p, r: torch.tensor([True] * len(r)))
    assert "returned a bool" in _err([bool_tensor])
    bool_array = RewardSource("a", lambda p, r: np.ones(len(r), dtype=bool))
    assert "returned a bool" in _err([bool_array])


def test_scalar_and_2d_results_are_rejected(mod: Path):
    assert "returned float 1.0; expected a list, tuple" in _err([_source(mod, "scalar")])
    assert "of shape (4, 1); expected shape (4,)" in _err([_source(mod, "matrix")])


def test_misaligned_inputs():
    src = parse_reward_specs([ARITH])
    assert "4 prompts but 3 responses" in _err(src, responses=RESPONSES[:3], columns={"answer": ANSWERS})
    assert "column 'answer' must be a list of 4 values" in _err(src, columns={"answer": ANSWERS[:2]})
    with pytest.raises(RewardFunctionError, match="at least one reward source"):
        compute_rewards([], PROMPTS, RESPONSES, {})


# ------------------------------------------------------------------------------------------------------------------
# RewardFunctionScorer
# ------------------------------------------------------------------------------------------------------------------


def test_scorer_pickles_without_functions_and_scores(mod: Path):
    scorer = RewardFunctionScorer([f"{ARITH}@2", _spec(mod, "length_bonus") + "@0.5"])
    assert isinstance(scorer.specs, tuple)
    assert scorer.names == [ARITH, _spec(mod, "length_bonus")]
    total, per = scorer(PROMPTS, RESPONSES, {"answer": ANSWERS})
    assert total.tolist() == [2.5, 0.5, 2.5, 0.5]
    assert set(per) == set(scorer.names)

    data = pickle.dumps(scorer)
    assert b"length_bonus" in data and b"_rlhf_reward_file_" not in data  # specs only, no function objects
    clone = pickle.loads(data)
    assert clone == scorer and hash(clone) == hash(scorer)
    assert clone._sources is None  # loads lazily
    total2, _ = clone(PROMPTS, RESPONSES, {"answer": ANSWERS})
    assert torch.equal(total, total2)
    first = clone.load()
    assert [s.fn for s in clone.load()] == [s.fn for s in first]  # cached


def test_scorer_checks_specs_without_importing(tmp_path: Path):
    with pytest.raises(RewardFunctionError, match="weight"):
        RewardFunctionScorer([f"{ARITH}@heavy"])
    with pytest.raises(RewardFunctionError, match="at least one"):
        RewardFunctionScorer([])
    lazy = RewardFunctionScorer([f"{tmp_path}/later.py:fn"])  # file does not exist yet: fine until first use
    with pytest.raises(RewardFunctionError, match="not found"):
        lazy(["p"], ["r"], {})
