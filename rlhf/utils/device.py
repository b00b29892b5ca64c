"""Capability detection: which attention kernel and dtype this process can use.

flash-attention 2 is selected by what the worker process can actually do, so the same configs run on a CPU
laptop (sdpa) and on a GPU cluster without edits. Backend and precision are decided by the driver from the
cluster's resources (rlhf.trainers.run.start_cluster).
"""
from __future__ import annotations

import importlib.util


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_attn_implementation(requested: str) -> str:
    """``auto`` -> ``flash_attention_2`` when on CUDA with flash-attn installed, else ``sdpa``."""
    if requested != "auto":
        if requested == "flash_attention_2" and not (cuda_available() and _has_flash_attn()):
            raise RuntimeError("model.attn_implementation=flash_attention_2 needs CUDA and the flash-attn package")
        return requested
    return "flash_attention_2" if cuda_available() and _has_flash_attn() else "sdpa"


def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def torch_dtype(precision: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[precision]
