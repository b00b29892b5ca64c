"""Multi-turn episodes kept token-in / token-out (rlhf/rollout/episodes.py): the batch layout, the prefix check
against a re-encoding environment, exactly zero gradient on environment tokens, and split-vs-whole invariance of
every loss aggregation for episodes with different numbers of turns (one episode = one sample)."""

from __future__ import annotations

import pytest
import torch
from group_helpers import LocalGroup
from shared_helpers import float64_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.distributed.engine import EngineSpec
from rlhf.objectives.actor_critic import PolicyObjective, TokenLogps
from rlhf.ops.aggregation import aggregate_sum
from rlhf.ops.policy_loss import PolicyLossConfig, policy_loss
from rlhf.rl import Episode, EpisodeError, episodes_batch, rollout_batch
from rlhf.rollout.types import Generation

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _episodes(vocab: int, n: int = 8, seed: int = 0):
    """``n`` episodes of 1 to 3 turns: responses of 1-5 tokens, observations of 2-4 tokens between turns."""
    gen = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(4, vocab, (k,), generator=gen).tolist()  # noqa: E731
    episodes = []
    for i in range(n):
        episode = Episode(tuple(ids(2 + i % 3)), index=i)
        for turn in range(1 + i % 3):
            if turn:
                episode.add_observation(ids(2 + (i + turn) % 3))
            k = 1 + (i + 2 * turn) % 5
            episode.add_response(ids(k), (-0.5 - 0.1 * torch.rand(k, generator=gen)).tolist())
        episodes.append(episode)
    return episodes


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


@pytest.fixture(scope="module")
def model_fp64(tiny_model):
    return float64_model(tiny_model)


def test_the_batch_marks_policy_tokens_only_and_places_their_sampling_logps():
    episode = Episode((5, 6), index=0)
    episode.add_response([7, 8], [-0.1, -0.2])
    episode.add_observation([9, 10, 11])
    episode.add_response([12], [-0.3])
    short = Episode((5,), index=1)
    short.add_response([13], [-0.4])
    batch = episodes_batch([episode, short], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12], [5, 13, 0, 0, 0, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 8, [1, 1, 0, 0, 0, 0, 0, 0]]
    assert torch.allclose(batch.rollout_logps[0], torch.tensor([0, 0, -0.1, -0.2, 0, 0, 0, -0.3]))
    assert (episode.turns, episode.policy_tokens, episode.env_tokens) == (2, 3, 3)
    assert episode.token_ids == (5, 6, 7, 8, 9, 10, 11, 12)  # the next turn's prompt: nothing re-encoded


