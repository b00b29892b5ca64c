"""RewardPool on the shared Ray cluster: chunks scored in parallel by real actors give compute_rewards' numbers
whatever the number of actors and the chunk size; a function that raises, hangs or kills its actor on one sample
fails that sample only (named in the message); a hung or dead actor is replaced and the pool keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf.rewards.functions import RewardFunctionError, compute_rewards, parse_reward_specs
from rlhf.rewards.pool import RewardPool

pytestmark = pytest.mark.usefixtures("ray_session")

REWARDS = """
import os, time

def slow(prompts, responses, answers):
    time.sleep(0.05 * len(prompts))  # 50 ms per sample
    return [len(r) / 3 + (1.0 if r == a else 0.0) for r, a in zip(responses, answers)]

def raises_on_bad(prompts, responses):
    if "bad" in prompts:
        raise KeyError("no reference for " + prompts[prompts.index("bad")])
    return [float(len(p)) for p in prompts]

def hangs_on_hang(prompts, responses):
    if "hang" in prompts:
        time.sleep(600)
    return [0.25 * len(r) for r in responses]

def dies_on_die(prompts, responses):
    if "die" in prompts:
        os._exit(3)  # the actor process goes away mid-call
    return [1.0] * len(prompts)
"""

PROMPTS = [f"prompt {i}" for i in range(12)]
RESPONSES = [("r" * (i % 5)) + str(i) for i in range(12)]
ANSWERS = [r if i % 3 == 0 else "?" for i, r in enumerate(RESPONSES)]


@pytest.fixture(scope="module")
def rfile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "ray_pool_rewards.py"
    path.write_text(REWARDS)
    return path


def specs(rfile: Path, *names: str):
    return [f"{rfile}:{name}" for name in names]


def reference(rfile: Path, names, prompts, keep):
    """compute_rewards in this process on the samples ``keep``."""
    return compute_rewards(
        parse_reward_specs(specs(rfile, *names)),
        [prompts[i] for i in keep],
        [RESPONSES[i] for i in keep],
        {"answer": [ANSWERS[i] for i in keep]},
    )


@pytest.mark.parametrize("num_workers, chunk_size", [(1, 5), (3, 2)])
def test_parallel_scores_equal_compute_rewards(rfile, num_workers, chunk_size):
    names = ("slow@0.5", "raises_on_bad@-1")
    with RewardPool(specs(rfile, *names), num_workers, chunk_size, 5.0, "fail", cpus_per_worker=0.5) as pool:
        got = pool.score(PROMPTS, RESPONSES, {"answer": ANSWERS})
    total, per_source = reference(rfile, names, PROMPTS, range(len(PROMPTS)))
    assert torch.equal(got.total, total) and all(torch.equal(got.per_source[k], v) for k, v in per_source.items())
    assert (got.errors, got.timeouts, bool(got.failed.any())) == (0, 0, False)


def test_raising_and_hanging_samples_fail_alone_and_the_hung_actor_is_replaced(rfile):
    prompts = list(PROMPTS)
    prompts[3], prompts[8] = "bad", "hang"
    names = ("slow@0.5", "raises_on_bad", "hangs_on_hang@2")
    with RewardPool(specs(rfile, *names), 2, 4, 1.0, "drop", cpus_per_worker=0.5) as pool:
        before = [a._actor_id for a in pool._actors]
        got = pool.score(prompts, RESPONSES, {"answer": ANSWERS})
        assert got.failed.tolist() == [i in (3, 8) for i in range(12)]
        assert (got.errors, got.timeouts) == (1, 1)
        by_index = {f.index: f for f in got.failures}
        assert f"'{rfile}:raises_on_bad' raised KeyError" in by_index[3].message
        assert "no reference for bad" in by_index[3].message and "prompt='bad'" in by_index[3].message
        assert f"'{rfile}:hangs_on_hang' hung (> 1 s) on sample 8: prompt='hang'" in by_index[8].message
        good = [i for i in range(12) if i not in (3, 8)]
        assert torch.equal(got.total[good], reference(rfile, names, prompts, good)[0])
        after = [a._actor_id for a in pool._actors]
        assert sum(b != a for b, a in zip(before, after)) == 1  # the one that hosted the hang, only
        again = pool.score(PROMPTS, RESPONSES, {"answer": ANSWERS})  # still serving, on the fresh actor too
        assert torch.equal(again.total, reference(rfile, names, PROMPTS, range(12))[0]) and not again.failed.any()
    with RewardPool(specs(rfile, "raises_on_bad"), 1, 4, 1.0, "fail", cpus_per_worker=0.5) as failing:
        with pytest.raises(RewardFunctionError, match=f"'{rfile}:raises_on_bad' raised KeyError: .* on sample 3"):
            failing.score(prompts, RESPONSES, {"answer": ANSWERS})


def test_a_sample_that_kills_its_actor_fails_alone(rfile):
    prompts = list(PROMPTS[:6])
    prompts[4] = "die"
    with RewardPool(specs(rfile, "dies_on_die"), 1, 3, 2.0, 0.0, cpus_per_worker=0.5) as pool:
        got = pool.score(prompts, RESPONSES[:6])
        assert got.total.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0] and got.substituted.tolist()[4]
        assert got.errors == 1 and "made its worker fail: the actor died" in got.failures[0].message
        assert "on sample 4: prompt='die'" in got.failures[0].message
        assert pool.score(PROMPTS[:2], RESPONSES[:2]).total.tolist() == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------------------------
# A real RL run: reward functions on the pool, a remote reward on loopback, reward.on_error=drop
# ---------------------------------------------------------------------------------------------------------------

RUN_REWARDS = """
def flaky(prompts, responses):
    # fails on one prompt of the step: its group must carry no loss, the others train
    if any(p.startswith("flaky") for p in prompts):
        raise ValueError("no checker for " + next(p for p in prompts if p.startswith("flaky")))
    return [0.25 * (len(r) % 3) for r in responses]
