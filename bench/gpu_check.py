"""The one-GPU check: the project's training, packing and weight-sync paths on one device, in under 5 minutes.

    python bench/gpu_check.py [--device cuda|cpu] [--precision bf16|fp32] [--zero-stage 0-3]
                              [--model PATH | --size 0.5b|1.5b] [--checks sft,dpo,packing,ipc,sync,sp,head,sleep]
                              [--threads N]

Needs only torch, transformers, peft and deepspeed (no Ray, no vLLM: nothing here imports them). Eight checks, each
with the project's own code, one process plus one receiver process:

1. engine        ``TrainerWorker`` (the rank a Ray actor hosts, built here in-process on a one-rank process group:
                 nccl on CUDA, gloo on CPU, as ``strategy.backend=auto`` picks) builds the ``TrainEngine`` on ZeRO 0
                 (``--zero-stage`` for another; runs use 2), the optimizer the engine picks, and takes one step.
2. sft / dpo     one global batch of 8 rows, whole (micro 8 x GA 1) against split (micro 2 x GA 4), cut by
                 ``cut_by_rows`` and normalised over the whole batch as ``WorkerGroup.train_batch`` does: loss, grad
                 norm and the weights after one optimizer step, from the same start.
3. packing       per-token log-probs of the packed forward (flash-attn varlen if importable, else torch's varlen_attn on
                 CUDA in bf16, else sdpa per row: the CPU twin)
                 against the padded forward; real tokens/s of each.
4. ipc           ``IpcSender`` hands the model's weights in buckets (CUDA IPC handles; shared memory on CPU) to a
                 receiver process running the vLLM worker extension's load path; every tensor's SHA-256 is compared.
5. sync group    the weight-sync group's backend (NCCL on CUDA, gloo on CPU) forms and broadcasts, and a member that
                 never arrives is named after the arrival bound instead of a hang.
6. sequence      two ranks share every row (``strategy.sequence_parallel_size=2``, two processes, one device each:
   parallel      NCCL on 2 GPUs, gloo on CPU): per-token log-probs and the gradient of the sharded forward against
                 the unsharded one. On a machine with one GPU it is reported SKIP (NCCL cannot put two ranks on one
                 device); the CPU twin is the same code on gloo.
7. head tiles    the LM head in tiles (``model.tiled_head``, rlhf.ops.logprobs.head_token_logprobs) against the whole
                 logits at the model's width and vocabulary: log-probs, entropies and the gradients of the hidden
                 states and the head, without a kept set (the backward in tiles of the vocabulary, whose
                 half-precision products into float32 use the device's own) and with top-p and an entropy bonus
                 (tiles of tokens); the time and peak memory of each.
8. sleep         ``colocate.trainer_sleep``: a rank that took a step sleeps (weights, gradients, Adam's states to
                 pinned host memory; host to host on CPU), leaving at most 5% of its device memory, and wakes to the
                 same bits; the time of each. And ``colocate.offload_frozen``: the reference a training rank holds
                 moves to host memory (freeing at least 95% of its weights' device memory) while the rank trains,
                 and its next score, which wakes it, is the same bits; the time of each way.

Prints one table and exits 1 if any check fails. ``--device cpu`` is the CPU twin (tests/unit/test_gpu_check.py).
``--perturb-normalizer F`` multiplies the split runs' normalizer by F: a mis-normalised gradient, which the sft/dpo
rows must catch (the failure case of the test).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import socket
import sys
import tempfile
import time
import traceback

STARTED = time.perf_counter()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

GLOBAL_BATCH, SPLIT_MICRO = 8, 2
# Bounds on relative differences, by precision. What must be caught is a normalisation error: a wrong factor (the GA
# count, a per-micro-batch mean) moves the loss or the grad norm by O(1) (0.33-0.75 for GA 4). Within a precision
# the two cuts differ only in summation order and padding (matmul shapes):
# * fp32 (unit roundoff 6e-8): measured ~2e-7 on losses and grad norms (shared/notes: "Numerics to expect");
#   1e-4 leaves 500x for other CPUs and GPUs' TF32-free kernels while still 3000x below a normalisation error.
# * bf16 (unit roundoff 2^-8 = 3.9e-3): every matmul output carries it; sums of many such terms over a batch
#   average it down, so a few u, 2e-2 (~5u), is generous and still >15x below a normalisation error.
# Weights after one AdamW step are compared as ||w_split - w_whole|| / ||w_whole - w_start||, relative to the
# update itself: Adam's first step is ~lr * sign(g), so a coordinate whose gradient is ~0 (k_proj biases) or flips
# sign by rounding moves by up to 2 lr. fp32: measured 1e-5 on the tiny model; the bound 1e-3 leaves ~100x, and a
# step that went elsewhere (wrong LR, no step) is O(1).
# bf16 has no fixed bound: the weights the model holds are the fp32 masters rounded to bf16, and an lr-1e-3 step is a
# few bf16 ulps of a 0.02 weight, so how far a bf16 step lands from the exact one grows with the share of weights
# near a rounding edge and of gradients near 0, i.e. with the model (measured 0.039 on the tiny model, 0.14 at 0.5B
# against a split-vs-whole bound of 0.2). Both bf16 cuts are instead compared with an fp32 step of the same rows
# from the same weights: the split may land at most BF16_WEIGHTS_FACTOR times as far from it as the whole batch
# does (both carry the same kind of bf16 rounding; a wrong step is O(1) away), with BF16_WEIGHTS_FLOOR for a whole
# batch that lands unusually close.
BF16_WEIGHTS_FACTOR, BF16_WEIGHTS_FLOOR = 2.0, 0.05
# Packed vs padded per-token log-probs: the same maths on differently shaped matmuls and attention kernels; measured
# 2e-8 (fp32) and 3e-5 (bf16, CPU). Bounds 1e-4 and 5e-2 (~13u: flash-attn and sdpa round differently in bf16); a
# row attending across a packing boundary changes log-probs by O(1).
BOUNDS = {
    "fp32": {"loss": 1e-4, "grad_norm": 1e-4, "weights": 1e-3, "logps": 1e-4},
    "bf16": {"loss": 2e-2, "grad_norm": 2e-2, "weights": 0.2, "logps": 5e-2},
}


# ----------------------------------------------------------------------------------------------- helpers
def rel(a, b) -> float:
    """``||a - b|| / ||b||`` in float64 (numbers or tensors)."""
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def within(name: str, value: float, bound: float) -> str:
    return f"{name} {value:.1e}{'<=' if value <= bound else ' >'}{bound:.0e}"


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def random_rows(rows: int, lo: int, hi: int, vocab: int, seed: int, pairs: bool = False):
    """A right-padded ``Batch`` of random tokens, ``(rows, T)`` or ``(rows, 2, T)``, lengths uniform in [lo, hi];
    targets are every token after the first 4 (the "prompt")."""
    import torch

    from rlhf.batch import Batch

    gen = torch.Generator().manual_seed(seed)
    shape = (rows, 2) if pairs else (rows,)
    lengths = torch.randint(lo, hi + 1, shape, generator=gen)
    columns = torch.arange(hi)
    mask = (columns < lengths[..., None]).long()
    ids = torch.randint(4, vocab, (*shape, hi), generator=gen) * mask
    return Batch(input_ids=ids, attention_mask=mask, loss_mask=mask * (columns >= 4).long())


# ----------------------------------------------------------------------------------------------- checks
def build_worker(role: str, model_path: str, precision: str, micro: int):
    """A one-rank ``TrainerWorker`` (the process group is already up) training the model on ``--zero-stage``."""
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.worker import TrainerWorker
    from rlhf.models.loading import ModelSpec

    worker = TrainerWorker(role, 0, 1, num_threads=THREADS or os.cpu_count() or 1)
    worker.device = DEVICE
    worker.build(
        ModelSpec(path=model_path, precision=precision, attn_implementation="auto"),
        EngineSpec.for_global_batch(GLOBAL_BATCH, micro, 1, zero_stage=ZERO_STAGE, precision=precision),
        OptimSpec(lr=1e-3, total_steps=1, max_grad_norm=0.0),
    )  # no clipping: the norm is compared raw
    return worker


def one_step(worker, batch, objective, perturb: float = 1.0) -> dict:
    """One optimizer step on ``batch`` cut as the worker's spec says -> loss, grad norm, weights before/after."""
    import torch

    from rlhf.distributed.engine import iter_full_state
    from rlhf.distributed.micro_batches import cut_by_rows

    spec = worker.engine.spec
    shard = cut_by_rows(len(batch), 1, spec.micro_batch_size).micro_batches[0]
    micro = [batch.select(rows).trim().contiguous() for rows in shard]  # as WorkerGroup cuts a global batch
    normalizer = sum(objective.count(mb) for mb in micro)  # over the whole batch, before the first backward
    # every weight whole (ZeRO-3 partitions gathered), in the state dict's order
    flat = lambda: torch.cat([t.double().flatten() for _, t in iter_full_state(worker.model, ZERO_STAGE)])  # noqa: E731
    start = flat()
    result = worker.train_step(micro, objective, normalizer * perturb)
    return {
        "loss": objective.finalize(result.sums, normalizer)["loss"],
        "grad_norm": result.grad_norm,
        "start": start,
        "end": flat(),
        "applied": worker.engine.last_step_applied,
        "optimizer": type(worker.engine.optimizer.optimizer).__name__
        if hasattr(worker.engine.optimizer, "optimizer")
        else type(worker.engine.optimizer).__name__,
    }


