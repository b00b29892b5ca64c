"""KTO (``train_dpo`` with ``dpo.loss_type=kto``) end to end on real Ray actors and DeepSpeed engines, in float64.

One global batch split as (micro x GA x ranks), or packed under a token budget, with the reference precomputed or
scored online on 1 or 2 reference ranks or held in the policy's processes (``dpo.ref_num_workers=0``), logs the same
numbers to 1e-10 at every step (loss, the KL reference point
z_0, grad norm, rewards) and ends with the same weights; step 1 equals a float64 computation written from the paper,
with z_0 averaged over the whole global batch. The reference is another tiny model, so r and z_0 are not 0 from the
first step.
"""

from __future__ import annotations

import os

import pytest
import torch
from offline_helpers import _assert_ranks_ran_different_counts, _grad_norm, _read_jsonl, _rows, _tokenize_whole
from shared_helpers import uneven_unpaired_rows, write_jsonl

from rlhf.config.loader import load_config
from rlhf.config.schema import DPORunConfig
from rlhf.data.plan import EpochPlan

pytestmark = pytest.mark.usefixtures("ray_session")

ROWS, GLOBAL_BATCH, BETA, UNDESIRABLE_WEIGHT = 19, 4, 0.5, 2.0
# float64 summation order (micro-batch shapes, packed vs padded kernels, the all-reduce): the bound
FP64_RTOL = 1e-10
FP64_WEIGHT_ATOL = 1e-12  # max |w - w_first| after 4 AdamW steps (weights O(0.02-1))

KTO_FACTORISATIONS = {  # name: (micro, ranks, ref_mode, reference ranks (0: held), overrides); global batch 4
    "4x1x1-pre-held": (4, 1, "precompute", 0, ()),  # held by the policy's rank, dropped after the precompute
    "1x2x2-online": (1, 2, "online", 1, ()),
    "2x1x2-pre": (2, 2, "precompute", 2, ()),
    # both sequences of a row (its own, its mismatched) packed, <= 72 tokens a micro-batch (rows hold 24-60):
    # in steps 2 and 3 one rank needs a micro-batch more than the other, a lockstep filler runs; the held reference
    # in host memory while the policy trains (dpo.ref_offload), woken by each step's score and the evaluation's
    "tok72-packed-x2-online-held": (
        1,
        2,
        "online",
        0,
        ("train.packing=true", "train.max_tokens_per_micro_batch=72", "dpo.ref_offload=true"),
    ),
}


@pytest.fixture(scope="module")
def kto_data(tmp_path_factory):
    base = tmp_path_factory.mktemp("kto_data")
    train = write_jsonl(base / "train.jsonl", uneven_unpaired_rows(ROWS, seed=4))
    held_out = write_jsonl(base / "eval.jsonl", uneven_unpaired_rows(7, seed=5))
    return train, held_out


@pytest.fixture(scope="module")
def other_tiny_model(tmp_path_factory):
    """The reference: the tiny architecture and tokenizer with other weights."""
    from rlhf.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("kto_ref") / "tiny"), seed=1)


@pytest.fixture(scope="module")
def kto_runs(tiny_model, other_tiny_model, kto_data, tmp_path_factory):
    from rlhf.trainers.offline.dpo import train_dpo

    base, (train, held_out) = tmp_path_factory.mktemp("kto"), kto_data
    runs = {}
    for name, (micro, ranks, mode, ref_ranks, more) in KTO_FACTORISATIONS.items():
        out = str(base / name)
        overrides = [
            f"model.path={tiny_model}",
            f"model.ref_path={other_tiny_model}",
            f"data.train_path={train}",
            f"data.eval_path={held_out}",
            f"train.output_dir={out}",
            f"train.global_batch_size={GLOBAL_BATCH}",
            f"train.micro_batch_size={micro}",
            f"train.num_workers={ranks}",
            "train.max_epochs=1",
            "train.lr=1e-3",
            "train.seed=7",
            "data.max_length=64",
            "logging.tensorboard=false",
            "strategy.precision=fp64",
            "strategy.zero_stage=0",
            "dpo.loss_type=kto",
            f"dpo.beta={BETA}",
            f"dpo.undesirable_weight={UNDESIRABLE_WEIGHT}",
            f"dpo.ref_mode={mode}",
            f"dpo.ref_num_workers={ref_ranks}",
            *more,
        ]
        cfg = load_config(DPORunConfig, overrides=overrides)
        result = train_dpo(cfg)
        runs[name] = (_rows(out), result.final_dir, cfg)
    return runs


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def _weights64(final_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(final_dir, "model.safetensors"))