"""


def test_an_rl_run_scores_on_actors_and_over_http_and_drops_the_failed_groups(tmp_path, tiny_model):
    import json

    from rl_helpers import train_rl
    from shared_helpers import Service

    from rlhf.synthetic.arithmetic import make_rl_prompts, write_jsonl

    rows = make_rl_prompts(16, seed=3)
    rows[0]["prompt"] = "flaky " + rows[0]["prompt"]  # the prompt the flaky function fails on
    prompts = write_jsonl(str(tmp_path / "prompts.jsonl"), rows)
    (tmp_path / "flaky.py").write_text(RUN_REWARDS)
    service = Service(lambda _, p: (200, json.dumps({"rewards": [len(r) / 10 for r in p["responses"]]}).encode()))
    try:
        (row,), _ = train_rl(
            tiny_model,
            prompts,
            str(tmp_path / "run"),
            f"reward.functions=[rlhf.synthetic.arithmetic:reward,{tmp_path / 'flaky.py'}:flaky]",
            "reward.num_workers=2",
            "reward.cpus_per_worker=0.25",
            "reward.chunk_size=8",
            "reward.on_error=drop",
            f"reward.http={service.url}",
            "reward.http_batch_size=8",
            "rollout.prompts_per_step=16",
            "rollout.n_samples_per_prompt=2",
            "train.global_batch_size=32",
            "train.micro_batch_size=16",
            "train.max_steps=1",
            "algo.kl_coef=0",  # no KL term: no reference model (no assertion here reads the KL)
        )
    finally:
        service.close()
    assert row["reward/errors"] == 2 and row["reward/failed_samples"] == 2  # the prompt's two samples, isolated
    assert row["failed/samples"] == row["failed/rows_out"] == 2  # out of the step, and no other sample
    assert row["reward/timeouts"] == 0 and row["reward/http"] > 0
    assert len(service.calls) == 4  # 32 samples in batches of 8
    assert row["grad_norm"] > 0  # the other groups trained
