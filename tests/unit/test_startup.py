"""``rlhf.utils.startup``: ``collector_paused`` (no automatic garbage collection inside, the collector as it was
after) and ``import_uncompiled`` (a module's import-time ``torch.compile`` calls left out, ``torch.compile`` as it was
after; tests/unit/test_one_rank_stage.py checks that a built engine loaded DeepSpeed's Muon module this way)."""

from __future__ import annotations

import gc
import os
import sys
import weakref

import pytest

from rlhf.utils.startup import collector_paused, import_uncompiled


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


COMPILED_AT_IMPORT = """
import torch


@torch.compile
def kernel(x):
    return x + 1
"""


@pytest.mark.parametrize("before", [None, "0"])
def test_what_a_module_compiles_at_import_stays_eager_and_torch_compile_compiles_after(before, tmp_path, monkeypatch):
    """A module that wraps a function in ``torch.compile`` at import, as DeepSpeed's Muon module does: imported
    through ``import_uncompiled``, the function is the one written; the switch is back as the caller had it (unset,
    or ``"0"``), and a later ``torch.compile`` compiles."""
    import torch

    name = f"compiles_at_import_{before}"
    (tmp_path / f"{name}.py").write_text(COMPILED_AT_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    if before is None:
        monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    else:
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", before)
    monkeypatch.delitem(sys.modules, name, raising=False)

    import_uncompiled(name)
    module = sys.modules[name]
    assert not hasattr(module.kernel, "_torchdynamo_orig_callable")  # as written
    assert os.environ.get("TORCHDYNAMO_DISABLE") == before
    assert hasattr(torch.compile(lambda x: x - 1), "_torchdynamo_orig_callable")  # compiles again

    import_uncompiled(name)  # loaded: nothing happens
    assert sys.modules[name] is module and os.environ.get("TORCHDYNAMO_DISABLE") == before
    monkeypatch.delitem(sys.modules, name)
