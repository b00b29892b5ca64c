"""bf16 on ZeRO 0 where DeepSpeed's own step is kept (FP16_UnfusedOptimizer with expert parameters or model
parallelism; the multi-tensor step, tests/unit/test_unfused_step.py, is switched off here): the overflow test before
each step reads its per-parameter answers back once (rlhf.distributed.overflow_check), and decides what DeepSpeed's
loop decides: clean steps the same bits, a step with one non-finite gradient skipped. The engines run in a subprocess
with its own one-rank gloo group."""

from __future__ import annotations

import torch
from shared_helpers import (
    assert_the_poisoned_step_was_skipped,
    bf16_step_trace,
    one_rank_worker,
    subprocess_fixture,
)

STEPS, ROWS, MICRO = 3, 4, 2  # step 1 clips (max_grad_norm 1.0), 2-3 do not; then one poisoned step


def _run(worker, steps: int) -> dict:
    """:func:`shared_helpers.bf16_step_trace` (``steps`` clean steps of 2 micro-batches, then one whose gradient of a
    single weight is NaN), with the tensors the overflow test read back per step."""
    from rlhf.utils.host_reads import HostReads

    checker = worker.engine.engine.optimizer.overflow_checker
    reads, has_overflow = [], checker.has_overflow

    def counted(params, has_moe_params=None):
        with HostReads() as mode:  # each a device synchronisation on a GPU
            answer = has_overflow(params, has_moe_params)
        reads.append(mode.total)
        return answer

    checker.has_overflow = counted
    run = bf16_step_trace(worker, steps, ROWS, MICRO, lambda o: [t for group in o.fp32_groups for t in group])
    del run["last_micro"]
    run["reads"] = reads
    return run


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
        worker = one_rank_worker(label, model_path, 0, ROWS, MICRO, STEPS + 1, 1e-3)
        results[label] = _run(worker, STEPS)
    engine_module.check_overflow_in_one_read = one_read
    engine_module.unfused_step_applies = multi_tensor
    torch.save(results, out_path)


trained = subprocess_fixture(__file__)


def test_one_read_decides_as_deepspeeds_loop(trained):
    mine, theirs = trained["one read"], trained["loop"]
    assert mine["optimizer"] == theirs["optimizer"] == "FP16_UnfusedOptimizer"
    assert mine["trace"] == theirs["trace"]
    for name, weight in theirs["clean"].items():
        assert torch.equal(mine["clean"][name], weight), name
    # the poisoned step is skipped: reported as infinite and not applied, the weights where the clean steps left them
    assert_the_poisoned_step_was_skipped(mine, STEPS)


def test_one_read_reads_once_a_step(trained):
    mine, theirs = trained["one read"], trained["loop"]
    assert len(mine["reads"]) == len(theirs["reads"]) == STEPS + 1
    # DeepSpeed's loop: one read per parameter (until the first non-finite one), and the all-reduced flag
    assert theirs["reads"][:STEPS] == [theirs["parameters"] + 1] * STEPS
    assert mine["reads"] == [2] * (STEPS + 1)