def test_kto_factorisations_agree_in_float64(kto_runs):
    (first_name, (first, first_dir, first_cfg)), *others = kto_runs.items()
    assert len(first) == ROWS // GLOBAL_BATCH
    keys = ("loss", "kl", "grad_norm", "rewards/desirable", "rewards/undesirable", "logps/desirable")
    worst = {k: 0.0 for k in keys}
    for name, (rows, _, _) in others:
        assert len(rows) == len(first), name
        for a, b in zip(first, rows):
            assert (a["num_samples"], a["num_tokens"]) == (b["num_samples"], b["num_tokens"]), (name, a, b)
            for key in keys:
                if key in a or key in b:
                    worst[key] = max(worst[key], _rel(b[key], a[key]))
    print(f"[kto fp64] {len(others)} layouts vs {first_name}, max rel diff per metric: {worst}")
    assert all(v <= FP64_RTOL for v in worst.values()), worst
    # nothing vanished: a real gradient, and the KL reference point above its clamp at 0 at some step
    assert all(r["grad_norm"] > 1e-3 for r in first) and max(r["kl"] for r in first) > 1e-3, first
    _assert_ranks_ran_different_counts({name: rows for name, (rows, _, _) in kto_runs.items()})

    ref_weights = _weights64(first_dir)
    assert next(iter(ref_weights.values())).dtype == torch.float64
    gap = max(float((w - ref_weights[k]).abs().max()) for _, (_, d, _) in others for k, w in _weights64(d).items())
    print(f"[kto fp64] final weights max |diff| {gap:.1e}")
    assert gap <= FP64_WEIGHT_ATOL

    evals = [_read_jsonl(os.path.join(cfg.train.output_dir, "eval.jsonl"))[-1] for _, _, cfg in kto_runs.values()]
    for ev in evals[1:]:
        for key in ("loss", "kl"):
            assert _rel(ev[key], evals[0][key]) <= FP64_RTOL, (key, ev, evals[0])
        assert ev["num_tokens"] == evals[0]["num_tokens"]


def _logp(model, tokenizer, prompt: str, completion: str) -> torch.Tensor:
    """log pi(completion | prompt) summed over the completion's tokens (+ EOS), one row, no padding."""
    p, c = _tokenize_whole(tokenizer, prompt, completion)
    ids = torch.tensor([p + c])
    logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(p) :, None]).sum()


def test_kto_step1_equals_the_paper_in_float64(kto_runs, tiny_model, other_tiny_model, kto_data):
    """Ethayarajh et al. 2024, eq. 7 with z_0 from mismatched pairs (sec. 4.1), written out for step 1's global
    batch: row i's KL term takes the completion of row (i + n // 2) mod n of the dataset (every row is kept)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows, _, cfg = kto_runs["1x2x2-online"]
    data = _read_jsonl(kto_data[0])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)  # noqa: E731
    policy, reference = load(tiny_model).train(), load(other_tiny_model).eval()
    batch = EpochPlan(num_samples=ROWS, global_batch_size=GLOBAL_BATCH, max_epochs=1, seed=cfg.train.seed).step(1)

    def logratio(i: int, j: int) -> torch.Tensor:  # prompt of row i, completion of row j
        with torch.no_grad():
            ref = _logp(reference, tokenizer, data[i]["prompt"], data[j]["completion"])
        return _logp(policy, tokenizer, data[i]["prompt"], data[j]["completion"]) - ref

    with torch.no_grad():
        z0 = torch.stack([logratio(i, (i + ROWS // 2) % ROWS) for i in batch.indices]).mean().clamp(min=0)
    losses = []
    for i in batch.indices:
        r = logratio(i, i)
        if data[i]["label"]:
            losses.append(1.0 - torch.sigmoid(BETA * (r - z0)))
        else:
            losses.append(UNDESIRABLE_WEIGHT - UNDESIRABLE_WEIGHT * torch.sigmoid(BETA * (z0 - r)))
    total = torch.stack(losses).mean()
    total.backward()
    loss = float(total.detach())
    run = f"run loss {rows[0]['loss']!r} kl {rows[0]['kl']!r}"
    print(f"[kto fp64] step 1: {run}; paper loss {loss!r} z0 {float(z0)!r}")
    assert float(z0) > 0
    assert _rel(rows[0]["kl"], float(z0)) <= FP64_RTOL
    assert _rel(rows[0]["loss"], loss) <= FP64_RTOL
    assert _rel(rows[0]["grad_norm"], _grad_norm(policy)) <= FP64_RTOL
