"""``python -m rlhf.cli.doctor``: what this machine and Ray cluster offer, what a run would select, and whether
each capability actually works here.

    python -m rlhf.cli.doctor [--workdir DIR] [--no-runs] [--address ADDR]

Prints the library versions, the cluster's nodes (CPUs, GPUs), and what ``auto`` resolves to for a run on this
cluster: GPUs per trainer rank, backend, precision, attention implementation, weight-sync transport (separate
engines and hybrid engine), vLLM sleep mode. Then it runs, on the hardware it finds, a 2-step SFT and a 2-step
GRPO with a weight sync into vLLM (on GPUs also the hybrid engine: IPC and sleep mode), each on a tiny model it
builds locally, and reports pass/fail per capability. Exit status 0 when everything passed, 1 otherwise.

On a GPU cluster it is the first thing to run
(``RAY_AUTH_MODE=token ray job submit --address http://HEAD_IP:8265 --working-dir . -- python -m rlhf.cli.doctor``);
the test suite runs it on CPU.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Callable, List, Optional

from rlhf.cli.common import quiet_environment
from rlhf.cli.make_assets import make_assets
from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import SFTRunConfig, StrategyConfig
from rlhf.distributed.cluster import actor_env, init_ray
from rlhf.distributed.packing import describe_cluster, nodes_from_ray
from rlhf.distributed.resource_plan import resolve_devices
from rlhf.utils.device import resolve_attn_implementation
from rlhf.utils.metrics import read_metrics
from rlhf.utils.versions import SUPPORTED, version_problems, versions_report

# Largest mean |vLLM - trainer| log-prob gap after a sync: the same weights give rounding only (~1e-7 in fp32),
# stale weights give a gap of the size of one update.
MISMATCH_LIMIT = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _run_check(checks: List[Check], name: str, fn: Callable[[], str]) -> bool:
    """``fn()`` returns the detail of a pass; any exception is a failure with its message."""
    try:
        checks.append(Check(name, True, fn()))
    except Exception as exc:  # noqa: BLE001 - the doctor reports every failure and goes on
        checks.append(Check(name, False, f"{type(exc).__name__}: {exc}"))
        if os.environ.get("RLHF_DOCTOR_TRACEBACK"):
            traceback.print_exc()
    return checks[-1].ok


def _versions(checks: List[Check]) -> None:
    for package, found in versions_report().items():
        print(f"  {package:<13} {found:<28} (supported: {package}{SUPPORTED[package][1]})")

    def check() -> str:
        problems = version_problems(SUPPORTED)
        if problems:
            raise RuntimeError("; ".join(problems))
        return "every library within its supported range"

    _run_check(checks, "versions", check)


def _cluster(address: str) -> tuple:
    """Join or start Ray; returns the cluster's nodes and total GPUs."""
    import ray

    joined = init_ray(address, needed_cpus=4)
    nodes = nodes_from_ray([n for n in ray.nodes() if n.get("Alive")])
    print(f"\ncluster: {'a new local Ray cluster' if joined == 'local' else joined}; {describe_cluster(nodes)}")
    return nodes, float(ray.cluster_resources().get("GPU", 0.0))


def _probe_worker(gpus: float) -> dict:
    """What a trainer worker sees on a node of the cluster (attention kernel, CUDA), from inside an actor."""
    import ray

    @ray.remote
    def probe() -> dict:
        import torch

        # strategy.precision=auto on a GPU is bf16 (on CPU attention is sdpa whatever the precision)
        return {
            "attn": resolve_attn_implementation("auto", "bf16"),
            "cuda": torch.version.cuda or "none",
            "devices": torch.cuda.device_count(),
            "bf16": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
        }

    return ray.get(
        probe.options(num_cpus=0.1, num_gpus=min(gpus, 1.0), runtime_env={"env_vars": actor_env(gpus)}).remote()
    )


def _selections(cluster_gpus: float) -> dict:
    """What ``auto`` picks for a run on this cluster, printed as a table."""
    from rlhf.rollout.weights.sync import resolve_weight_sync  # lazy: pulls in torch (the version report needs none)

    devices = resolve_devices(StrategyConfig(), cluster_gpus)
    worker = _probe_worker(devices.gpus_per_worker)
    gpus = devices.gpus_per_worker
    picks = {
        "GPUs per trainer rank": f"{gpus:g}",
        "backend": devices.backend,
        "precision": devices.precision,
        "attention": worker["attn"],
        "CUDA (worker)": f"{worker['cuda']}, {worker['devices']} visible device(s)",
        "weight sync, own engines": resolve_weight_sync("auto", hybrid_engine=False, gpus_per_engine=gpus),
        "weight sync, hybrid engine": resolve_weight_sync("auto", hybrid_engine=True, gpus_per_engine=gpus),
        "vLLM sleep mode (hybrid)": "on" if gpus > 0 else "off (CUDA only)",
    }
    print("\na run with the defaults (strategy.*=auto, rollout.weight_sync=auto) would select:")
    for key, value in picks.items():
        print(f"  {key:<27} {value}")
    return {"devices": devices, **picks}


def _assets(workdir: str) -> dict:
    return make_assets(
        os.path.join(workdir, "assets"),
        num_sft=64,
        num_pref=8,
        num_prompts=32,
        num_eval_prompts=8,
        log=lambda line: None,
    )


