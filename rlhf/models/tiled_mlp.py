"""The gated MLP of every decoder layer in sequence tiles (``model.tiled_mlp``), for long rows.

A gated MLP (``down(act(gate(x)) * up(x))``) holds three ``(T, intermediate)`` activations per layer for the
backward, 2-4x the hidden size each: at long ``T`` the largest activations of the layer. DeepSpeed's ``TiledMLP``
(Arctic Long Sequence Training, Bekman et al. 2025, ``deepspeed.runtime.sequence_parallel.ulysses_sp``) runs the
MLP on ``ceil(T / hidden)`` tiles of positions without keeping them, saves only its input, and recomputes each tile
in the backward: the same numbers (the tiles are independent positions), one more MLP forward per step, and the
intermediate activations of one tile alive at a time. It pays only when ``T`` is several times the hidden size;
below that the MLP runs whole.

Under ZeRO 3 every rank would have to run as many tiles as every other (each tile gathers the MLP's weights): the
config refuses the two together (``model.tiled_mlp``).
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch

Tensor = torch.Tensor
_GATED = ("gate_proj", "up_proj", "down_proj", "act_fn")


def enable_tiled_mlp(module: torch.nn.Module) -> int:
    """Make every gated MLP of ``module`` (an HF model, LoRA-wrapped or not) run in tiles; returns how many.

    Raises:
        ValueError: the model has no gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``).
    """
    mlps = [m for m in module.modules() if all(hasattr(m, name) for name in _GATED)]
    if not mlps:
        raise ValueError(
            "model.tiled_mlp needs gated MLPs (gate_proj, up_proj, down_proj, act_fn): this model has none"
        )
    for mlp in mlps:
        mlp.forward = types.MethodType(_tiled_forward, mlp)
    return len(mlps)


def _gated(mlp: Any, x: Tensor) -> Tensor:
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def _tiled_forward(mlp: Any, x: Tensor) -> Tensor:
    """``(..., T, H)`` -> ``(..., T, H)``: whole below ``2 H`` positions, else in ``ceil(T / H)`` tiles."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    tiles = math.ceil(x.shape[-2] / x.shape[-1])
    if tiles < 2:
        return _gated(mlp, x)
    # the weights' gradients are complete only after the last tile (DeepSpeed's ZeRO 1-2 hooks wait for it)
    weights = [p for p in mlp.parameters() if p.requires_grad]
    return TiledMLP.apply(_gated, mlp, x, tiles, weights)
