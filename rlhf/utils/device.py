"""Capability detection: which attention kernel and dtype this process can use.

flash-attention 2 is selected by what the worker process can actually do, so the same configs run on a CPU
laptop (sdpa) and on a GPU cluster without edits. Backend and precision are decided by the driver from the
cluster's resources (rlhf.trainers.context.start_cluster).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# flash-attn's kernels take half precision only; an fp32 or fp64 model on a GPU runs sdpa
FLASH_ATTN_PRECISIONS = ("bf16", "fp16")


def resolve_attn_implementation(requested: str, precision: str) -> str:
    """``auto`` -> ``flash_attention_2`` when on CUDA with a flash-attn that imports and a half-precision model
    (``precision``, as ``strategy.precision`` resolved), else ``sdpa`` (with a warning that says why when
    flash-attn is installed but broken)."""
    if requested != "auto":
        if requested == "flash_attention_2":
            problem = (
                "no CUDA device"
                if not cuda_available()
                else f"it runs bf16 or fp16 only, and this model is {precision}"
                if precision not in FLASH_ATTN_PRECISIONS
                else flash_attn_problem()
            )
            if problem:
                raise RuntimeError(
                    f"model.attn_implementation=flash_attention_2 needs CUDA and a working flash-attn "
                    f"package: {problem}"
                )
        return requested
    if not cuda_available() or precision not in FLASH_ATTN_PRECISIONS:
        return "sdpa"
    problem = flash_attn_problem()
    if problem and importlib.util.find_spec("flash_attn") is not None:
        import warnings

        warnings.warn(
            f"model.attn_implementation=auto: using sdpa, not flash_attention_2: {problem}",
            RuntimeWarning,
            stacklevel=2,
        )
    return "sdpa" if problem else "flash_attention_2"


@functools.lru_cache(maxsize=None)
def flash_attn_problem() -> str:
    """Why this process cannot use flash-attn; ``""`` when it can.

    Its modules are imported, not only found: a wheel built for another torch or CUDA is found but fails to load
    its extension (``undefined symbol``), which transformers would otherwise only meet at the first forward pass.
    ``flash_attn_interface`` is the module holding the variable-length kernel that packing calls.
    """
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    try:
        importlib.import_module("flash_attn")
        importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as exc:  # ImportError / OSError for a broken extension, RuntimeError from its own checks
        return f"flash-attn is installed but does not import ({type(exc).__name__}: {exc})"
    return ""


def torch_dtype(precision: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[precision]
