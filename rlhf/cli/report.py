"""``python -m rlhf.cli.report OUTPUT_DIR [OUTPUT_DIR ...]``: PNG plots of runs' ``metrics.jsonl``.

One panel per metric any of the runs logged (loss, reward, KL, grad norm, lr, stage timings, ...), one line per
run, held-out evaluations (``eval.jsonl``) as points. With one run the figure goes to ``OUTPUT_DIR/report.png``;
with several, to ``--out`` (default ``report.png``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Sequence, Tuple

from rlhf.reports.plots import plot_runs
from rlhf.utils.log import get_logger
from rlhf.utils.metrics import MetricsFileError, read_metrics

log = get_logger(__name__)

# (metric key, panel title), in display order; only the ones present are drawn.
PANELS: Tuple[Tuple[str, str], ...] = (
    ("loss", "loss"),
    ("reward_mean", "reward"),
    ("accuracy", "accuracy"),
    ("rewards/accuracy", "DPO reward accuracy"),
    ("rewards/margin", "DPO reward margin"),
    ("kl", "KL to the reference"),
    ("policy_loss", "policy loss"),
    ("value_loss", "value loss"),
    ("entropy", "entropy"),
    ("response_length", "response length"),
    ("clip_frac", "clip fraction"),
    ("logp_mismatch", "vLLM / trainer log-prob mismatch"),
    ("grad_norm", "grad norm"),
    ("critic_grad_norm", "critic grad norm"),
    ("lr", "learning rate"),
    ("samples_per_s", "samples / s"),
    # multi-turn episodes (env.spec)
    ("reward/env", "environment reward"),
    ("episode/turns", "turns per episode"),
    ("episode/policy_tokens", "policy tokens per episode"),
    ("episode/env_tokens", "environment tokens per episode"),
    ("episode/ended_done", "episodes ended by the environment"),
    ("episode/ended_max_turns", "episodes cut at rollout.max_turns"),
    ("episode/ended_token_budget", "episodes cut at rollout.max_episode_tokens"),
    ("episode/ended_max_new_tokens", "responses cut at rollout.max_new_tokens"),
    ("episode/ended_prefix_mismatch", "episodes cut at a prefix mismatch"),
)
TIMING_PREFIX = "time/"
PERF_PREFIX = "perf/"  # perf/<role>/mfu, tokens_per_s (and forward_ ones): one panel each
REWARD_SOURCE_PREFIX = "reward/"  # each reward function's (and the reward model's) mean: one panel per source
TURN_REWARD_PREFIX = "episode/reward_turn_"  # the environment's mean reward at turn t: one panel per turn


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message names it."""


def run_names(dirs: Sequence[str]) -> List[str]:
    """Short unique names: the directory's base name, with parents added while two runs would share one."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in dirs]
    depth = 1
    while True:
        names = [os.sep.join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names) or depth >= max(len(p) for p in parts):
            return names
        depth += 1


def load_runs(dirs: Sequence[str]) -> Tuple[Dict[str, List[dict]], List[str]]:
    """Run name -> metrics rows (and ``<name> (held-out)`` -> eval rows); the names of the held-out series."""
    runs: Dict[str, List[dict]] = {}
    held_out: List[str] = []
    for name, run_dir in zip(run_names(dirs), dirs):
        metrics = os.path.join(run_dir, "metrics.jsonl")
        if not os.path.isfile(metrics):
            raise ReportError(f"{run_dir}: no metrics.jsonl (is it a run's train.output_dir?)")
        runs[name] = read_metrics(metrics)
        evals = os.path.join(run_dir, "eval.jsonl")
        if os.path.isfile(evals):
            held_out.append(f"{name} (held-out)")
            runs[held_out[-1]] = read_metrics(evals)
    return runs, held_out


def panels_for(runs: Dict[str, List[dict]]) -> List[Tuple[str, str]]:
    keys = {k for rows in runs.values() for row in rows for k in row}
    timings = sorted(k for k in keys if k.startswith(TIMING_PREFIX))
    perf = sorted(k for k in keys if k.startswith(PERF_PREFIX))
    listed = {key for key, _ in PANELS}
    sources = sorted(k for k in keys if k.startswith(REWARD_SOURCE_PREFIX) and k not in listed)
    turns = sorted((k for k in keys if k.startswith(TURN_REWARD_PREFIX)), key=lambda k: int(k.rsplit("_", 1)[1]))
    return (
        [p for p in PANELS if p[0] in keys]
        + [(k, f"reward of {k[len(REWARD_SOURCE_PREFIX) :]}") for k in sources]
        + [(k, f"environment reward at turn {k.rsplit('_', 1)[1]}") for k in turns]
        + [(k, f"seconds: {k[len(TIMING_PREFIX) :]}") for k in timings]
        + [(k, k[len(PERF_PREFIX) :].replace("/", ": ").replace("_", " ")) for k in perf]
    )


def _missing_matplotlib() -> str:
    """``""`` when matplotlib imports, else a one-line message naming what to install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return (
            f"the report draws with matplotlib, which does not import here ({exc}); install it with "
            f"`pip install matplotlib` (it is a dependency of rlhf: `pip install -e .` brings it)"
        )
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rlhf.cli.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("runs", nargs="+", metavar="OUTPUT_DIR", help="run directories (train.output_dir)")
    ap.add_argument("--out", default="", help="PNG path (default: OUTPUT_DIR/report.png, or report.png for several)")
    ap.add_argument("--smooth", type=int, default=1, help="moving-average window over each run's steps (1 = raw)")
    args = ap.parse_args(argv)
    missing = _missing_matplotlib()
    if missing:
        log.error(f"error: {missing}")
        return 1

    try:
        runs, held_out = load_runs(args.runs)
        panels = panels_for(runs)
        if not panels:
            raise ReportError(f"no metric to plot in {', '.join(args.runs)}")
    except (ReportError, MetricsFileError, OSError) as exc:
        log.error(f"error: {exc}")
        return 2
    out = args.out or (os.path.join(args.runs[0], "report.png") if len(args.runs) == 1 else "report.png")
    drawn = plot_runs(
        runs,
        panels,
        out,
        smooth=args.smooth,
        unsmoothed=held_out,
        title=" vs ".join(n for n in runs if n not in held_out),
    )
    log.info(f"wrote {out} ({len(drawn)} panels: {', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