def _finite(row: dict, keys) -> None:
    bad = {k: row.get(k) for k in keys if not (isinstance(row.get(k), float) and math.isfinite(row[k]))}
    if bad:
        raise RuntimeError(f"step {row.get('step')}: non-finite or missing {bad}")


def _sft(assets: dict, workdir: str, precision: str) -> str:
    from rlhf.trainers.offline.sft import train_sft  # lazy: pulls in torch (and a broken install fails this check only)

    cfg = load_config(
        SFTRunConfig,
        "sft_tiny",
        [
            f"model.path={assets['model']}",
            f"data.train_path={assets['sft']}",
            f"train.output_dir={workdir}/sft",
            "train.global_batch_size=8",
            "train.micro_batch_size=4",
            "train.max_steps=2",
            "train.save_final=false",
            "logging.tensorboard=false",
            "logging.progress_bar=off",
            "train.overwrite=true",
        ],
    )  # --workdir may be reused
    result = train_sft(cfg)
    row = result.final_metrics
    _finite(row, ("loss", "grad_norm"))
    return f"2 steps, {precision}: loss {row['loss']:.4f}, grad_norm {row['grad_norm']:.4f}"


def _grpo(assets: dict, workdir: str, name: str, precision: str, extra: tuple = ()) -> str:
    from rlhf.trainers.online.runner import (
        train_ppo,  # lazy: pulls in torch (and a broken install fails this check only)
    )

    out = os.path.join(workdir, name)
    cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            f"model.path={assets['model']}",
            f"data.train_path={assets['prompts']}",
            f"train.output_dir={out}",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=8",
            "train.global_batch_size=16",
            "train.micro_batch_size=8",
            "train.max_steps=2",
            "train.lr=1e-3",
            "train.save_final=false",
            "logging.tensorboard=false",
            "logging.progress_bar=off",
            "train.overwrite=true",
            *extra,
        ],
    )
    train_ppo(cfg)
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    for row in rows:
        _finite(row, ("reward_mean", "grad_norm", "logp_mismatch"))
    # Step 2 samples from the weights step 1 pushed: its mismatch is the sync's proof.
    mismatch, limit = rows[-1]["logp_mismatch"], MISMATCH_LIMIT[precision]
    if not mismatch < limit:
        raise RuntimeError(
            f"step 2 vLLM/trainer log-prob mismatch {mismatch:.2e} >= {limit:g}: the engine does not "
            f"hold the policy's weights"
        )
    return (
        f"2 steps: reward {rows[-1]['reward_mean']:.3f}, step-2 log-prob mismatch {mismatch:.1e} (< {limit:g}), "
        f"sync {rows[-1]['sync_mb_per_s']:.0f} MB/s"
    )


def _runs(checks: List[Check], picks: dict, workdir: str) -> None:
    precision = picks["devices"].precision
    assets = {}

    def build() -> str:
        assets.update(_assets(workdir))
        return f"tiny model and data in {workdir}/assets"

    if not _run_check(checks, "tiny assets", build):
        return
    _run_check(checks, f"SFT (DeepSpeed, {picks['backend']})", lambda: _sft(assets, workdir, precision))
    method = picks["weight sync, own engines"]
    _run_check(checks, f"GRPO + vLLM, weight sync {method}", lambda: _grpo(assets, workdir, "grpo", precision))
    if picks["devices"].gpus_per_worker > 0:  # the hybrid engine's IPC and sleep mode exist only on GPUs
        _run_check(
            checks,
            "GRPO, hybrid engine (ipc, sleep)",
            lambda: _grpo(
                assets, workdir, "grpo-hybrid", precision, ("colocate.hybrid_engine=true", "rollout.num_engines=1")
            ),
        )


def report(checks: List[Check]) -> int:
    width = max([len(c.name) for c in checks] + [len("capability")]) + 2
    print(f"\n  {'capability':<{width}}result")
    for c in checks:
        print(f"  {c.name:<{width}}{'pass' if c.ok else 'FAIL'}  {c.detail}")
    failed = [c.name for c in checks if not c.ok]
    print(f"\n{len(checks) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rlhf.cli.doctor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workdir", default="", help="where the tiny assets and runs go (default: a temp dir)")
    ap.add_argument("--address", default="", help="Ray cluster to join (default: RAY_ADDRESS, else a local one)")
    ap.add_argument("--no-runs", action="store_true", help="only print what is found and selected")
    args = ap.parse_args(argv)

    quiet_environment()
    checks: List[Check] = []
    print("versions:")
    _versions(checks)
    state: dict = {}
    if not _run_check(checks, "ray cluster", lambda: _describe_cluster(state, args.address)):
        return report(checks)
    if not _run_check(checks, "worker probe", lambda: _describe_selections(state)):
        return report(checks)
    if not args.no_runs:
        _runs(checks, state["picks"], args.workdir or tempfile.mkdtemp(prefix="rlhf-doctor-"))
    return report(checks)


def _describe_cluster(state: dict, address: str) -> str:
    nodes, gpus = _cluster(address)
    state["gpus"] = gpus
    return f"{len(nodes)} node(s), {sum(n.cpus for n in nodes):g} CPUs, {gpus:g} GPUs"


def _describe_selections(state: dict) -> str:
    state["picks"] = _selections(state["gpus"])
    return f"attention {state['picks']['attention']}, {state['picks']['precision']}"


if __name__ == "__main__":
    sys.exit(main())
