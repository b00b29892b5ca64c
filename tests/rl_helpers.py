"""Shared by the RL end-to-end test files: the run helper and the per-step row checks (the prompts and the
shaping reward are the ``rl_prompts`` / ``rl_shaping`` fixtures of conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os

import torch

from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig

#: Row keys measured on the clock: they differ between any two runs, so an exactness test leaves them out.
CLOCK = ("samples_per_s", "sync_mb_per_s", "async/waited_s", "async/generated_ahead_s")


def untimed(row: dict) -> dict:
    """A metrics row without its clock-measured keys (``time/``, ``perf/``, :data:`CLOCK`): what two runs that train
    identically must log identically."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/")) and k not in CLOCK}


STEP_KEYS = (
    "step",
    "epoch",
    "reward_mean",
    "reward_std",
    "accuracy",
    "policy_loss",
    "entropy",
    "clip_frac",
    "response_length",
    "logp_mismatch",
    "time/generate",
    "time/score",
    "time/logprobs",
    "time/train",
    "time/sync",
    "samples_per_s",
    "grad_norm",
    "lr",
    "num_samples",
)


def tiny_rl_config(tiny_model, prompts, *extra) -> RLRunConfig:
    """``grpo_tiny`` on the tiny model and ``prompts``, rewarded by the arithmetic reward function, then ``extra``:
    a config to validate, plan or describe (nothing starts)."""
    reward = "reward.functions=[rlhf.synthetic.arithmetic:reward]"
    return load_config(
        RLRunConfig, "grpo_tiny", [f"model.path={tiny_model}", f"data.train_path={prompts}", reward, *extra]
    )


def train_rl(tiny_model, prompts, out, *overrides):
    """``train_ppo`` with ``grpo_tiny`` on the tiny model and ``prompts``, writing to ``out`` (no TensorBoard), then
    ``overrides``; returns the metrics rows and the run's result."""
    from rlhf.trainers.online.runner import train_ppo

    cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            f"model.path={tiny_model}",
            f"data.train_path={prompts}",
            f"train.output_dir={out}",
            "logging.tensorboard=false",
            *overrides,
        ],
    )
    result = train_ppo(cfg)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], result


def run_rl(tiny_model, prompts, shaping, out, *extra):
    return train_rl(
        tiny_model,
        prompts,
        out,
        f"reward.functions=[rlhf.synthetic.arithmetic:reward,{shaping}]",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "rollout.max_prompt_length=16",  # the arithmetic prompts are ~8 tokens; token budgets below count on it
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.max_steps=2",
        "train.lr=1e-4",
        *extra,
    )


def check_rows(rows, steps=(1, 2), extra_keys=()):
    assert [r["step"] for r in rows] == list(steps)
    for r in rows:
        assert r["grad_norm"] > 0 and r["reward_std"] > 0  # a real learning signal, not all-zero advantages
        missing = [k for k in STEP_KEYS + tuple(extra_keys) if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert r["num_samples"] == 16 and 0.0 <= r["accuracy"] <= 1.0
        # vLLM's sampling log-probs and the trainer's agree on the same tokens; after step 1 this also proves the
        # weight sync landed (stale engine weights would give a large mismatch).
        assert r["logp_mismatch"] < 1e-4, r["logp_mismatch"]


def greedy_reference(model, prompt_ids, n_new):
    """Greedy continuation and the log-prob of each chosen token by repeated full forwards of an HF model:
    what a vLLM engine holding the same weights must generate."""
    ids = list(prompt_ids)
    out_ids, out_logps = [], []
    with torch.no_grad():
        for _ in range(n_new):
            logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
            tok = int(logps.argmax())
            out_ids.append(tok)
            out_logps.append(float(logps[tok]))
            ids.append(tok)
    return out_ids, out_logps


@contextlib.contextmanager
def one_torch_thread():
    """This process's torch maths on one intra-op thread inside the block (restored after it). For the small
    forward passes tests run in the test process itself: a second thread buys nothing on the tiny model, and on a
    loaded machine (``make test`` runs two test processes next to Ray actors on two cores) a parallel region can
    wait for a descheduled OpenMP thread. Measured next to two busy processes: eight greedy references of 6 tokens
    (:func:`greedy_reference`) took 0.4 s on one thread, 0.8 to 10.7 s on two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
