"""The weight-sync process group: the policy's sender rank plus every worker of every vLLM engine.

It is made apart from the trainer's own (DeepSpeed) group and from vLLM's tensor-parallel group, both of which
already own ``torch.distributed``'s default group in their processes: a ``TCPStore`` hosted by the sender (port 0,
so the OS picks a free port and nothing can race for it) and a process-group backend built on it directly, never
registered as the default. NCCL on GPUs, gloo on CPU: the same code, only the backend class and the tensors'
device differ, so the CPU tests run the GPU path's code.

Rank 0 is the sender; engine ``e``'s tensor-parallel worker ``w`` is rank ``1 + sum(tp of engines < e) + w``.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Tuple

import torch

# Bounds forming the group and every broadcast: a peer that never joins, or dies mid-broadcast, is an error
# after this long rather than a hang (a closed TCP connection is reported at once by gloo).
SYNC_TIMEOUT_S = float(os.environ.get("RLHF_WEIGHT_SYNC_TIMEOUT_S", "600"))
_PREFIX = "rlhf-weight-sync"


@dataclass(frozen=True)
class GroupAddress:
    """Where the sender's store listens, and the group's shape."""

    host: str
    port: int
    world_size: int
    backend: str  # "nccl" | "gloo"


def listen(world_size: int, backend: str, timeout_s: float = SYNC_TIMEOUT_S) -> Tuple[object, GroupAddress]:
    """Rank 0: host the group's store on this node; returns the store (keep it alive) and its address."""
    import ray

    host = ray.util.get_node_ip_address()
    store = torch.distributed.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=timeout_s))
    return store, GroupAddress(host, int(store.port), world_size, backend)


class SyncGroup:
    """One member of the group; :meth:`broadcast` from rank 0 to all. Construction is collective: it returns once
    every member has joined (or raises after the timeout)."""

    def __init__(self, address: GroupAddress, rank: int, store=None, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = torch.distributed.TCPStore(address.host, address.port, address.world_size, is_master=False,
                                               timeout=timeout)
        self.rank, self.address, self._store = rank, address, store
        prefixed = torch.distributed.PrefixStore(_PREFIX, store)
        self.backend = _make_backend(address.backend, prefixed, rank, address.world_size, timeout)
        self.device = torch.device("cuda", torch.cuda.current_device()) if address.backend == "nccl" else \
            torch.device("cpu")
        # NCCL builds its communicator at the first collective: one byte now makes a group that cannot really
        # form fail at start-up, not at the first weight sync.
        self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device), src=0)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In place on every member: rank ``src``'s ``tensor`` overwrites the others'."""
        options = torch.distributed.BroadcastOptions()
        options.rootRank = src
        self.backend.broadcast([tensor], options).wait()

    def close(self) -> None:
        shutdown = getattr(self.backend, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _make_backend(backend: str, store, rank: int, world_size: int, timeout: datetime.timedelta):
    """The one device-specific call: a NCCL communicator on GPUs, a gloo one on CPU."""
    if backend == "nccl":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
    raise ValueError(f"weight-sync backend must be nccl or gloo, got {backend!r}")
