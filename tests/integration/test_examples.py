"""The custom-loop examples (examples/custom_rl_loop.py, examples/custom_loop.py) run end to end, short, on the
session's Ray cluster, and what they print is what they claim: the RL loop's weight syncs land, the preference
loop's logged metrics are global-batch numbers."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from offline_helpers import logp_rounding
from shared_helpers import load_example

pytestmark = pytest.mark.usefixtures("ray_session")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load_example(name: str):
    return load_example(EXAMPLES / f"{name}.py", f"example_{name}")


def test_custom_rl_loop_weight_syncs_land(tmp_path, capsys):
    example = _load_example("custom_rl_loop")
    history = example.main(
        steps=3, prompts_per_step=4, samples_per_prompt=4, micro_batch_size=8, work_dir=str(tmp_path)
    )
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:
        assert math.isfinite(h["loss"]) and h["grad_norm"] > 0 and 0 <= h["reward"] <= 1
        # steps 2 and 3 sample with the weights the previous step pushed: the trainer's log-probs of the very same
        # tokens agree with vLLM's only if that sync landed (one AdamW step at lr 2e-3 moves them by ~0.2 on average)
        assert h["logp_mismatch"] < 1e-5, h
    assert capsys.readouterr().out.splitlines()[-1].startswith("done: reward ")


def test_custom_preference_loop_logs_global_metrics(tmp_path):
    """Step 1 trains on the initial weights, so its logged metrics must be the example's objective over the whole
    global batch of 16 pairs computed here in one piece (the run cut it into 2 ranks x 2 micro-batches of 4)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.data.tokenize import collate_pairs
    from rlhf.objectives.base import host_sums

    example = _load_example("custom_loop")
    out = example.main(steps=2, num_workers=2, micro_batch_size=4, grad_accum_steps=2, work_dir=str(tmp_path))
    history, (before, after) = out["history"], out["eval"]
    assert len(history) == 2 and all(math.isfinite(v) for h in history for v in h.values())
    assert os.path.exists(os.path.join(out["final"], "config.json"))

    tokenizer = AutoTokenizer.from_pretrained(out["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(out["model_dir"], dtype=torch.float32).eval()
    objective = example.MeanLogpPreference()
    first = collate_pairs(example.preference_pairs(tokenizer, 2 * 16, seed=0)[:16], tokenizer.pad_token_id)
    held_out = collate_pairs(example.preference_pairs(tokenizer, 64, seed=1), tokenizer.pad_token_id)
    with torch.no_grad():
        for logged, batch in ((history[0], first), (before, held_out)):
            _, sums = objective.loss(model, batch)
            want = objective.finalize(host_sums(sums), objective.count(batch))
            # margin = beta (mean logp_c - mean logp_r) cancels: float32 rounding (the run's forwards are batched
            # differently from this one) moves it by up to beta x the rounding of both mean log-probs (the error model
            # of offline_helpers), whatever its size, and the loss (softplus(gamma - margin), slope <= 1) as much;
            # the pairs' mean logp_r is logp/chosen - margin / beta.
            chosen = want["logp/chosen"]
            rejected = chosen - want["margin"] / objective.beta
            rounding = objective.beta * logp_rounding(abs(chosen) + abs(rejected))
            floors = {"margin": rounding, "loss": rounding}
            for key, value in want.items():
                assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-6 + floors.get(key, 0.0)), key
    assert after != before  # the held-out numbers after training come from the trained weights
