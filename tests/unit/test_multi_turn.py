"""The turn-by-turn rollout loop (rlhf/rollout/multi_turn.py) on stand-ins for the engines and the environments:
which episodes go to the engines each turn, with which tokens and seeds, how observations are appended, and how
episodes end (done, max_turns, the token budget). The real engines and environment actors are the integration
tests' business."""

from __future__ import annotations

import dataclasses
from typing import List, Sequence

import pytest

from rlhf.rollout.episodes import episodes_batch
from rlhf.rollout.multi_turn import TURN_SEED_STRIDE, RolloutStats, TurnLimits, episode_metrics, run_episodes
from rlhf.rollout.types import Generation, SamplingSpec


class Engine:
    """Request j answers ``length`` tokens ``100 + (seed + j) % 50``, finished by ``finish[call]`` (``"stop"``: it
    ended itself, ``"length"``: cut at max_new_tokens; the last entry repeats); records every call."""

    def __init__(self, length: int = 3, finish: Sequence[str] = ("stop",)):
        self.length, self.finish, self.calls = length, finish, []

    def generate(self, prompt_ids, sampling: SamplingSpec) -> List[Generation]:
        reason = self.finish[min(len(self.calls), len(self.finish) - 1)]
        self.calls.append(([tuple(p) for p in prompt_ids], sampling.seed))
        return [
            Generation(
                tuple(p),
                tuple(100 + (sampling.seed + j) % 50 for _ in range(self.length)),
                tuple(-0.1 * (k + 1) for k in range(self.length)),
                reason,
            )
            for j, p in enumerate(prompt_ids)
        ]


@dataclasses.dataclass
class Outcome:
    observation: str
    reward: float
    done: bool
    info: dict = dataclasses.field(default_factory=dict)


class Counting:
    """Episode i is done after ``row["turns"]`` turns; each turn's observation is ``"o<turn>"``, reward 1 per turn."""

    def __init__(self):
        self.rows, self.turn, self.steps, self.closed = {}, {}, [], None

    def reset(self, rows):
        self.rows = {i: r for i, r in enumerate(rows)}
        self.turn = {i: 0 for i in self.rows}
        return ["hi" if r.get("greet") else None for r in rows]

    def step(self, ids, responses, response_ids):
        self.steps.append((list(ids), list(responses), [tuple(r) for r in response_ids]))
        out = []
        for i in ids:
            self.turn[i] += 1
            out.append(Outcome(f"o{self.turn[i]}", 1.0, self.turn[i] >= self.rows[i]["turns"], {"turn": self.turn[i]}))
        return out

    def close(self, ids):
        self.closed = list(ids)


def encode(text: str) -> List[int]:
    return [ord(c) for c in text]


def decode(ids) -> str:
    return " ".join(map(str, ids))


SAMPLING = SamplingSpec(max_new_tokens=3, seed=7)


def test_live_episodes_go_to_the_engines_together_with_their_tokens_so_far():
    engine, env = Engine(), Counting()
    prompts = [(1, 2), (3,), (4, 5, 6)]
    rows = [{"turns": 1}, {"turns": 3, "greet": True}, {"turns": 2}]
    stats = RolloutStats()
    records = run_episodes(engine, env, prompts, rows, SAMPLING, encode, decode, TurnLimits(4, 64), stats)
    assert [r.episode.turns for r in records] == [1, 3, 2] and stats.turns == 3
    assert [r.ended_by for r in records] == ["done"] * 3
    assert [len(c[0]) for c in engine.calls] == [3, 2, 1]  # only the live episodes, every turn one call
    assert [c[1] for c in engine.calls] == [7 + t * TURN_SEED_STRIDE for t in range(3)]
    # turn 2's prompts are exactly the episodes' tokens after turn 1: sampled ids + the observation's ids
    second = records[1].episode
    assert engine.calls[1][0][0] == (3,) + tuple(encode("hi")) + second.segments[0].ids + tuple(encode("o1"))
    # reset's observation joins the prompt (context before the first turn); the turns alternate after it
    assert second.prompt_ids == (3,) + tuple(encode("hi"))
    assert [s.source for s in second.segments] == ["policy", "env", "policy", "env", "policy"]
    # the environment saw each response as text and as the sampled ids
    ids, texts, raw = env.steps[0]
    assert ids == [0, 1, 2] and texts[0] == decode(raw[0]) and raw[0] == records[0].episode.segments[0].ids
    assert [r.turn_rewards for r in records] == [[1.0], [1.0, 1.0, 1.0], [1.0, 1.0]] and env.closed == [0, 1, 2]
    assert records[1].turn_infos == [{"turn": 1}, {"turn": 2}, {"turn": 3}]  # each step's info, kept per turn
    # the final observation of a finished episode is not appended: nothing after the last policy turn
    assert all(r.episode.segments[-1].source == "policy" for r in records)


