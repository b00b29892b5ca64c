"""An actor's start-up with less work: without Python's cyclic garbage collector (``collector_paused``), and
without the compiler imports DeepSpeed's Muon optimizer makes (``import_deepspeed_muon_uncompiled``).

Importing torch, transformers, DeepSpeed and vLLM and building a model makes hundreds of thousands of objects that
live as long as the process. Python's collector is triggered by allocations: while they pile up it runs again and
again, and each of its full passes walks every object made so far, none of which is garbage. Paused for the
start-up, it makes one full pass when the start-up ends, which frees the start-up's cyclic garbage then, as the
passes it skipped would have: the process goes on with the heap it had before, reached with less work.

Measured on 2 CPU cores (tiny model), CPU time of a trainer rank's process group and build: 5.1 s with the
collector running, 4.3 s paused; of a vLLM engine's start (its imports and ``LLM(...)``): 9.3 s and 8.0 s, and 6.5 s
with what the imports made frozen before vLLM's own start-up collections (``rlhf.rollout.vllm.engine``). vLLM
freezes its whole heap once its engine has started, so an engine's later collections skip the start-up's objects.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block; at its end (also when it raises) back on, after one
    full pass that frees the cyclic garbage the block made.

    Reference counting still frees every object that is not in a cycle inside the block. Nested blocks leave it to
    the outermost, and a collector that was already off stays off (and makes no pass).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        # the start-up's cycles go now, not at a later pass or at the process's exit (where Ray may stop it)
        gc.collect()


DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_uncompiled(module: str) -> None:
    """Import ``module`` with ``torch.compile`` a no-op while it loads: what it wraps at import stays as written
    (eager). The switch is ``TORCHDYNAMO_DISABLE``, which each ``torch.compile`` call reads: it is back as it was
    when the import ends, so every later ``torch.compile`` compiles. Once the module is loaded this does nothing."""
    if module in sys.modules:
        return
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(module)
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


def import_deepspeed_muon_uncompiled() -> None:
    """DeepSpeed's Muon optimizer module (``DEEPSPEED_MUON``) through :func:`import_uncompiled`.

    DeepSpeed's engine imports that module in every build, for ``isinstance`` checks only (its ZeRO and bf16
    optimizers ask whether the optimizer is Muon), and the module wraps its kernels in ``torch.compile`` at import.
    Those calls load TorchDynamo's debugging backends, functorch's AOT autograd and networkx, which nothing else in a
    rank needs: on 2 cores, ``import deepspeed`` with its engine and Muon takes 1.47 s of CPU with them and 0.22 s
    without, and a trainer rank's whole start a median of 5.3 s and 4.6 s (docs/performance.md). A run never trains
    with Muon (the optimizer is AdamW; ``rlhf.config.deepspeed_check`` refuses a DeepSpeed ``optimizer`` section),
    and uncompiled, its kernels would still be right, eager. ``model.compile`` compiles as before: the switch is only
    off during this import.
    """
    import_uncompiled(DEEPSPEED_MUON)