def release() -> None:
    """Free the engines and models of a finished check before the next one builds its own (``--model`` may be big)."""
    import torch

    gc.collect()  # DeepSpeed engines hold reference cycles
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


# What the check's other processes (the IPC receiver, the sequence-parallel ranks) import: on the CPU twin a fork
# server imports it once and forks each of them from there (processes()).
CHILD_IMPORTS = [
    "torch",
    "deepspeed",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "torch.utils.cpp_extension",
    "rlhf.models.head",
    "rlhf.models.sequence_parallel",
    "rlhf.rollout.vllm.extension",
]


def processes():
    """The multiprocessing context of the check's other processes. On CUDA ``spawn``: CUDA cannot be re-initialised
    in a forked child. On the CPU twin a fork server that imported :data:`CHILD_IMPORTS` once (started early by
    :func:`run`): each spawned process spent 2 to 5 s on its own imports."""
    import multiprocessing

    if DEVICE.type == "cuda":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(CHILD_IMPORTS)
    return context


def check_split_vs_whole(name, model_path, precision, batch, objective, perturb) -> list:
    """The same global batch, the same starting weights: one step whole, one step split (in bf16 also one fp32 step,
    the reference of the weights row)."""
    whole = one_step(build_worker(f"{name}-whole", model_path, precision, GLOBAL_BATCH), batch, objective)
    release()
    split = one_step(build_worker(f"{name}-split", model_path, precision, SPLIT_MICRO), batch, objective, perturb)
    release()
    bounds = dict(BOUNDS[precision])
    diffs = {
        "loss": rel(split["loss"], whole["loss"]),
        "grad_norm": rel(split["grad_norm"], whole["grad_norm"]),
        "weights": rel(split["end"] - split["start"], whole["end"] - whole["start"]),
    }
    if precision == "bf16":
        exact = one_step(build_worker(f"{name}-fp32", model_path, "fp32", GLOBAL_BATCH), batch, objective)
        release()
        update = exact["end"] - exact["start"]
        whole_off = rel(whole["end"] - whole["start"], update)
        diffs["weights"] = rel(split["end"] - split["start"], update)
        bounds["weights"] = max(BF16_WEIGHTS_FLOOR, BF16_WEIGHTS_FACTOR * whole_off)
    ok = all(diffs[k] <= bounds[k] for k in diffs) and bool((split["start"] == whole["start"]).all())
    detail = "  ".join(within(k, v, bounds[k]) for k, v in diffs.items())
    if precision == "bf16":
        detail += f" (split vs an fp32 step; whole {whole_off:.1e})"
    rows = [(f"{name}: micro {GLOBAL_BATCH}xGA1 vs {SPLIT_MICRO}xGA{GLOBAL_BATCH // SPLIT_MICRO}", ok, detail, "")]
    if name == "sft":  # the engine row: built, stepped, moved the weights, with a finite norm
        engine_ok = whole["applied"] and math.isfinite(whole["grad_norm"]) and rel(whole["end"], whole["start"]) > 0
        rows.insert(
            0,
            (
                f"engine: ZeRO {ZERO_STAGE} {precision}, {whole['optimizer']}",
                engine_ok,
                f"grad_norm {whole['grad_norm']:.4g}  loss {whole['loss']:.4f}",
                "",
            ),
        )
    return rows