def test_max_turns_and_the_token_budget_end_episodes():
    rows = [{"turns": 9}, {"turns": 9}]
    records = run_episodes(
        Engine(),
        Counting(),
        [(1,), (1, 2, 3, 4)],
        rows,
        SAMPLING,
        encode,
        decode,
        TurnLimits(max_turns=2, max_episode_tokens=9),
    )
    first, second = records
    assert first.ended_by == "max_turns" and first.episode.turns == 2
    assert len(first.episode.token_ids) == 1 + 3 + 2 + 3  # prompt, response, "o1", response
    assert second.ended_by == "token_budget" and len(second.episode.token_ids) == 9  # cut, never over
    batch = episodes_batch([r.episode for r in records], pad_id=0)
    assert batch.input_ids.shape == (2, 9)
    assert batch.loss_mask[0].tolist() == [0, 1, 1, 1, 0, 0, 1, 1, 1]  # "o1" is context


def test_a_prompt_already_over_budget_never_reaches_the_engines():
    engine = Engine()
    records = run_episodes(
        engine, Counting(), [(1,) * 8, (2,)], [{"turns": 1}, {"turns": 1}], SAMPLING, encode, decode, TurnLimits(2, 8)
    )
    assert records[0].ended_by == "token_budget" and records[0].episode.turns == 0
    assert [len(c[0]) for c in engine.calls] == [1]


def test_episode_metrics():
    records = run_episodes(
        Engine(), Counting(), [(1,), (2,)], [{"turns": 1}, {"turns": 2}], SAMPLING, encode, decode, TurnLimits(3, 64)
    )
    m = episode_metrics(records, RolloutStats(env_seconds=0.5))
    assert m["episode/turns"] == 1.5 and m["episode/policy_tokens"] == 4.5 and m["episode/env_tokens"] == 1.0
    assert m["episode/ended_done"] == 1.0 and m["episode/env_reward"] == 1.5 and m["time/env"] == 0.5


def test_a_response_cut_at_the_end_of_an_episode_is_not_a_clean_finish():
    """The environment says done after a response cut by max_new_tokens (``finish_reason="length"``) or by the
    token budget: the episode ends at that limit, so rollout.episode_limit applies to it. A cut response mid-episode
    is the environment's to judge (the episode goes on); a whole one followed by done is a clean finish."""
    rows = [{"turns": 1}, {"turns": 2}]
    cut = run_episodes(
        Engine(finish=("length",)), Counting(), [(1,), (2,)], rows, SAMPLING, encode, decode, TurnLimits(3, 64)
    )
    assert [r.ended_by for r in cut] == ["max_new_tokens"] * 2 and all(r.at_limit for r in cut)
    assert [r.episode.turns for r in cut] == [1, 2]  # the cut first response of episode 1 did not end it
    whole_last = run_episodes(
        Engine(finish=("length", "stop")), Counting(), [(1,), (2,)], rows, SAMPLING, encode, decode, TurnLimits(3, 64)
    )
    assert [r.ended_by for r in whole_last] == ["max_new_tokens", "done"] and not whole_last[1].at_limit
    # 4 prompt tokens + 3 sampled in a budget of 6: the response is cut to 2 tokens, then the environment's done
    budget = run_episodes(Engine(), Counting(), [(1,) * 4], [{"turns": 1}], SAMPLING, encode, decode, TurnLimits(3, 6))
    assert budget[0].ended_by == "token_budget" and budget[0].at_limit and budget[0].episode.num_tokens == 6
    # the last allowed turn without done stays max_turns, cut or not
    last = run_episodes(
        Engine(finish=("length",)), Counting(), [(1,)], [{"turns": 9}], SAMPLING, encode, decode, TurnLimits(1, 64)
    )
    assert last[0].ended_by == "max_turns"
    m = episode_metrics(cut + whole_last, RolloutStats())
    assert m["episode/ended_max_new_tokens"] == 0.75 and m["episode/ended_done"] == 0.25


def test_a_reset_observation_counts_in_the_token_budget():
    """The environment's first observation is context like any observation: prompt + observation are cut at
    max_episode_tokens and an episode left without room never reaches the engines (the row never outgrows the
    budget, which sizes the engines' context and the trainer's rows)."""
    engine = Engine()
    rows = [{"turns": 1, "greet": True}, {"turns": 1, "greet": True}]
    records = run_episodes(engine, Counting(), [(1,) * 7, (2,)], rows, SAMPLING, encode, decode, TurnLimits(2, 8))
    assert records[0].episode.token_ids == (1,) * 7 + tuple(encode("hi"))[:1]  # 7 + 2 tokens cut to 8
    assert records[0].ended_by == "token_budget" and records[0].episode.turns == 0
    assert records[1].episode.prompt_ids == (2,) + tuple(encode("hi")) and records[1].ended_by == "done"
    assert [len(c[0]) for c in engine.calls] == [1]


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_turns >= 1"):
        TurnLimits(0, 10)


def test_prefill_groups_fit_one_scheduler_step():
    from rlhf.rollout.vllm.engine import prefill_groups

    assert prefill_groups([10, 10, 10], None) == [(0, 3)]
    assert prefill_groups([], 100) == []
    assert prefill_groups([40, 40, 40, 10], 100) == [(0, 2), (2, 4)]  # a prompt costs its tokens + 1 decode token
    assert prefill_groups([500, 10], 100) == [(0, 1), (1, 2)]  # longer than a step: alone
    assert prefill_groups([1] * 60, 100) == [(0, 50), (50, 60)]
