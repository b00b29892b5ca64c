"""Offline-trainer benchmark: throughput of SFT and DPO on the tiny model, and gradient exactness.

    python bench/bench_offline.py [--workdir DIR] [--steps 30]

Prints (figures, not pass/fail):
1. Gradient exactness: the full gradient vector of one global batch, stepped by ``WorkerGroup.train_batch`` on real
   Ray ranks (DeepSpeed ZeRO-2) under several (micro x GA x ranks) factorisations and read back from the first
   AdamW update (eps = 1, so the update is -lr x gradient to first order), compared with the whole batch in one
   piece. For contrast, the classic bug (token-mean per micro-batch, then mean of micro-batches, written as an
   objective) on the same data.
2. Throughput: real Ray actors + DeepSpeed engines, samples/s and target tokens/s per factorisation (first step,
   which includes warm-up, excluded), and the worst relative difference of logged loss / grad norm between them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _uneven_rows(n, seed, pairs):
    rng = random.Random(seed)

    def tail(k):
        return " ".join(str(rng.randrange(10)) for _ in range(rng.randint(0, k)))

    rows = []
    for _ in range(n):
        a, b = rng.randrange(30), rng.randrange(30)
        if pairs:
            rows.append(
                {
                    "prompt": f"{a}+{b}=",
                    "chosen": f"{a + b} {tail(12)}".strip(),
                    "rejected": f"{a + b + 1} {tail(18)}".strip(),
                }
            )
        else:
            rows.append({"prompt": f"{a}+{b}=", "response": f"{a + b} {tail(18)}".strip()})
    return rows


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


# ------------------------------------------------------------------------------------------- exactness
@dataclass(frozen=True)
class PerMicroBatchMean:
    """The classic bug as an objective: ``inner``'s mean over each micro-batch, then the mean over the global
    batch's micro-batches (``count`` is 1 a micro-batch, so the group divides the summed means by their number)."""

    inner: Any

    def count(self, batch) -> int:
        return 1

    def loss(self, model, batch):
        loss_sum, sums = self.inner.loss(model, batch)
        return loss_sum / self.inner.count(batch), sums

    def finalize(self, sums, normalizer):
        return {}


def _weights(directory):
    """Every tensor of an HF model directory (safetensors), flattened in name order, float64."""
    import torch
    from safetensors.torch import load_file

    state = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(directory, name)))
    return torch.cat([state[k].reshape(-1).double() for k in sorted(state)])


def gradient_exactness(model_dir, sft_rows, pair_rows, out, global_batch=8):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.data.tokenize import collate_pairs, collate_sft, tokenize_pairs, tokenize_sft
    from rlhf.distributed.cluster import actor_env
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.group import GroupResources, WorkerGroup
    from rlhf.models.loading import ModelSpec
    from rlhf.objectives.dpo import DPOObjective, ReferenceLogps
    from rlhf.objectives.sft import SFTObjective

    tok = AutoTokenizer.from_pretrained(model_dir)
    sft = tokenize_sft(
        sft_rows[:global_batch], tok, max_length=64, prompt_key="prompt", response_key="response"
    ).examples
    pairs = tokenize_pairs(
        pair_rows[:global_batch], tok, max_length=64, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected"
    ).examples
    pair_batch = collate_pairs(pairs, tok.pad_token_id)
    with torch.no_grad():  # the reference is the initial policy
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        pair_batch = pair_batch.replace(ref_logps=ReferenceLogps()(model, pair_batch))
    initial = _weights(model_dir)
    # AdamW's first update is -lr * g / (|g| + eps) per weight (bias-corrected moments: m = g, sqrt(v) = |g|); with
    # eps = 1 >> |g| it is -lr * g to first order, so the weights after one step give the gradient back. No clipping.
    optim = OptimSpec(lr=100.0, total_steps=1, eps=1.0, max_grad_norm=0.0)
    groups = {
        n: WorkerGroup(
            f"bench-{n}rank", GroupResources(num_workers=n, cpus_per_worker=0.5, env_vars=actor_env(0)), "gloo"
        )
        for n in (1, 2, 4)
    }

    def update(objective, batch, micro, ranks):
        """The weights' change after one ``train_batch`` of the global batch under (micro x GA x ranks)."""
        group, saved = groups[ranks], os.path.join(out, "exactness")
        group.build(
            ModelSpec(path=model_dir), EngineSpec.for_global_batch(global_batch, micro, ranks, zero_stage=2), optim
        )
        group.train_batch(batch, objective)
        group.save_pretrained(saved)
        return _weights(saved) - initial

    factorisations = [(8, 1), (1, 1), (2, 2), (1, 2), (4, 2), (2, 4)]  # (micro, ranks); GA = 8 / (micro x ranks)
    report = {}
    try:
        for name, objective, batch in (
            ("sft", SFTObjective(), collate_sft(sft, tok.pad_token_id)),
            ("dpo", DPOObjective(beta=0.1), pair_batch),
        ):
            whole = update(objective, batch, *factorisations[0])
            worst = max(
                float((update(objective, batch, m, r) - whole).norm() / whole.norm()) for m, r in factorisations[1:]
            )
            naive = max(
                float((update(PerMicroBatchMean(objective), batch, m, r) - whole).norm() / whole.norm())
                for m, r in factorisations[1:]
            )
            report[name] = (worst, naive)
            note = "  <- equal pairs per micro-batch, so a mean of means happens to be exact" if name == "dpo" else ""
            print(
                f"  {name}: worst relative gradient difference over {len(factorisations) - 1} factorisations "
                f"= {worst:.2e}   (per-micro-batch mean instead: {naive:.2e}){note}",
                flush=True,
            )
    finally:
        for group in groups.values():
            group.shutdown()
    return report


