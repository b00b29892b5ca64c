"""DeepSpeed's ZeRO-0 fp32 gradient clipping in two multi-tensor operations, with DeepSpeed's numbers.

fp32 weights without ZeRO (``strategy.zero_stage=0``, fp32): DeepSpeed wraps no optimizer, and its engine clips the
gradients before the step with ``deepspeed.runtime.utils.clip_grad_norm_``: a Python loop takes each gradient's float32
norm, the norms are stacked, squared, summed and rooted, the total is averaged over the data-parallel ranks with an
all-reduce (every rank holds the same, already reduced gradients: the mean of equal values), and a second loop
multiplies every gradient by ``min(1, max_norm / (norm + 1e-6))`` (by exactly 1.0 when nothing clips). On a model of
many small tensors that is two Python iterations and two operations a parameter each step (the bench's ``narrow`` CPU
model: 579 tensors).

:func:`install_multi_tensor_clip` replaces the engine's ``clip_fp32_gradients`` with the same arithmetic in one
``_foreach_norm`` and one ``_foreach_mul_``: the same per-tensor float32 norms (the per-tensor kernels on a CPU: the
same bits; on a GPU the fused kernel may round a norm in its last bit), squared and summed in the same order, the
same average (on one rank the identity, ``x * 1.0 / 1.0``, so the all-reduce over a group of one is left out), the
same ``max_norm / (norm + 1e-6)`` as a division of two device tensors, the same factor on every element, and nothing
read back to the host. The weights are DeepSpeed's bit for bit (tests/unit/test_fp32_clip.py). The norm the project logs
at ZeRO 0 is its own float64 one (``rlhf.distributed.engine.TrainEngine``); this one only clips.
"""

from __future__ import annotations

from typing import Any, List

import torch

from rlhf.distributed.flat_grads import multi_tensor_norm


def multi_tensor_clip_applies(ds_engine: Any) -> bool:
    """Whether ``ds_engine`` (a DeepSpeed engine) clips with the function this reproduces: fp32 weights without ZeRO
    (bf16 and fp16 wrap an optimizer that clips; ZeRO clips inside its optimizer) and no model parallelism (its norms
    would be summed over the model-parallel group, the duplicates left out)."""
    return (
        ds_engine.zero_optimization_stage() == 0
        and not ds_engine.bfloat16_enabled()
        and not ds_engine.fp16_enabled()
        and ds_engine.mpu is None
        and all(p.dtype == torch.float32 for p in ds_engine.module.parameters() if p.requires_grad)
    )


def install_multi_tensor_clip(ds_engine: Any) -> None:
    """Make ``ds_engine.clip_fp32_gradients`` (an engine that :func:`multi_tensor_clip_applies` to) the
    multi-tensor clip."""
    from deepspeed import comm as dist
    from deepspeed.utils import groups

    def clip_fp32_gradients() -> None:
        grads: List[torch.Tensor] = [p.grad for p in ds_engine.module.parameters() if p.grad is not None]
        if not grads:
            return
        total = multi_tensor_norm(grads)
        group = groups._get_data_parallel_group()
        ranks = dist.get_world_size(group=group)
        if ranks > 1:  # DeepSpeed's mean over ranks of the same norm, rounded as it rounds it
            total = total * 1.0 / float(ranks)
            dist.all_reduce(total, group=group)
        coefficient = torch.full_like(total, ds_engine.gradient_clipping()).div_(total + 1e-6).clamp_(max=1.0)
        torch._foreach_mul_(grads, coefficient)

    ds_engine.clip_fp32_gradients = clip_fp32_gradients
