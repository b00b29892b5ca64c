"""Forming a process group with bounded waits that name who is missing.

A process group forms in two waits, and torch bounds neither in a way a user can act on: a member reaches the store
that rank 0 hosts (a firewall or the wrong interface: it retries until its timeout, 30 minutes by default), then
every member waits for all the others (one that never arrives holds the rest until that timeout too; NCCL's own
rendezvous, at the first collective, does not time out at all). Here both waits are bounded and each error names
the peer it waited for:

1. :func:`connect_store`: a member that cannot reach rank 0's store within ``timeout_s`` fails naming the store's
   address and its host (``"policy rank 0"``).
2. :func:`arrive`: every member writes its arrival key into the store and waits for all the others' keys; after
   ``timeout_s`` it fails naming the members whose keys are missing. Only after every member has arrived is the
   backend (gloo, NCCL) built, so its own rendezvous starts with every peer present and cannot wait for an absent
   one.

The same code runs for gloo and NCCL (only the backend built afterwards differs), so the CPU tests run the GPU
path's waits. Used by the trainers' group (:meth:`rlhf.distributed.worker.TrainerWorker.init_process_group`) and
the weight-sync group (:mod:`rlhf.rollout.weights.group`).
"""

from __future__ import annotations

import datetime
import time
from typing import Sequence

import torch

# Driver-side waits on a whole call add this to the members' own bound: the members' errors, which name the
# missing peer, arrive first; the driver's own names an actor that never answered at all (stuck elsewhere).
DRIVER_GRACE_S = 30.0


class RendezvousTimeout(RuntimeError):
    """A member of a process group did not reach the store, or not every member arrived, in time; names whom."""


def host_store(host: str, port: int, world_size: int, timeout_s: float):
    """Rank 0: a ``TCPStore`` on ``port`` (``0``: the OS picks a free one, ``store.port`` says which) of this node,
    whose address the others are given as ``host``. It returns at once: :func:`arrive` is where rank 0 waits for
    the others."""
    return torch.distributed.TCPStore(
        host, port, world_size, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def connect_store(host: str, port: int, world_size: int, timeout_s: float, who: str, host_name: str):
    """Another member: a client of rank 0's store at ``host:port``, or :class:`RendezvousTimeout` after
    ``timeout_s`` naming ``who`` (this member), the address and ``host_name`` (the member that hosts it)."""
    started = time.monotonic()
    try:
        return torch.distributed.TCPStore(
            host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except (RuntimeError, OSError) as exc:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
        raise RendezvousTimeout(
            f"{who} could not reach the store of {host_name} at {host}:{port} within {timeout_s:g} s "
            f"(gave up after {time.monotonic() - started:.0f} s: {str(exc).splitlines()[0][:200]}); check that "
            f"{host} is reachable from this node on that port (firewall, NCCL_SOCKET_IFNAME)"
        ) from exc


def _key(rank: int) -> str:
    return f"rlhf-arrived/{rank}"


def arrive(store, rank: int, members: Sequence[str], timeout_s: float, what: str) -> None:
    """Mark rank ``rank`` as arrived and wait until every rank of ``members`` (``members[r]`` names rank ``r``,
    e.g. ``"policy rank 1"``) has; :class:`RendezvousTimeout` after ``timeout_s`` naming those still missing.

    ``store``: the group's store (a ``PrefixStore`` keeps a group's keys apart when the store is shared).
    ``what``: the group, for the message (``"the policy's process group"``).
    """
    store.set(_key(rank), "1")
    keys = [_key(r) for r in range(len(members))]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistStoreError: the wait timed out (or the store went away)
        missing = [members[r] for r in range(len(members)) if not store.check([keys[r]])]
        if not missing:  # every key arrived just as the wait gave up
            return
        raise RendezvousTimeout(
            f"{what}: {_listed(missing)} did not arrive within {timeout_s:g} s ({members[rank]} waited for "
            f"{'it' if len(missing) == 1 else 'them'}); look at {missing[0]}'s log for why it did not start or "
            f"could not reach the store"
        ) from exc


def _listed(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