def check_dpo(model_path: str, precision: str, vocab: int, perturb: float) -> list:
    """Split vs whole for DPO; the reference log-probs are the starting policy's, from a frozen load of it."""
    import torch

    from rlhf.models.loading import ModelSpec, load_model
    from rlhf.objectives.dpo import DPOObjective, ReferenceLogps

    pairs = random_rows(GLOBAL_BATCH, 8, 48, vocab, seed=2, pairs=True)
    with torch.no_grad():
        reference = load_model(ModelSpec(path=model_path, precision=precision)).to(DEVICE).eval()
        pairs = pairs.replace(ref_logps=ReferenceLogps()(reference, pairs.to(DEVICE)).cpu())
    del reference
    return check_split_vs_whole("dpo", model_path, precision, pairs, DPOObjective(), perturb)


def check_packing(model_path: str, precision: str, vocab: int) -> tuple:
    """Packed vs padded forward of the same weights: per-token log-probs on the targets, and real tokens/s."""
    import torch

    from rlhf.models.loading import ModelSpec, load_model
    from rlhf.models.packing import packed_attention, varlen_kernel
    from rlhf.objectives.sft import causal_lm_token_logps
    from rlhf.utils.device import resolve_attn_implementation, torch_dtype

    padded_attn = resolve_attn_implementation("auto", precision)
    rows, longest = (16, 512) if DEVICE.type == "cuda" else (8, 128)
    batch = random_rows(rows, 8, longest, vocab, seed=7).to(DEVICE)
    results = {}
    for label, attn, packing in (("padded", padded_attn, False), ("packed", packed_attention(padded_attn), True)):
        model = (
            load_model(ModelSpec(path=model_path, precision=precision, attn_implementation=attn, packing=packing))
            .to(DEVICE)
            .eval()
        )
        with torch.no_grad():
            logps = causal_lm_token_logps(model, batch.input_ids, batch.attention_mask, packing)  # warm-up too
            times = []
            for _ in range(3):
                sync(DEVICE)
                started = time.perf_counter()
                causal_lm_token_logps(model, batch.input_ids, batch.attention_mask, packing)
                sync(DEVICE)
                times.append(time.perf_counter() - started)
        results[label] = (logps[batch.loss_mask.bool()], int(batch.attention_mask.sum()) / min(times))
        del model
        release()
    diff, bound = rel(results["packed"][0], results["padded"][0]), BOUNDS[precision]["logps"]
    kernel = (
        "flash-attn varlen"
        if packed_attention(padded_attn) == "flash_attention_2"
        else varlen_kernel(DEVICE, torch_dtype(precision))
    )
    tokens = f"padded {results['padded'][1]:,.0f} / packed {results['packed'][1]:,.0f}"
    return (f"packing: {kernel} vs padded {padded_attn}", diff <= bound, within("logps", diff, bound), tokens)


