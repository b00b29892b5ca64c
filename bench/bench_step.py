"""Training-step benchmark: the project's trainer rank against plain PyTorch loops on the same model and rows, with MFU.

    python bench/bench_step.py [--device cuda|cpu] [--size 1.5b | --model PATH] [--trainers sft,dpo,rl,logprob]
        [--zero-stage 0,1,2,3] [--packing] [--rows uniform|longtail] [--seq 1024] [--micro 4] [--ga 4]
        [--steps 8] [--rounds 1] [--precision bf16|fp32] [--plain autocast,bf16] [--peak-tflops X] [--json PATH]
        [--tiled-head] [--compile] [--max-tokens N] [--ds JSON] [--profile NAME,...] [--threads N]

What runs, per trainer (``sft``, ``dpo``, ``rl`` = the PPO policy update, ``logprob`` = the forward-only reference /
old-policy pass):

* ``plain-autocast``: fp32 weights under ``torch.autocast(bf16)``, torch's AdamW (fused on CUDA), clip 1.0: what HF
  Trainer and TRL run with bf16. ``plain-bf16``: bf16 weights, no master copy (eager PyTorch's speed limit).
  ``plain-fp32``: fp32 weights (the CPU baseline). Each computes the trainer's loss in a few lines (log-softmax of
  the whole logits, the global normaliser), on the padded rows.
* ``rlhf-zeroK``: the project's trainer rank (``TrainerWorker`` and its DeepSpeed engine, as a Ray actor hosts it,
  built here in-process on a one-rank group: nccl on CUDA, gloo on CPU) at ZeRO stage K, the batch cut and
  normalised as ``WorkerGroup.train_batch`` does; ``--packing`` runs it padding-free, ``--max-tokens`` cuts its
  micro-batches by a token budget (``train.max_tokens_per_micro_batch``), ``--tiled-head`` applies the LM head in
  token tiles (``model.tiled_head``: compare the peak memory), ``--compile`` compiles each decoder layer
  (``model.compile``; the warm-up steps take the compile). On one rank ZeRO 2 and 3 build ZeRO 1
  (``rlhf.distributed.engine.effective_zero_stage``). ``rlhf-ref`` is the frozen reference worker's ``score`` pass.

Each step's rows are fresh random token ids (``--rows uniform``: every row ``--seq`` long; ``longtail``: lengths
``seq * u^3``, mean ~seq/4, as chat and RL data are); every system sees the same rows. Reported per system: the
median seconds per optimizer step (``--steps`` after 2 warm-up steps, median of ``--rounds`` interleaved rounds),
real tokens per second (padding not counted), MFU (:mod:`rlhf.utils.flops`: the model FLOPs of the real tokens over
the device's dense peak), the peak of allocated device memory, the process's CPU seconds per step (on a GPU: the
host's share; a step whose host time exceeds its wall time is bound by the host), and speed relative to the first
plain system. ``--device cpu --size tiny`` is the CPU twin (tests/unit/test_bench_step.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

WARMUP_STEPS = 2
PROFILE = ""  # --profile
PROFILED: set = set()  # the systems profiled so far
THREADS = os.cpu_count() or 1  # every system's torch threads: all the host's cores (main() says why) or --threads
PROMPT_TOKENS = 16  # RL and DPO rows: the first tokens are the prompt, the rest the response (the targets)
DPO_BETA, CLIP = 0.1, 0.2


def prompt_tokens(seq: int) -> int:
    """The prompt length of RL and DPO rows of up to ``seq`` tokens: :data:`PROMPT_TOKENS`, or half a row of fewer
    than twice that (``--seq 16`` on the host-bound CPU model), so that every row has a response to train on."""
    return min(PROMPT_TOKENS, seq // 2)


# ----------------------------------------------------------------------------------------------- rows
def row_lengths(kind: str, rows: int, seq: int, generator) -> "torch.Tensor":  # noqa: F821
    """``(rows,)`` real lengths: all ``seq`` (uniform) or ``seq * u^3`` clamped to [2 * prompt_tokens(seq), seq]."""
    import torch

    if kind == "uniform":
        return torch.full((rows,), seq, dtype=torch.long)
    u = torch.rand(rows, generator=generator, dtype=torch.float64)
    return (seq * u**3).long().clamp(2 * prompt_tokens(seq), seq)


def make_batch(trainer: str, rows: int, seq: int, vocab: int, kind: str, seed: int):
    """One global batch of ``rows`` rows (``rows`` pairs for DPO) as the trainer's ``Batch``, right-padded to the
    longest row."""
    import torch

    from rlhf.batch import Batch

    gen = torch.Generator().manual_seed(seed)
    shape = (rows, 2) if trainer == "dpo" else (rows,)
    lengths = row_lengths(kind, math.prod(shape), seq, gen).view(shape)
    width = int(lengths.max())
    columns = torch.arange(width)
    mask = (columns < lengths[..., None]).long()
    ids = torch.randint(4, vocab, (*shape, width), generator=gen) * mask
    first_target = 1 if trainer in ("sft", "logprob") else prompt_tokens(seq)
    loss_mask = mask * (columns >= first_target).long()
    if trainer == "dpo":
        return Batch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask, ref_logps=-5.0 * lengths.double())
    if trainer == "rl":
        old = -torch.rand(rows, width, generator=gen) * 8.0 * loss_mask
        advantages = torch.randn(rows, width, generator=gen, dtype=torch.float32) * loss_mask
        return Batch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask, old_logps=old, advantages=advantages)
    return Batch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask)


# ----------------------------------------------------------------------------------------------- plain loops
def plain_token_logps(model, ids, mask):
    """``(B, T-1)`` log-probs of tokens 1.. under ``model`` (the whole float32 log-softmax, as the common loop)."""
    import torch

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def plain_loss(trainer: str, model, batch):
    """The trainer's loss sum over one micro-batch, written as a plain loop writes it."""
    import torch

    if trainer == "dpo":
        pairs, width = batch.input_ids.shape[0], batch.input_ids.shape[-1]
        lp = plain_token_logps(model, batch.input_ids.view(-1, width), batch.attention_mask.view(-1, width))
        seq = (lp * batch.loss_mask.view(-1, width)[:, 1:]).sum(-1).view(pairs, 2)
        margin = (seq[:, 0] - batch.ref_logps[:, 0]) - (seq[:, 1] - batch.ref_logps[:, 1])
        return -torch.nn.functional.logsigmoid(DPO_BETA * margin).sum()
    lp = plain_token_logps(model, batch.input_ids, batch.attention_mask)
    targets = batch.loss_mask[:, 1:].to(lp.dtype)
    if trainer == "sft":
        return -(lp * targets).sum()
    ratio = torch.exp(lp - batch.old_logps[:, 1:])  # rl: PPO's clipped surrogate, token-mean numerator
    adv = batch.advantages[:, 1:]
    surrogate = torch.maximum(-ratio * adv, -ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    return (surrogate * targets).sum()


def normaliser(trainer: str, batch) -> int:
    if trainer == "dpo":
        return int(batch.input_ids.shape[0])
    return int(batch.loss_mask[:, 1:].sum())


@dataclass
class System:
    """One way of running a trainer's step: ``setup()`` builds it, ``step(batch)`` runs one global batch,
    ``close()`` frees it; ``params`` the model's parameter count, ``flops`` its :class:`ModelFlops`."""

    name: str
    setup: Callable[[], None]
    step: Callable[[object], None]
    close: Callable[[], None]
    state: dict = field(default_factory=dict)


def plain_system(trainer: str, weights: str, args, device) -> System:
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.utils.flops import ModelFlops

    autocast = weights == "autocast"
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    state: dict = {}

    def setup():
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").to(device)
        model.config.use_cache = False
        state["model"], state["flops"] = model, ModelFlops.of(model)
        if trainer == "logprob":
            model.eval().requires_grad_(False)
        else:
            model.train()
            state["opt"] = torch.optim.AdamW(
                model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda"
            )

    def step(batch):
        model = state["model"]
        per_micro = args.micro
        micro = [batch.select(range(i, i + per_micro)).trim() for i in range(0, len(batch), per_micro)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            if trainer == "logprob":
                with torch.no_grad():
                    for mb in micro:
                        mb = mb.to(device)
                        plain_token_logps(model, mb.input_ids, mb.attention_mask)
                return
            norm = normaliser(trainer, batch)
            for mb in micro:
                (plain_loss(trainer, model, mb.to(device)) / norm).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)

    def close():
        state.clear()

    return System(f"plain-{weights}", setup, step, close, state)


def rlhf_system(trainer: str, zero: int, args, device) -> System:
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.group import row_lengths
    from rlhf.distributed.micro_batches import cut_by_rows, cut_by_tokens
    from rlhf.distributed.worker import TrainerWorker
    from rlhf.models.loading import ModelSpec
    from rlhf.objectives.actor_critic import PolicyObjective, TokenLogps
    from rlhf.objectives.dpo import DPOObjective
    from rlhf.objectives.sft import SFTObjective
    from rlhf.utils.flops import ModelFlops

    objective = {"sft": SFTObjective(), "dpo": DPOObjective(beta=DPO_BETA), "rl": PolicyObjective()}.get(trainer)
    state: dict = {}
    rows = args.micro * args.ga

    engine = dict(zero_stage=zero, precision=args.precision, user_config=args.ds or None)

    def setup():
        worker = TrainerWorker(f"bench-{trainer}", 0, 1, num_threads=THREADS)  # as the plain loops
        worker.device = device
        worker.build(
            ModelSpec(
                path=args.model,
                precision=args.precision,
                attn_implementation="auto",
                packing=args.packing,
                tiled_head=args.tiled_head,
                compile=args.compile,
            ),
            (
                EngineSpec.for_token_budget(rows, args.max_tokens, 1, packing=args.packing, **engine)
                if args.max_tokens
                else EngineSpec.for_global_batch(rows, args.micro, 1, **engine)
            ),
            None if trainer == "logprob" else OptimSpec(lr=1e-5, total_steps=10**6, max_grad_norm=1.0),
        )
        state["worker"], state["flops"] = worker, ModelFlops.of(worker.model)

    def step(batch):
        worker = state["worker"]
        if args.max_tokens:  # as WorkerGroup.train_batch cuts under train.max_tokens_per_micro_batch
            shard = cut_by_tokens(row_lengths(batch), 1, args.max_tokens, args.packing).micro_batches[0]
        else:
            shard = cut_by_rows(len(batch), 1, args.micro).micro_batches[0]
        micro = [batch.select(r).trim().contiguous() for r in shard]  # as WorkerGroup.train_batch cuts
        if trainer == "logprob":
            worker.score(micro, TokenLogps())
            return
        worker.train_step(micro, objective, sum(objective.count(mb) for mb in micro))

    def close():
        state.clear()

    name = "rlhf-ref" if trainer == "logprob" else f"rlhf-zero{zero}"
    name += "-packed" if args.packing else ""
    name += f"-tok{args.max_tokens}" if args.max_tokens else ""
    name += "-tiled" if args.tiled_head else ""
    return System(name + ("-compiled" if args.compile else ""), setup, step, close, state)


# ----------------------------------------------------------------------------------------------- measuring
def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def release(device) -> None:
    import torch

    gc.collect()  # DeepSpeed engines hold reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(system: System, batches: list, device) -> dict:
    """Build, warm up, time ``len(batches) - WARMUP_STEPS`` steps, free: medians of wall and CPU seconds."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    system.setup()
    walls, cpus = [], []
    for i, batch in enumerate(batches):
        sync(device)
        wall, cpu = time.perf_counter(), time.process_time()
        system.step(batch)
        sync(device)
        if i >= WARMUP_STEPS:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    flops = system.state["flops"]
    if system.name not in PROFILED and any(part and part in system.name for part in PROFILE.split(",")):
        PROFILED.add(system.name)  # once, in the first round
        profile_step(system, batches[-1], device)
    system.close()
    release(device)
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "peak_gib": peak, "flops": flops}


def profile_step(system: System, batch, device) -> None:
    """One more step under torch's profiler (ops by self CPU time: the host's share), one counting its host reads of
    tensor data (:mod:`rlhf.utils.host_reads`: on a CPU too, what would make a GPU's host wait) and one under
    cProfile (the Python functions behind it)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from rlhf.utils.host_reads import HostReads

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        system.step(batch)
        sync(device)
    events = prof.key_averages()
    counts = {e.key: e.count for e in events}
    launches = sum(n for key, n in counts.items() if "LaunchKernel" in key)
    syncs = sum(n for key, n in counts.items() if "Synchronize" in key)
    ops = sum(n for key, n in counts.items() if key.startswith("aten::"))
    print(f"PROFILE {system.name}: {launches} kernel launches, {syncs} device synchronisations, {ops} aten ops a step")
    # on a GPU the reads of device tensors (each a synchronisation); on the CPU twin every read, the host's included
    with HostReads(None if device.type == "cpu" else device.type) as reads:
        system.step(batch)
        sync(device)
    print(f"PROFILE {system.name}: {reads.total} host reads of tensor data a step {reads.by_op}")
    print(f"PROFILE {system.name}: ops by self CPU time")
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))
    python = cProfile.Profile()
    python.enable()
    system.step(batch)
    sync(device)
    python.disable()
    print(f"PROFILE {system.name}: Python functions by own time")
    pstats.Stats(python).sort_stats("tottime").print_stats(22)


