"""The weight-sync process group: the policy's sender rank plus every worker of every vLLM engine.

It is made apart from the trainer's own (DeepSpeed) group and from vLLM's tensor-parallel group, both of which
already own ``torch.distributed``'s default group in their processes: a ``TCPStore`` hosted by the sender (port 0,
so the OS picks a free port and nothing can race for it) and a process-group backend built on it directly, never
registered as the default. NCCL on GPUs, gloo on CPU: the same code, only the backend class and the tensors'
device differ, so the CPU tests run the GPU path's code.

Rank 0 is the sender; engine ``e``'s tensor-parallel worker ``w`` is rank ``1 + sum(tp of engines < e) + w``.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from rlhf.config.rl_schema import RolloutConfig
from rlhf.distributed.rendezvous import arrive, connect_store, host_store

_PREFIX = "rlhf-weight-sync"


@dataclass(frozen=True)
class SyncTimeouts:
    """The weight sync's bounds: a peer that never answers is an error naming it, never a hang."""

    connect_s: float  # forming the group: reaching rank 0's store, every member arriving, the first collective
    call_s: float  # one weight-sync call: a bucket's broadcast or load, the begin and finish of an update

    @classmethod
    def of(cls, rollout=RolloutConfig) -> "SyncTimeouts":
        """A run's (``rollout.weight_sync_connect_timeout_s`` / ``weight_sync_timeout_s``); the defaults without
        one (a custom loop)."""
        return cls(connect_s=rollout.weight_sync_connect_timeout_s, call_s=rollout.weight_sync_timeout_s)


@dataclass(frozen=True)
class GroupAddress:
    """Where the sender's store listens, the group's members (``members[r]`` names rank ``r``) and bounds."""

    host: str
    port: int
    members: Tuple[str, ...]
    backend: str  # "nccl" | "gloo"
    timeouts: SyncTimeouts

    @property
    def world_size(self) -> int:
        return len(self.members)

    def to_wire(self) -> dict:
        """Plain data for an RPC into a vLLM worker process."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: dict) -> "GroupAddress":
        return cls(
            wire["host"], int(wire["port"]), tuple(wire["members"]), wire["backend"], SyncTimeouts(**wire["timeouts"])
        )


def listen(members: Sequence[str], backend: str, timeouts: SyncTimeouts) -> Tuple[object, GroupAddress]:
    """Rank 0: host the group's store on this node (a port the OS picks); returns the store (keep it alive) and
    its address."""
    import ray

    host = ray.util.get_node_ip_address()
    store = host_store(host, 0, len(members), timeouts.call_s)
    return store, GroupAddress(host, int(store.port), tuple(members), backend, timeouts)


class SyncGroup:
    """One member of the group; :meth:`broadcast` from rank 0 to all. Construction is collective: it returns once
    every member has joined, or raises after ``timeouts.connect_s`` naming the members that did not
    (:mod:`rlhf.distributed.rendezvous`)."""

    def __init__(self, address: GroupAddress, rank: int, store=None) -> None:
        t = address.timeouts
        if store is None:
            store = connect_store(
                address.host, address.port, address.world_size, t.connect_s, address.members[rank], address.members[0]
            )
        self.rank, self.address, self._store = rank, address, store
        prefixed = torch.distributed.PrefixStore(_PREFIX, store)
        arrive(prefixed, rank, address.members, t.connect_s, "the weight-sync group")
        # every member is here: the backend's own rendezvous (NCCL's at the first collective) waits for no one
        self.backend = _make_backend(
            address.backend, prefixed, rank, address.world_size, datetime.timedelta(seconds=t.call_s)
        )
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if address.backend == "nccl" else torch.device("cpu")
        )
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
