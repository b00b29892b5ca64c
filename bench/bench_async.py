"""Asynchronous RL benchmark: the same GRPO run synchronous (``rollout.max_staleness=0``) and with bounded staleness
``k = 1`` and ``k = 2``, on two shapes.

    python bench/bench_async.py [--workdir DIR] [--steps 12] [--model DIR]

Shapes (both on the tiny model; the engine and the policy each get one CPU, so on a 2-core machine they can run at
the same time):

* ``demo``: the demo's step (``grpo_tiny``: 128 samples of at most 6 tokens), where generation is a small share of
  the step, so overlap can win little;
* ``balanced``: longer responses (``--balanced-tokens``, 48 by default, and 32 samples) from a fresh tiny model,
  whose random weights rarely sample EOS, so every response runs to the budget, as long reasoning does: generation
  and the rest of the step take comparable time (its rewards stay near 0).

* ``longtail`` (not run by default: ``--shapes longtail``): the demo's model at temperature 2 with 64 new tokens,
  most answers short, some to the budget; with ``--partial N`` the async runs use partial rollouts of N tokens.

Prints per run (figures, not pass/fail), over the steps after the first (which include warm-up): seconds per step
and samples/s; seconds per stage (``generate`` is the time blocked on generation, ``ahead`` the generation that ran
during the step); the trainer's idle share (blocked on generation) and the engine's (not generating); reward per
step and per wall-second. Then, for each shape, the limit of a two-stage pipeline, ``max(generate, the rest)`` of the
synchronous step, and each async step time against it.

``--extra KEY=VALUE ...``: overrides for the ``k >= 1`` runs only (an off-policy correction, say).

``--model``: the ``demo`` shape's model (e.g. the demo's SFT model, ``.assets/demo/runs/sft/final`` after ``make
demo``, so that rewards move); default: that one if present, else a fresh tiny model (rewards then stay near 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEMO_SFT = os.path.join(".assets", "demo", "runs", "sft", "final")


def shape_overrides(shape: str, balanced_tokens: int) -> list:
    if shape == "demo":
        return []  # grpo_tiny as the demo runs it
    if shape == "longtail":  # the demo's model at T=2: most answers end in a few tokens, some run to the budget
        return [
            "rollout.temperature=2.0",
            "rollout.max_new_tokens=64",
            "rollout.prompts_per_step=8",
            "rollout.n_samples_per_prompt=4",
            "train.global_batch_size=16",
            "train.micro_batch_size=16",
        ]
    return [
        "rollout.prompts_per_step=8",
        "rollout.n_samples_per_prompt=4",
        f"rollout.max_new_tokens={balanced_tokens}",
        "train.global_batch_size=16",
        "train.micro_batch_size=16",
        "health.flat_reward_steps=0",  # random weights answer no sum right: every reward is 0, and the guard says so
    ]


def run(model: str, prompts: str, workdir: str, name: str, steps: int, overrides: list) -> dict:
    from rlhf.config import load_config
    from rlhf.config.rl_schema import RLRunConfig
    from rlhf.trainers.online.runner import train_ppo

    out = os.path.join(workdir, name)
    cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            f"model.path={model}",
            f"data.train_path={prompts}",
            f"train.output_dir={out}",
            f"train.max_steps={steps}",
            "logging.print_every=1000",
            "logging.tensorboard=false",
            "train.save_final=false",
            "train.overwrite=true",
            "rollout.cpus_per_engine=1",
            *overrides,
        ],
    )
    started = time.perf_counter()
    train_ppo(cfg)
    wall = time.perf_counter() - started
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {"rows": rows, "wall_s": wall, "samples": cfg.rollout.samples_per_step}


def summarize(name: str, result: dict) -> dict:
    rows = result["rows"][1:]
    step_s = statistics.mean(sum(v for k, v in r.items() if k.startswith("time/")) for r in rows)
    blocked = statistics.mean(r["time/generate"] + r.get("time/wait", 0.0) for r in rows)
    ahead = statistics.mean(r.get("async/generated_ahead_s", 0.0) for r in rows)
    generating = ahead + statistics.mean(r["time/generate"] for r in rows) if ahead else blocked
    stages = {k[5:]: statistics.mean(r.get(k, 0.0) for r in rows) for k in result["rows"][-1] if k.startswith("time/")}
    rewards = [r["reward_mean"] for r in result["rows"]]
    line = " ".join(f"{k} {v:.3f}" for k, v in stages.items())
    print(
        f"  {name:<12} {step_s:6.3f} s/step {result['samples'] / step_s:7.1f} samples/s | {line} | ahead "
        f"{ahead:.3f} | trainer idle {blocked / step_s:5.1%} engine idle {max(0.0, 1 - generating / step_s):5.1%}"
    )
    print(
        f"  {'':<12} reward per step {' '.join(f'{x:.3f}' for x in rewards)}; mean {statistics.mean(rewards):.3f}, "
        f"{sum(rewards) / result['wall_s']:.4f} per wall-second ({result['wall_s']:.0f} s in all)"
    )
    return {"step_s": step_s, "generate_s": stages.get("generate", 0.0), "rest_s": step_s - stages.get("generate", 0.0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--model", default="", help=f"start from this model (default: {DEMO_SFT} if present, else a fresh one)"
    )
    ap.add_argument("--balanced-tokens", type=int, default=48)
    ap.add_argument("--shapes", default="demo,balanced")
    ap.add_argument("--staleness", default="0,1,2")
    ap.add_argument("--partial", type=int, default=0, help="rollout.partial_rollout_tokens of the k >= 1 runs")
    ap.add_argument(
        "--extra",
        nargs="*",
        default=[],
        help="more overrides for the k >= 1 runs (e.g. algo.off_policy_correction=tis)",
    )
    args = ap.parse_args(argv)

    from rlhf.cli.common import quiet_environment

    quiet_environment()
    from rlhf.distributed.cluster import init_ray
    from rlhf.models.tiny import build_tiny_model
    from rlhf.synthetic import arithmetic

    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-async-")
    fresh = build_tiny_model(os.path.join(workdir, "model"))
    model = args.model or (DEMO_SFT if os.path.isdir(DEMO_SFT) else fresh)
    prompts = os.path.join(workdir, "prompts.jsonl")
    arithmetic.write_jsonl(prompts, arithmetic.make_rl_prompts(512, seed=0))
    print(f"demo shape: model {model}; balanced shape: {fresh}; {args.steps} GRPO steps per run; under {workdir}")
    init_ray(needed_cpus=4)
    for shape in args.shapes.split(","):
        print(f"\n{shape}:")
        figures = {}
        for k in (int(x) for x in args.staleness.split(",")):
            name = f"{shape}-k{k}"
            overrides = [*shape_overrides(shape, args.balanced_tokens), f"rollout.max_staleness={k}"]
            if k and args.partial:
                overrides.append(f"rollout.partial_rollout_tokens={args.partial}")
            if k:
                overrides += args.extra
            start = fresh if shape == "balanced" else model
            figures[k] = summarize(f"k={k}", run(start, prompts, workdir, name, args.steps, overrides))
        if 0 in figures:
            sync = figures[0]
            limit = max(sync["generate_s"], sync["rest_s"])
            print(
                f"  two-stage limit max(generate {sync['generate_s']:.3f}, rest {sync['rest_s']:.3f}) = {limit:.3f} s: "
                + ", ".join(
                    f"k={k} {f['step_s'] / limit:.2f}x of it, {sync['step_s'] / f['step_s']:.2f}x sync's samples/s"
                    for k, f in figures.items()
                    if k
                )
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
