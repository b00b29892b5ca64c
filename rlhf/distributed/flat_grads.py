"""DeepSpeed's bf16 micro-batch gradients moved into its float32 sums in one add per parameter group.

``BF16_Optimizer`` (bf16 weights on ZeRO 1, which a one-GPU run with the default ZeRO 2 builds:
:func:`rlhf.distributed.engine.effective_zero_stage`) keeps each parameter's micro-batch gradient in bf16 in its
``.grad`` and, after every backward, adds it into that parameter's slice of a flat float32 buffer in a Python loop: per
parameter a cast into a new tensor, an add and a dozen attribute look-ups. A 1.5B Qwen2 (338 tensors) at 4
micro-batches a step pays 2,700 kernel launches and 1,352 Python calls a step for it, on a step that the host already
bounds (docs/performance.md).

Here each group's bf16 gradients are views of one flat bf16 buffer laid out as the float32 one (the same parameters in
the same order, its alignment padding at the end). Autograd adds a micro-batch's gradient into its view in place, as
it does into any existing ``.grad``, and moving the micro-batch into the float32 sums is one ``add_`` per group (the
cast happens inside the kernel), clearing it one ``zero_``; the step's clipping multiplies one flat tensor a group
too. Every element sees the operations it saw before (a bf16 gradient summed onto zero, widened to float32, added to
its running sum): the sums, the norm and the weights are the same bits (tests/unit/test_flat_grads.py). The flat
buffers live from a step's first backward to its ``zero_grad``, as the per-parameter gradients they replace did.

The step (:meth:`FlatLowPrecisionGrads.step`, without model parallelism or Muon) is DeepSpeed's with its clipping norm
taken in one multi-tensor operation and read back once. DeepSpeed's takes a norm per parameter in a Python loop (338
launches at 1.5B), marks a non-finite total with a ``-1`` it copies from the host (a blocking copy: on a GPU the host
waits for the device), reads the total back to test it, and reads the clip coefficient back to decide whether to
multiply. Here ``_foreach_norm`` takes the same per-parameter float32 norms (the per-tensor kernels on a CPU: the same
bits; on a GPU its fused kernel may round a norm in its last bit), squared, summed and rooted as DeepSpeed does; the
total is read back once, which decides the skip and is the norm the engine logs; the coefficient, DeepSpeed's
expression, is clamped at 1 and always multiplied (by exactly 1.0 when nothing clips: the same bits), so nothing else
waits.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch


class FlatLowPrecisionGrads:
    """Installs itself on a ``BF16_Optimizer``: its ``clear_lp_grads`` (the backward prologue, and ``zero_grad``),
    ``update_hp_grads`` (the backward epilogue) and ``get_grads_for_norm`` (what the step clips) become the flat
    versions below, and its ``step`` the one below where :meth:`step_applies_to` says it fits."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.groups: List[List[torch.nn.Parameter]] = optimizer.bf16_groups
        self.flats: Optional[List[torch.Tensor]] = None  # one bf16 buffer per group while a step accumulates
        self.views: List[List[torch.Tensor]] = []
        for group, hp_grads in zip(self.groups, optimizer.fp32_groups_gradients):
            for lp, hp in zip(group, hp_grads):
                lp._hp_grad = hp  # what DeepSpeed's loop sets at every update (tensor_fragment's full-grad API)
        self._grads_for_norm = optimizer.get_grads_for_norm
        optimizer.clear_lp_grads = self.clear_lp_grads
        optimizer.update_hp_grads = self.update_hp_grads
        optimizer.get_grads_for_norm = self.get_grads_for_norm
        if self.step_applies_to(optimizer):
            optimizer.step = self.step

    @staticmethod
    def applies_to(optimizer: Any) -> bool:
        """Whether ``optimizer`` takes its gradients the way this replaces: one backward's bf16 ``.grad`` added into
        float32 after the backward (not in a hook per parameter), no expert-parallel gradient correction."""
        return (
            not optimizer.immediate_grad_update
            and optimizer.grad_acc_dtype == torch.float32
            and getattr(optimizer, "autoep_folding_tp_group", None) is None
            and not optimizer.has_moe_layers
        )

    @staticmethod
    def step_applies_to(optimizer: Any) -> bool:
        """Whether :meth:`step` reproduces ``optimizer``'s: no model parallelism (its norm would be reduced over the
        model-parallel group, its duplicates skipped) and no Muon (its orthogonalised updates)."""
        return optimizer.mpu is None and not optimizer._uses_muon

    @torch.no_grad()
    def clear_lp_grads(self, set_to_none: bool = False) -> None:
        if set_to_none:  # the step is over (zero_grad): the buffers go, as the per-parameter gradients did
            for group in self.groups:
                for lp in group:
                    lp.grad = None
            self.flats, self.views = None, []
            return
        if self.flats is None:
            self._allocate()
        else:
            for flat in self.flats:
                flat.zero_()
        assert self.flats is not None
        for group, views in zip(self.groups, self.views):
            for lp, view in zip(group, views):
                if lp.grad is not view:  # set to None or replaced by someone else since: point it back
                    lp.grad = view

    def _allocate(self) -> None:
        self.flats = [torch.zeros_like(flat) for flat in self.optimizer.bf16_groups_flat]
        self.views = []
        for flat, group in zip(self.flats, self.groups):
            sizes = [p.numel() for p in group]
            self.views.append([v.view(p.shape) for v, p in zip(flat[: sum(sizes)].split(sizes), group)])

    @torch.no_grad()
    def update_hp_grads(self, clear_lp_grads: bool = False) -> None:
        if self.flats is None:  # no backward since the last zero_grad
            return
        optimizer = self.optimizer
        for i, (hp_flat, lp_flat) in enumerate(zip(optimizer.fp32_groups_gradients_flat, self.flats)):
            hp_flat.add_(lp_flat)
            optimizer.fp32_groups_has_gradients[i] = [True] * len(self.groups[i])
            if clear_lp_grads:
                lp_flat.zero_()

    def get_grads_for_norm(self, for_clipping: bool = False) -> Any:
        """What the step clips: the float32 sums as one flat tensor per group (one multiply each instead of one per
        parameter; the same factor on the same elements, the alignment padding zero). The norm itself is still taken
        per parameter, as DeepSpeed sums it."""
        if for_clipping and self.flats is not None:
            return list(self.optimizer.fp32_groups_gradients_flat)
        return self._grads_for_norm(for_clipping=for_clipping)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """``BF16_Optimizer.step`` (DeepSpeed 0.19.8) for a group of no model parallelism, experts or Muon, with the
        clipping norm in one multi-tensor operation and one host read (the module docstring)."""
        optimizer = self.optimizer
        if closure is not None:
            raise NotImplementedError(f"{type(optimizer).__name__} does not support closure.")
        optimizer.overflow = False
        grads, _ = self._grads_for_norm()  # DeepSpeed's choice: each parameter's float32 sum, if it has one
        device = optimizer.fp32_groups_flat_partition[0].device
        total = multi_tensor_norm(grads) if grads else torch.zeros((), device=device)
        norm = float(total)  # the step's one read: the skip below, and the norm the engine logs
        if not math.isfinite(norm):  # a NaN or an infinity in some gradient: DeepSpeed skips the step
            optimizer.overflow = True
            optimizer._global_grad_norm = float("inf")
            optimizer.clear_hp_grads()
            optimizer.clear_lp_grads()
            return
        optimizer._global_grad_norm = norm
        if optimizer.clip_grad > 0.0:
            coefficient = optimizer.clip_grad / (total + 1e-6)  # DeepSpeed's expression, in float32 on the device
            coefficient.clamp_(max=1.0)  # DeepSpeed multiplies only below 1; times 1.0 changes no bit
            for flat in self.get_grads_for_norm(for_clipping=True):
                flat.mul_(coefficient)
        for partition, grad in zip(optimizer.fp32_groups_flat_partition, optimizer.fp32_groups_gradient_flat_partition):
            partition.grad = grad  # the float32 sums (applies_to: grad_acc_dtype is float32)
        optimizer.optimizer.step()
        optimizer._lazy_init_hp_params_optimizer_state()
        optimizer.update_lp_params()
        optimizer.clear_hp_grads()


def multi_tensor_norm(grads: List[torch.Tensor]) -> torch.Tensor:
    """DeepSpeed's global 2-norm of float32 ``grads`` (``get_global_norm_of_tensors`` without model parallelism, and
    ``clip_grad_norm_``'s before its mean over ranks): each one's norm, stacked, squared, summed and rooted on the
    device, the per-tensor norms taken in one ``_foreach_norm`` (DeepSpeed's loops take ``t.float().norm(2.0)`` one
    tensor at a time). Not finite if any gradient is not."""
    return torch.stack(torch._foreach_norm(grads, 2.0)).pow(2.0).sum().pow(1.0 / 2.0)
