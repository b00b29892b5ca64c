"""Per-turn credit (``algo.turn_credit=turn``): each turn's environment reward at that turn's last policy token.

Checked against a plain-PyTorch reference written per episode as a loop over its policy tokens (observation tokens
between turns are holes the estimators skip), in float64, for GAE and the REINFORCE++ family; and the config rules.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from rlhf.config.loader import load_config
from rlhf.config.rl_schema import AlgorithmConfig, RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.rl import Episode, advantages_for, episodes_batch, turn_reward_tokens
from rlhf.trainers.online.scoring import StepScoring

# (turn lengths of the policy's responses, observation lengths after each turn but the last)
SHAPES = [([3, 2, 4], [2, 3]), ([1], []), ([2, 0, 3], [1, 2]), ([4, 1], [5])]


def _episodes(rng: random.Random):
    """Episodes with observation holes (one an empty turn), each turn's reward and a score of other sources."""
    episodes, turn_rewards, other = [], [], []
    for index, (turns, observations) in enumerate(SHAPES):
        episode = Episode(tuple(rng.randrange(5, 50) for _ in range(rng.randint(1, 4))), index=index)
        for t, n in enumerate(turns):
            episode.add_response([rng.randrange(5, 50) for _ in range(n)], [-rng.random() for _ in range(n)])
            if t < len(observations):
                episode.add_observation([rng.randrange(5, 50) for _ in range(observations[t])])
        episodes.append(episode)
        # multiples of 1/64: exact in float32, which scores and placed rewards pass through
        turn_rewards.append([rng.randint(-64, 64) / 64 for _ in turns])
        other.append(rng.randint(-64, 64) / 64)
    return episodes, turn_rewards, other


def _policy_positions(episode: Episode):
    """Per turn, the batch columns of its policy tokens."""
    at, turns = len(episode.prompt_ids), []
    for segment in episode.segments:
        if segment.source == "policy":
            turns.append(list(range(at, at + len(segment.ids))))
        at += len(segment.ids)
    return turns


def _reference(episodes, turn_rewards, other, values, kl_penalty, per_turn, gamma, lam):
    """Per episode: the rewards of its policy tokens in order (the KL penalty on each; each turn's reward at its
    last token when ``per_turn``, else summed into the score; the rest of the score at the last token), then
    GAE's backward recursion over those tokens only. Returns ``(advantages, returns-to-go)`` as ``(B, T)``."""
    width = values.shape[1]
    adv = torch.zeros(len(episodes), width, dtype=torch.float64)
    rtg = torch.zeros_like(adv)
    for b, episode in enumerate(episodes):
        turns = _policy_positions(episode)
        tokens = [c for cols in turns for c in cols]
        reward = {c: -float(kl_penalty[b, c]) for c in tokens}
        score = other[b] + sum(turn_rewards[b])
        if per_turn:
            last_seen = None
            for cols, r in zip(turns, turn_rewards[b]):
                last_seen = cols[-1] if cols else last_seen
                if last_seen is None:
                    continue  # no policy token yet: it stays with the score
                reward[last_seen] += r
                score -= r
        reward[tokens[-1]] += score
        next_value = next_adv = next_ret = 0.0
        for c in reversed(tokens):
            v = float(values[b, c])
            a = reward[c] + gamma * next_value - v + gamma * lam * next_adv
            g = reward[c] + gamma * next_ret
            adv[b, c], rtg[b, c] = a, g
            next_value, next_adv, next_ret = v, a, g
    return adv, rtg


def _batch(episodes, dtype=torch.float64, seed=0):
    batch = episodes_batch(episodes, pad_id=0)
    g = torch.Generator().manual_seed(seed)
    shape = batch.input_ids.shape
    return batch.replace(
        old_logps=-torch.rand(shape, generator=g, dtype=dtype),
        ref_logps=-torch.rand(shape, generator=g, dtype=dtype),
        values=torch.randn(shape, generator=g, dtype=dtype),
    )


@pytest.mark.parametrize("per_turn", [True, False])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_gae_with_turn_rewards_matches_a_per_episode_loop(per_turn, kl_coef):
    episodes, turn_rewards, other = _episodes(random.Random(1))
    batch = _batch(episodes)
    placed = turn_reward_tokens(episodes, turn_rewards, batch.input_ids.shape[1]).double()
    scores = torch.tensor([o + sum(t) for o, t in zip(other, turn_rewards)], dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    out, _ = advantages_for(
        batch,
        scores,
        estimator="gae",
        gamma=gamma,
        lam=lam,
        kl_coef=kl_coef,
        kl_estimator="k1",
        kl_in_reward=True,
        turn_rewards=placed if per_turn else None,
    )
    mask = batch.loss_mask.bool()
    kl = torch.where(mask, batch.old_logps - batch.ref_logps, 0.0) * kl_coef
    expected, _ = _reference(episodes, turn_rewards, other, batch.values, kl, per_turn, gamma, lam)
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-12)


