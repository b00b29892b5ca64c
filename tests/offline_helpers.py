"""Shared by the offline end-to-end test files (SFT, DPO, reward model): run overrides, metric rows, weight
comparisons, and plain single-process PyTorch references (no DeepSpeed, no Ray, no project loss code)."""

from __future__ import annotations

import glob
import json
import math
import os

import torch

LOSS_RTOL = 1e-5  # fp32; observed ~1e-7
ABS_TOL = 1e-5  # for quantities that are ~0
WEIGHT_RTOL = 1e-3  # Adam turns rounding noise in ~zero gradients (attention k biases) into lr-sized steps

# DPO while the policy still has the reference's weights (step 1; step 2 too after a warm-up step at LR 0; LoRA's
# frozen base as the reference), in float32. rewards/margin = (beta / P) sum_p [(pi_cp - rho_cp) - (pi_rp - rho_rp)]
# over the P pairs, pi / rho the policy's / reference's summed log-prob s = sum_t log p_t of a completion: two
# forwards of the same weights on the same tokens that differ only in batch shape (padding width, rows per forward),
# hence in GEMM blocking and reduction order, so |pi - rho| is rounding. Error model: |pi - rho| <= K u |s|, u =
# 2^-24 (float32's unit roundoff) and |s| = sum_t |log p_t| (every log p_t < 0). K measured on the tiny model and
# pair data, every pair of 1, 2, 3, 4, 8, 19 pairs per forward x 1, 2 threads: <= 2.5 for a single completion; K = 8
# is taken. Summed over the pairs with the worst signs, |margin| <= beta K u (|logps/chosen| + |logps/rejected|)
# (the logged pair means of s, the same for policy and reference up to rounding): 3.7e-5 for beta 0.5 on this data,
# where at most 0.49 beta u (|lc| + |lr|) = 1.9e-6 was seen (the signs partly cancel; 1.9e-6 is also the figure a
# fixed 1e-6 bound failed on). A policy that is not the reference's weights gives far larger margins (0.035 after one
# update at lr 2e-3 on this data). Each pair's sign (rewards/accuracy) is rounding's then: not compared at those steps.
FP32_UNIT_ROUNDOFF = 2.0**-24
SUMMED_LOGP_ROUNDING = 8  # K above


def logp_rounding(abs_logp):
    """The most two float32 forwards of the same weights, batched differently, can disagree on a summed (or mean)
    log-prob of size ``abs_logp`` (the model above)."""
    return SUMMED_LOGP_ROUNDING * FP32_UNIT_ROUNDOFF * abs_logp


def dpo_rounding_margin(row, beta):
    """The largest |rewards/margin| float32 rounding alone gives in ``row`` when policy == reference (see above)."""
    return beta * logp_rounding(abs(row["logps/chosen"]) + abs(row["logps/rejected"]))


def assert_dpo_policy_is_the_reference(row, beta, label_smoothing=0.0):
    """``row`` is a step whose policy has the reference's weights: its margin is rounding (the model above) and its
    (c)DPO loss log 2 to first order in the pairs' margins h: -(1 - eps) log sigmoid(h) - eps log sigmoid(-h) =
    log 2 - (1 - 2 eps) h / 2 + O(h^2), so |loss - log 2| <= (1 - 2 eps) / 2 x the margin bound, plus the loss's own
    float32 rounding (each pair's ~0.69 within a few u, summed over a handful of pairs: 16 u)."""
    bound = dpo_rounding_margin(row, beta)
    assert abs(row["rewards/margin"]) <= bound, (row["step"], row["rewards/margin"], bound)
    assert abs(row["loss"] - math.log(2)) <= (1 - 2 * label_smoothing) / 2 * bound + 16 * FP32_UNIT_ROUNDOFF, (
        row["step"],
        row["loss"],
        bound,
    )


def _overrides(model, data, out, gb, mbs, nw, zero, epochs=2, lr=1e-3, extra=()):
    return [
        f"model.path={model}",
        f"data.train_path={data}",
        f"train.output_dir={out}",
        f"train.global_batch_size={gb}",
        f"train.micro_batch_size={mbs}",
        f"train.num_workers={nw}",
        f"strategy.zero_stage={zero}",
        f"train.max_epochs={epochs}",
        f"train.lr={lr}",
        "train.seed=7",
        "train.warmup_steps=1",
        "data.max_length=64",
        "logging.tensorboard=false",
        *extra,
    ]


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _weights(final_dir):
    from safetensors.torch import load_file

    out = {}
    for path in glob.glob(os.path.join(final_dir, "*.safetensors")):
        out.update(load_file(path))
    return out


