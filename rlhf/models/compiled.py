"""Compiled decoder layers (``model.compile=true``): ``torch.compile`` on each transformer block of an HF model.

A whole-model compile would trace the loss, the packing bookkeeping and DeepSpeed's hooks too; a block is the unit
that repeats (every layer shares one compiled graph) and holds what eager PyTorch runs as many small kernels: the
RMSNorm, the rotary embedding, the gated MLP's activation, the residual adds. Inductor fuses those. The matmuls and
attention kernels are the same ones eager runs, so the step's numbers move by rounding only (fused elementwise
chains and reductions in another order): float32 within 1e-6 of eager (tests/unit/test_compiled_layers.py).

Row lengths change at every micro-batch, so the layers are compiled with dynamic shapes: one graph for every length
instead of one compile per new length.
"""

from __future__ import annotations

from typing import List

import torch


def decoder_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The transformer blocks of an HF model (LoRA-wrapped or not): the modules whose class transformers lists in
    ``_no_split_modules`` (the blocks it never splits across devices), in order.

    Raises:
        ValueError: the model names no such class, or none of its modules is one.
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"model.compile compiles each decoder layer, but {type(model).__name__} names no layer class "
            f"(transformers' _no_split_modules); set model.compile=false"
        )
    return layers


def compile_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer of ``model`` in place (``nn.Module.compile``: the module keeps its parameters,
    names and hooks; the first call of each input shape family compiles). Returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model``'s decoder layers run compiled."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