def test_per_turn_credit_changes_the_advantages_and_keeps_each_rows_total():
    """Turn by turn or at the end, a row's undiscounted rewards sum to its score; discounted, early turns differ."""
    episodes, turn_rewards, other = _episodes(random.Random(2))
    batch = _batch(episodes).replace(values=None)
    placed = turn_reward_tokens(episodes, turn_rewards, batch.input_ids.shape[1]).double()
    scores = torch.tensor([o + sum(t) for o, t in zip(other, turn_rewards)], dtype=torch.float64)
    first = [_policy_positions(e)[0][0] for e in episodes]
    rows = torch.arange(len(episodes))
    for gamma in (1.0, 0.7):
        by_turn, _ = advantages_for(batch, scores, estimator="reinforce_pp", gamma=gamma, turn_rewards=placed)
        at_end, _ = advantages_for(batch, scores, estimator="reinforce_pp", gamma=gamma)
        if gamma == 1.0:  # the return at each row's first token is its whole score either way
            torch.testing.assert_close(by_turn.returns[rows, first], scores, rtol=0, atol=1e-12)
            torch.testing.assert_close(at_end.returns[rows, first], scores, rtol=0, atol=1e-12)
        else:
            assert not torch.allclose(by_turn.returns, at_end.returns)
            _, expected = _reference(
                episodes, turn_rewards, other, torch.zeros_like(batch.old_logps), batch.old_logps * 0, True, gamma, 1.0
            )
            torch.testing.assert_close(by_turn.returns, expected, rtol=0, atol=1e-12)


def test_reinforce_pp_baseline_takes_turn_rewards_with_the_group_mean_of_whole_scores():
    episodes, turn_rewards, other = _episodes(random.Random(3))
    batch = _batch(episodes).replace(values=None)
    placed = turn_reward_tokens(episodes, turn_rewards, batch.input_ids.shape[1]).double()
    scores = torch.tensor([o + sum(t) for o, t in zip(other, turn_rewards)], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    out, _ = advantages_for(batch, scores, groups, estimator="reinforce_pp_baseline", gamma=0.8, turn_rewards=placed)
    mean = torch.stack([scores[groups == g].mean() for g in groups])
    # the reference with the group mean taken off the score: other' = other - mean
    _, expected = _reference(
        episodes,
        turn_rewards,
        [o - float(m) for o, m in zip(other, mean)],
        torch.zeros_like(batch.old_logps),
        batch.old_logps * 0,
        True,
        0.8,
        1.0,
    )
    torch.testing.assert_close(out.returns, expected, rtol=0, atol=1e-12)


def test_turn_reward_tokens_sit_on_each_turns_last_token_and_skip_empty_turns():
    episode = Episode((1, 2), index=0)
    episode.add_response([3, 4], [-0.1, -0.2])  # columns 2, 3
    episode.add_observation([5])  # column 4
    episode.add_response([], [])  # an empty turn: its reward goes to column 3
    episode.add_observation([6, 7])  # columns 5, 6
    episode.add_response([8], [-0.3])  # column 7
    empty_first = Episode((1,), index=1)
    empty_first.add_response([], [])  # nothing before it: not placed (stays with the score)
    empty_first.add_observation([2])
    empty_first.add_response([3], [-0.5])  # column 2
    placed = turn_reward_tokens([episode, empty_first], [[1.0, 2.0, 4.0], [8.0, 16.0]], 9)
    assert placed[0].tolist() == [0, 0, 0, 3.0, 0, 0, 0, 4.0, 0]
    assert placed[1].tolist() == [0, 0, 16.0, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="3 turn rewards for 2 policy turns"):
        turn_reward_tokens([empty_first], [[1.0, 2.0, 3.0]], 9)


def test_group_estimators_refuse_turn_rewards():
    episodes, turn_rewards, other = _episodes(random.Random(4))
    batch = _batch(episodes)
    placed = turn_reward_tokens(episodes, turn_rewards, batch.input_ids.shape[1]).double()
    with pytest.raises(ValueError, match="sequence scores only"):
        advantages_for(batch, torch.zeros(4), torch.tensor([0, 0, 1, 1]), estimator="grpo", turn_rewards=placed)


def test_turn_credit_config_rules():
    assert AlgorithmConfig(advantage_estimator="gae", turn_credit="turn").turn_credit == "turn"
    with pytest.raises(ConfigError, match="algo.turn_credit"):
        AlgorithmConfig(advantage_estimator="grpo", turn_credit="turn")
    with pytest.raises(ConfigError, match="algo.turn_credit"):
        AlgorithmConfig(turn_credit="per_token")
    base = ["model.path=/m", "data.train_path=/d.jsonl", "algo.advantage_estimator=reinforce_pp"]
    with pytest.raises(ConfigError, match=r"algo.turn_credit \(turn\) needs episodes"):
        load_config(RLRunConfig, "grpo_tiny", [*base, "algo.turn_credit=turn"])
    multi = ["env.spec=e.py:E", "rollout.max_turns=2", "rollout.max_episode_tokens=300", "algo.turn_credit=turn"]
    assert load_config(RLRunConfig, "grpo_tiny", [*base, *multi]).algo.turn_credit == "turn"


def test_the_step_scoring_weights_turn_rewards_and_drops_them_where_a_limit_replaced_the_score():
    base = ["model.path=/m", "data.train_path=/d.jsonl", "algo.advantage_estimator=reinforce_pp"]
    multi = ["env.spec=e.py:E", "rollout.max_turns=2", "rollout.max_episode_tokens=300", "env.reward_weight=0.5"]
    placed = torch.tensor([[0.0, 2.0, 0.0, 4.0], [1.0, 0.0, 0.0, 8.0]])
    rollout = SimpleNamespace(turn_rewards=placed, at_limit=torch.tensor([False, True]))
    credit = lambda *extra: StepScoring(  # noqa: E731
        load_config(RLRunConfig, "grpo_tiny", [*base, *multi, *extra]), ()
    ).turn_credit(rollout)
    assert credit() is None  # algo.turn_credit=episode: the environment's rewards stay in the score
    assert credit("algo.turn_credit=turn").tolist() == [[0.0, 1.0, 0.0, 2.0], [0.5, 0.0, 0.0, 4.0]]
    penalized = credit("algo.turn_credit=turn", "rollout.episode_limit=penalize")
    assert penalized.tolist() == [[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]]
