"""A one-rank group asked for ZeRO 2 or 3 builds ZeRO 1 (rlhf.distributed.engine.effective_zero_stage): nothing to
partition, none of stage 2's per-parameter bucket hooks or stage 3's per-module gathers, and the weights of a real
one-rank ZeRO 2 (or 3) engine: bit for bit in fp32 for ZeRO 2; in bf16 the same fp32 gradient sum (the one-rank
ZeRO 1 skips DeepSpeed's cast of it to bf16 for an all-reduce over one rank), clipped by a norm each optimizer sums
in its own order (~2e-7 apart), so a weight may land one bf16 step away. The engines run in a subprocess with its
own one-rank gloo group."""

from __future__ import annotations

import math

import pytest
import torch
from shared_helpers import random_sft_step, run_main, subprocess_fixture

from rlhf.distributed.engine import effective_zero_stage

STEPS, ROWS, MICRO, LR = 3, 4, 2, 1e-3


def test_effective_stage():
    assert effective_zero_stage(2, 1) == 1
    assert [effective_zero_stage(s, 2) for s in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert [effective_zero_stage(s, 1) for s in (0, 1, 3)] == [0, 1, 1]
    assert [effective_zero_stage(s, 1, offload_optimizer=True) for s in (2, 3)] == [2, 3]


def _train(model_path: str, out_path: str, port: int) -> None:
    """In the subprocess: per precision, a one-rank group asked for ZeRO 2 (built as ZeRO 1) and a real one-rank
    ZeRO 2 (the mapping switched off), each 3 optimizer steps of 2 micro-batches; saves weights, norms, losses and
    the optimizer each built; in fp32 also the same for ZeRO 3, a frozen ZeRO-3 worker's build, the asked-for ZeRO 2
    with ``model.tiled_head`` (the LM head in token tiles, rlhf.models.head) on the real engine, and the asked-for
    ZeRO 2 with DeepSpeed's contiguous gradients (its default, which one rank's fp32 ZeRO 1 turns off); last, how the
    builds left DeepSpeed's Muon module (loaded, compiled or not) and whether networkx was imported."""
    import rlhf.distributed.engine as engine_module
    from rlhf.distributed.engine import EngineSpec, OptimSpec, iter_full_state
    from rlhf.distributed.worker import TrainerWorker
    from rlhf.models.loading import ModelSpec

    TrainerWorker("probe", 0, 1).init_process_group("127.0.0.1", port, "gloo", timeout_s=60)
    mapped = engine_module.effective_zero_stage
    results = {}
    real = lambda stage, *_: stage  # noqa: E731 - the mapping switched off
    cases = [
        (p, 2, label, stage_of, False)
        for p in ("fp32", "bf16")
        for label, stage_of in (("asked 2", mapped), ("real 2", real))
    ]
    cases += [("fp32", 3, "asked 3", mapped, False), ("fp32", 3, "real 3", real, False)]
    cases.append(("fp32", 2, "tiled", mapped, True))
    cases.append(("fp32", 2, "contiguous", mapped, False))
    for precision, stage, label, mapping, tiled in cases:
        engine_module.effective_zero_stage = mapping
        user = {"zero_optimization": {"contiguous_gradients": True}} if label == "contiguous" else None
        spec = EngineSpec(zero_stage=stage, precision=precision, micro_batch_size=MICRO, grad_accum_steps=ROWS // MICRO,
                          user_config=user)  # fmt: skip
        worker = TrainerWorker(label, 0, 1)
        worker.build(
            ModelSpec(path=model_path, precision=precision, tiled_head=tiled),
            spec,
            OptimSpec(lr=LR, total_steps=STEPS, max_grad_norm=1.0),
        )
        gen, trace, tokens = torch.Generator().manual_seed(0), [], 0
        for _ in range(STEPS):
            result, micro = random_sft_step(worker, gen, ROWS, MICRO)
            tokens += sum(int(m.attention_mask.sum()) for m in micro)
            trace.append((result.grad_norm, result.sums["loss_sum"]))
            if len(trace) == 1:
                first = {n: t.clone() for n, t in iter_full_state(worker.model, worker.zero_stage)}
        results[precision, label] = {
            "stage": worker.engine.spec.zero_stage,
            "optimizer": type(worker.engine.engine.optimizer).__name__,
            "hooks": len(getattr(worker.engine.engine.optimizer, "_grad_acc_hooks", [])),
            "weights": {n: t.clone() for n, t in iter_full_state(worker.model, worker.zero_stage)},
            "weights_after_step_1": first,
            "partitioned": any(hasattr(p, "ds_numel") for p in worker.model.parameters()),
            "trace": trace,
            "perf": worker.take_perf(),
            "perf_again": worker.take_perf(),
            "tokens": tokens,
            "matmul_params": worker.model_flops.matmul_params,
        }
    engine_module.effective_zero_stage = mapped
    frozen = TrainerWorker("frozen 3", 0, 1)
    frozen.build(ModelSpec(path=model_path), EngineSpec(zero_stage=3, precision="fp32", micro_batch_size=1,
                                                         grad_accum_steps=1), None)  # fmt: skip
    results["frozen 3"] = {
        "stage": frozen.zero_stage,
        "partitioned": any(hasattr(p, "ds_numel") for p in frozen.model.parameters()),
        "engine": type(frozen.model).__name__,
    }
    import sys

    from deepspeed.runtime.zero.muon import original_muon

    from rlhf.utils.startup import DEEPSPEED_MUON

    results["muon"] = {  # what the builds above left loaded (rlhf.utils.startup.import_deepspeed_muon_uncompiled)
        "loaded": DEEPSPEED_MUON in sys.modules,
        "compiled": hasattr(original_muon.muon_update, "_torchdynamo_orig_callable"),
        "networkx": "networkx" in sys.modules,
    }
    torch.save(results, out_path)


trained = subprocess_fixture(__file__)


def test_the_engines_loaded_deepspeeds_muon_module_without_compiling_it(trained):
    """DeepSpeed's optimizers import its Muon module in every build; TrainEngine loads it first with
    ``torch.compile`` off: its kernels as written, and none of the compiler's imports (networkx the largest)."""
    assert trained["muon"] == {"loaded": True, "compiled": False, "networkx": False}


def test_asked_zero2_builds_zero1_with_the_weights_of_a_real_zero2_in_fp32(trained):
    asked, real = trained["fp32", "asked 2"], trained["fp32", "real 2"]
    assert asked["stage"] == 1 and real["stage"] == 2 and asked["optimizer"] == "DeepSpeedZeroOptimizer"
    numel = sum(w.numel() for w in real["weights"].values())
    for (norm_a, loss_a), (norm_r, loss_r) in zip(asked["trace"], real["trace"]):
        # the same weights: the same losses; the norms are each stage's float32 sum of squares, maybe in its own order
        assert loss_a == loss_r and abs(norm_a - norm_r) <= 2 * math.log2(numel) * 2**-24 * norm_r
    assert asked["weights"].keys() == real["weights"].keys()
    for name, weight in real["weights"].items():
        assert torch.equal(asked["weights"][name], weight), name


def test_asked_zero2_builds_zero1_and_steps_as_a_real_zero2_in_bf16(trained):
    """bf16: step 1 starts from the same weights and sums the same fp32 gradient; only the pre-clip norm is each
    optimizer's own float32 sum of squares (pairwise: within log2(n) roundings of 2^-24 each). So the first norms
    agree to that, and the weights after step 1 to one bf16 rounding (2^-7 of their size). From step 2 on the two
    forwards run on weights a rounding apart, and bf16's own noise steers Adam where a gradient is ~0: each later step
    moves a weight by at most lr * max|m_hat / sqrt(v_hat)| (<= 1.01 for betas (0.9, 0.95) in 3 steps, by
    Cauchy-Schwarz), so the runs end within 2 * 1.01 * lr per later step and a rounding of each other. (How far
    those later steps land is the CPU's bf16 kernels' business: measured 2.4e-4 on an AMD EPYC with avx512_bf16.)"""
    asked, real = trained["bf16", "asked 2"], trained["bf16", "real 2"]
    assert asked["stage"] == 1 and real["stage"] == 2 and asked["optimizer"] == "BF16_Optimizer"
    numel = sum(w.numel() for w in real["weights"].values())
    (norm_a, loss_a), (norm_r, loss_r) = asked["trace"][0], real["trace"][0]
    assert loss_a == loss_r
    assert abs(norm_a - norm_r) <= 2 * math.log2(numel) * 2**-24 * norm_r
    later_steps = 2 * 1.01 * LR * (STEPS - 1)
    for key, slack in (("weights_after_step_1", 0.0), ("weights", later_steps)):
        assert asked[key].keys() == real[key].keys()
        for name, weight in real[key].items():
            mine, theirs = asked[key][name].double(), weight.double()
            rounding = 2**-7 * torch.maximum(mine.abs(), theirs.abs())
            assert bool(((mine - theirs).abs() <= slack + rounding).all()), (key, name)


def test_one_rank_fp32_zero1_takes_no_hook_and_the_steps_of_contiguous_gradients(trained):
    """DeepSpeed's fp32 ZeRO-1 optimizer hooks every parameter when gradients are kept contiguous; one rank turns
    that off (rlhf.distributed.engine.build_ds_config) and must take the same steps: the same losses, norms and
    weights, bit for bit, as the engine with DeepSpeed's default."""
    ours, default = trained["fp32", "asked 2"], trained["fp32", "contiguous"]
    assert (ours["stage"], default["stage"]) == (1, 1)
    assert ours["hooks"] == 0 and default["hooks"] == len(default["weights"])
    assert ours["trace"] == default["trace"]
    for name, weight in default["weights"].items():
        assert torch.equal(ours["weights"][name], weight), name


def test_asked_zero3_builds_zero1_with_the_weights_of_a_real_zero3(trained):
    """fp32: the one-rank ZeRO 1 a ZeRO-3 request builds takes the steps of a real one-rank ZeRO 3 (its weights
    gathered whole). Step 1 starts from the same weights: the same loss, and norms within float32 rounding (of the
    gradients' sums and the norm's own: 2 log2(n) roundings). The gradients are each engine's own float32 sums (ZeRO
    3's linear layers have a backward of their own), a few roundings apart even without clipping (measured), and so
    are the clipping coefficients: Adam carries that into weights whose gradient is ~0 (k_proj biases, whose gradient
    softmax cancels) as up to lr per step (measured 4.6e-6), and into the others as more than rounding (measured
    <= 2.5e-6 after 3 steps of lr 1e-3). So later losses agree closely, not to the bit: equal at step 2 and 5e-8
    apart at step 3 on one CPU, equal on others."""
    asked, real = trained["fp32", "asked 3"], trained["fp32", "real 3"]
    assert (asked["stage"], real["stage"]) == (1, 3) and (asked["partitioned"], real["partitioned"]) == (False, True)
    assert asked["weights"].keys() == real["weights"].keys()
    numel = sum(w.numel() for w in real["weights"].values())
    (norm_a, loss_a), (norm_r, loss_r) = asked["trace"][0], real["trace"][0]
    assert loss_a == loss_r and abs(norm_a - norm_r) <= 2 * math.log2(numel) * 2**-24 * norm_r
    for (norm_a, loss_a), (norm_r, loss_r) in zip(asked["trace"][1:], real["trace"][1:]):
        assert loss_a == pytest.approx(loss_r, rel=1e-5) and norm_a == pytest.approx(norm_r, rel=1e-5)
    for name, weight in real["weights"].items():
        torch.testing.assert_close(asked["weights"][name], weight, rtol=0, atol=STEPS * LR, msg=name)


def test_a_frozen_one_rank_zero3_worker_holds_a_plain_module(trained):
    """A frozen role (the reference, the reward model) asked for ZeRO 3 on one rank: nothing to partition, so the
    plain module of ZeRO 0-2, not a DeepSpeed engine gathering each module at every forward."""
    frozen = trained["frozen 3"]
    assert (frozen["stage"], frozen["partitioned"]) == (1, False)
    assert frozen["engine"] != "DeepSpeedEngine"


def test_the_worker_accounts_its_steps_for_perf_metrics(trained):
    """``TrainerWorker.take_perf``: the real tokens of every step since the last read, their training FLOPs, the
    seconds spent, no peak on a CPU; read once."""
    run = trained["fp32", "asked 2"]
    work = run["perf"]["work"]["train"]
    assert set(run["perf"]["work"]) == {"train"} and run["perf"]["peak_tflops"] is None
    assert work["tokens"] == run["tokens"] and work["seconds"] > 0
    assert run["matmul_params"] > 0 and work["flops"] >= 6 * run["matmul_params"] * run["tokens"]
    assert run["perf_again"]["work"] == {}


def test_a_tiled_head_trains_on_the_real_engine_as_the_whole_logits(trained):
    """``model.tiled_head`` on a DeepSpeed engine (its head swapped for the identity during the forward, its weight's
    gradient from the tiles): the losses, grad norms and weights of the whole-logits run, to float32 rounding."""
    tiled, whole = trained["fp32", "tiled"], trained["fp32", "asked 2"]
    for (norm_t, loss_t), (norm_w, loss_w) in zip(tiled["trace"], whole["trace"]):
        assert loss_t == pytest.approx(loss_w, rel=1e-6) and norm_t == pytest.approx(norm_w, rel=1e-5)
    for name, weight in whole["weights"].items():  # Adam turns rounding into lr-sized steps where a gradient is ~0
        torch.testing.assert_close(tiled["weights"][name], weight, rtol=0, atol=3e-3, msg=name)


@pytest.mark.parametrize("workers, shown", [(1, True), (2, False)])
def test_the_dry_run_names_the_one_rank_groups_that_build_zero1(workers, shown, tmp_path, capsys, monkeypatch):
    argv = ["--config", "sft_tiny", "--dry-run", "model.path=/m", "data.train_path=/d.jsonl"]
    argv += ["strategy.zero_stage=3", f"train.num_workers={workers}", "train.global_batch_size=8"]
    rc, out, err = run_main("rlhf.cli.train_sft", argv, tmp_path, capsys, monkeypatch)
    assert rc == 0, err
    assert ("DeepSpeed ZeRO-3 (ZeRO-1 on the one-rank policy: nothing to partition)" in out) == shown, out
