"""``bench/bench_step.py --device cpu``: the step benchmark's CPU twin runs every trainer against the plain loop and
reports figures that agree with each other (tokens/s with s/step, MFU with the model's FLOPs)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.utils.flops import ModelFlops

ROOT = Path(__file__).resolve().parents[2]
SEQ, MICRO, GA, PEAK = 32, 2, 2, 0.5
# Next to another busy test process, the twin's tiny steps on two threads (its default: all cores) took up to 100x
# as long as on one (OpenMP threads waiting on each other): 20 s a run against 5 s.
ONE_THREAD = ["--threads", "1"]


def test_cpu_twin(tiny_model, tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    args = ["--device", "cpu", "--model", tiny_model, "--seq", str(SEQ), "--micro", str(MICRO), "--ga", str(GA)]
    args += ["--steps", "1", "--zero-stage", "2", "--peak-tflops", str(PEAK), "--json", str(out), *ONE_THREAD]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_step.py"), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    systems = {(r["trainer"], r["system"]) for r in rows}
    for trainer in ("sft", "dpo", "rl"):
        assert {(trainer, "plain-fp32"), (trainer, "rlhf-zero2")} <= systems
    assert {("logprob", "plain-fp32"), ("logprob", "rlhf-ref")} <= systems
    assert "| trainer | system" in done.stdout and "MFU = sum_rows" in done.stdout

    flops = ModelFlops.of(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    for row in rows:
        assert row["s_per_step"] > 0 and math.isfinite(row["s_per_step"])
        rows_per_step = MICRO * GA * (2 if row["trainer"] == "dpo" else 1)
        assert row["tokens_per_s"] * row["s_per_step"] == pytest.approx(rows_per_step * SEQ)
        # uniform rows of SEQ tokens: the MFU is the model FLOPs of those rows over the step time and the peak
        step_flops = flops.flops([SEQ] * rows_per_step, training=row["trainer"] != "logprob")
        assert row["mfu"] == pytest.approx(step_flops / row["s_per_step"] / (PEAK * 1e12))
        assert row["peak_gib"] is None  # no device memory on a CPU
    first = {r["trainer"]: r for r in rows if r["system"] == "plain-fp32"}
    for row in rows:
        assert row["vs_plain"] == pytest.approx(first[row["trainer"]]["s_per_step"] / row["s_per_step"])


def test_cpu_twin_packed_under_a_token_budget(tiny_model, tmp_path):
    """``--packing --max-tokens``: the trainer rank cuts each step as a run under train.max_tokens_per_micro_batch
    does; long-tailed rows count their real tokens only, the same for the plain loop and the rank."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    args = ["--device", "cpu", "--model", tiny_model, "--seq", "64", "--micro", "4", "--ga", "2", "--steps", "1"]
    args += ["--trainers", "sft", "--zero-stage", "1", "--rows", "longtail", "--packing", "--max-tokens", "96"]
    args += ONE_THREAD
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_step.py"), *args, "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plain, rank = json.loads(out.read_text())
    assert (plain["system"], rank["system"]) == ("plain-fp32", "rlhf-zero1-packed-tok96")
    assert rank["tokens_per_s"] * rank["s_per_step"] == pytest.approx(plain["tokens_per_s"] * plain["s_per_step"])
    assert rank["tokens_per_s"] * rank["s_per_step"] < 8 * 64  # long-tailed: fewer real tokens than 8 full rows


def _bench_step():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_step_module", ROOT / "bench" / "bench_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["uniform", "longtail"])
def test_every_rl_and_dpo_row_has_a_response_to_train_on_however_short(kind):
    """The RL and DPO rows' prompt is 16 tokens, or half a row of fewer than 32 (``--seq 16`` on the host-bound CPU
    model once gave the RL update no target token at all, and DPO a loss of empty responses)."""
    bench = _bench_step()
    for seq in (2, 16, 33, 1024):
        for trainer in ("dpo", "rl"):
            batch = bench.make_batch(trainer, 8, seq, 50, kind, seed=0)
            targets = batch.loss_mask[..., 1:].sum(-1)
            assert (targets > 0).all() and (targets < batch.attention_mask.sum(-1)).all(), (seq, trainer)
    with pytest.raises(SystemExit):
        bench.main(["--seq", "1"])


def test_the_gpu_session_script_is_valid_bash_and_asks_only_for_existing_options():
    """``bench/gpu_session.sh`` runs on a lent GPU, where a typo costs device time: every ``--option`` it passes is
    one that ``bench_step.py`` or ``gpu_check.py`` defines."""
    import re

    script = ROOT / "bench" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    defined = set()
    for name in ("bench_step.py", "gpu_check.py"):
        defined |= set(re.findall(r'add_argument\(\s*"(--[a-z-]+)"', (ROOT / "bench" / name).read_text()))
    used = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", script.read_text()))
    pip_flags = {"--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target"}
    assert used - pip_flags and used - pip_flags <= defined, sorted(used - pip_flags - defined)
