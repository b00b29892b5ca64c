"""DPO end to end on real Ray actors + real DeepSpeed engines: one global batch split as (micro x GA x ranks)
under different ZeRO stages and reference modes (precomputed by the policy's own ranks or by a group of its own,
scored online by a group of 1 or 2 ranks) logs the same numbers and ends with the same weights; step 1 equals a
plain PyTorch computation over the whole batch. (SFT: test_offline_training.py.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import List

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
    assert_dpo_policy_is_the_reference,
)
from shared_helpers import tee_stdout

from rlhf.config.loader import load_config
from rlhf.config.schema import DPORunConfig
from rlhf.data.plan import EpochPlan

pytestmark = pytest.mark.usefixtures("ray_session")


DPO_FACTORISATIONS = {  # name: (micro, ranks, zero, ref_mode, reference ranks[, overrides]); global batch 4
    # the starting policy precomputed: its own ranks score it, no reference group (0 ranks)
    "4x1x1-z2-pre": (4, 1, 2, "precompute", 0),
    # online, the reference held in the policy's processes (dpo.ref_num_workers=0): a frozen ZeRO-3 copy beside the
    # training engine on each of the 2 ranks, no reference group
    # training with it in host memory (dpo.ref_offload), woken to score each step's batch and the held-out pairs
    "1x2x2-z3-online-held": (1, 2, 3, "online", 0, ("dpo.ref_num_workers=0", "dpo.ref_offload=true")),
    # another model.ref_path (a copy of the same weights): precomputed on 2 reference ranks, then released
    "2x1x2-z0-pre": (2, 2, 0, "precompute", 2),
    # padding-free pairs (chosen + rejected) in micro-batches of <= 80 tokens, the reference scored the same way;
    # in step 4 one rank needs a micro-batch fewer than the other (a lockstep filler)
    "tok80-packed-x2-z3-online": (1, 2, 3, "online", 2, ("train.packing=true", "train.max_tokens_per_micro_batch=80")),
}


@contextlib.contextmanager
def recording_roles():
    """The roles of every plan the offline runs start (``start_plan``, observed), one sorted list a run."""
    from rlhf.trainers.offline import loop

    started: List[List[str]] = []
    real_start_plan = loop.start_plan

    def recorded(plan, *args, **kwargs):
        started.append(sorted({a.role for a in plan.actors}))
        return real_start_plan(plan, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "start_plan", recorded)
        yield started


@pytest.fixture(scope="module")
def dpo_runs(tiny_model, pair_data, tmp_path_factory):
    from rlhf.trainers.offline.dpo import train_dpo

    base = tmp_path_factory.mktemp("dpo")
    reference_copy = shutil.copytree(tiny_model, base / "reference")  # another path, the same weights
    runs = {}
    with recording_roles() as started:
        for name, (mbs, nw, zero, mode, ref_ranks, *more) in DPO_FACTORISATIONS.items():
            out = str(base / name)
            reference = (f"dpo.ref_num_workers={ref_ranks}",) if ref_ranks else ()
            if mode == "precompute" and ref_ranks:
                reference += (f"model.ref_path={reference_copy}",)
            extra = (
                f"dpo.ref_mode={mode}",
                "dpo.beta=0.5",
                "dpo.label_smoothing=0.1",
                *reference,
                f"data.eval_path={pair_data}",
                *(more[0] if more else ()),
            )
            cfg = load_config(
                DPORunConfig,
                overrides=_overrides(tiny_model, pair_data, out, 4, mbs, nw, zero, epochs=1, extra=extra),
            )
            with tee_stdout() as printed:
                result = train_dpo(cfg)
            runs[name] = (_rows(out), result.final_dir, cfg, started[-1], printed.getvalue())
    return runs


def test_dpo_factorisations_and_reference_modes_agree(dpo_runs):
    roles = {name: v[3] for name, v in dpo_runs.items()}
    assert roles == {
        name: ["policy", "reference"] if ref_ranks else ["policy"]
        for name, (_, _, _, _, ref_ranks, *_) in DPO_FACTORISATIONS.items()
    }
    rows = {k: v[0] for k, v in dpo_runs.items()}
    # the offloaded copy (dpo.ref_offload) said once what each of its 2 ranks moved: it agrees below all the same
    offloaded = {k: v[4].count("[dpo] reference offload: 2 x ") for k, v in dpo_runs.items()}
    assert offloaded == {k: int(k == "1x2x2-z3-online-held") for k in dpo_runs}
    _assert_same_runs(rows, ("loss", "grad_norm", "rewards/margin", "rewards/accuracy"), dpo_beta=0.5)
    _assert_ranks_ran_different_counts(rows)
    assert len(next(iter(rows.values()))) == 19 // 4  # drop_last at global-batch granularity
    _assert_same_weights([v[1] for v in dpo_runs.values()])
    # Held-out evaluation after the last step: reference log-probs precomputed or scored online, same numbers.
    evals = [_read_jsonl(os.path.join(cfg.train.output_dir, "eval.jsonl")) for _, _, cfg, _, _ in dpo_runs.values()]
    assert all([e["step"] for e in ev] == [4] for ev in evals)
    for ev in evals[1:]:
        assert ev[0]["loss"] == pytest.approx(evals[0][0]["loss"], rel=1e-3)  # weights agree to ~1e-4
        assert ev[0]["rewards/accuracy"] == evals[0][0]["rewards/accuracy"]
    # every held-out pair counted once (19 pairs over 2 ranks: the lockstep filler batch is not counted)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(next(iter(dpo_runs.values()))[2].model.path)
    expected_tokens = sum(
        len(tokenizer(r[k], add_special_tokens=False)["input_ids"]) + 1
        for r in _read_jsonl(next(iter(dpo_runs.values()))[2].data.eval_path)
        for k in ("chosen", "rejected")
    )
    assert all(ev[0]["num_tokens"] == expected_tokens for ev in evals)


def test_dpo_step1_equals_plain_pytorch_whole_batch(dpo_runs, tiny_model, pair_data):
    """Policy == reference at step 1, so the cDPO loss is log 2 (up to float32 rounding) and the gradient is
    -(beta/2)(1-2 eps) x mean over pairs of grad(chosen - rejected log-probs); checked against plain PyTorch."""
    rows, _, cfg, _, _ = dpo_runs["1x2x2-z3-online-held"]
    assert_dpo_policy_is_the_reference(rows[0], cfg.dpo.beta, cfg.dpo.label_smoothing)
    # the starting policy's own ranks scored the reference before the first step: its weights, to rounding
    precomputed_on_policy = dpo_runs["4x1x1-z2-pre"][0][0]
    assert_dpo_policy_is_the_reference(precomputed_on_policy, cfg.dpo.beta, cfg.dpo.label_smoothing)
    beta, eps = cfg.dpo.beta, cfg.dpo.label_smoothing

    def cdpo(c, r, n_c, n_r):  # ref = policy: the log-ratios' value is 0, their gradient the policy's
        h = beta * (c - r - c.detach() + r.detach())
        return -(1 - eps) * torch.nn.functional.logsigmoid(h) - eps * torch.nn.functional.logsigmoid(-h)

    _, grad_norm, _ = _plain_step_one(tiny_model, pair_data, cfg, cdpo)
    assert rows[0]["grad_norm"] == pytest.approx(grad_norm, rel=LOSS_RTOL)


# ----------------------------------------------------------------------------------------- reference-free
REFERENCE_FREE_RUNS = {  # name: (loss_type, micro, ranks, zero[, overrides]); global batch 4, 4 steps
    "4x1x1-z2-simpo": ("simpo", 4, 1, 2),
    # padding-free pairs in micro-batches of <= 80 tokens on ZeRO 3, label smoothing and a tuned gamma
    "tok80-packed-x2-z3-simpo": ("simpo", 1, 2, 3, ("train.packing=true", "train.max_tokens_per_micro_batch=80")),
    "2x1x2-z0-orpo": ("orpo", 2, 2, 0),
}


@pytest.fixture(scope="module")
def reference_free_runs(tiny_model, pair_data, tmp_path_factory):
    """SimPO whole and split, ORPO split; every run records the roles it started."""
    from rlhf.trainers.offline.dpo import train_dpo

    base = tmp_path_factory.mktemp("reference_free")
    runs = {}
    with recording_roles() as started:
        for name, (loss_type, mbs, nw, zero, *more) in REFERENCE_FREE_RUNS.items():
            out = str(base / name)
            extra = (f"dpo.loss_type={loss_type}", f"data.eval_path={pair_data}", *(more[0] if more else ()))
            if loss_type == "simpo":
                extra += ("dpo.label_smoothing=0.1", "dpo.simpo_gamma=0.5")
            cfg = load_config(
                DPORunConfig, overrides=_overrides(tiny_model, pair_data, out, 4, mbs, nw, zero, epochs=1, extra=extra)
            )
            result = train_dpo(cfg)
            runs[name] = (_rows(out), result.final_dir, cfg, started[-1])
    return runs


def test_reference_free_runs_start_no_reference_and_split_as_the_whole(reference_free_runs):
    assert all(roles == ["policy"] for *_, roles in reference_free_runs.values())
    simpo = {k: v for k, v in reference_free_runs.items() if k.endswith("simpo")}
    rows = {k: v[0] for k, v in simpo.items()}
    _assert_same_runs(rows, ("loss", "grad_norm", "rewards/margin", "rewards/accuracy", "logps/chosen"))
    _assert_ranks_ran_different_counts(rows)
    assert len(next(iter(rows.values()))) == 19 // 4
    _assert_same_weights([v[1] for v in simpo.values()])
    evals = [_read_jsonl(os.path.join(cfg.train.output_dir, "eval.jsonl")) for _, _, cfg, _ in simpo.values()]
    assert evals[0][0]["loss"] == pytest.approx(evals[1][0]["loss"], rel=1e-3)


def _plain_step_one(tiny_model, pair_data, cfg, pair_loss):
    """Step 1's loss, gradient norm and mean token-averaged chosen NLL in plain PyTorch: ``pair_loss(chosen_sum,
    rejected_sum, chosen_count, rejected_count)`` over the step's pairs (the EpochPlan's), averaged over the global
    batch of 4."""
    from transformers import AutoTokenizer

    plan = EpochPlan(num_samples=19, global_batch_size=4, max_epochs=1, seed=cfg.train.seed)
    data = _read_jsonl(pair_data)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = _plain_model(tiny_model)
    total, chosen_nll = 0.0, 0.0
    for i in plan.step(1).indices:
        nll_c, n_c = _completion_nll_and_count(model, tokenizer, data[i]["prompt"], data[i]["chosen"])
        nll_r, n_r = _completion_nll_and_count(model, tokenizer, data[i]["prompt"], data[i]["rejected"])
        total = total + pair_loss(-nll_c, -nll_r, n_c, n_r)
        chosen_nll += nll_c.item() / n_c
    (total / 4).backward()
    return float(total) / 4, _grad_norm(model), chosen_nll / 4


def test_simpo_and_orpo_step_one_are_the_papers_losses_in_plain_pytorch(reference_free_runs, tiny_model, pair_data):
    logsigmoid = torch.nn.functional.logsigmoid

    def simpo(c, r, n_c, n_r):  # Meng et al. 2024, eq. 6 (beta 2, the paper's), soft label 0.1, gamma 0.5
        z = 2.0 * c / n_c - 2.0 * r / n_r - 0.5
        return -0.9 * logsigmoid(z) - 0.1 * logsigmoid(-z)

    def orpo(c, r, n_c, n_r):  # Hong et al. 2024, eq. 6-7: chosen NLL + 0.1 x -log sigmoid(log odds ratio)
        odds = [a - torch.log(-torch.expm1(a)) for a in (c / n_c, r / n_r)]
        return -c / n_c - 0.1 * logsigmoid(odds[0] - odds[1])

    for name, pair_loss in (("tok80-packed-x2-z3-simpo", simpo), ("2x1x2-z0-orpo", orpo)):
        rows, _, cfg, _ = reference_free_runs[name]
        loss, grad_norm, chosen_nll = _plain_step_one(tiny_model, pair_data, cfg, pair_loss)
        assert rows[0]["loss"] == pytest.approx(loss, rel=LOSS_RTOL), name
        assert rows[0]["grad_norm"] == pytest.approx(grad_norm, rel=LOSS_RTOL), name
        if name.endswith("orpo"):  # its SFT term, logged apart
            assert rows[0]["nll/chosen"] == pytest.approx(chosen_nll, rel=LOSS_RTOL)
        else:
            assert "nll/chosen" not in rows[0]


# ---------------------------------------------------------------------------------------------------- RM
