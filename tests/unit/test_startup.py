"""``rlhf.utils.startup``: ``collector_paused`` (no automatic garbage collection inside, the collector as it was
after) and ``import_deepspeed_muon_uncompiled`` (DeepSpeed's Muon module loaded without ``torch.compile``'s imports,
which compiles again afterwards)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from rlhf.utils.startup import collector_paused


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture
def collections():
    """The generations of every collection that starts while the test runs."""
    seen = []

    def note(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(note)
    yield seen
    gc.callbacks.remove(note)


def _allocate(n=200_000):
    """Enough tracked objects to trigger many automatic collections (the first generation's threshold is 700)."""
    return [_Cycle() for _ in range(n)]


def test_no_automatic_collection_runs_inside_and_the_collector_is_back_after(collections):
    assert gc.isenabled()
    _allocate()
    assert collections, "the allocations trigger collections when the collector runs"
    collections.clear()
    with collector_paused():
        assert not gc.isenabled()
        kept = _allocate()
        dropped = _Cycle()
        gone = weakref.ref(dropped)
        del dropped  # garbage, but in a cycle: only the collector frees it
        inside = list(collections)  # read in the block: the block's end makes a pass
        assert gone() is not None
    assert inside == [] and gc.isenabled()
    assert gone() is None and 2 in collections  # the closing full pass freed the cycle made inside
    assert len(kept) == 200_000


def test_as_a_decorator_and_when_the_block_raises(collections):
    inside = []

    @collector_paused()
    def start():
        _allocate()
        inside.extend(collections)
        raise RuntimeError("start-up failed")

    with pytest.raises(RuntimeError, match="start-up failed"):
        start()
    assert inside == [] and gc.isenabled()


def test_nested_blocks_and_a_collector_already_off_are_left_as_they_were():
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves it to the outer one
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # off before: stays off
    finally:
        gc.enable()


# In a fresh interpreter (the test process may have loaded DeepSpeed's Muon already), after torch and transformers'
# model classes, as a trainer rank has them when its engine is built.
MUON_PROBE = """
import os, sys
import torch, transformers.models.auto.auto_factory
from rlhf.utils.startup import DEEPSPEED_MUON, import_deepspeed_muon_uncompiled
os.environ["TORCHDYNAMO_DISABLE"] = "0"
import_deepspeed_muon_uncompiled()
from deepspeed.runtime.zero.muon import original_muon
heavy = sorted(m for m in ("networkx", "torch._functorch.aot_autograd", "torch._dynamo.repro.after_dynamo")
               if m in sys.modules)
print(DEEPSPEED_MUON in sys.modules, heavy, os.environ["TORCHDYNAMO_DISABLE"])
print(hasattr(original_muon.muon_update, "_torchdynamo_orig_callable"))
print(hasattr(torch.compile(lambda x: x + 1), "_torchdynamo_orig_callable"))
"""


def test_deepspeeds_muon_loads_uncompiled_and_torch_compile_compiles_after():
    done = subprocess.run(
        [sys.executable, "-c", MUON_PROBE], capture_output=True, text=True, timeout=300, env=_cpu_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded, muon_compiled, compiled_after = done.stdout.strip().splitlines()
    # loaded, without the compiler's imports, and the switch as the caller had it ("0", not removed or "1")
    assert loaded == "True [] 0"
    assert muon_compiled == "False"  # Muon's kernels as written (eager); a run never trains with Muon
    assert compiled_after == "True"  # a later torch.compile (model.compile) compiles


def _cpu_env() -> dict:
    import os

    return dict(os.environ, DS_ACCELERATOR="cpu")
