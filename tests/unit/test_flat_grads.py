"""bf16 on ZeRO 1 (DeepSpeed's BF16_Optimizer, what a one-GPU bf16 run builds): the micro-batch gradients are views of
one flat bf16 buffer per group and reach the float32 sums in one add per group, clipped in one multiply per group
(rlhf.distributed.flat_grads), with the norms, losses, float32 masters and weights of DeepSpeed's own per-parameter
loop, bit for bit. The engines run in a subprocess with its own one-rank gloo group."""

from __future__ import annotations

import pytest
import torch
from shared_helpers import bf16_one_rank_worker, random_sft_step, saved_by_subprocess

STEPS, ROWS, MICRO, LR = 3, 6, 2, 1e-3


def _train(model_path: str, out_path: str, port: int) -> None:
    """In the subprocess: the same 3 steps of 3 uneven micro-batches on a bf16 ZeRO-1 engine with the flat gradients
    and with DeepSpeed's loop (the flat path switched off); per run the step trace, the weights, the float32
    masters, how many times DeepSpeed's per-parameter update ran, and where each ``.grad`` lives mid-window."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from rlhf.distributed.engine import iter_full_state
    from rlhf.distributed.flat_grads import FlatLowPrecisionGrads
    from rlhf.distributed.worker import TrainerWorker, normalize
    from rlhf.objectives.sft import SFTObjective
    from rlhf.utils.host_reads import HostReads

    TrainerWorker("probe", 0, 1).init_process_group("127.0.0.1", port, "gloo", timeout_s=60)
    loop_calls = [0]
    per_parameter = BF16_Optimizer._update_hp_grad

    def counted(self, *args, **kwargs):
        loop_calls[0] += 1
        return per_parameter(self, *args, **kwargs)

    BF16_Optimizer._update_hp_grad = counted
    applies = FlatLowPrecisionGrads.applies_to
    results = {}
    for label in ("flat", "loop"):
        FlatLowPrecisionGrads.applies_to = staticmethod(applies if label == "flat" else lambda optimizer: False)
        loop_calls[0] = 0
        worker = bf16_one_rank_worker(label, model_path, 1, ROWS, MICRO, STEPS, LR)
        optimizer = worker.engine.engine.optimizer
        gen, trace, objective = torch.Generator().manual_seed(0), [], SFTObjective()
        for _ in range(STEPS):
            result, micro = random_sft_step(worker, gen, ROWS, MICRO)
            trace.append((result.grad_norm, result.sums["loss_sum"]))
        results[label] = {
            "optimizer": type(optimizer).__name__,
            "trace": trace,
            "weights": {n: t.clone() for n, t in iter_full_state(worker.model, worker.zero_stage)},
            "masters": [t.detach().clone() for t in optimizer.fp32_groups_flat_partition],
            "loop_calls": loop_calls[0],
            "grads_after_step": [p.grad is None for p in worker.model.parameters()],
        }
        # one backward of a new window, not its last: where each parameter's gradient now lives
        loss, _ = objective.loss(worker.engine, micro[0])
        loss = normalize(loss, objective.count(micro[0]), 1)  # the count: the driver's, from the host batch
        with HostReads() as reads:  # a backward that is not the window's last: nothing for the host to wait for
            worker.engine.micro_step(loss, is_last=False)
        results[label]["micro_step_reads"] = reads.by_op
        flats = getattr(optimizer.update_hp_grads, "__self__", None)
        spans = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in getattr(flats, "flats", [])]
        results[label]["grads_in_flat"] = [
            any(lo <= p.grad.data_ptr() < hi for lo, hi in spans) for p in worker.model.parameters()
        ]
        results[label]["hp_sum"] = [g.detach().clone() for g in optimizer.fp32_groups_gradients_flat]
    FlatLowPrecisionGrads.applies_to = applies
    BF16_Optimizer._update_hp_grad = per_parameter
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    return saved_by_subprocess(__file__, "_train", tiny_model, tmp_path_factory.mktemp("flat") / "results.pt")


def test_flat_gradients_take_the_steps_of_deepspeeds_loop_bit_for_bit(trained):
    flat, loop = trained["flat"], trained["loop"]
    assert flat["optimizer"] == loop["optimizer"] == "BF16_Optimizer"
    assert flat["trace"] == loop["trace"]  # the same losses and pre-clip norms, as Python floats
    assert all(norm > 1.0 for norm, _ in flat["trace"])  # max_grad_norm 1.0: every step clips
    assert flat["weights"].keys() == loop["weights"].keys()
    for name, weight in loop["weights"].items():
        assert torch.equal(flat["weights"][name], weight), name
    for mine, theirs in zip(flat["masters"], loop["masters"]):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(flat["hp_sum"], loop["hp_sum"]):  # a window's first micro-batch, mid-window
        assert torch.equal(mine, theirs)


def test_flat_gradients_replace_the_per_parameter_loop(trained):
    flat, loop = trained["flat"], trained["loop"]
    parameters = len(flat["grads_in_flat"])
    assert loop["loop_calls"] == STEPS * (ROWS // MICRO) * parameters  # DeepSpeed's: every parameter, every backward
    assert flat["loop_calls"] == 0
    assert all(flat["grads_in_flat"]) and not any(loop["grads_in_flat"])
    assert all(flat["grads_after_step"]) and all(loop["grads_after_step"])  # nothing held between steps


def test_a_backward_inside_the_window_reads_nothing_back(trained):
    """No host read in a micro-batch's backward (the loss's own metrics: tests/unit/test_packing.py), so a step's
    waits for the device do not grow with its micro-batches."""
    assert trained["flat"]["micro_step_reads"] == trained["loop"]["micro_step_reads"] == {}
