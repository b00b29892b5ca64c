"""Weight-sync parts without vLLM: transport selection and fallback, sender shapes, and the two process-crossing
primitives for real (a gloo weight-sync group between processes; a shared-memory handle opened by another
process, the CPU twin of a CUDA IPC handle). The engines themselves: tests/integration/test_vllm_rollout.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from rl_helpers import tiny_rl_config

from rlhf.config.schema import ConfigError
from rlhf.distributed.errors import WorkerError, WorkerTimeout
from rlhf.rollout.weights.ipc import open_shared, share
from rlhf.rollout.weights.senders import BroadcastSender, IpcSender, ObjectStoreSender, make_senders
from rlhf.rollout.weights.sync import ALIGN, bucket_groups, layout, resolve_weight_sync


@pytest.mark.parametrize(
    "method,hybrid,gpus,want",
    [
        ("auto", False, 0, "broadcast"),
        ("auto", True, 0, "broadcast"),
        ("auto", False, 1, "broadcast"),
        ("auto", True, 1, "ipc"),
        ("object_store", True, 1, "object_store"),
        ("ipc", True, 0, "ipc"),
    ],
)
def test_auto_selects_ipc_only_for_the_gpu_hybrid_engine(method, hybrid, gpus, want):
    assert resolve_weight_sync(method, hybrid_engine=hybrid, gpus_per_engine=gpus) == want


def test_bucket_groups_respect_the_size_and_keep_order():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([3, 5, 40, 1, 1, 2])]  # float32: 12, 20, 160 ... bytes
    groups = list(bucket_groups(named, bucket_bytes=64))
    assert [n for g in groups for n, _ in g] == [n for n, _ in named]
    for group in groups:
        assert layout(group)[1] <= 64 + ALIGN or len(group) == 1  # only a lone tensor may exceed a bucket


def test_make_senders_gives_every_rank_its_part():
    engines = ["e0", "e1"]
    broadcast = make_senders("broadcast", engines, [1, 2], 3, 1 << 20, "gloo")
    assert isinstance(broadcast[0], BroadcastSender) and broadcast[1:] == [None, None]
    assert broadcast[0].world_size == 1 + 1 + 2  # rank 0 + every tensor-parallel worker of every engine
    assert broadcast[0].members == [
        "policy rank 0",
        "rollout engine 0 worker 0",
        "rollout engine 1 worker 0",
        "rollout engine 1 worker 1",
    ]  # rank r's name, for an error naming it
    assert isinstance(make_senders("object_store", engines, [1, 1], 2, 1, "gloo")[0], ObjectStoreSender)
    ipc = make_senders("ipc", engines, [1, 1], 2, 1, "gloo")
    assert [type(s) for s in ipc] == [IpcSender, IpcSender] and ipc[1].names == ["rollout engine 1"]
    with pytest.raises(ValueError, match="one engine per policy rank"):
        make_senders("ipc", engines, [1, 1], 4, 1, "gloo")


def test_ipc_needs_the_hybrid_engine(tiny_model, rl_prompts):
    with pytest.raises(ConfigError, match=r"rollout.weight_sync is ipc, which needs colocate.hybrid_engine=true"):
        tiny_rl_config(tiny_model, rl_prompts, "rollout.weight_sync=ipc")
    with pytest.raises(ConfigError, match="rollout.weight_sync must be one of auto, broadcast, ipc, object_store"):
        tiny_rl_config(tiny_model, rl_prompts, "rollout.weight_sync=nccl")


class _Engines:
    """Stands in for RolloutEngines: a broadcast group that cannot be formed (or whose engine died)."""

    gpus_per_engine = 0.0

    def __init__(self, died=False, stuck=False):
        self.tried, self.died, self.stuck = [], died, stuck

    def connect_weight_sync(self, policy, method, bucket_bytes, backend, timeouts=None, adapter_only=False):
        import ray

        self.tried.append((method, backend))
        if method == "broadcast":
            if self.stuck:
                raise WorkerTimeout(
                    "rollout engine 1 did not answer connect_weight_sync within 90 s", ["rollout engine 1"]
                )
            exc = WorkerError("rollout engine 1 failed in connect_weight_sync: timed out")
            if self.died:
                raise exc from ray.exceptions.RayActorError()
            raise exc


@pytest.mark.parametrize("asked,fallback", [("auto", True), ("broadcast", False)])
def test_auto_falls_back_to_the_object_store_and_a_named_method_fails_naming_the_key(
    tiny_model, rl_prompts, asked, fallback, capsys
):
    from rlhf.trainers.online.roles import connect_weight_sync

    cfg = tiny_rl_config(tiny_model, rl_prompts, f"rollout.weight_sync={asked}")
    actors = SimpleNamespace(engines=_Engines(), policy=object())
    ctx = SimpleNamespace(gpus_per_worker=0.0)
    if fallback:
        connect_weight_sync(cfg, ctx, actors)
        assert actors.engines.tried == [("broadcast", "gloo"), ("object_store", "gloo")]
        assert "using the object store (rollout.weight_sync=auto)" in capsys.readouterr().out
    else:
        with pytest.raises(
            ConfigError,
            match=r"^rollout.weight_sync=broadcast: cannot set up the broadcast "
            r"transport: rollout engine 1 failed",
        ):
            connect_weight_sync(cfg, ctx, actors)
        assert actors.engines.tried == [("broadcast", "gloo")]


_MEMBER = textwrap.dedent("""
    import sys, torch
    from rlhf.rollout.weights.group import GroupAddress, SyncGroup, SyncTimeouts
    host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    group = SyncGroup(GroupAddress(host, port, ("sender", "a", "b"), "gloo", SyncTimeouts(60.0, 60.0)), rank=rank)
    data = torch.zeros(1 << 16, dtype=torch.uint8)
    group.broadcast(data, src=0)
    print(int(data.long().sum()), flush=True)