def test_a_single_turn_rollout_is_the_one_segment_episode():
    gens = [
        Generation((1, 2, 3), (4, 5), (-0.5, -0.25), "stop"),
        Generation((1,), (6,), (-1.0,), "length"),
        Generation((2, 2), (), (), "stop"),
    ]
    batch = rollout_batch(gens, pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 6, 0, 0, 0], [2, 2, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert batch.rollout_logps.tolist() == [[0, 0, 0, -0.5, -0.25], [0, -1.0, 0, 0, 0], [0] * 5]
    assert batch.sample_index.tolist() == [0, 1, 2]


def test_segments_refuse_missing_or_extra_logps():
    with pytest.raises(ValueError, match="one sampling log-prob per token: 2 tokens, 1 log-probs"):
        Episode((1,)).add_response([2, 3], [-0.1])


def test_the_prefix_check_catches_an_environment_that_re_encodes_the_text(tiny_model):
    """The policy sampled two tokens whose text the tokenizer would encode differently (e.g. " " then "+", which
    re-encode as the merged " +"): an environment that decodes the conversation and encodes it again hands back
    different ids, and the episode names the turn and the position instead of training on tokens never sampled."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    special = set(tok.all_special_ids)
    plain = [i for i in range(len(tok)) if i not in special and tok.decode([i]).isascii() and tok.decode([i])]
    pair = next(
        (a, b) for a in plain for b in plain if tok(tok.decode([a, b]), add_special_tokens=False)["input_ids"] != [a, b]
    )
    prompt = tuple(tok("1+2=", add_special_tokens=False)["input_ids"])
    episode = Episode(prompt, index=3)
    episode.add_response(pair, [-0.1, -0.2])

    def re_encoding_env(ids):  # the bug: text round-trip of the whole conversation, then the observation
        return tok(tok.decode(list(ids)) + " ok", add_special_tokens=False)["input_ids"]

    with pytest.raises(
        EpisodeError,
        match=rf"episode 3, turn 1: the new prompt does not extend the episode's "
        rf"tokens: they differ at position {len(prompt)} of {len(prompt) + 2}",
    ):
        episode.extend_to(re_encoding_env(episode.token_ids))
    assert episode.extend_to(re_encoding_env(episode.token_ids), on_mismatch="truncate") is False
    assert episode.truncated and episode.token_ids == prompt + pair  # kept as sampled, nothing appended
    good = Episode(prompt, index=4)
    good.add_response(pair, [-0.1, -0.2])
    observation = tok(" ok", add_special_tokens=False)["input_ids"]
    assert good.extend_to(list(good.token_ids) + observation) is True  # ids appended, not text: a true extension
    assert good.segments[-1].ids == tuple(observation) and good.segments[-1].source == "env"


@pytest.mark.parametrize("mode", MODES)
def test_environment_tokens_get_exactly_zero_gradient(model, mode):
    """d loss / d log-prob is exactly 0 at every environment token, and whatever the batch holds there (old and
    rollout log-probs, advantages, even NaN) changes neither the loss nor the model's gradient."""
    batch = episodes_batch(_episodes(model.config.vocab_size), pad_id=0)
    with torch.no_grad():
        logps = TokenLogps()(model, batch)
    gen = torch.Generator().manual_seed(1)
    mask = batch.loss_mask.bool()
    batch = batch.replace(
        old_logps=logps + 0.2 * torch.randn(logps.shape, generator=gen),
        advantages=torch.randn(logps.shape, generator=gen) * mask,
    )
    env = batch.attention_mask.bool() & ~mask
    env[:, 0] = False  # position 0 is never predicted
    assert env.sum() > 10

    leaf = logps.clone().requires_grad_(True)
    per_token, _ = policy_loss("ppo", leaf, batch.old_logps, batch.advantages, mask, PolicyLossConfig())
    aggregate_sum(mode, per_token, mask).backward()
    assert (leaf.grad[env] == 0).all() and (leaf.grad[mask].abs() > 0).any()

    def model_grads(b):
        model.zero_grad()
        total, _ = PolicyObjective(agg_mode=mode, clip=PolicyLossConfig(tis_cap=2.0), correct_off_policy=True).loss(
            model, b
        )
        total.backward()
        return total.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    junk = lambda x, value: torch.where(env, torch.full_like(x, value), x)  # noqa: E731
    clean_loss, clean = model_grads(batch)
    poisoned = batch.replace(
        old_logps=junk(batch.old_logps, float("nan")),
        advantages=junk(batch.advantages, 1e6),
        rollout_logps=junk(batch.rollout_logps, float("nan")),
    )
    dirty_loss, dirty = model_grads(poisoned)
    assert torch.equal(clean_loss, dirty_loss)
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))
    model.zero_grad()


@pytest.mark.parametrize("mode", MODES)
def test_multi_turn_metrics_are_the_same_for_every_split(model_fp64, mode):
    """8 episodes of 1-3 turns trained as one global batch under four (micro x ranks) splits log the objective over
    the whole batch: the normalizer counts policy tokens (token-mean) or episodes (the seq modes) of all of it.

    In float64: the splits pad the rows to different widths and sum in different orders, so they agree to float64
    rounding (<= 2e-15 relative seen); 1e-12 leaves ~500x for other CPUs' reduction orders and still catches a wrong
    normalizer or a dropped token by many orders. (In float32 the same sums of mixed-sign terms differ by up to
    1.5e-6 relative, so no machine-independent bound near the size of a real bug exists there.)"""
    model = model_fp64
    batch = episodes_batch(_episodes(model.config.vocab_size, seed=2), pad_id=0)
    with torch.no_grad():
        logps = TokenLogps()(model, batch)
    assert logps.dtype == torch.float64
    gen = torch.Generator().manual_seed(3)
    noise = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    batch = batch.replace(
        old_logps=logps + 0.3 * noise(logps.shape), advantages=noise(len(batch), 1).expand_as(logps) * batch.loss_mask
    )
    objective = PolicyObjective(agg_mode=mode)
    with torch.no_grad():
        whole = objective.finalize(objective.loss(model, batch)[1], objective.count(batch))
    assert objective.count(batch) == (int(batch.loss_mask.sum()) if mode == "token-mean" else len(batch))
    for micro, ranks in ((8, 1), (2, 2), (1, 4), (1, 8)):
        result = LocalGroup(model, EngineSpec.for_global_batch(8, micro, ranks), ranks).train_batch(batch, objective)
        for key, value in whole.items():
            assert result.metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-15), (micro, ranks, key)
