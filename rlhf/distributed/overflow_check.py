"""DeepSpeed's ZeRO-0 bf16 overflow test with one device synchronisation a step, not one per parameter.

``FP16_UnfusedOptimizer`` (DeepSpeed's wrapper for bf16 weights without ZeRO) asks before every step whether any
gradient holds a NaN or an infinity, one parameter at a time: ``has_inf_or_nan`` answers with a device scalar and the
loop's ``if`` reads each answer back to the host. On a GPU that is a synchronisation per parameter (one H200, 1.5B:
371 ``cudaStreamSynchronize`` a step), each one draining the queue the host had run ahead into. Here the
per-parameter answers are stacked on the device and read once. The question, DeepSpeed's test for it and what a yes
does (the step is skipped, the norm reported as infinite) are unchanged (tests/unit/test_overflow_check.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def check_overflow_in_one_read(optimizer: Any) -> None:
    """Make ``optimizer``'s overflow checker (a ``CheckOverflow``) read its per-parameter answers back at once."""
    checker = optimizer.overflow_checker

    def has_overflow_serial(params: Iterable[torch.nn.Parameter]) -> bool:
        flags = [checker._has_inf_or_nan(p.grad.data, i) for i, p in enumerate(params) if p.grad is not None]
        return bool(torch.stack(flags).any()) if flags else False

    checker.has_overflow_serial = has_overflow_serial