def check_head(model_path: str, precision: str, vocab: int) -> list:
    """The LM head in tiles against the whole logits, forward and backward, at the model's width and vocabulary."""
    import torch
    from transformers import AutoConfig

    from rlhf.ops.logprobs import SamplingFilter, head_token_logprobs, token_logprobs, token_logprobs_with_entropy
    from rlhf.utils.device import torch_dtype

    width, dtype = AutoConfig.from_pretrained(model_path).hidden_size, torch_dtype(precision)
    tokens = 4096 if DEVICE.type == "cuda" else 256
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, tokens, width, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(vocab, width, generator=gen) * width**-0.5).to(DEVICE, dtype)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen).to(DEVICE)
    coefs = torch.randn(1, tokens, generator=gen).to(DEVICE)

    def whole(h, w, sampling_filter, bonus):
        logits = torch.nn.functional.linear(h, w)
        if not bonus:
            return token_logprobs(logits, ids, 1.0, sampling_filter), None
        return token_logprobs_with_entropy(logits, ids, 1.0, sampling_filter, entropy_grad=True)

    def tiled(h, w, sampling_filter, bonus):
        return head_token_logprobs(h, w, None, ids, 1.0, sampling_filter, entropy=bool(bonus))

    rows = []
    # SFT's and DPO's case (log-probs alone: the backward in tiles of the vocabulary), and an RL update's with a
    # top-p sampler and an entropy bonus (tiles of tokens)
    for label, sampling_filter, bonus in (
        ("head tiles: vocabulary", None, 0.0),
        ("head tiles: tokens, top-p", SamplingFilter(top_p=0.9), 0.01),
    ):
        results = {}
        for way, fn in (("whole", whole), ("tiled", tiled)):
            for _ in range(2):  # the second is timed
                h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                release()
                if DEVICE.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                sync(DEVICE)
                started = time.perf_counter()
                logps, entropy = fn(h, w, sampling_filter, bonus)
                loss = (logps * coefs).sum()
                (loss if entropy is None else loss + bonus * (entropy * coefs).sum()).backward()
                sync(DEVICE)
                seconds = time.perf_counter() - started
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if DEVICE.type == "cuda" else ""
            outputs = [logps, h.grad, w.grad] + ([] if entropy is None else [entropy])
            results[way] = ([t.detach() for t in outputs], seconds, peak)
        worst = max(rel(a, b) for a, b in zip(results["tiled"][0], results["whole"][0]))
        bound = BOUNDS[precision]["loss"]
        speed = " / ".join(f"{way} {results[way][1] * 1e3:.0f} ms{results[way][2]}" for way in results)
        rows.append((label, worst <= bound, within("worst of logps, grads, entropy", worst, bound), speed))
    return rows


def digest(tensor) -> str:
    """SHA-256 of a tensor's bytes (any dtype, any device)."""
    import torch

    flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    return hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()


