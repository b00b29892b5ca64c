"""DeepSpeed's ZeRO-0 bf16 optimizer step in a handful of multi-tensor operations, with DeepSpeed's numbers.

``FP16_UnfusedOptimizer`` (DeepSpeed's wrapper for bf16 weights without ZeRO, what ``strategy.zero_stage=0`` builds in
bf16) keeps a float32 master copy of each parameter and, at every step, walks the parameters in Python several times:
a NaN/infinity test per gradient (one device synchronisation each), a float32 copy and a norm per gradient for the
clipping norm, a second float32 copy per gradient for the optimizer, a multiply per gradient (by 1.0 when nothing
clips), and a copy of each master back into its bf16 weight. At 1.5B (338 tensors) that is ~2,700 kernel launches
and as many Python iterations a step, on a step the host already bounds (docs/performance.md), where the plain
PyTorch loop launches one fused AdamW.

:func:`install_unfused_step` replaces the step with one that copies each group's bf16 gradients into one float32
buffer at once (``_foreach_copy_``), takes the per-parameter norms from those copies at once (``_foreach_norm``),
multiplies each buffer once when it clips and copies the masters back at once. What each element goes through is
DeepSpeed's: the same widening copy, the same per-parameter float32 norm, squared and summed in the same order, the
same ``max_norm / (norm + 1e-6)`` factor, the same rounding back to bf16. On a CPU the multi-tensor operations run
the per-tensor kernels, and the norms, masters and weights are DeepSpeed's bit for bit
(tests/unit/test_unfused_step.py); on a GPU their fused kernels may round a norm differently in its last bit.

DeepSpeed's separate NaN/infinity test is not run: a non-finite gradient makes its norm non-finite, and DeepSpeed's
step already skips on a non-finite norm, reporting it infinite, as the test would have: the same steps are skipped.
"""

from __future__ import annotations

import math
from typing import Any, List, Tuple

import torch


def unfused_step_applies(optimizer: Any) -> bool:
    """Whether ``optimizer`` (an ``FP16_UnfusedOptimizer``) takes a step this reproduces: bf16, no fused LAMB, no model
    parallelism (its norm would be reduced over a model-parallel group) and no expert (MoE) parameters."""
    from deepspeed.moe.utils import is_moe_param

    return (
        optimizer.low_precision_dtype == torch.bfloat16
        and not optimizer.fused_lamb_legacy
        and optimizer.mpu is None
        and not any(is_moe_param(p) for group in optimizer.fp16_groups for p in group)
    )


def install_unfused_step(optimizer: Any) -> None:
    """Make ``optimizer.step`` (an ``FP16_UnfusedOptimizer`` that :func:`unfused_step_applies`) the multi-tensor
    step."""

    def step(closure: Any = None) -> bool:
        if closure is not None:
            raise NotImplementedError(f"{type(optimizer).__name__} does not support closure.")
        optimizer.overflow = False
        buffers, views = _float32_gradients(optimizer)
        norms = [_group_norm(v, w) for v, w in zip(views, optimizer.fp16_groups)]
        optimizer._global_grad_norm = _global_norm(norms)
        if not math.isfinite(optimizer._global_grad_norm):  # a NaN or an infinity in some gradient
            return optimizer._skip_invalid_grad_norm()
        optimizer._update_scale(False)
        factor = 1.0 / optimizer.unscale_and_clip_grads(optimizer._global_grad_norm, apply_scale=False)
        if factor != 1.0:  # DeepSpeed multiplies every gradient, by 1.0 when nothing clips: the same bits
            for buffer in buffers:
                buffer.mul_(factor)
        optimizer.optimizer.step()
        for masters, weights in zip(optimizer.fp32_groups, optimizer.fp16_groups):
            for master in masters:
                master.grad = None
            with torch.no_grad():  # the masters rounded into the bf16 weights (leaves that take gradients)
                torch._foreach_copy_(weights, masters)
        return optimizer.overflow

    optimizer.step = step


def _float32_gradients(optimizer: Any) -> Tuple[List[torch.Tensor], List[List[torch.Tensor]]]:
    """Each group's bf16 gradients widened into one new float32 buffer (zeros where a parameter has none), the masters'
    ``.grad`` views of it: what DeepSpeed's ``fp16_param.grad.to(float32)`` per parameter makes, in one copy.
    Returns the buffers and, per group, the views."""
    buffers, all_views = [], []
    for masters, weights in zip(optimizer.fp32_groups, optimizer.fp16_groups):
        sizes = [m.numel() for m in masters]
        device = masters[0].device if masters else torch.device("cpu")
        buffer = torch.empty(sum(sizes), dtype=torch.float32, device=device)
        views = [v.view(m.shape) for v, m in zip(buffer.split(sizes), masters)]
        have = [(view, w.grad) for view, w in zip(views, weights) if w.grad is not None]
        if have:
            torch._foreach_copy_([view for view, _ in have], [grad for _, grad in have])
        for view, w in zip(views, weights):
            if w.grad is None:
                view.zero_()
        for master, view in zip(masters, views):
            master.grad = view
        buffers.append(buffer)
        all_views.append(views)
    return buffers, all_views


def _group_norm(views: List[torch.Tensor], weights: List[torch.nn.Parameter]) -> float:
    """DeepSpeed's ``get_weight_norm`` of a group's gradients (those of the weights that have one): each one's float32
    2-norm, squared and added in order onto ``0.``, read back as a float, its square root; -1 when that is not
    finite (DeepSpeed's mark). Taken from the float32 copies (``views``, the masters' new ``.grad``): the very values
    DeepSpeed's ``grad.float()`` makes, without making them again."""
    widened = [view for view, w in zip(views, weights) if w.grad is not None]
    if not widened:
        return 0.0
    total: Any = 0.0
    for square in torch._foreach_pow(torch._foreach_norm(widened, 2), 2.0):
        total = total + square
    norm = float(total) ** 0.5
    return norm if math.isfinite(norm) else -1.0


def _global_norm(norms: List[float]) -> float:
    """DeepSpeed's ``get_global_norm``: infinite if any group's norm is marked invalid, else the root of the sum of
    their squares (in Python floats, in order)."""
    if any(not math.isfinite(n) or n < 0 for n in norms):
        return float("inf")
    return math.sqrt(sum(n**2.0 for n in norms))
