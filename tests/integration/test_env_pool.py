"""EnvironmentPool on the shared Ray cluster: batched turns in order with per-episode state, a raising environment
and a hanging one (each an EnvError naming spec, episode and turn), and the pool still serving afterwards."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlhf.envs import EnvError, EnvironmentPool

pytestmark = pytest.mark.usefixtures("ray_session")

ENVS = '''
import time
from rlhf.envs import Environment, StepOutcome

class Counter(Environment):
    """Keeps a running total of the numbers it is sent, starting from the row's `start` column."""
    def reset(self, row):
        self.total, self.turn = int(row["start"]), 0
        return f"{row['prompt']}={self.total}"
    def step(self, response, response_ids):
        self.turn += 1
        self.total += int(response)
        return StepOutcome(str(self.total), float(self.total), self.turn == 3, {"ids": list(response_ids)})

class Raising(Environment):
    def reset(self, row):
        return "ok"
    def step(self, response, response_ids):
        if response == "boom":
            raise ZeroDivisionError("tool crashed")
        return StepOutcome("fine")

class Sleepy(Environment):
    def reset(self, row):
        self.turn = 0
        return "zzz"
    def step(self, response, response_ids):
        self.turn += 1
        if response == "sleep":
            time.sleep(60)
        return StepOutcome(f"awake {self.turn}", done=self.turn >= 2)
'''


@pytest.fixture(scope="module")
def envs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("envs") / "pool_envs.py"
    path.write_text(ENVS)
    return path


def test_batched_turns_keep_order_and_state(envs: Path):
    with EnvironmentPool(f"{envs}:Counter", num_actors=2, cpus_per_actor=0.5, step_timeout_s=20) as pool:
        rows = [{"prompt": f"p{i}", "start": 10 * i} for i in range(5)]
        assert pool.reset(rows) == [f"p{i}={10 * i}" for i in range(5)]
        ids = list(range(5))
        for turn in range(1, 4):
            outcomes = pool.step(ids, [str(i + turn) for i in ids], [(i, turn) for i in ids])
            expected = [10 * i + sum(i + t for t in range(1, turn + 1)) for i in ids]
            assert [o.reward for o in outcomes] == [float(x) for x in expected]
            assert [o.observation for o in outcomes] == [str(x) for x in expected]
            assert [o.done for o in outcomes] == [turn == 3] * 5
            assert [o.info["ids"] for o in outcomes] == [[i, turn] for i in ids]
        with pytest.raises(
            EnvError,
            match=r"stepped after its episode ended at turn 3 in step \(turn 4 of "
            r"episode 3\)",
        ):
            pool.step([3], ["1"])
        pool.close(ids)
        with pytest.raises(EnvError, match="episode 0 is not live"):
            pool.step([0], ["1"])


def test_a_raising_environment_names_spec_episode_turn_and_cause(envs: Path):
    spec = f"{envs}:Raising"
    with EnvironmentPool(spec, num_actors=2, cpus_per_actor=0.5, step_timeout_s=20) as pool:
        pool.reset([{}] * 4)
        pool.step([0, 1, 2, 3], ["a"] * 4)
        with pytest.raises(EnvError) as info:
            pool.step([0, 1, 2, 3], ["a", "a", "a", "boom"])
        assert str(info.value) == (
            f"environment {spec!r} raised ZeroDivisionError: tool crashed in step (turn 2 of episode 3)"
        )
        assert (info.value.spec, info.value.episode, info.value.turn) == (spec, 3, 2)


def test_a_hanging_environment_times_out_and_the_pool_recovers(envs: Path):
    spec = f"{envs}:Sleepy"
    with EnvironmentPool(spec, num_actors=2, cpus_per_actor=0.5, step_timeout_s=2) as pool:
        pool.reset([{}] * 6)
        pool.step(list(range(6)), ["hi"] * 6)
        start = time.monotonic()
        with pytest.raises(EnvError) as info:
            pool.step(list(range(6)), ["hi"] * 5 + ["sleep"])
        assert time.monotonic() - start < 15
        assert str(info.value) == f"environment {spec!r} hung for more than 2 s in step (turn 2 of episode 5)"
        assert (info.value.episode, info.value.turn) == (5, 2)
        with pytest.raises(EnvError, match=r"episode 3 was lost \(its actor was replaced after: .*hung"):
            pool.step([3], ["hi"])  # on the replaced actor with episode 5
        assert pool.reset([{}, {}], episode_ids=[5, 7]) == ["zzz", "zzz"]  # the replacement serves new episodes
        assert [o.observation for o in pool.step([5, 7], ["hi", "hi"])] == ["awake 1", "awake 1"]


def test_errors_returned_in_place_fail_only_their_episodes(envs: Path):
    """``errors="return"`` (env.on_error=drop): a raising episode and every episode of a hung actor come back as
    EnvErrors in their places; the other actor's episodes take their turn, and the next turn goes on without them."""
    spec = f"{envs}:Sleepy"
    with EnvironmentPool(spec, num_actors=2, cpus_per_actor=0.5, step_timeout_s=2) as pool:
        pool.reset([{}] * 4)
        out = pool.step([0, 1, 2, 3], ["hi", "sleep", "hi", "hi"], errors="return")
        # episode 1 hung on actor 1, which also hosted episode 3: both gone; actor 0's episodes 0 and 2 went on
        assert [type(o).__name__ for o in out] == ["StepOutcome", "EnvError", "StepOutcome", "EnvError"]
        assert str(out[1]) == f"environment {spec!r} hung for more than 2 s in step (turn 1 of episode 1)"
        assert "episode 3 was lost with its actor" in str(out[3])
        again = pool.step([0, 1, 2, 3], ["hi"] * 4, errors="return")
        assert [o.observation for o in again[::2]] == ["awake 2"] * 2 and [o.done for o in again[::2]] == [True] * 2
        assert all(isinstance(o, EnvError) and "was lost" in str(o) for o in again[1::2])
    with EnvironmentPool(f"{envs}:Raising", num_actors=2, cpus_per_actor=0.5, step_timeout_s=20) as pool:
        pool.reset([{}] * 3)
        out = pool.step([0, 1, 2], ["a", "boom", "a"], errors="return")
        assert [o.observation if not isinstance(o, EnvError) else o.turn for o in out] == ["fine", 1, "fine"]


def test_a_spec_the_actors_cannot_load_is_an_env_error(tmp_path: Path):
    path = tmp_path / "typo.py"
    path.write_text(
        "class Env:\n    def reset(self, row):\n        return ''\n    def step(self, r, ids):\n"
        "        return None, 0.0, True, {}\n"
    )
    with pytest.raises(EnvError, match=r"has no attribute 'Evn'\. Did you mean 'Env'\?"):
        EnvironmentPool(f"{path}:Evn", num_actors=1, cpus_per_actor=0.5)