def receive(conn, device_type: str) -> None:
    """The receiver process (a hybrid engine's worker): the vLLM worker extension's IPC load path with a model that
    keeps what it is given; answers each call, and ``finish`` with every tensor's digest."""
    import torch

    from rlhf.rollout.vllm.extension import WeightSyncExtension

    class Model:
        received: dict = {}

        def load_weights(self, weights):
            self.received.update({name: tensor.clone() for name, tensor in weights})

    class Runner:
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        model = Model()

    extension = WeightSyncExtension()
    extension.model_runner = Runner()
    while True:
        call, args = conn.recv()
        if call == "begin_weight_update":  # the extension's, without vLLM's layerwise reload
            extension._rlhf_start_record(*args)
            conn.send(None)
        elif call == "load_weights":
            conn.send(extension.rlhf_load_shared_bucket(*args))
        elif call == "finish_weight_update":  # its record of the update, and every tensor's digest
            digests = {name: digest(t) for name, t in Runner.model.received.items()}
            conn.send([{**extension._rlhf_record(), "digests": digests}])
            return
        else:
            conn.send(None)


class PipeEngine:
    """What ``IpcSender`` calls (``engine.<method>.remote(...)``), forwarded over a pipe to :func:`receive`; each
    call returns a "ref" whose :meth:`get` waits for the answer (one call is in flight at a time)."""

    def __init__(self, conn, receiver) -> None:
        self.conn, self.receiver = conn, receiver

    def get(self, timeout_s: float = 120.0):
        """The receiver's next answer; an error, not a hang, when it died or went silent."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            if not self.receiver.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the receiver process {'died' if not self.receiver.is_alive() else 'is silent'}"
                    f" (exit code {self.receiver.exitcode})"
                )
        return self.conn.recv()

    def __getattr__(self, call: str):
        engine = self

        class Method:
            @staticmethod
            def remote(*args):
                engine.conn.send(("load_weights" if call == "load_shared_bucket" else call, args))
                return engine

        return Method()


def check_ipc(model_path: str, precision: str) -> tuple:
    """The model's weights through ``IpcSender`` (double-buffered buckets) into another process; digests compared."""
    from rlhf.models.loading import ModelSpec, load_model
    from rlhf.rollout.weights.group import SyncTimeouts
    from rlhf.rollout.weights.senders import IpcSender

    class LocalIpcSender(IpcSender):  # the one Ray call of the sender (gather over actor refs) done over the pipe
        answers: dict = {}

        def _all(self, call, refs):
            self.answers[call] = [ref.get() for ref in refs]
            return self.answers[call]

    model = load_model(ModelSpec(path=model_path, precision=precision)).to(DEVICE)
    context = processes()
    ours, theirs = context.Pipe()
    receiver = context.Process(target=receive, args=(theirs, DEVICE.type), daemon=True)
    receiver.start()
    try:
        engine = PipeEngine(ours, receiver)
        sender = LocalIpcSender(
            engine,
            0,
            bucket_bytes=256 * 1024,  # small: many buckets, both buffers
            timeouts=SyncTimeouts(connect_s=60.0, call_s=120.0),
        )
        sender.connect()
        named = [(n, t.detach().to(sender.device)) for n, t in model.state_dict().items()]
        stats = sender.send(iter(named))
        got = sender.answers["finish_weight_update"][0][0]["digests"]  # the receiver's (send checked its record)
    finally:
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
    want = {name: digest(t) for name, t in named}
    ok = got == want and receiver.exitcode == 0 and stats["buckets"] >= 2
    kind = "CUDA IPC" if sender.device.type == "cuda" else "shared memory"
    return (
        f"ipc: {kind}, {int(stats['buckets'])} buckets",
        ok,
        f"sha256 {sum(got.get(n) == d for n, d in want.items())}/{len(want)} tensors",
        f"{stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.2f} s",
    )


def check_sync_group() -> tuple:
    """The weight-sync group's backend on this device (NCCL on CUDA: ``ProcessGroupNCCL`` on a prefixed store, the
    probe broadcast, one member), and its arrival bound: a second member that never comes is named after the bound
    (``rollout.weight_sync_connect_timeout_s``), before any NCCL rendezvous could wait for it."""
    import torch

    from rlhf.distributed.rendezvous import RendezvousTimeout, host_store
    from rlhf.rollout.weights.group import GroupAddress, SyncGroup, SyncTimeouts

    # The absent member never comes, so any bound proves the wait ends and names it: the CPU twin (a unit test) waits
    # less.
    backend, bound = ("nccl", 2.0) if DEVICE.type == "cuda" else ("gloo", 0.5)
    store = host_store("127.0.0.1", 0, 1, 60.0)
    group = SyncGroup(
        GroupAddress("127.0.0.1", int(store.port), ("policy rank 0",), backend, SyncTimeouts(60.0, 60.0)),
        rank=0,
        store=store,
    )
    data = torch.arange(4096, device=group.device).remainder(251).to(torch.uint8)
    group.broadcast(data)
    sync(DEVICE)
    formed = group.device.type == DEVICE.type and int(data.long().sum()) == sum(i % 251 for i in range(4096))
    group.close()
    members = ("policy rank 0", "rollout engine 0 worker 0")
    store = host_store("127.0.0.1", 0, len(members), 60.0)
    started, named = time.perf_counter(), False
    try:
        SyncGroup(
            GroupAddress("127.0.0.1", int(store.port), members, backend, SyncTimeouts(bound, 60.0)), rank=0, store=store
        )
    except RendezvousTimeout as exc:
        named = f"rollout engine 0 worker 0 did not arrive within {bound:g} s" in str(exc)
    waited = time.perf_counter() - started
    return (
        f"sync group: {backend}, arrival bound",
        formed and named and waited < bound + 10,
        f"1 member {'formed' if formed else 'FAILED'}; absent peer {'named' if named else 'NOT named'} after "
        f"{waited:.1f} s (bound {bound:g} s)",
        "",
    )


