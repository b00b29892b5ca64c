"""Handing a tensor to another process on the same device without copying it through Ray: a CUDA IPC handle on
GPUs, a shared-memory file on CPU (its twin, which the tests run).

Both are torch's own multiprocessing reductions. The CPU handle names a file in ``/dev/shm`` (the
``file_system`` sharing strategy; the default ``file_descriptor`` strategy passes descriptors over a Unix
socket that Ray does not have). The CUDA handle names device memory; the receiver opens it on *its* current
device, because Ray gives each actor its own ``CUDA_VISIBLE_DEVICES`` numbering.

The sender must keep the tensor alive until every receiver is done with it, and a handle is opened once: it carries
one reference to the memory, which opening it gives back (``file_system`` sharing counts references in the
shared segment and unlinks it at zero; CUDA IPC has a producer-side counter of its own, and keeps a freed block
until ``torch.cuda.ipc_collect()`` sees the counter at zero). :class:`rlhf.rollout.weights.senders.IpcSender` therefore
exports each of its buffers once per sync and the engine opens each handle once, whatever the number of buckets.
"""

from __future__ import annotations

import pickle

import torch

_STORAGE_DEVICE_ARG = 6  # rebuild_cuda_tensor(cls, size, stride, offset, storage_cls, dtype, device, handle, ...)


def share(tensor: torch.Tensor) -> bytes:
    """A handle to ``tensor``'s memory, as bytes (vLLM's RPC to a worker process carries only plain data). A CPU
    tensor is moved into shared memory first, in place."""
    from torch.multiprocessing.reductions import reduce_tensor

    if tensor.is_cuda:
        rebuild, args = reduce_tensor(tensor)
        return pickle.dumps(("cuda", rebuild, args))
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    tensor.share_memory_()
    return pickle.dumps(("shm", bytes(ForkingPickler.dumps(tensor))))


def open_shared(handle: bytes) -> torch.Tensor:
    """The tensor behind :func:`share`'s handle, in this process (same memory, no copy)."""
    kind, *payload = pickle.loads(handle)
    if kind == "cuda":
        rebuild, args = payload
        args = list(args)
        args[_STORAGE_DEVICE_ARG] = torch.cuda.current_device()
        return rebuild(*args)
    if kind == "shm":
        # Registers the shared-storage rebuild functions. Not ``import torch.multiprocessing.reductions``: that
        # statement binds ``torch`` as a local name of this whole function, and the CUDA branch above then fails.
        from torch.multiprocessing import reductions  # noqa: F401

        return pickle.loads(payload[0])
    raise ValueError(f"unknown shared-tensor handle kind {kind!r}")
