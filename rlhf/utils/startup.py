"""An actor's start-up without Python's cyclic garbage collector.

Importing torch, transformers, DeepSpeed and vLLM and building a model makes hundreds of thousands of objects that
live as long as the process. Python's collector is triggered by allocations: while they pile up it runs again and
again, and each of its full passes walks every object made so far, none of which is garbage. Paused for the
start-up and resumed after, it runs when the objects have settled.

Measured on 2 CPU cores (tiny model): a trainer rank's process group and build took 5.1 s of CPU time with the
collector running and 4.3 s paused; a vLLM engine's start (its import and ``LLM(...)``) 9.3 s and 8.0 s, and 6.5 s
with what the imports made frozen before vLLM's own start-up collections (``rlhf.rollout.vllm.engine``). vLLM
freezes its whole heap once its engine has started, so an engine's later collections skip the start-up's objects.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, back on after it (also when the block raises).

    Reference counting still frees every object that is not in a cycle; cyclic garbage waits for the collector's
    first pass after the block. Nested blocks leave it to the outermost, and a collector that was already off
    stays off.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
