"""fp32 on ZeRO 0: the multi-tensor clip (rlhf.distributed.fp32_clip) takes DeepSpeed's steps bit for bit (clipping
and not), in a few operations where DeepSpeed's ``clip_grad_norm_`` takes two a parameter, and reads nothing back. The
engines run in a subprocess with its own one-rank gloo group."""

from __future__ import annotations

import torch
from shared_helpers import counting, one_rank_worker, random_sft_step, subprocess_fixture

STEPS, ROWS, MICRO = 4, 4, 2  # steps 1-2 clip (max_grad_norm 1.0), 3-4 do not


def _train(model_path: str, out_path: str, port: int) -> None:
    """In the subprocess: per clip (the multi-tensor one, DeepSpeed's), the losses and logged norms of each step, the
    weights after them, and the ops and host reads of each clip."""
    import rlhf.distributed.engine as engine_module
    from rlhf.distributed.engine import iter_full_state
    from rlhf.distributed.worker import TrainerWorker

    TrainerWorker("probe", 0, 1).init_process_group("127.0.0.1", port, "gloo", timeout_s=60)
    applies = engine_module.multi_tensor_clip_applies
    results = {}
    for label in ("multi-tensor", "deepspeed"):
        engine_module.multi_tensor_clip_applies = applies if label == "multi-tensor" else lambda ds_engine: False
        worker = one_rank_worker(label, model_path, 0, ROWS, MICRO, STEPS, 1e-3, precision="fp32")
        ds_engine = worker.engine.engine
        counts: list = []
        ds_engine.clip_fp32_gradients = counting(ds_engine.clip_fp32_gradients, counts)
        gen, trace = torch.Generator().manual_seed(0), []
        for step in range(STEPS):
            if step == STEPS // 2:
                ds_engine._config.gradient_clipping = 1e9  # from here nothing clips
            result, _ = random_sft_step(worker, gen, ROWS, MICRO)
            trace.append((result.grad_norm, result.sums["loss_sum"]))
        results[label] = {
            "trace": trace,
            "weights": {n: t.clone() for n, t in iter_full_state(worker.model, worker.zero_stage)},
            "counts": counts,
            "parameters": sum(1 for p in worker.model.parameters() if p.requires_grad),
            "optimizer": type(ds_engine.optimizer).__name__,
        }
    engine_module.multi_tensor_clip_applies = applies
    torch.save(results, out_path)


trained = subprocess_fixture(__file__)


def test_the_multi_tensor_clip_takes_deepspeeds_steps_bit_for_bit(trained):
    mine, theirs = trained["multi-tensor"], trained["deepspeed"]
    assert mine["optimizer"] == theirs["optimizer"] == "AdamW"  # fp32 on ZeRO 0: DeepSpeed wraps nothing
    assert mine["trace"] == theirs["trace"]  # the losses, and the float64 norms the engine logs
    norms = [norm for norm, _ in mine["trace"]]
    assert all(n > 1.0 for n in norms[: STEPS // 2])  # the first steps clip (max_grad_norm 1.0)
    assert mine["weights"].keys() == theirs["weights"].keys()
    for name, weight in theirs["weights"].items():
        assert torch.equal(mine["weights"][name], weight), name


def test_the_multi_tensor_clip_takes_a_few_operations_and_no_read(trained):
    """DeepSpeed's clip: a norm and a multiply per parameter; this one: the same in one multi-tensor operation each,
    plus the scalar arithmetic (~10 operations whatever the model), and no host read."""
    mine, theirs = trained["multi-tensor"], trained["deepspeed"]
    parameters = mine["parameters"]
    assert len(mine["counts"]) == len(theirs["counts"]) == STEPS
    assert all(ops <= 12 and reads == 0 for ops, reads in mine["counts"]), mine["counts"]
    assert all(ops >= 2 * parameters for ops, _ in theirs["counts"]), (theirs["counts"], parameters)
