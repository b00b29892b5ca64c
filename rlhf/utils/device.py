"""Capability detection: which backend, precision and attention kernel this process can use.

GPU-only paths (NCCL, bf16, flash-attention 2) are selected here by what the process can actually do, so the
same configs run on a CPU laptop (gloo, fp32, sdpa) and on a GPU cluster without edits.
"""
from __future__ import annotations

import importlib.util


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_backend(requested: str) -> str:
    """``auto`` -> ``nccl`` when CUDA is available, else ``gloo``."""
    if requested != "auto":
        if requested == "nccl" and not cuda_available():
            raise RuntimeError("strategy.backend=nccl needs CUDA devices; this process has none (use gloo or auto)")
        return requested
    return "nccl" if cuda_available() else "gloo"


def resolve_precision(requested: str) -> str:
    """``auto`` -> ``bf16`` on GPUs that support it, else ``fp32`` (CPU kernels are fastest and exact in fp32)."""
    if requested != "auto":
        return requested
    import torch

    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


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

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