def _assert_same_runs(runs, keys, tight_steps=None, loose_rtol=1e-3, dpo_beta=None):
    """Same step count, samples and tokens; ``keys`` equal to float rounding for the first ``tight_steps`` steps
    (all by default) and to ``loose_rtol`` after that (training dynamics amplify rounding step by step).

    ``dpo_beta``: DPO runs. At a step where both runs' policies are still the reference (margins within rounding,
    see :func:`dpo_rounding_margin`), the margins agree to the sum of both rounding bounds, the losses to half that,
    and accuracy is not compared (each pair's sign is rounding's)."""
    (ref_name, ref_rows), *others = runs.items()
    for name, rows in others:
        assert len(rows) == len(ref_rows), f"{name}: {len(rows)} steps vs {len(ref_rows)}"
        for a, b in zip(ref_rows, rows):
            assert a["num_samples"] == b["num_samples"] and a["num_tokens"] == b["num_tokens"], (name, a, b)
            rtol = LOSS_RTOL if tight_steps is None or a["step"] <= tight_steps else loose_rtol
            rounding = [] if dpo_beta is None else [dpo_rounding_margin(r, dpo_beta) for r in (a, b)]
            at_reference = bool(rounding) and all(abs(r["rewards/margin"]) <= m for r, m in zip((a, b), rounding))
            for key in keys:
                floor = ABS_TOL
                if at_reference and key == "rewards/accuracy":
                    continue
                if at_reference and key == "rewards/margin":
                    floor = max(ABS_TOL, sum(rounding))
                if at_reference and key == "loss":  # log 2 - h / 2 to first order (assert_dpo_policy_is_the_reference)
                    floor = max(ABS_TOL, sum(rounding) / 2 + 32 * FP32_UNIT_ROUNDOFF)
                assert abs(a[key] - b[key]) <= rtol * abs(a[key]) + floor, (
                    f"{name} step {a['step']} {key}: {a[key]} vs {b[key]}"
                )


def _assert_ranks_ran_different_counts(runs):
    """The token-budget runs (names starting ``tok``) logged how each step was cut, and in at least one step the
    ranks needed different numbers of micro-batches (so lockstep fillers ran): the case the budget's exactness
    hinges on. Row-cut runs log no cut."""
    budget = {name: rows for name, rows in runs.items() if name.startswith("tok")}
    assert budget, f"no token-budget run among {sorted(runs)}"
    for name, rows in runs.items():
        if name not in budget:
            assert all("fillers" not in r and "micro_batches" not in r for r in rows), name
    for name, rows in budget.items():
        assert all(r["micro_batches"] >= 1 and r["fillers"] >= 0 for r in rows), name
        assert any(r["fillers"] > 0 for r in rows), (
            f"{name}: no step had ranks with different micro-batch counts: {[r['micro_batches'] for r in rows]}"
        )


def _assert_same_weights(dirs):
    ref = _weights(dirs[0])
    assert ref, f"no safetensors in {dirs[0]}"
    for other in dirs[1:]:
        w = _weights(other)
        assert set(w) == set(ref)
        for k in ref:
            diff = (ref[k].double() - w[k].double()).norm() / max(ref[k].double().norm().item(), 1e-12)
            assert diff < WEIGHT_RTOL, f"{other} {k}: relative weight difference {diff:.2e}"


def _plain_model(path, kind="causal"):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(7)  # same seed as train.seed: the reward head initialises identically
    if kind == "causal":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    else:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, attn_implementation="eager"
        )
    return model.train()


def _grad_norm(model):
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))


def _tokenize_whole(tokenizer, prompt, completion):
    """Independent of rlhf.data.tokenize: prompt ids, completion ids + EOS."""
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p, c


def _completion_nll_and_count(model, tokenizer, prompt, completion):
    p, c = _tokenize_whole(tokenizer, prompt, completion)
    ids = torch.tensor([p + c])
    logits = model(input_ids=ids).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits[len(p) - 1 :], ids[0, len(p) :], reduction="sum")
    return nll, len(c)


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------------- SFT