def systems_for(trainer: str, args, device) -> List[System]:
    plain = [plain_system(trainer, w, args, device) for w in args.plain]
    if trainer == "logprob":  # frozen, on one rank: every stage loads the same plain module (effective_zero_stage)
        return plain + [rlhf_system(trainer, 0, args, device)]
    return plain + [rlhf_system(trainer, z, args, device) for z in args.zero_stage]


def run(args, device) -> List[dict]:
    from transformers import AutoConfig

    from rlhf.utils.flops import mfu

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    results: List[dict] = []
    if device.type == "cpu":
        # release() collects after every system, and a collection walks every object the imports made (~0.25 s on
        # the CPU twin, several times its tiny steps): freeze them (none is garbage after this collection).
        gc.collect()
        gc.freeze()
    for trainer in args.trainers:
        rows = args.micro * args.ga
        steps = WARMUP_STEPS + args.steps
        distinct = [make_batch(trainer, rows, args.seq, vocab, args.rows, seed=s) for s in range(min(steps, 4))]
        batches = [distinct[i % len(distinct)] for i in range(steps)]
        lengths = [b.row_lengths() for b in batches[WARMUP_STEPS:]]
        tokens = statistics.mean(sum(x) for x in lengths)
        systems = systems_for(trainer, args, device)
        rounds: Dict[str, List[dict]] = {s.name: [] for s in systems}
        for round_ in range(args.rounds):
            for system in systems:
                rounds[system.name].append(measure(system, batches, device))
                run = rounds[system.name][-1]  # as it comes: a run cut short by a time limit still says something
                print(f"ROUND {round_ + 1} {trainer} {system.name} {run['wall']:.4f} s/step", flush=True)
        base = None
        for system in systems:
            runs = rounds[system.name]
            wall = statistics.median(r["wall"] for r in runs)
            model_flops = runs[0]["flops"]
            flops = statistics.mean(model_flops.flops(x, training=trainer != "logprob") for x in lengths)
            row = {
                "trainer": trainer,
                "system": system.name,
                "s_per_step": wall,
                "tokens_per_s": tokens / wall,
                "mfu": mfu(flops, wall, args.peak_tflops),
                "peak_gib": runs[0]["peak_gib"],
                "cpu_s_per_step": statistics.median(r["cpu"] for r in runs),
            }
            base = base or row
            row["vs_plain"] = base["s_per_step"] / wall
            results.append(row)
            print_row(row, flush=True)
    gc.unfreeze()  # the interpreter's exit collects everything again
    return results


