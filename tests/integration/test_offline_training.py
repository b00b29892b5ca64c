"""End-to-end offline training on real Ray actors + real DeepSpeed engines (CPU, gloo), tiny model.

The accumulation contract is tested as equivalences: one global batch split as (micro x GA x ranks) =
(8,1,1), (1,8,1), (2,2,2), (1,4,2) -- each under a different ZeRO stage -- must log the same loss and grad norm
and end with the same weights; and the logged step-1 numbers must equal a plain single-process PyTorch
computation over the whole global batch (no DeepSpeed, no Ray, no project loss code). This file: SFT; DPO and the
reward model: test_dpo_training.py, test_rm_training.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from offline_helpers import (
    LOSS_RTOL,
    _assert_ranks_ran_different_counts,
    _assert_same_runs,
    _assert_same_weights,
    _completion_nll_and_count,
    _grad_norm,
    _overrides,
    _plain_model,
    _read_jsonl,
    _rows,
)

from rlhf.config.loader import load_config
from rlhf.config.schema import SFTRunConfig
from rlhf.data.plan import EpochPlan
from rlhf.utils.schedule import lr_multiplier

pytestmark = pytest.mark.usefixtures("ray_session")

SFT_FACTORISATIONS = {  # name: (micro, ranks, zero stage[, overrides]); global batch 8
    "8x1x1-z0": (8, 1, 0),
    "1x8x1-z2": (1, 1, 2),
    "2x2x2-z3": (2, 2, 3),
    "1x4x2-z1": (1, 2, 1),
    # padding-free, micro-batches of <= 52 tokens (rows of 7-42): ranks run 2-3 of them, and in steps 1 and 4 one
    # rank needs a micro-batch fewer than the other (a lockstep filler)
    "tok52-packed-x2-z3": (1, 2, 3, ("train.packing=true", "train.max_tokens_per_micro_batch=52")),
}
# The factorisation that also evaluates held-out data (data.eval_path: the training rows), after its last step only
# (train.eval_every=0): that writes eval.jsonl, never a metrics.jsonl row, once the final weights are trained, so
# what the factorisations compare (metrics.jsonl, final weights) is untouched (test_sft_eval_over_two_ranks_...).
EVALUATED = "2x2x2-z3"


@pytest.fixture(scope="module")
def sft_runs(tiny_model, sft_data, tmp_path_factory):
    from rlhf.trainers.offline.sft import train_sft

    base = tmp_path_factory.mktemp("sft")
    runs = {}
    for name, (mbs, nw, zero, *extra) in SFT_FACTORISATIONS.items():
        out = str(base / name)
        held_out = (f"data.eval_path={sft_data}",) if name == EVALUATED else ()
        cfg = load_config(
            SFTRunConfig,
            overrides=_overrides(
                tiny_model, sft_data, out, 8, mbs, nw, zero, extra=(*(extra[0] if extra else ()), *held_out)
            ),
        )
        result = train_sft(cfg)
        runs[name] = (_rows(out), result.final_dir, cfg)
    return runs


def test_sft_factorisations_log_identical_numbers(sft_runs):
    _assert_same_runs({k: v[0] for k, v in sft_runs.items()}, ("loss", "grad_norm", "lr"))
    _assert_ranks_ran_different_counts({k: v[0] for k, v in sft_runs.items()})


def test_sft_factorisations_end_with_identical_weights(sft_runs):
    _assert_same_weights([v[1] for v in sft_runs.values()])


def test_sft_steps_epochs_and_drop_last(sft_runs):
    rows = next(iter(sft_runs.values()))[0]
    # 21 rows, global batch 8: floor(21/8) = 2 steps per epoch (5 rows dropped after each shuffle), 2 epochs.
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["epoch"] for r in rows] == [1, 1, 2, 2]
    assert all(r["num_samples"] == 8 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_sft_lr_follows_schedule_over_exact_horizon(sft_runs):
    rows, _, cfg = next(iter(sft_runs.values()))
    for i, r in enumerate(rows):
        expected = cfg.train.lr * lr_multiplier(i, total_steps=4, warmup_steps=1, kind="cosine", min_ratio=0.0)
        assert r["lr"] == pytest.approx(expected, rel=1e-9)
    # transformers' get_cosine_schedule_with_warmup(1 warm-up step, 4 steps): warm-up from 0, then (1 + cos(pi p)) / 2
    # at p = 0, 1/3, 2/3; the floor (0) would come at step 5, which the run does not take.
    assert [r["lr"] / cfg.train.lr for r in rows] == pytest.approx([0.0, 1.0, 0.75, 0.25], abs=1e-12)


def test_sft_step1_equals_plain_pytorch_whole_batch(sft_runs, tiny_model, sft_data):
    """Logged loss and grad norm of step 1 = token-mean NLL of the whole global batch and its gradient norm,
    computed in this process with plain PyTorch."""
    from transformers import AutoTokenizer

    rows, _, cfg = sft_runs["1x4x2-z1"]
    plan = EpochPlan(num_samples=21, global_batch_size=8, max_epochs=2, seed=cfg.train.seed)
    data = _read_jsonl(sft_data)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = _plain_model(tiny_model)
    total, count = 0.0, 0
    for i in plan.step(1).indices:
        nll, n = _completion_nll_and_count(model, tokenizer, data[i]["prompt"], data[i]["response"])
        total, count = total + nll, count + n
    loss = total / count
    loss.backward()
    assert rows[0]["num_tokens"] == count
    # perf metrics (rlhf.utils.flops): the step's real tokens over its seconds; no MFU on CPU ranks (no peak)
    assert all(row["perf/policy/tokens_per_s"] > 0 for row in rows)
    assert not any(k.endswith("mfu") for k in rows[0])
    assert rows[0]["loss"] == pytest.approx(loss.item(), rel=LOSS_RTOL)
    assert rows[0]["grad_norm"] == pytest.approx(_grad_norm(model), rel=LOSS_RTOL)


def test_sft_max_steps_counts_optimizer_steps_not_epochs(tiny_model, sft_data, tmp_path):
    from rlhf.trainers.offline.sft import train_sft

    out = str(tmp_path / "max3")
    cfg = load_config(
        SFTRunConfig,
        overrides=_overrides(
            tiny_model,
            sft_data,
            out,
            8,
            2,
            1,  # one rank: held-out evaluation over two, with a lockstep filler, is test_sft_eval_over_two_ranks_...
            2,
            epochs=2,
            extra=("train.max_steps=3", f"data.eval_path={sft_data}", "train.eval_every=2"),
        ),
    )
    result = train_sft(cfg)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and result.steps == 3
    assert [r["epoch"] for r in rows] == [1, 1, 2]  # the third step is the first of epoch 2
    # Horizon 3 with 1 warm-up step: the last step is the cosine at p = 1/2 (a horizon of 4 = epochs x steps per
    # epoch would give 0.75, one of 6 0.905).
    assert rows[-1]["lr"] == pytest.approx(cfg.train.lr * 0.5, rel=1e-12)
    assert os.path.isfile(os.path.join(result.final_dir, "model.safetensors"))
    assert os.path.isfile(os.path.join(result.final_dir, "tokenizer_config.json"))

    # Held-out evaluation after steps 2 and 3 (the last); the final one equals the saved model's token-mean NLL
    # over every eval row, computed here with plain PyTorch.
    evals = _read_jsonl(os.path.join(out, "eval.jsonl"))
    assert [e["step"] for e in evals] == [2, 3]
    _assert_eval_is_the_saved_models_nll(evals[-1], result.final_dir, sft_data)


def test_sft_eval_over_two_ranks_counts_no_lockstep_filler(sft_runs, sft_data):
    """The held-out evaluation of the 2-rank ZeRO-3 factorisation (every forward a collective): 21 rows, 8 a call
    in micro-batches of 2, so the last call's 3 micro-batches give one rank a lockstep filler, not counted. Only
    after the last step (train.eval_every=0), it equals the saved model's token-mean NLL over every eval row."""
    _, final_dir, cfg = sft_runs[EVALUATED]
    assert cfg.train.num_workers == 2 and cfg.strategy.zero_stage == 3 and cfg.train.eval_every == 0
    evals = _read_jsonl(os.path.join(cfg.train.output_dir, "eval.jsonl"))
    assert [e["step"] for e in evals] == [4]
    _assert_eval_is_the_saved_models_nll(evals[-1], final_dir, sft_data)


def _assert_eval_is_the_saved_models_nll(row, final_dir, data):
    """``row`` (an eval.jsonl row) = the token-mean NLL of the model saved in ``final_dir`` over every row of
    ``data``, computed here with plain PyTorch: its tokens counted once each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    model = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for example in _read_jsonl(data):
            nll, n = _completion_nll_and_count(model, tokenizer, example["prompt"], example["response"])
            total, count = total + float(nll), count + n
    assert row["num_tokens"] == count
    assert row["loss"] == pytest.approx(total / count, rel=LOSS_RTOL)


# ---------------------------------------------------------------------------------------------------- DPO
