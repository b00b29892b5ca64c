"""``make demo``: SFT then DPO on the synthetic addition task, on a local Ray cluster, CPU only.

Builds the tiny model and data locally (no hub), trains through the same Python API the CLIs use, and prints a
before/after table: held-out greedy accuracy of the base, SFT and DPO models, and each stage's first/last loss.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf.cli.demo", description=__doc__)
    ap.add_argument("--workdir", default=".assets/demo")
    ap.add_argument("--sft-epochs", type=int, default=6)
    ap.add_argument("--dpo-epochs", type=int, default=1)
    ap.add_argument("--num-workers", type=int, default=2, help="data-parallel ranks per trainer")
    args = ap.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from rlhf.cli.common import quiet_environment

    quiet_environment()
    from rlhf.cli.make_assets import make_assets
    from rlhf.config import DPORunConfig, SFTRunConfig, load_config
    from rlhf.distributed.cluster import init_ray
    from rlhf.eval.generation import accuracy
    from rlhf.synthetic.arithmetic import is_correct
    from rlhf.trainers.dpo import train_dpo
    from rlhf.trainers.sft import train_sft

    started = time.time()
    assets = make_assets(os.path.join(args.workdir, "assets"), log=print)
    eval_rows = _rows(assets["eval_prompts"])
    runs = os.path.join(args.workdir, "runs")
    init_ray(needed_cpus=2 * args.num_workers)
    common = [f"train.num_workers={args.num_workers}", "logging.print_every=10"]

    sft_cfg = load_config(SFTRunConfig, "sft_tiny", [
        f"model.path={assets['model']}", f"data.train_path={assets['sft']}", f"train.output_dir={runs}/sft",
        f"train.max_epochs={args.sft_epochs}", "train.lr=2e-3", "train.global_batch_size=32",
        "train.micro_batch_size=8", *common])
    sft = train_sft(sft_cfg)

    dpo_cfg = load_config(DPORunConfig, "dpo_tiny", [
        f"model.path={sft.final_dir}", f"data.train_path={assets['preference']}", f"train.output_dir={runs}/dpo",
        f"train.max_epochs={args.dpo_epochs}", "train.global_batch_size=32", "train.micro_batch_size=8",
        # RPO: DPO + NLL of the chosen answer; plain DPO lowers the chosen likelihood too and greedy accuracy drops.
        "dpo.nll_coef=1.0", *common])
    dpo = train_dpo(dpo_cfg)

    table = [("base (random init)", assets["model"], None), ("after SFT", sft.final_dir, runs + "/sft"),
             ("after DPO (+NLL)", dpo.final_dir, runs + "/dpo")]
    print("\n" + "=" * 78)
    print(f"{'model':<20} {'held-out accuracy':>18} {'first loss':>12} {'last loss':>12} {'steps':>7}")
    for name, model_dir, run_dir in table:
        acc = accuracy(model_dir, eval_rows, is_correct)
        first = last = steps = ""
        if run_dir:
            metrics = _rows(os.path.join(run_dir, "metrics.jsonl"))
            first, last, steps = f"{metrics[0]['loss']:.4f}", f"{metrics[-1]['loss']:.4f}", str(len(metrics))
        print(f"{name:<20} {acc:>17.1%} {first:>12} {last:>12} {steps:>7}")
    extra = _rows(os.path.join(runs, "dpo", "metrics.jsonl"))[-1]
    print(f"DPO last step: reward accuracy {extra['rewards/accuracy']:.2f}, margin {extra['rewards/margin']:.3f}")
    print(f"outputs under {runs}; total {time.time() - started:.0f}s")
    print("=" * 78)
    return 0


if __name__ == "__main__":
    sys.exit(main())
