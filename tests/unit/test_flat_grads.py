"""bf16 on ZeRO 1 (DeepSpeed's BF16_Optimizer, what a one-GPU bf16 run builds): the micro-batch gradients are views of
one flat bf16 buffer per group and reach the float32 sums in one add per group, and the step takes its clipping norm
in one multi-tensor operation, read back once, and clips one flat tensor per group (rlhf.distributed.flat_grads),
with the norms, losses, float32 masters and weights of DeepSpeed's own per-parameter loops, bit for bit, clipping and
not, and the same skip of a step whose gradient is not finite. The engines run in a subprocess with its own one-rank
gloo group."""

from __future__ import annotations

import torch
from shared_helpers import (
    assert_the_poisoned_step_was_skipped,
    bf16_step_trace,
    one_rank_worker,
    subprocess_fixture,
)

STEPS, ROWS, MICRO, LR = 4, 6, 2, 1e-3  # steps 1-2 clip (max_grad_norm 1.0), 3-4 do not; then one poisoned step


def _train(model_path: str, out_path: str, port: int) -> None:
    """In the subprocess: the same steps of 3 uneven micro-batches (:func:`shared_helpers.bf16_step_trace`) on a
    bf16 ZeRO-1 engine with the flat gradients and step, and with DeepSpeed's loops (the flat path switched off); per
    run also how many times DeepSpeed's per-parameter update ran, and where each ``.grad`` lives mid-window."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

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
        worker = one_rank_worker(label, model_path, 1, ROWS, MICRO, STEPS + 1, LR)
        optimizer = worker.engine.engine.optimizer
        run = bf16_step_trace(worker, STEPS, ROWS, MICRO, lambda o: o.fp32_groups_flat_partition)
        micro = run.pop("last_micro")
        run["loop_calls"] = loop_calls[0]
        run["grads_after_step"] = [p.grad is None for p in worker.model.parameters()]
        run["groups"] = len(optimizer.bf16_groups)
        # one backward of a new window, not its last: where each parameter's gradient now lives
        objective = SFTObjective()
        loss, _ = objective.loss(worker.engine, micro[0])
        loss = normalize(loss, objective.count(micro[0]), 1)  # the count: the driver's, from the host batch
        with HostReads() as reads:  # a backward that is not the window's last: nothing for the host to wait for
            worker.engine.micro_step(loss, is_last=False)
        run["micro_step_reads"] = reads.by_op
        flats = getattr(optimizer.update_hp_grads, "__self__", None)
        spans = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in getattr(flats, "flats", [])]
        run["grads_in_flat"] = [
            any(lo <= p.grad.data_ptr() < hi for lo, hi in spans) for p in worker.model.parameters()
        ]
        run["hp_sum"] = [g.detach().clone() for g in optimizer.fp32_groups_gradients_flat]
        results[label] = run
    FlatLowPrecisionGrads.applies_to = applies
    BF16_Optimizer._update_hp_grad = per_parameter
    torch.save(results, out_path)


trained = subprocess_fixture(__file__)


def test_flat_gradients_take_the_steps_of_deepspeeds_loop_bit_for_bit(trained):
    flat, loop = trained["flat"], trained["loop"]
    assert flat["optimizer"] == loop["optimizer"] == "BF16_Optimizer"
    # the optimizer's norm, the logged norm and the loss of every step, as Python floats, and which steps applied
    assert flat["trace"] == loop["trace"]
    norms = [norm for norm, *_ in flat["trace"][:STEPS]]
    assert all(n > 1.0 for n in norms)  # steps 1-2 clip at 1.0; 3-4 would have, their clip_grad raised
    assert flat["clean"].keys() == loop["clean"].keys()
    for name, weight in loop["clean"].items():
        assert torch.equal(flat["clean"][name], weight), name
    for mine, theirs in zip(flat["masters"], loop["masters"]):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(flat["hp_sum"], loop["hp_sum"]):  # a window's first micro-batch, mid-window
        assert torch.equal(mine, theirs)


def test_a_non_finite_gradient_skips_the_step_as_deepspeed_does(trained):
    for run in trained.values():
        assert_the_poisoned_step_was_skipped(run, STEPS)


def test_flat_gradients_replace_the_per_parameter_loop(trained):
    flat, loop = trained["flat"], trained["loop"]
    parameters = len(flat["grads_in_flat"])
    backwards = (STEPS + 1) * (ROWS // MICRO)
    assert loop["loop_calls"] == backwards * parameters  # DeepSpeed's: every parameter, every backward
    assert flat["loop_calls"] == 0
    assert all(flat["grads_in_flat"]) and not any(loop["grads_in_flat"])
    assert all(flat["grads_after_step"]) and all(loop["grads_after_step"])  # nothing held between steps


def test_the_step_reads_back_once_and_walks_no_parameter_list(trained):
    """DeepSpeed's step takes a norm per parameter and reads twice (the total's validity, the clip coefficient);
    the flat step's operations do not grow with the parameters, and its one read is the norm."""
    flat, loop = trained["flat"], trained["loop"]
    parameters, groups = flat["parameters"], flat["groups"]
    for (ops, reads), (their_ops, their_reads) in zip(flat["counts"][:STEPS], loop["counts"][:STEPS]):
        assert reads == 1
        assert their_reads >= 2
        # a stack, a square, a sum and a root of the norms, the coefficient, a multiply a group, the partitions'
        # copy into the bf16 weights, the sums' zeroing: a fixed handful (one multi-tensor norm counts once)
        assert ops <= 12 + 4 * groups, ops
        assert their_ops >= parameters, their_ops  # a norm per parameter


def test_a_backward_inside_the_window_reads_nothing_back(trained):
    """No host read in a micro-batch's backward (the loss's own metrics: tests/unit/test_packing.py), so a step's
    waits for the device do not grow with its micro-batches."""
    assert trained["flat"]["micro_step_reads"] == trained["loop"]["micro_step_reads"] == {}
