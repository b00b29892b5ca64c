"""A trainer rank's device memory handed over while rollout engines on the same device generate.

With the hybrid engine (``colocate.hybrid_engine``) a vLLM engine shares each policy rank's device. vLLM's sleep mode
frees the engine's memory while the policy trains; ``colocate.trainer_sleep`` is the other half, as OpenRLHF's
DeepSpeed sleep (``offload_states``) and verl's parameter / optimizer offload are: while the engines generate, the
rank's weights, gradients and optimizer states (and the frozen models it holds) wait in host memory.

How: every storage those tensors live in is copied to the host and resized to zero bytes; waking resizes each back
and copies its bytes in (FSDP frees and refills its parameters' storages the same way). A storage is the unit, not a
tensor: DeepSpeed's parameters are views into flat buffers, its optimizer keeps further views, and all of them keep
their storage, offset and shape, so nothing needs re-linking and the woken state is the same bits. The storages are
found by walking the modules (parameters, their gradients, ZeRO-3 partitions, buffers) and the optimizer objects
(DeepSpeed's wrapper, the torch optimizer inside, their lists and dicts of tensors). A storage the walk misses stays
where it is: less memory handed over, nothing wrong.

On a GPU the storages on the rank's CUDA device move to pinned host memory. The CPU twin runs the same code on the
rank's CPU storages (a copy into another host buffer), so the tests see every storage emptied and refilled.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Sequence, Tuple

import torch

# objects whose attributes are walked for tensors (a DeepSpeed optimizer wrapper, a torch optimizer, the project's
# own helpers installed on them); anything else (process groups, the accelerator, modules of code) is left alone
_WALKED = ("deepspeed", "torch.optim", "rlhf", "peft")


def state_tensors(roots: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``roots``: a module's parameters (with their ``.grad`` and ZeRO-3 ``ds_tensor``
    partitions) and buffers; lists, tuples, sets and dicts (keys too: a torch optimizer's state is keyed by
    parameter); the attributes of objects of the packages in ``_WALKED``; the object behind a bound method."""
    seen = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            if obj.is_leaf:  # a non-leaf's .grad is never set (and reading it warns)
                stack.append(obj.grad)
            stack.append(getattr(obj, "ds_tensor", None))
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj.parameters())
            stack.extend(obj.buffers())
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        elif type(obj).__module__.startswith(_WALKED) and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())


def device_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> List[torch.UntypedStorage]:
    """The distinct non-empty storages of ``tensors`` on ``device`` that can be resized (a storage borrowed from
    numpy or a file cannot, and is left in place)."""
    found: Dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if tensor.device != device:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.resizable():
            found.setdefault(storage.data_ptr(), storage)
    return list(found.values())


def own_borrowed(modules: Iterable[torch.nn.Module]) -> None:
    """Give each parameter and buffer of ``modules`` whose storage is borrowed (not resizable: a weight still in the
    checkpoint's memory map, as transformers loads safetensors on a CPU) memory of its own, so that it can sleep. A
    GPU rank's weights were copied to the device when built, so this finds none there."""
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.numel() and not tensor.untyped_storage().resizable():
                tensor.data = tensor.data.clone()


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class HostCopies:
    """Storages emptied on their device, their bytes kept on the host until :meth:`restore`."""

    kept: List[Tuple[torch.UntypedStorage, torch.Tensor]]

    @classmethod
    def offload(cls, storages: List[torch.UntypedStorage]) -> "HostCopies":
        """Copy each storage to the host (pinned when it comes from a CUDA device, so that waking is one DMA) and
        resize it to zero bytes: its memory goes back to the device's allocator."""
        kept = []
        for storage in storages:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(_as_bytes(storage))
            storage.resize_(0)
            kept.append((storage, host))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return cls(kept)

    @property
    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self.kept)

    def restore(self) -> None:
        """Every storage back at its size on its device, with the bytes it had."""
        for storage, host in self.kept:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.kept = []


def offload_state(models: Sequence[torch.nn.Module], others: Sequence[Any], device: torch.device) -> HostCopies:
    """Every storage on ``device`` of ``models`` and of ``others`` (a training engine, its optimizer) emptied into
    host memory; a weight still borrowed from its checkpoint's memory map gets memory of its own first
    (:func:`own_borrowed`), so that it is moved too."""
    own_borrowed(models)
    return HostCopies.offload(device_storages(state_tensors([*models, *others]), device))


def moved_text(per_rank: Sequence[int]) -> str:
    """``ranks x MiB`` of what a group's ranks moved (the bytes each): their number and the most one moved."""
    return f"{len(per_rank)} x {max(per_rank) / 2**20:.1f} MiB"