def _sequence_rank(
    rank: int, port: int, cuda: bool, model_path: str, precision: str, vocab: int, out, threads=None
) -> None:
    """One rank of the sequence-parallel check (a spawned process): the unsharded and the sharded forward and
    backward of the same rows; rank 0 puts ``(max log-prob difference, max log-prob, gradient difference norm,
    gradient norm)`` on ``out``."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.models.head import token_logprobs_and_entropy
    from rlhf.models.sequence_parallel import enable_sequence_parallel, new_sequence_group
    from rlhf.utils.device import torch_dtype

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if threads:
        torch.set_num_threads(threads)
    torch.distributed.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False)
    batch = random_rows(4, 16, 200, vocab, seed=5)
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(6)).to(device) * mask
    results = []
    for sharded in (False, True):
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch_dtype(precision), attn_implementation="sdpa"
        ).to(device)
        if sharded:
            enable_sequence_parallel(model, new_sequence_group(rank, 2, 2, "sdpa"))
        logps, _ = token_logprobs_and_entropy(model, ids, mask)
        (logps.float() * weights).sum().backward()
        grad = torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])
        if sharded:  # each rank holds its positions' share of the gradient
            torch.distributed.all_reduce(grad)
        results.append((logps.detach().float(), grad))
    (ref_logps, ref_grad), (sp_logps, sp_grad) = results
    real = mask.bool()
    real[:, 0] = False
    if rank == 0:
        out.put(
            (
                float((sp_logps - ref_logps)[real].abs().max()),
                float(ref_logps[real].abs().max()),
                float((sp_grad - ref_grad).norm()),
                float(ref_grad.norm()),
            )
        )
    torch.distributed.destroy_process_group()


def check_sequence_parallel(model_path: str, precision: str, vocab: int) -> tuple:
    """Check 6 (module docstring): two spawned ranks, one device each."""
    import torch

    name = "sequence parallel 2"
    if DEVICE.type == "cuda" and torch.cuda.device_count() < 2:
        return (name, None, "one GPU: NCCL cannot put two ranks on one device (CPU twin: --device cpu)", "")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = processes()
    out = context.Queue()
    ranks = [
        context.Process(
            target=_sequence_rank, args=(rank, port, DEVICE.type == "cuda", model_path, precision, vocab, out, THREADS)
        )
        for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    try:
        logp_diff, logp_max, grad_diff, grad_norm = out.get(timeout=300)
    finally:
        for process in ranks:
            process.join(timeout=60)
    bound = 1e-5 if precision == "fp32" else 5e-2  # fp32: rounding of differently shaped matmuls; bf16: 8 bits
    logp_rel, grad_rel = logp_diff / logp_max, grad_diff / grad_norm
    return (
        name,
        logp_rel <= bound and grad_rel <= bound,
        f"log-probs {within('', logp_rel, bound).strip()}, gradient {within('', grad_rel, bound).strip()}",
        "",
    )


# ----------------------------------------------------------------------------------------------- main
def check_sleep(model_path: str, precision: str, vocab: int) -> tuple:
    """``colocate.trainer_sleep`` (rlhf.distributed.sleep): a rank that took a step (so Adam's states exist) sleeps,
    which must leave (almost) none of its memory on the device, and wakes to the same bits, then steps again. On the
    CPU twin the storages move host to host: the bytes moved must cover the weights and Adam's two moments."""
    import torch

    from rlhf.distributed.engine import iter_full_state
    from rlhf.objectives.sft import SFTObjective

    cuda = DEVICE.type == "cuda"
    allocated = (lambda: torch.cuda.memory_allocated(DEVICE)) if cuda else (lambda: 0)  # noqa: E731
    base = allocated()
    worker = build_worker("sleep", model_path, precision, GLOBAL_BATCH)
    batch = random_rows(GLOBAL_BATCH, 8, 48, vocab, seed=5)
    one_step(worker, batch, SFTObjective())
    state = lambda: [t.clone() for _, t in iter_full_state(worker.model, ZERO_STAGE)]  # noqa: E731
    before, held = state(), allocated() - base
    weights = sum(t.numel() * t.element_size() for t in before)  # the clones: on the device, held apart
    held -= weights
    started = time.perf_counter()
    moved = worker.sleep()
    slept_s, left = time.perf_counter() - started, allocated() - base - weights
    started = time.perf_counter()
    worker.wake()
    woke_s = time.perf_counter() - started
    same = all(torch.equal(a, b) for a, b in zip(before, state()))
    after = one_step(worker, batch, SFTObjective())
    del before
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    if cuda:  # the clones above are the only tensors allowed to stay
        ok = same and left <= 0.05 * held and math.isfinite(after["loss"])
        detail = f"{mib(moved)} to host, {mib(max(left, 0))} of {mib(held)} left on the device, woken bit-equal: {same}"
    else:
        ok = same and moved >= 3 * weights and math.isfinite(after["loss"])
        detail = f"{mib(moved)} moved (weights {mib(weights)}), woken bit-equal: {same}"
    return (f"sleep: {'device to pinned host' if cuda else 'host to host'}", ok, detail,
            f"sleep {slept_s:.2f} s, wake {woke_s:.2f} s")  # fmt: skip


def check_offload(model_path: str, precision: str, vocab: int) -> tuple:
    """``colocate.offload_frozen`` / ``dpo.ref_offload`` (TrainerWorker.sleep_held): the frozen reference a training
    rank holds moves to host memory while the rank trains, which must free (almost) all of its weights' device
    memory, and the score that wakes it is the same bits as before; the time of each way."""
    import torch

    from rlhf.distributed.engine import EngineSpec
    from rlhf.models.loading import ModelSpec
    from rlhf.objectives.actor_critic import TokenLogps
    from rlhf.objectives.sft import SFTObjective

    cuda = DEVICE.type == "cuda"
    allocated = (lambda: torch.cuda.memory_allocated(DEVICE)) if cuda else (lambda: 0)  # noqa: E731
    worker = build_worker("offload", model_path, precision, GLOBAL_BATCH)
    frozen = EngineSpec.for_global_batch(GLOBAL_BATCH, GLOBAL_BATCH, 1, zero_stage=ZERO_STAGE, precision=precision)
    worker.hold("reference", ModelSpec(path=model_path, precision=precision, attn_implementation="auto"), frozen)
    held = sum(getattr(p, "ds_tensor", p).numel() * p.element_size() for p in worker.held["reference"].parameters())
    batch = random_rows(GLOBAL_BATCH, 8, 48, vocab, seed=6)
    score = lambda: worker.score([batch], TokenLogps(), on="reference")[0]  # noqa: E731
    scored = score()
    started = time.perf_counter()
    score()
    score_s = time.perf_counter() - started  # awake: the pass alone
    one_step(worker, batch, SFTObjective())  # Adam's states exist
    before = allocated()
    started = time.perf_counter()
    moved = worker.sleep_held(["reference"])
    offload_s, freed = time.perf_counter() - started, before - allocated()
    after = one_step(worker, batch, SFTObjective())  # trains with the reference in host memory
    started = time.perf_counter()
    same = torch.equal(score(), scored)  # the score wakes it
    wake_s = max(time.perf_counter() - started - score_s, 0.0)
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    ok = same and moved >= held and math.isfinite(after["loss"]) and (not cuda or freed >= 0.95 * held)
    detail = f"{mib(moved)} of the reference's {mib(held)} to host" + (f", {mib(freed)} freed" if cuda else "")
    return (f"offload: {'device to pinned host' if cuda else 'host to host'}", ok,
            f"{detail}, woken by its score bit-equal: {same}",
            f"offload {offload_s:.2f} s, wake ~{wake_s:.2f} s (score {score_s:.2f} s)")  # fmt: skip


def print_table(rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def run(args) -> int:
    import torch

    from rlhf.distributed.worker import TrainerWorker
    from rlhf.objectives.sft import SFTObjective

    if DEVICE.type == "cpu" and {"ipc", "sp"} & set(args.checks):
        from multiprocessing import forkserver

        processes()
        forkserver.ensure_running()  # its imports run while the first checks do
    model_path = args.model
    if model_path is None and args.size:
        from rlhf.models.sizes import build_sized_model

        model_path = build_sized_model(
            os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), args.size),
            args.size,
            device=DEVICE.type if DEVICE.type == "cuda" else None,
        )
    if model_path is None:
        from rlhf.models.tiny import build_tiny_model

        model_path = build_tiny_model(os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), "tiny"), seed=0)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    TrainerWorker("gpu-check", 0, 1).init_process_group(
        "127.0.0.1", port, "nccl" if DEVICE.type == "cuda" else "gloo", timeout_s=60
    )

    precision, perturb = args.precision, args.perturb_normalizer
    checks = {  # --checks name: (the row's name if the check cannot run, the check)
        "sft": (
            "engine + sft",
            lambda: check_split_vs_whole(
                "sft", model_path, precision, random_rows(GLOBAL_BATCH, 8, 48, vocab, seed=1), SFTObjective(), perturb
            ),
        ),
        "dpo": ("dpo", lambda: check_dpo(model_path, precision, vocab, perturb)),
        "packing": ("packing", lambda: [check_packing(model_path, precision, vocab)]),
        "ipc": ("ipc", lambda: [check_ipc(model_path, precision)]),
        "sync": ("sync group", lambda: [check_sync_group()]),
        "sp": ("sequence parallel", lambda: [check_sequence_parallel(model_path, precision, vocab)]),
        "head": ("head tiles", lambda: check_head(model_path, precision, vocab)),
        "sleep": ("sleep", lambda: [check(model_path, precision, vocab) for check in (check_sleep, check_offload)]),
    }
    assert tuple(checks) == CHECKS
    if DEVICE.type == "cpu":
        # The CPU twin calls release() some 20 times, and a collection walks every object the imports made (~0.25 s
        # each): freeze them (none is garbage after this collection) and release() collects what the checks made.
        gc.collect()
        gc.freeze()
    rows = []
    for name, check in (checks[key] for key in args.checks):
        done = len(rows)
        try:
            rows += check()
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a failed row, the others still run
            traceback.print_exc()
            rows.append((name, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}", ""))
        release()
        for row, ok, detail, speed in rows[done:]:  # as each check ends: a run cut short still shows its rows
            verdict = "SKIP" if ok is None else "PASS" if ok else "FAIL"
            print(f"CHECK {row}: {verdict}  {detail}  {speed}  ({time.perf_counter() - STARTED:.0f} s)", flush=True)
    gc.unfreeze()  # the interpreter's exit collects everything again
    table = [("check", "result", "relative differences (<= bound)", "tokens/s | throughput")]
    table += [
        (name, "SKIP" if ok is None else "PASS" if ok else "FAIL", detail, speed) for name, ok, detail, speed in rows
    ]
    print(
        f"\nrlhf one-GPU check on {torch.cuda.get_device_name(0) if DEVICE.type == 'cuda' else 'cpu'}, "
        f"{args.precision}, model {model_path}, {time.perf_counter() - STARTED:.0f} s"
    )
    print_table(table)
    failed = [r[0] for r in rows if r[1] is False]
    torch.distributed.destroy_process_group()  # NCCL warns at exit otherwise
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'ALL PASSED'}")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--precision", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu"
    )
    parser.add_argument("--model", default=None, help="an HF causal LM directory (default: a tiny Qwen2 built here)")
    parser.add_argument(
        "--size", choices=("tiny", "small", "0.5b", "1.5b", "7b"), default=None,
        help="instead of --model: a Qwen2-shaped random init of this size, built here (rlhf.models.sizes)",
    )  # fmt: skip
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=0,
        help="the engine's ZeRO stage for the engine, sft and dpo rows (runs use 2 by default)",
    )
    parser.add_argument(
        "--checks",
        default=",".join(CHECKS),
        help=f"the checks to run, comma-separated (default: all of {', '.join(CHECKS)}; sft includes the engine row)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's threads in each process of the check (default: torch's; the engine rows' worker all cores)",
    )
    parser.add_argument("--perturb-normalizer", type=float, default=1.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.checks = [name.strip() for name in args.checks.split(",") if name.strip()]
    unknown = [name for name in args.checks if name not in CHECKS]
    if unknown or not args.checks:
        parser.error(f"--checks: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(CHECKS)}")
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    if args.device == "cpu":  # the CPU twin, also on a GPU machine: DeepSpeed's CPU accelerator, no CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --device cpu for the CPU twin")
    global DEVICE, ZERO_STAGE, THREADS
    ZERO_STAGE, THREADS = args.zero_stage, args.threads
    if THREADS:
        torch.set_num_threads(THREADS)
    DEVICE = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    return run(args)


CHECKS = ("sft", "dpo", "packing", "ipc", "sync", "sp", "head", "sleep")  # --checks names, in the order the checks run
DEVICE = None  # set by main()
ZERO_STAGE = 0  # set by main()
THREADS = None  # --threads, set by main()

if __name__ == "__main__":
    sys.exit(main())
