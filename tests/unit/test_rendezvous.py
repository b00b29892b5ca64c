"""Bounded waits where a process group forms (issue #23): a peer that never arrives, or cannot reach rank 0's
store, is named after the bound, and every member that waited returns; nothing stays blocked.

Real ``TCPStore`` s and gloo groups across real processes (the CPU twin: the same waits run before NCCL's
rendezvous on GPUs, which cannot time out on its own). A bound that only a member that never comes runs out is short
(0.5 to 1 s); every subprocess is waited for with a timeout, so a wait that is not bounded fails the test instead of
hanging it.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from rlhf.distributed.rendezvous import RendezvousTimeout, arrive, connect_store, host_store
from rlhf.rollout.weights.group import _PREFIX, GroupAddress, SyncGroup, SyncTimeouts

# The arrival bound of the test where a member never comes: rank 0 starts its own wait only once the other member
# has arrived, so the bound only has to outlast rank 0's arrival after that (milliseconds), and engine 1's absence.
BOUND_S = 1.0
MEMBERS = ("policy rank 0", "rollout engine 0 worker 0", "rollout engine 1 worker 0")

_JOINER = textwrap.dedent("""
    import sys
    from rlhf.rollout.weights.group import GroupAddress, SyncGroup, SyncTimeouts
    from rlhf.distributed.rendezvous import RendezvousTimeout
    port, rank, members, bound = int(sys.argv[1]), int(sys.argv[2]), tuple(sys.argv[3].split(",")), float(sys.argv[4])
    print("started", flush=True)  # imports done: the test starts rank 0's clock only now
    try:
        SyncGroup(GroupAddress("127.0.0.1", port, members, "gloo", SyncTimeouts(bound, 60.0)), rank=rank)
    except RendezvousTimeout as exc:
        print(exc, flush=True)
        sys.exit(3)
    print("joined", flush=True)
""")


def _joiner(port: int, rank: int, bound: float = BOUND_S) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _JOINER, str(port), str(rank), ",".join(MEMBERS), str(bound)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_a_weight_sync_member_that_never_arrives_is_named_by_every_member_that_waited():
    """Rank 0 here, engine 0's worker in another process, engine 1's worker never starts: both members that
    arrived fail after the bound naming engine 1, and the other process exits (it is not left blocked)."""
    store = host_store("127.0.0.1", 0, len(MEMBERS), 60.0)
    address = GroupAddress("127.0.0.1", int(store.port), MEMBERS, "gloo", SyncTimeouts(BOUND_S, 60.0))
    joiner = _joiner(store.port, rank=1)
    assert joiner.stdout.readline().strip() == "started"  # on a loaded machine its imports alone take seconds
    # engine 0's worker has arrived (its key is in the group's store) before rank 0 starts its clock: however slow
    # the machine, rank 0's wait ends naming engine 1 alone
    torch.distributed.PrefixStore(_PREFIX, store).wait(["rlhf-arrived/1"], datetime.timedelta(seconds=60))
    started = time.monotonic()
    with pytest.raises(RendezvousTimeout) as caught:
        SyncGroup(address, rank=0, store=store)
    waited = time.monotonic() - started
    out, _ = joiner.communicate(timeout=60)
    assert str(caught.value).startswith(
        f"the weight-sync group: rollout engine 1 worker 0 did not arrive within "
        f"{BOUND_S:g} s (policy rank 0 waited for it)"
    )
    assert joiner.returncode == 3 and "rollout engine 1 worker 0 did not arrive" in out
    assert "(rollout engine 0 worker 0 waited for it)" in out
    assert BOUND_S <= waited < BOUND_S + 30  # the bound, not torch's 30-minute default


def test_with_every_member_present_the_group_forms():
    """The same three ranks, all present: the arrival wait passes and the group's first collective (the one-byte
    probe broadcast every member runs on joining) completes."""
    store = host_store("127.0.0.1", 0, len(MEMBERS), 60.0)
    address = GroupAddress("127.0.0.1", int(store.port), MEMBERS, "gloo", SyncTimeouts(60.0, 60.0))
    joiners = [_joiner(store.port, rank, bound=60.0) for rank in (1, 2)]
    SyncGroup(address, rank=0, store=store)
    outs = [j.communicate(timeout=60)[0].split() for j in joiners]
    assert outs == [["started", "joined"]] * 2 and [j.returncode for j in joiners] == [0, 0]


def test_a_member_that_cannot_reach_the_store_names_the_address_and_its_host():
    with _closed_port() as port:
        started = time.monotonic()
        with pytest.raises(
            RendezvousTimeout,
            match=rf"^rollout engine 0 worker 0 could not reach the store of "
            rf"policy rank 0 at 127\.0\.0\.1:{port} within 1 s",
        ):
            connect_store("127.0.0.1", port, 2, 1.0, "rollout engine 0 worker 0", "policy rank 0")
        assert time.monotonic() - started < 30


def test_a_trainer_rank_that_never_arrives_is_named_and_no_group_is_left_half_made():
    """``TrainerWorker.init_process_group`` (what each Ray actor of a role runs): rank 0 of a 2-rank group whose
    rank 1 never comes fails after ``strategy.init_timeout_s`` naming it, before any backend is built."""
    from rlhf.distributed.worker import TrainerWorker

    with _closed_port() as port:
        with pytest.raises(
            RendezvousTimeout,
            match=r"^the reward's process group: reward rank 1 did not arrive "
            r"within 0\.5 s \(reward rank 0 waited for it\)",
        ):
            TrainerWorker("reward", 0, 2).init_process_group("127.0.0.1", port, "gloo", timeout_s=0.5)
    assert not torch.distributed.is_initialized()


def test_arrive_lists_every_missing_member():
    store = host_store("127.0.0.1", 0, 4, 60.0)
    names = ["policy rank 0", "policy rank 1", "policy rank 2", "policy rank 3"]
    other = connect_store("127.0.0.1", store.port, 4, 10.0, names[2], names[0])
    other.set("rlhf-arrived/2", "1")  # rank 2 arrived (as arrive() marks it); ranks 1 and 3 never do
    with pytest.raises(
        RendezvousTimeout,
        match=r"^g: policy rank 1 and policy rank 3 did not arrive within 0\.5 s "
        r"\(policy rank 0 waited for them\)",
    ):
        arrive(store, 0, names, 0.5, "g")


class _closed_port:
    """A port nothing listens on (bound, then released, for the block's duration)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        return self.port

    def __exit__(self, *exc) -> None:
        return None
