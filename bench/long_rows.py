"""Long rows: the peak memory per rank of one SFT step on a single row, by row length and sequence-parallel size.

    python bench/long_rows.py [--lengths 1024,2048,4096,8192] [--sp 1,2,4] [--budget-mb 0]
        [--gradient-checkpointing] [--tiled-head] [--tiled-mlp] [--precision fp32|bf16] [--heads 4] [--kv-heads 2]
        [--hidden 128] [--layers 2] [--vocab 512] [--size 0.5b|1.5b|...] [--device cpu|cuda] [--json PATH]

Each sequence-parallel size ``n`` gets a worker group of ``n`` ranks (one sequence group: every rank holds ``1/n``
of the row's positions, :mod:`rlhf.models.sequence_parallel`), built as a run builds its policy (a real Ray actor
per rank, its DeepSpeed engine, gloo on CPU). For each length it trains one optimizer step on one row of random
tokens through ``WorkerGroup.train_batch`` and reads, on every rank, the step's peak memory above the memory held
before it:

* CPU: the process's peak resident set (``VmHWM``), reset right before the step (``/proc/self/clear_refs``, after
  handing freed blocks back to the system with ``malloc_trim``), minus the resident set at that moment: what the
  step itself added (activations, logits, gradients; the optimizer's state is made by a warm-up step first).
* CUDA: ``torch.cuda.max_memory_allocated`` above the allocated memory before the step.

Reported: per length and size, the largest rank's peak (MB) and the step's seconds; with ``--budget-mb M`` the
longest listed length whose peak fits ``M`` at each size. The model is the project's tiny Qwen2 (random weights)
with ``--heads`` query and ``--kv-heads`` key/value heads (both must split over the sizes asked for), or with
``--size`` a random Qwen2 of that size (:mod:`rlhf.models.sizes`; on a GPU:
``--device cuda --size 1.5b --precision bf16 --sp 1 --lengths 8192,16384,32768 --tiled-head --tiled-mlp
--gradient-checkpointing``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _memory_probe(reset: bool):
    """A score function for the ranks (nested, so Ray ships it by value): with ``reset``, clear the peak and return
    the memory held now; else return the peak since (MB, as a ``(1,)`` tensor)."""

    def probe(model, batch):
        import torch

        if torch.cuda.is_available():
            if reset:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                return torch.tensor([torch.cuda.memory_allocated() / 2**20])
            torch.cuda.synchronize()
            return torch.tensor([torch.cuda.max_memory_allocated() / 2**20])
        if reset:
            import ctypes
            import gc

            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed blocks back to the system: the step's own peak shows
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak resident set starts again from the current one
        status = open("/proc/self/status").read()
        kb = int(re.search(r"VmRSS:\s+(\d+)" if reset else r"VmHWM:\s+(\d+)", status).group(1))
        return torch.tensor([kb / 1024])

    return probe


def _on_every_rank(group, row, probe) -> List[float]:
    """``probe`` on every rank (the group's ``score`` reads one rank per sequence group)."""
    import ray

    return [float(out[0]) for out in ray.get([w.score.remote([row], probe) for w in group.workers])]


def _row(length: int, vocab: int, seed: int):
    import torch

    from rlhf.batch import Batch

    ids = torch.randint(4, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, 0] = 0
    return Batch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask)


def measure(args: argparse.Namespace, model_path: str, sp: int, lengths: List[int]) -> List[Dict[str, float]]:
    """One group of ``sp`` ranks; for each length a warm-up step, then the measured one."""
    from rlhf.distributed.cluster import actor_env
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.group import GroupResources, WorkerGroup
    from rlhf.models.loading import ModelSpec
    from rlhf.objectives.sft import SFTObjective

    gpus = 1.0 if args.device == "cuda" else 0.0
    group = WorkerGroup(
        "policy",
        GroupResources(sp, cpus_per_worker=0.5, gpus_per_worker=gpus, env_vars=actor_env(gpus)),
        "nccl" if gpus else "gloo",
    )
    rows = []
    try:
        group.build(
            ModelSpec(
                path=model_path,
                precision=args.precision,
                gradient_checkpointing=args.gradient_checkpointing,
                tiled_head=args.tiled_head,
                tiled_mlp=args.tiled_mlp,
            ),
            EngineSpec(
                zero_stage=0,
                precision=args.precision,
                micro_batch_size=1,
                grad_accum_steps=1,
                sequence_parallel_size=sp,
            ),
            OptimSpec(lr=1e-5, total_steps=2 * len(lengths) + 2, scheduler="constant"),
        )
        for i, length in enumerate(lengths):
            row = _row(length, args.vocab, seed=i)
            group.train_batch(row, SFTObjective())  # warm-up: the optimizer's state, the allocator's pools
            before = _on_every_rank(group, row, _memory_probe(reset=True))
            started = time.perf_counter()
            group.train_batch(row, SFTObjective())
            seconds = time.perf_counter() - started
            peaks = _on_every_rank(group, row, _memory_probe(reset=False))
            peak = max(p - b for p, b in zip(peaks, before))
            rows.append({"sp": sp, "length": length, "peak_mb": round(peak, 1), "seconds": round(seconds, 2)})
            print(f"  sp {sp}  length {length:>6}  peak {peak:8.1f} MB per rank  {seconds:6.2f} s", flush=True)
    finally:
        group.shutdown()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--sp", default="1,2,4")
    parser.add_argument("--budget-mb", type=float, default=0.0)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--tiled-head", action="store_true")
    parser.add_argument("--tiled-mlp", action="store_true")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--size", default="", help="a rlhf.models.sizes size instead of the tiny model")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    import ray

    from rlhf.models.tiny import build_tiny_model

    lengths = [int(x) for x in args.lengths.split(",")]
    sizes = [int(x) for x in args.sp.split(",")]
    where = os.path.join(tempfile.mkdtemp(prefix="long-rows-"), "model")
    if args.size:
        from rlhf.models.sizes import MODEL_SIZES, build_sized_model

        model_path = build_sized_model(where, args.size, max_positions=max(lengths), device=args.device)
        shape = MODEL_SIZES[args.size]
        args.hidden, args.layers, args.vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
        args.heads, args.kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    else:
        model_path = build_tiny_model(
            where,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            vocab_size=args.vocab,
            max_position_embeddings=max(lengths),
        )
    ray.init(address="local", num_cpus=max(sizes), include_dashboard=False, log_to_driver=False)
    try:
        print(
            f"one SFT step on one row; model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
            f"({args.kv_heads} KV), vocab {args.vocab}, {args.precision} on {args.device}"
            + (", gradient checkpointing" if args.gradient_checkpointing else "")
            + (", tiled head" if args.tiled_head else "")
            + (", tiled MLP" if args.tiled_mlp else "")
        )
        rows = [r for sp in sizes for r in measure(args, model_path, sp, lengths)]
    finally:
        ray.shutdown()
    if args.budget_mb:
        for sp in sizes:
            fit = [r["length"] for r in rows if r["sp"] == sp and r["peak_mb"] <= args.budget_mb]
            print(f"longest row within {args.budget_mb:g} MB per rank at sp {sp}: {max(fit) if fit else 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