# ------------------------------------------------------------------------------------------- throughput
def throughput(model_dir, sft_path, pair_path, out, steps):
    from rlhf.config import DPORunConfig, SFTRunConfig, load_config
    from rlhf.trainers.offline.dpo import train_dpo
    from rlhf.trainers.offline.sft import train_sft

    results = {}
    trainers = (("sft", SFTRunConfig, train_sft, sft_path), ("dpo", DPORunConfig, train_dpo, pair_path))
    for trainer, cls, fn, data in trainers:
        runs = {}
        for micro, workers in ((16, 1), (4, 1), (8, 2)):
            name = f"{trainer} micro={micro} ga={16 // (micro * workers)} ranks={workers}"
            run_dir = os.path.join(out, f"{trainer}-{micro}x{workers}")
            cfg = load_config(
                cls,
                None,
                [
                    f"model.path={model_dir}",
                    f"data.train_path={data}",
                    f"train.output_dir={run_dir}",
                    "train.global_batch_size=16",
                    f"train.micro_batch_size={micro}",
                    f"train.num_workers={workers}",
                    f"train.max_steps={steps}",
                    "train.max_epochs=100",
                    "train.lr=1e-3",
                    "data.max_length=64",
                    "strategy.zero_stage=2",
                    "logging.tensorboard=false",
                    "logging.print_every=1000",
                    "train.save_final=false",
                    "train.overwrite=true",
                ],
            )  # --workdir again: replace the last bench
            fn(cfg)
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            timed = rows[1:]
            secs = sum(r["step_time_s"] for r in timed)
            runs[name] = rows
            print(
                f"  {name:<34} {sum(r['num_samples'] for r in timed) / secs:8.1f} samples/s "
                f"{sum(r['num_tokens'] for r in timed) / secs:9.1f} target tokens/s "
                f"({secs / len(timed) * 1000:.0f} ms/step)"
            )
        ref = next(iter(runs.values()))
        worst = max(
            abs(a[k] - b[k]) / abs(a[k])
            for rows in runs.values()
            for a, b in zip(ref, rows)
            for k in ("loss", "grad_norm")
        )
        print(f"  {trainer}: worst relative difference of logged loss/grad_norm across factorisations: {worst:.2e}")
        results[trainer] = worst
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="rlhf-bench-")
    from rlhf.cli.common import quiet_environment

    quiet_environment()
    from rlhf.models.tiny import build_tiny_model

    model_dir = os.path.join(work, "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_tiny_model(model_dir, seed=0)
    sft_rows, pair_rows = _uneven_rows(512, 1, pairs=False), _uneven_rows(512, 2, pairs=True)
    sft_path = _write(os.path.join(work, "sft.jsonl"), sft_rows)
    pair_path = _write(os.path.join(work, "pairs.jsonl"), pair_rows)

    from rlhf.distributed.cluster import init_ray

    init_ray(needed_cpus=4)
    started = time.time()
    print("== gradient exactness (fp32, ZeRO-2, one global batch of 8, uneven lengths; WorkerGroup.train_batch)")
    gradient_exactness(model_dir, sft_rows, pair_rows, work)
    print(f"== throughput (real Ray + DeepSpeed ZeRO-2, CPU, global batch 16, {args.steps} steps)")
    throughput(model_dir, sft_path, pair_path, os.path.join(work, "runs"), args.steps)
    print(f"== done in {time.time() - started:.0f}s; work dir {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
