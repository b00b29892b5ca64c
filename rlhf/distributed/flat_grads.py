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
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch


class FlatLowPrecisionGrads:
    """Installs itself on a ``BF16_Optimizer``: its ``clear_lp_grads`` (the backward prologue, and ``zero_grad``),
    ``update_hp_grads`` (the backward epilogue) and ``get_grads_for_norm`` (what the step clips) become the flat
    versions below."""

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
