"""Environments without Ray: loading by spec (and its errors), one episode in-process, StepOutcome validation."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.envs import EnvError, Environment, LocalEpisode, StepOutcome, load_environment

ENVS = '''
from rlhf.envs import Environment, StepOutcome

class Counter(Environment):
    """Says the turn number; done after `turns` (a row column) turns; reward 1 when the response echoes it."""
    def reset(self, row):
        self.turns, self.n = int(row["turns"]), 0
        return f"{row['prompt']} 0"
    def step(self, response, response_ids):
        self.n += 1
        done = self.n >= self.turns
        return StepOutcome(None if done else str(self.n), float(response == str(self.n - 1)), done,
                           {"ids": len(response_ids)})

class Duck:  # no base class: a tuple from step is accepted
    def reset(self, row):
        return "go"
    def step(self, response, response_ids):
        return ("more", 1, response == "stop", {})

class Raising(Environment):
    def reset(self, row):
        return "x"
    def step(self, response, response_ids):
        raise KeyError("no such tool")

class BadOutcome(Environment):
    def reset(self, row):
        return "x"
    def step(self, response, response_ids):
        return StepOutcome.__new__(StepOutcome) if response == "raw" else {"reward": 1}

class NoStep:
    def reset(self, row):
        return ""

class NeedsArgs(Environment):
    def __init__(self, sandbox):
        self.sandbox = sandbox

NOT_A_CLASS = 3

def counter():
    return Counter()
'''


@pytest.fixture()
def envs(tmp_path: Path) -> Path:
    path = tmp_path / "my_envs.py"
    path.write_text(ENVS)
    return path


def _error(spec: str) -> str:
    with pytest.raises(EnvError) as info:
        load_environment(spec)
    assert repr(spec) in str(info.value) and info.value.spec in (None, spec)
    return str(info.value)


def test_load_by_file_and_module(envs: Path):
    cls = load_environment(f"{envs}:Counter")
    assert issubclass(cls, Environment) and cls.__name__ == "Counter"
    assert load_environment("rlhf.envs.base:Environment") is Environment


def test_loading_errors_name_the_spec(envs: Path, tmp_path: Path):
    assert "not found" in _error(f"{tmp_path}/nope.py:Env")
    msg = _error(f"{envs}:Countr")
    assert "has no attribute 'Countr'" in msg and "Did you mean 'Counter'" in msg
    assert "Classes available there: BadOutcome, Counter, Duck, NeedsArgs, NoStep, Raising" in msg
    assert "is not a class or a function (it is int)" in _error(f"{envs}:NOT_A_CLASS")
    # a function is an agent (rlhf.envs.agents), which takes the episode's client and row
    assert "agent function counter() must take (client, row)" in _error(f"{envs}:counter")
    assert "has no step method" in _error(f"{envs}:NoStep")
    assert "constructor requires sandbox" in _error(f"{envs}:NeedsArgs")
    assert "cannot import module 'rlhf.no_such'" in _error("rlhf.no_such:Env")
    assert "must look like 'path/to/file.py:Class' or 'package.module:Class'" in _error("no_colon")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('top-level boom')\n")
    assert "failed: RuntimeError: top-level boom" in _error(f"{broken}:Env")


def test_an_episode_in_process(envs: Path):
    cls = load_environment(f"{envs}:Counter")
    episode = LocalEpisode(cls(), f"{envs}:Counter", index=4)
    assert episode.reset({"prompt": "count", "turns": 3}) == "count 0"
    outcomes = [episode.step(r, (1, 2)) for r in ["0", "x", "2"]]
    assert [(o.observation, o.reward, o.done, o.info) for o in outcomes] == [
        ("1", 1.0, False, {"ids": 2}),
        ("2", 0.0, False, {"ids": 2}),
        (None, 1.0, True, {"ids": 2}),
    ]
    with pytest.raises(
        EnvError,
        match=r"was stepped after its episode ended at turn 3 in step \(turn 4 of episode "
        r"4\)",
    ):
        episode.step("3", ())


def test_duck_typed_env_may_return_a_tuple(envs: Path):
    episode = LocalEpisode(load_environment(f"{envs}:Duck")(), "duck", 0)
    assert episode.reset({}) == "go"
    assert episode.step("again", ()) == StepOutcome("more", 1.0, False, {})
    assert episode.step("stop", ()).done


def test_errors_name_spec_episode_turn_and_cause(envs: Path):
    spec = f"{envs}:Raising"
    episode = LocalEpisode(load_environment(spec)(), spec, 5)
    episode.reset({})
    with pytest.raises(EnvError) as info:
        episode.step("a", ())
    assert str(info.value) == f"environment {spec!r} raised KeyError: 'no such tool' in step (turn 1 of episode 5)"
    assert (info.value.spec, info.value.episode, info.value.turn) == (spec, 5, 1)
    copy = pickle.loads(pickle.dumps(info.value))  # crosses from a Ray actor intact
    assert str(copy) == str(info.value) and (copy.episode, copy.turn) == (5, 1)

    bad = LocalEpisode(load_environment(f"{envs}:BadOutcome")(), "bad", 2)
    bad.reset({})
    with pytest.raises(
        EnvError,
        match=r"returned a bad outcome: step must return a StepOutcome or a tuple .* got "
        r"dict .* in step \(turn 1 of episode 2\)",
    ):
        bad.step("x", ())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"reward": True}, "reward must be a finite real number"),
        ({"reward": math.nan}, "reward must be a finite real number"),
        ({"reward": "1"}, "reward must be a finite real number"),
        ({"done": 1}, "done must be a bool"),
        ({"observation": 3}, "observation must be a str or None"),
        ({"info": [1]}, "info must be a dict"),
    ],
)
def test_step_outcome_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepOutcome(**kwargs)


def test_step_outcome_normalizes():
    outcome = StepOutcome("obs", 2, True)
    assert outcome.reward == 2.0 and isinstance(outcome.reward, float) and outcome.info == {}
    assert StepOutcome.coerce(("o", 0.5, False, {"k": 1})) == StepOutcome("o", 0.5, False, {"k": 1})
    with pytest.raises(ValueError, match="got list"):
        StepOutcome.coerce(["o", 0.5, False, {}])


def test_reset_must_return_text(tmp_path: Path):
    path = tmp_path / "e.py"
    path.write_text(
        "class E:\n    def reset(self, row):\n        return 3\n    def step(self, r, ids):\n"
        "        return None, 0.0, True, {}\n"
    )
    episode = LocalEpisode(load_environment(f"{path}:E")(), "e.py:E", 1)
    with pytest.raises(
        EnvError,
        match=r"returned int 3 \(reset must return the first observation as a str\) in "
        r"reset \(turn 0 of episode 1\)",
    ):
        episode.reset({})


def test_import_rlhf_envs_is_light():
    code = "import sys, rlhf.envs; print([m for m in ('ray', 'torch', 'vllm') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
