"""Offline-trainer benchmark: throughput of SFT and DPO on the tiny model, and gradient exactness.

    python bench/bench_offline.py [--workdir DIR] [--steps 30]

Prints (figures, not pass/fail):
1. Gradient exactness: the full gradient vector of one global batch computed under several (micro x GA x ranks)
   factorisations with the project's own collate / objective / normalization (ranks emulated in-process and
   averaged as DeepSpeed does), compared with the whole batch in one piece. For contrast, the classic bug
   (token-mean per micro-batch, then mean of micro-batches) on the same data.
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
            rows.append({"prompt": f"{a}+{b}=", "chosen": f"{a + b} {tail(12)}".strip(),
                         "rejected": f"{a + b + 1} {tail(18)}".strip()})
        else:
            rows.append({"prompt": f"{a}+{b}=", "response": f"{a + b} {tail(18)}".strip()})
    return rows


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


# ------------------------------------------------------------------------------------------- exactness
def _flat_grad(model):
    import torch

    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None])


def gradient_exactness(model_dir, sft_rows, pair_rows, global_batch=8):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.data.plan import StepPlan
    from rlhf.data.tokenize import collate_pairs, collate_sft, tokenize_pairs, tokenize_sft
    from rlhf.objectives.dpo import DPOObjective, ReferenceLogps
    from rlhf.objectives.sft import SFTObjective
    from rlhf.ops.losses import normalize

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    sft = tokenize_sft(sft_rows, tok, max_length=64, prompt_key="prompt", response_key="response").examples
    pairs = tokenize_pairs(pair_rows, tok, max_length=64, prompt_key="prompt", chosen_key="chosen",
                           rejected_key="rejected").examples
    step = StepPlan(step=1, epoch=1, indices=list(range(global_batch)))
    with torch.no_grad():
        ref = ReferenceLogps()(model, collate_pairs(pairs[:global_batch], tok.pad_token_id))

    def collate_sft_rows(rows):
        return collate_sft([sft[i] for i in rows], tok.pad_token_id)

    def collate_pair_rows(rows):
        return collate_pairs([pairs[i] for i in rows], tok.pad_token_id, ref_logps=ref[rows])

    def grad(objective, collate, micro, ranks, naive=False):
        model.zero_grad()
        shards = [[collate(mb) for mb in rank] for rank in step.shards(ranks, micro)]
        normalizer = sum(objective.count(mb) for rank in shards for mb in rank)
        n_micro = sum(len(rank) for rank in shards)
        for rank in shards:
            for mb in rank:
                loss_sum, _ = objective.loss(model, mb)
                if naive:  # per-micro-batch mean, then mean over micro-batches
                    loss = loss_sum / objective.count(mb) / n_micro
                else:  # the project's normalization; / ranks = DeepSpeed's gradient averaging over ranks
                    loss = normalize(loss_sum, normalizer, ranks) / ranks
                loss.backward()
        return _flat_grad(model)

    factorisations = [(8, 1), (1, 1), (2, 2), (1, 2), (4, 2), (2, 4)]
    report = {}
    for name, objective, collate in (("sft", SFTObjective(), collate_sft_rows),
                                     ("dpo", DPOObjective(beta=0.1), collate_pair_rows)):
        whole = grad(objective, collate, global_batch, 1)
        worst = max(float((grad(objective, collate, m, r) - whole).norm() / whole.norm())
                    for m, r in factorisations[1:])
        naive = max(float((grad(objective, collate, m, r, naive=True) - whole).norm() / whole.norm())
                    for m, r in factorisations[1:])
        report[name] = (worst, naive)
        note = "  <- equal pairs per micro-batch, so a mean of means happens to be exact" if name == "dpo" else ""
        print(f"  {name}: worst relative gradient difference over {len(factorisations) - 1} factorisations "
              f"= {worst:.2e}   (per-micro-batch mean instead: {naive:.2e}){note}")
    return report


# ------------------------------------------------------------------------------------------- throughput
def throughput(model_dir, sft_path, pair_path, out, steps):
    from rlhf.config import DPORunConfig, SFTRunConfig, load_config
    from rlhf.distributed.cluster import init_ray
    from rlhf.trainers.dpo import train_dpo
    from rlhf.trainers.sft import train_sft

    init_ray(needed_cpus=4)
    results = {}
    trainers = (("sft", SFTRunConfig, train_sft, sft_path), ("dpo", DPORunConfig, train_dpo, pair_path))
    for trainer, cls, fn, data in trainers:
        runs = {}
        for micro, workers in ((16, 1), (4, 1), (8, 2)):
            name = f"{trainer} micro={micro} ga={16 // (micro * workers)} ranks={workers}"
            run_dir = os.path.join(out, f"{trainer}-{micro}x{workers}")
            cfg = load_config(cls, None, [
                f"model.path={model_dir}", f"data.train_path={data}", f"train.output_dir={run_dir}",
                "train.global_batch_size=16", f"train.micro_batch_size={micro}", f"train.num_workers={workers}",
                f"train.max_steps={steps}", "train.max_epochs=100", "train.lr=1e-3", "data.max_length=64",
                "strategy.zero_stage=2", "logging.tensorboard=false", "logging.print_every=1000",
                "train.save_final=false", "train.overwrite=true"])  # --workdir again: replace the last bench
            fn(cfg)
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            timed = rows[1:]
            secs = sum(r["step_time_s"] for r in timed)
            runs[name] = rows
            print(f"  {name:<34} {sum(r['num_samples'] for r in timed) / secs:8.1f} samples/s "
                  f"{sum(r['num_tokens'] for r in timed) / secs:9.1f} target tokens/s "
                  f"({secs / len(timed) * 1000:.0f} ms/step)")
        ref = next(iter(runs.values()))
        worst = max(abs(a[k] - b[k]) / abs(a[k]) for rows in runs.values() for a, b in zip(ref, rows)
                    for k in ("loss", "grad_norm"))
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

    print("== gradient exactness (fp32, one global batch of 8, uneven lengths)")
    gradient_exactness(model_dir, sft_rows, pair_rows)
    print(f"== throughput (real Ray + DeepSpeed ZeRO-2, CPU, global batch 16, {args.steps} steps)")
    started = time.time()
    throughput(model_dir, sft_path, pair_path, os.path.join(work, "runs"), args.steps)
    print(f"== done in {time.time() - started:.0f}s; work dir {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
