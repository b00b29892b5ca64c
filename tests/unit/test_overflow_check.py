"""bf16 on ZeRO 0 where DeepSpeed's own step is kept (FP16_UnfusedOptimizer with expert parameters or model
parallelism; the multi-tensor step, tests/unit/test_unfused_step.py, is switched off here): the overflow test before
each step reads its per-parameter answers back once (rlhf.distributed.overflow_check), and decides what DeepSpeed's
loop decides: clean steps the same bits, a step with one non-finite gradient skipped. The engines run in a subprocess
with its own one-rank gloo group."""

from __future__ import annotations

import pytest
import torch
from shared_helpers import bf16_one_rank_worker, random_sft_step, saved_by_subprocess

STEPS, ROWS, MICRO = 3, 4, 2


def _run(worker, steps: int) -> dict:
    """``steps`` clean steps of 2 micro-batches, then one whose gradient of a single weight is NaN: the traces, the
    weights after the clean steps and after the poisoned one, and the tensors the overflow test read back per step."""
    from rlhf.distributed.engine import iter_full_state
    from rlhf.utils.host_reads import HostReads

    checker = worker.engine.engine.optimizer.overflow_checker
    reads, has_overflow = [], checker.has_overflow

    def counted(params, has_moe_params=None):
        with HostReads() as mode:  # each a device synchronisation on a GPU
            answer = has_overflow(params, has_moe_params)
        reads.append(mode.total)
        return answer

    checker.has_overflow = counted
    gen, trace = torch.Generator().manual_seed(0), []
    for poisoned in [False] * steps + [True]:
        if poisoned:
            clean = {n: t.clone() for n, t in iter_full_state(worker.model, worker.zero_stage)}
            weight = worker.model.get_parameter("model.layers.1.mlp.down_proj.weight")
            hook = weight.register_hook(lambda grad: grad * float("nan"))
        result, _ = random_sft_step(worker, gen, ROWS, MICRO)
        trace.append((result.grad_norm, result.sums["loss_sum"], worker.engine.last_step_applied))
    hook.remove()
    return {
        "trace": trace,
        "clean": clean,
        "after_poisoned_step": {n: t.clone() for n, t in iter_full_state(worker.model, worker.zero_stage)},
        "reads": reads,
        "optimizer": type(worker.engine.engine.optimizer).__name__,
        "parameters": sum(1 for p in worker.model.parameters() if p.requires_grad),
    }


def _train(model_path: str, out_path: str, port: int) -> None:
    """In the subprocess: :func:`_run` with the one-read test and with DeepSpeed's loop."""
    import rlhf.distributed.engine as engine_module
    from rlhf.distributed.worker import TrainerWorker

    TrainerWorker("probe", 0, 1).init_process_group("127.0.0.1", port, "gloo", timeout_s=60)
    one_read, multi_tensor = engine_module.check_overflow_in_one_read, engine_module.unfused_step_applies
    engine_module.unfused_step_applies = lambda optimizer: False  # DeepSpeed's step, the one this test is about
    results = {}
    for label in ("one read", "loop"):
        engine_module.check_overflow_in_one_read = one_read if label == "one read" else lambda optimizer: None
        worker = bf16_one_rank_worker(label, model_path, 0, ROWS, MICRO, STEPS + 1, 1e-3)
        results[label] = _run(worker, STEPS)
    engine_module.check_overflow_in_one_read = one_read
    engine_module.unfused_step_applies = multi_tensor
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    return saved_by_subprocess(__file__, "_train", tiny_model, tmp_path_factory.mktemp("overflow") / "results.pt")


def test_one_read_decides_as_deepspeeds_loop(trained):
    mine, theirs = trained["one read"], trained["loop"]
    assert mine["optimizer"] == theirs["optimizer"] == "FP16_UnfusedOptimizer"
    assert mine["trace"] == theirs["trace"]
    for name, weight in theirs["clean"].items():
        assert torch.equal(mine["clean"][name], weight), name
    # the poisoned step is skipped: reported as infinite and not applied, the weights where the clean steps left them
    assert [applied for _, _, applied in mine["trace"]] == [True] * STEPS + [False]
    assert mine["trace"][-1][0] == float("inf")
    for name, weight in mine["clean"].items():
        assert torch.equal(mine["after_poisoned_step"][name], weight), name


def test_one_read_reads_once_a_step(trained):
    mine, theirs = trained["one read"], trained["loop"]
    assert len(mine["reads"]) == len(theirs["reads"]) == STEPS + 1
    # DeepSpeed's loop: one read per parameter (until the first non-finite one), and the all-reduced flag
    assert theirs["reads"][:STEPS] == [theirs["parameters"] + 1] * STEPS
    assert mine["reads"] == [2] * (STEPS + 1)
