"""bf16 on ZeRO 0 (DeepSpeed's FP16_UnfusedOptimizer): the multi-tensor step (rlhf.distributed.unfused_step) takes
DeepSpeed's steps bit for bit (norms, float32 masters, bf16 weights; clipping and not), skips a step with a
non-finite gradient as DeepSpeed does, reports DeepSpeed's norm, and dispatches a few multi-tensor operations where
DeepSpeed walks every parameter. The engines run in a subprocess with its own one-rank gloo group."""

from __future__ import annotations

import torch
from shared_helpers import (
    assert_the_poisoned_step_was_skipped,
    bf16_step_trace,
    one_rank_worker,
    subprocess_fixture,
)

STEPS, ROWS, MICRO = 4, 4, 2  # steps 1-2 clip (max_grad_norm 1.0), 3-4 do not; then one poisoned step


def _run(worker) -> dict:
    optimizer = worker.engine.engine.optimizer
    run = bf16_step_trace(worker, STEPS, ROWS, MICRO, lambda o: [t for group in o.fp32_groups for t in group])
    run["groups"] = len(optimizer.fp16_groups)
    del run["last_micro"]
    return run


def _train(model_path: str, out_path: str, port: int) -> None:
    """In the subprocess: :func:`_run` with the multi-tensor step and with DeepSpeed's own."""
    import rlhf.distributed.engine as engine_module
    from rlhf.distributed.worker import TrainerWorker

    TrainerWorker("probe", 0, 1).init_process_group("127.0.0.1", port, "gloo", timeout_s=60)
    applies = engine_module.unfused_step_applies
    results = {}
    for label in ("multi-tensor", "deepspeed"):
        engine_module.unfused_step_applies = applies if label == "multi-tensor" else lambda optimizer: False
        worker = one_rank_worker(label, model_path, 0, ROWS, MICRO, STEPS + 1, 1e-3)
        results[label] = _run(worker)
    engine_module.unfused_step_applies = applies
    torch.save(results, out_path)


trained = subprocess_fixture(__file__)


def test_the_multi_tensor_step_takes_deepspeeds_steps_bit_for_bit(trained):
    mine, theirs = trained["multi-tensor"], trained["deepspeed"]
    assert mine["optimizer"] == theirs["optimizer"] == "FP16_UnfusedOptimizer"
    clean_steps = STEPS
    # DeepSpeed's norm (the one that clips) and the losses, as Python floats, step by step
    assert [t[0] for t in mine["trace"][:clean_steps]] == [t[0] for t in theirs["trace"][:clean_steps]]
    assert [t[2] for t in mine["trace"]] == [t[2] for t in theirs["trace"]]
    norms = [t[0] for t in mine["trace"][:clean_steps]]
    assert all(n > 1.0 for n in norms[: STEPS // 2])  # the first steps clip (max_grad_norm 1.0)
    for name, weight in theirs["clean"].items():
        assert torch.equal(mine["clean"][name], weight), name
    for a, b in zip(mine["masters"], theirs["masters"]):
        assert torch.equal(a, b)


def test_the_reported_norm_is_the_one_that_clips(trained):
    mine = trained["multi-tensor"]
    assert all(deepspeed == reported for deepspeed, reported, _, _ in mine["trace"][:STEPS])


def test_a_non_finite_gradient_skips_the_step_as_deepspeed_does(trained):
    for run in trained.values():
        assert_the_poisoned_step_was_skipped(run, STEPS)


def test_the_step_walks_no_parameter_list_in_python_ops(trained):
    mine, theirs = trained["multi-tensor"], trained["deepspeed"]
    parameters, groups = mine["parameters"], mine["groups"]
    for (ops, reads), (their_ops, their_reads) in zip(mine["counts"][:STEPS], theirs["counts"][:STEPS]):
        # per group a handful of multi-tensor operations, and one add per parameter: the norms' ordered sum
        assert ops <= parameters + 16 * groups, ops
        assert their_ops >= 5 * parameters, their_ops  # a copy, a norm, its square, a sum, a multiply, a copy back
        assert reads == groups  # each group's norm, read once
        assert their_reads > reads
