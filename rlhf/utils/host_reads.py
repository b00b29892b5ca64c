"""Count the operations that make the host wait for an accelerator, on any device (the CPU twin included).

On a GPU, ``.item()``, ``float(t)``, ``if t.any():``, ``.tolist()``, ``.cpu()``, ``nonzero`` and boolean-mask
indexing copy a result back to the host (or size an output by the data), so the host stops queueing kernels until
the device has run everything queued before: the device then idles while the host catches up. On a CPU these cost
nothing, yet they are the same calls: counting them on the CPU twin tells what a GPU step would synchronise, and a
test can hold the count of a training step constant whatever its number of micro-batches.

    with HostReads() as reads:
        worker.train_step(micro_batches, objective, normalizer)
    reads.total, reads.by_op   # e.g. 1, {"tolist": 1}
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Any, Dict, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701 (torch exports it nowhere else)

# aten ops whose result (or output size) the host reads on an accelerator: a scalar read back, a data-dependent
# shape, a host-side comparison.
_READING_OPS = {
    "aten::_local_scalar_dense",  # .item(), float(t), int(t), bool(t)
    "aten::nonzero",
    "aten::masked_select",
    "aten::equal",  # torch.equal: a host bool
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
}
# Tensor methods that copy to host memory without an aten op on a CPU tensor.
_READING_METHODS = {"tolist", "cpu", "numpy"}


_host_side = threading.local()


@contextlib.contextmanager
def host_side() -> Iterator[None]:
    """Reads inside this context are of host memory on every device (a batch's host original, before or beside its
    copy on the device): they wait for no device, and :class:`HostReads` does not count them, on the CPU twin
    either, where host and device memory are one."""
    depth = getattr(_host_side, "depth", 0)
    _host_side.depth = depth + 1
    try:
        yield
    finally:
        _host_side.depth = depth


def _on(device_type: Optional[str], args: tuple) -> bool:
    """Whether the op's first tensor argument lives on ``device_type`` (None: any device), outside :func:`host_side`."""
    if getattr(_host_side, "depth", 0):
        return False
    if device_type is None:
        return True
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.device.type == device_type


def _bool_mask_index(func: Any, args: tuple) -> bool:
    """``x[mask]`` with a boolean mask: an output sized by the data (a nonzero inside the kernel)."""
    if func.name() != "aten::index.Tensor" or len(args) < 2:
        return False
    return any(t is not None and t.dtype == torch.bool for t in args[1])


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counter, device_type: Optional[str]) -> None:
        super().__init__()
        self.counts, self.device_type = counts, device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if _on(self.device_type, args):
            if name in _READING_OPS:
                self.counts[name.removeprefix("aten::")] += 1
            elif _bool_mask_index(func, args):
                self.counts["bool-mask index"] += 1
        return func(*args, **(kwargs or {}))


class _Methods(TorchFunctionMode):
    def __init__(self, counts: Counter, device_type: Optional[str]) -> None:
        super().__init__()
        self.counts, self.device_type = counts, device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READING_METHODS and _on(self.device_type, args):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class HostReads:
    """A context that counts host reads of tensor data (see the module docstring) by kind.

    Counts what the calls inside it would synchronise on an accelerator: each ``.item()`` / ``float()`` /
    ``bool()`` of a tensor is one ``_local_scalar_dense``, each ``.tolist()`` / ``.cpu()`` one read whatever its
    size. ``device_type`` (e.g. ``"cuda"``) counts only reads of tensors on that kind of device: on a GPU, a read of
    a host tensor (an optimizer's step counter, a batch not yet moved) waits for nothing. Slow (every op passes
    through Python): for tests and benchmarks, never a training run.
    """

    def __init__(self, device_type: Optional[str] = None) -> None:
        self.counts: Counter = Counter()
        self._modes = (_Methods(self.counts, device_type), _Ops(self.counts, device_type))

    def __enter__(self) -> "HostReads":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def by_op(self) -> Dict[str, int]:
        return dict(self.counts)