""")


def test_a_gloo_weight_sync_group_broadcasts_across_processes():
    """Rank 0 hosts the store on a port the OS picks; two other processes join and receive its bytes."""
    from rlhf.rollout.weights.group import GroupAddress, SyncGroup, SyncTimeouts

    store = torch.distributed.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    address = GroupAddress("127.0.0.1", int(store.port), ("sender", "a", "b"), "gloo", SyncTimeouts(60.0, 60.0))
    members = [
        subprocess.Popen(
            [sys.executable, "-c", _MEMBER, "127.0.0.1", str(store.port), str(rank)], stdout=subprocess.PIPE, text=True
        )
        for rank in (1, 2)
    ]
    group = SyncGroup(address, rank=0, store=store)
    data = torch.arange(1 << 16, dtype=torch.int64).remainder(251).to(torch.uint8)
    group.broadcast(data, src=0)
    outs = [m.communicate(timeout=120)[0].strip() for m in members]
    assert outs == [str(int(data.long().sum()))] * 2


_RECEIVER = textwrap.dedent("""
    import ast, gc, sys
    from rlhf.rollout.weights.ipc import open_shared
    for handle in ast.literal_eval(sys.stdin.read()):  # one long-lived receiver, bucket after bucket (an engine)
        opened = open_shared(handle)
        print(opened.clone().sum().item(), flush=True)
        gc.collect()
    opened[0] = 99
""")


def test_a_shared_memory_handle_opens_the_same_memory_in_another_process():
    """The sender's buffer is shared once and handed over bucket after bucket, a new handle each time (a handle
    opened twice would give back the memory's reference twice and unlink it under the sender)."""
    tensor = torch.arange(10, dtype=torch.float32)
    handles = [share(tensor) for _ in range(4)]
    result = subprocess.run(
        [sys.executable, "-c", _RECEIVER],
        input=repr(handles + [share(tensor)]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["45.0"] * 5
    assert tensor[0].item() == 99.0  # written by the other process: one memory, not a copy
    assert torch.equal(open_shared(share(tensor)), tensor)


def test_a_stuck_engine_is_not_a_transport_to_fall_back_from(tiny_model, rl_prompts):
    """An engine that did not answer at all would hold the object-store set-up behind its stuck call: the run
    stops naming it instead of falling back."""
    from rlhf.trainers.online.roles import connect_weight_sync

    cfg = tiny_rl_config(tiny_model, rl_prompts)  # auto
    actors = SimpleNamespace(engines=_Engines(stuck=True), policy=object())
    with pytest.raises(WorkerTimeout, match="rollout engine 1 did not answer connect_weight_sync"):
        connect_weight_sync(cfg, SimpleNamespace(gpus_per_worker=0.0), actors)
    assert actors.engines.tried == [("broadcast", "gloo")]


def test_a_dead_engine_is_not_a_transport_to_fall_back_from(tiny_model, rl_prompts):
    from rlhf.trainers.online.roles import connect_weight_sync

    cfg = tiny_rl_config(tiny_model, rl_prompts)  # auto
    actors = SimpleNamespace(engines=_Engines(died=True), policy=object())
    with pytest.raises(WorkerError, match="rollout engine 1"):
        connect_weight_sync(cfg, SimpleNamespace(gpus_per_worker=0.0), actors)
    assert actors.engines.tried == [("broadcast", "gloo")]


def test_zero3_gathers_consecutive_parameters_in_chunks_of_about_gather_bytes():
    """ZeRO-3's weight sync gathers a chunk of parameters at once (one all-gather each, not one per tensor): the
    state dict's entries in order, a chunk closed before it would pass the budget, a parameter larger than it alone,
    a tied weight counted once, buffers riding along. A partitioned parameter's full size is its ``ds_numel``."""
    from rlhf.distributed.engine import gather_chunks

    def param(numel, partitioned=False):
        p = torch.nn.Parameter(torch.zeros(0 if partitioned else numel))
        if partitioned:
            p.ds_numel = numel
        return p

    embed, big = param(10, partitioned=True), param(100)
    params = {"embed": embed, "a": param(6, partitioned=True), "b": param(8), "big": big, "c": param(4), "head": embed}
    buffer = torch.zeros(50)
    entries = (
        [(n, params[n]) for n in ("embed", "a", "b")]
        + [("rope", buffer)]
        + [(n, params[n]) for n in ("big", "c", "head")]
    )
    chunks = gather_chunks(entries, params, gather_bytes=80)  # float32: 10, 6, 8, 100, 4, 10 (tied) params
    assert [[name for name, _ in chunk] for chunk in chunks] == [["embed", "a"], ["b", "rope"], ["big"], ["c", "head"]]
    assert [name for chunk in gather_chunks(entries, params, 1 << 30) for name, _ in chunk] == [n for n, _ in entries]