# ----------------------------------------------------------------------------------------------- output
COLUMNS = ("trainer", "system", "s/step", "tokens/s", "MFU", "peak GiB", "host s", "vs first")


def cells(row: dict) -> List[str]:
    return [
        row["trainer"],
        row["system"],
        f"{row['s_per_step']:.4f}",
        f"{row['tokens_per_s']:,.0f}",
        "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%",
        "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}",
        f"{row['cpu_s_per_step']:.3f}",
        f"{row['vs_plain']:.2f}x",
    ]


def print_row(row: dict, flush: bool = False) -> None:
    print("RESULT " + "  ".join(cells(row)), flush=flush)


def print_table(results: List[dict]) -> None:
    table = [list(COLUMNS)] + [cells(r) for r in results]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    for i, line in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", default=None, help="an HF causal LM directory (default: --size built here)")
    parser.add_argument("--size", default=None, help="a Qwen2-shaped random init: tiny, small, 0.5b, 1.5b, 7b")
    parser.add_argument("--trainers", default="sft,dpo,rl,logprob")
    parser.add_argument("--zero-stage", default="0,1,2,3", help="comma list of ZeRO stages for the rlhf rows")
    parser.add_argument("--packing", action="store_true", help="the rlhf rows run padding-free")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="the rlhf rows cut micro-batches by this token budget (train."
        "max_tokens_per_micro_batch; --micro stays the plain loops' cut)",
    )
    parser.add_argument("--compile", action="store_true", help="the rlhf rows compile each decoder layer")
    parser.add_argument("--tiled-head", action="store_true", help="the rlhf rows apply the LM head in token tiles")
    parser.add_argument("--rows", choices=("uniform", "longtail"), default="uniform")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--ga", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians over them)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None, help="default: bf16 cuda, fp32 cpu")
    parser.add_argument("--plain", default=None, help="plain loops: autocast, bf16, fp32 (default cuda: autocast,bf16)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak (default: known)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--ds", default="", help="a JSON object merged into the rlhf rows' DeepSpeed config")
    parser.add_argument(
        "--profile", default="", help="profile one more step of the systems whose name has one of these (comma list)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads of every system (default: all cores)")
    args = parser.parse_args(argv)
    if args.seq < 2:
        parser.error(f"--seq {args.seq}: a row needs at least 2 tokens (a prompt token and a target)")
    cuda = args.device == "cuda"
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.plain = (args.plain or ("autocast,bf16" if cuda else "fp32")).split(",")
    args.trainers = args.trainers.split(",")
    args.zero_stage = [int(z) for z in args.zero_stage.split(",") if z != ""]
    args.ds = json.loads(args.ds) if args.ds else None
    global PROFILE, THREADS
    PROFILE, THREADS = args.profile, args.threads or THREADS
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    from rlhf.distributed.worker import TrainerWorker
    from rlhf.models.sizes import build_sized_model
    from rlhf.utils.flops import peak_tflops

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if cuda and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --device cpu for the CPU twin")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    if args.model is None:
        args.model = build_sized_model(
            os.path.join(tempfile.mkdtemp(prefix="bench_step_"), args.size or "tiny"),
            args.size or "tiny",
            max_positions=max(4096, args.seq),
            device="cuda" if cuda else None,
        )
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    args.peak_tflops = args.peak_tflops or peak_tflops(name, args.precision)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Every system runs on all the host's cores (or --threads): a TrainerWorker sets torch's thread count when it is
    # made (a Ray actor's share), and made here with its default of one thread it left the first plain loop of a run
    # on one core (2.3 s a step against 1.28 s on 2 cores), until the first rlhf system set it back.
    TrainerWorker("bench", 0, 1, num_threads=THREADS).init_process_group(
        "127.0.0.1", port, "nccl" if cuda else "gloo", timeout_s=60
    )
    budget = f" (rlhf: <= {args.max_tokens} tokens)" if args.max_tokens else ""
    print(
        f"bench_step on {name}: model {args.model}, {args.precision}, rows {args.rows} <= {args.seq} tokens, "
        f"micro {args.micro} x GA {args.ga}{budget}, {args.steps} steps x {args.rounds} rounds, peak "
        f"{args.peak_tflops or '-'} TFLOP/s"
    )
    print("MFU = sum_rows (c*N*S + 2c*L*A*S^2) / s / peak; c = 6 (train) or 2 (forward); N = matmul parameters, "
          "L layers, A = heads x head_dim, S = a row's real length")  # fmt: skip
    results = run(args, device)
    print()
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
