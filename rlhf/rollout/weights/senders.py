"""The policy side of a weight sync: one sender object per policy rank, living in that rank's actor.

The trainer worker knows only the small protocol below (:class:`rlhf.distributed.worker.WeightSender`): it
streams its named full tensors into ``send`` (ZeRO-3 shards gathered) and reports the stats. Every transport
packs the same buckets (``rlhf.rollout.weights.sync``) and the engines load them through the same in-place reload;
only how a bucket's bytes travel differs:

* :class:`BroadcastSender` (``rollout.weight_sync=broadcast``): policy rank 0 and every engine worker form one
  process group at start-up (``rlhf.rollout.weights.group``); each bucket is broadcast, NCCL on GPUs, gloo on CPU.
* :class:`IpcSender` (``ipc``, the hybrid engine): every policy rank hands *its* engine, on the same device, a
  CUDA-IPC handle to the packed bucket (shared memory on CPU).
* :class:`ObjectStoreSender` (``object_store``): rank 0 puts each bucket's bytes in Ray's object store once; every
  engine reads it. Works anywhere, costs a device-to-host copy and a serialisation.

At most one bucket is in flight: the next is packed while the engines load the last, so memory stays bounded by
two buckets whatever the model size. A buffer the engines read in place (IPC) is therefore double-buffered; a
broadcast has delivered its bytes before it returns, so its sender reuses one buffer.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, cast

import torch

from rlhf.distributed.errors import WorkerError, gather
from rlhf.distributed.rendezvous import DRIVER_GRACE_S
from rlhf.rollout.weights.group import GroupAddress, SyncGroup, SyncTimeouts, listen
from rlhf.rollout.weights.ipc import share
from rlhf.rollout.weights.sync import ALIGN, bucket_checksum, bucket_groups, bucket_to_bytes, layout, pack_bucket

ENGINE_ROLE = "rollout engine"
Named = Iterable[Tuple[str, torch.Tensor]]


class _Sender:
    """Shared bookkeeping: begin/finish the engines' reload, time and count what was sent."""

    method = ""

    def __init__(
        self,
        engines: Sequence,
        bucket_bytes: int,
        timeouts: Optional[SyncTimeouts] = None,
        engine_ids: Optional[Sequence[int]] = None,
    ) -> None:
        self.engines = list(engines)
        self.bucket_bytes, self.timeouts = bucket_bytes, timeouts or SyncTimeouts.of()
        self.names = [f"{ENGINE_ROLE} {e}" for e in (engine_ids if engine_ids is not None else range(len(engines)))]
        self.device = torch.device("cpu")

    # The protocol's set-up steps; only the broadcast sender needs them.
    def listen(self) -> Optional[GroupAddress]:
        return None

    def connect(self) -> None:
        pass

    def send(self, named: Named, version: Optional[int] = None, adapter: Optional[Dict[str, Any]] = None) -> dict:
        """Stream ``named`` into the engines as weight ``version`` (the RL step they come from; None: not
        numbered). Every engine worker then echoes the version and a checksum of the bytes it received, compared
        with what was sent (:func:`check_delivery`): an update that did not fully arrive stops the run, naming the
        engine.

        ``adapter``: ``named`` is a LoRA adapter (PEFT's saved names) with this PEFT config
        (:func:`rlhf.models.lora.adapter_sync_config`); the engines keep their base weights and serve it as their
        new adapter. Each engine worker also reads back what it will compute with, checked against what was sent
        (:func:`check_adapter_residence`)."""
        started, sent, tensors, buckets, checksum = time.perf_counter(), 0, 0, 0, 0
        totals = AdapterTotals(adapter["lora_alpha"] / adapter["r"]) if adapter is not None else None
        begin = (version,) if adapter is None else (version, adapter)  # a full update's call is as it always was
        self._all("begin_weight_update", [e.begin_weight_update.remote(*begin) for e in self.engines])
        pending: list = []
        streamed = _engine_dtypes(named)
        for group in bucket_groups(totals.count(streamed) if totals else streamed, self.bucket_bytes):
            bucket = pack_bucket(group, out=self._buffer(group))  # packed while the engines load the last one
            checksum += bucket_checksum(bucket.data, bucket.nbytes)
            self._all("load_weights", pending)
            pending = self._ship(bucket)
            sent, tensors, buckets = sent + bucket.nbytes, tensors + len(bucket.metas), buckets + 1
        self._all("load_weights", pending)
        # an adapter is installed only if all of it arrived (the engine keeps serving the last one otherwise)
        finish = () if adapter is None else ([sent, checksum],)
        received = self._all("finish_weight_update", [e.finish_weight_update.remote(*finish) for e in self.engines])
        check_delivery(self.names, received, version, sent, checksum)
        if totals is not None:
            check_adapter_residence(self.names, received, version, totals)
        return {
            "bytes": float(sent),
            "tensors": float(tensors),
            "buckets": float(buckets),
            "seconds": time.perf_counter() - started,
            "method": self.method,
            **({"version": float(version)} if version is not None else {}),
            **({"adapter": 1.0} if adapter is not None else {}),
        }

    def _buffer(self, group) -> Optional[torch.Tensor]:
        """Where to pack ``group``: ``None`` for a new tensor on :attr:`device`."""
        return None

    def _ship(self, bucket) -> list:
        raise NotImplementedError

    def _all(self, call: str, refs: list) -> list:
        """The engines' answers to one call; an engine silent for ``timeouts.call_s`` (and a grace, in which the
        engines' own bounds answer first) is named."""
        return gather(refs, self.names, call, self.timeouts.call_s + DRIVER_GRACE_S)


class ObjectStoreSender(_Sender):
    method = "object_store"

    def _ship(self, bucket) -> list:
        import ray

        payload = ray.put(bucket_to_bytes(bucket))  # once, however many engines read it
        wire = bucket.wire_metas()
        return [e.load_weights.remote(wire, payload) for e in self.engines]


class BroadcastSender(_Sender):
    """Rank 0 of the weight-sync group; ``engine_workers[e]`` is engine ``e``'s worker count (its TP size)."""

    method = "broadcast"

    def __init__(
        self,
        engines: Sequence,
        engine_workers: Sequence[int],
        bucket_bytes: int,
        backend: str,
        timeouts: Optional[SyncTimeouts] = None,
    ) -> None:
        super().__init__(engines, bucket_bytes, timeouts)
        self.members = ["policy rank 0"] + [
            f"{ENGINE_ROLE} {e} worker {w}" for e, n in enumerate(engine_workers) for w in range(n)
        ]
        self.world_size = len(self.members)
        self.backend = backend
        self._store: Optional[object] = None  # the group's store (listen): kept alive while the group lives
        self._address: Optional[GroupAddress] = None
        self._group: Optional[SyncGroup] = None
        self._reused: Optional[torch.Tensor] = None

    def listen(self) -> GroupAddress:
        self._store, self._address = listen(self.members, self.backend, self.timeouts)
        return self._address

    def connect(self) -> None:
        if self._address is None:
            raise RuntimeError("BroadcastSender.connect() before listen()")
        self._group = SyncGroup(self._address, rank=0, store=self._store)
        self.device = self._group.device

    def _buffer(self, group) -> torch.Tensor:
        """The sender's buffer is reused: a broadcast has delivered every byte before the next bucket is packed."""
        self._reused = _fitting(self._reused, group, self.bucket_bytes, self.device)
        return self._reused

    def _ship(self, bucket) -> list:
        wire = bucket.wire_metas()
        refs = [e.receive_bucket.remote(wire, bucket.nbytes) for e in self.engines]
        try:
            cast(SyncGroup, self._group).broadcast(bucket.data, src=0)  # set by connect(), before any send
        except Exception as exc:  # a dead or failing engine: name it rather than the group's echo
            self._all("receive_bucket", refs)
            raise WorkerError(f"weight broadcast to the rollout engines failed: {exc}") from exc
        return refs


class IpcSender(_Sender):
    """Policy rank ``r`` -> engine ``r`` on the same device (the hybrid engine): a handle instead of a copy."""

    method = "ipc"

    def __init__(self, engine, engine_id: int, bucket_bytes: int, timeouts: Optional[SyncTimeouts] = None) -> None:
        super().__init__([engine], bucket_bytes, timeouts, engine_ids=[engine_id])
        # Two shared buffers, used in turn: bucket k+1 is packed while the engine still reads bucket k, and a buffer
        # is packed again only after the load of the bucket it held was waited for (the base class's order).
        self._shared: List[Optional[torch.Tensor]] = [None, None]
        self._turn = 0
        # Each buffer's handle, exported once per sync and handed over with every bucket the buffer carries: the
        # engine opens it once and keeps it until the update finishes (WeightSyncExtension). A handle carries one
        # reference (rlhf.rollout.weights.ipc), so one export per sync balances the engine's one open.
        self._handles: List[Optional[Tuple[torch.Tensor, bytes]]] = [None, None]

    def connect(self) -> None:
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )

    def _buffer(self, group) -> torch.Tensor:
        self._turn ^= 1
        buffer = _fitting(self._shared[self._turn], group, self.bucket_bytes, self.device)
        self._shared[self._turn] = buffer
        return buffer

    def send(self, named: Named, version: Optional[int] = None, adapter: Optional[Dict[str, Any]] = None) -> dict:
        self._handles = [None, None]
        try:
            return super().send(named, version, adapter)
        finally:
            self._handles = [None, None]  # the engine closed them at finish_weight_update (or begins afresh)
            if self.device.type == "cuda":
                # The engine has released every handle by now: free the blocks CUDA IPC kept for it (torch's
                # producer-side records, which otherwise only a later allocation or exit collects).
                torch.cuda.ipc_collect()

    def _ship(self, bucket) -> list:
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the packing copies must land before the engine reads
        return [self.engines[0].load_shared_bucket.remote(bucket.wire_metas(), self._handle(), bucket.nbytes)]

    def _handle(self) -> bytes:
        """The current buffer's handle, exported on its first bucket of the sync (again if the buffer grew)."""
        buffer, cached = self._shared[self._turn], self._handles[self._turn]
        assert buffer is not None, "_buffer() packed this bucket into it"
        if cached is None or cached[0] is not buffer:
            self._handles[self._turn] = cached = (buffer, share(buffer))
        return cached[1]


def check_delivery(
    names: Sequence[str], received: Sequence[Sequence[dict]], version: Optional[int], sent: int, checksum: int
) -> None:
    """Every worker of every engine (``received[e][w]``, :meth:`WeightSyncExtension.rlhf_finish_weight_update`)
    holds the update just sent: its version, its byte count and checksum (what this sender sent to it).

    Raises:
        WorkerError: naming the first engine worker whose record differs, and both records.
    """
    for name, workers in zip(names, received):
        for w, got in enumerate(workers):
            if (got.get("version"), got.get("bytes"), got.get("checksum")) != (version, sent, checksum):
                raise WorkerError(
                    f"{name} worker {w} did not receive the weight update to version {version}: it holds version "
                    f"{got.get('version')}, {got.get('bytes')} bytes with checksum {got.get('checksum')}; "
                    f"{sent} bytes with checksum {checksum} were sent"
                )


#: A resident adapter's read-back agrees with what was sent to this relative difference: both sides sum the same
#: values (vLLM copies A and B and scales B exactly as :class:`AdapterTotals` does) in float64, in other orders.
#: Any adapter module missing or stale moves a sum by far more (one module of a 2-layer model: a few percent).
RESIDENCE_RTOL = 1e-6


class AdapterTotals:
    """What an engine computes with once it holds the adapter being sent: ``sum_a`` = sum |A|, ``sum_b`` =
    sum |scaling * B|, in float64 over every adapter tensor, as the engine's LoRA layers hold them (vLLM multiplies
    B by ``scaling = alpha / r`` in B's dtype when it builds the adapter). Absolute values: a plain sum of
    Kaiming-initialised A can cancel to near zero, where a relative comparison means nothing."""

    def __init__(self, scaling: float) -> None:
        self.scaling = scaling
        self.sum_a = self.sum_b = 0.0

    def count(self, named: Named) -> Named:
        """``named`` passed through, counted on the way."""
        for name, tensor in named:
            if name.endswith(".lora_A.weight"):
                self.sum_a += float(tensor.detach().abs().sum(dtype=torch.float64))
            elif name.endswith(".lora_B.weight"):  # on the CPU, as vLLM scales it: the same rounding in bf16
                self.sum_b += float((tensor.detach().cpu() * self.scaling).abs().sum(dtype=torch.float64))
            yield name, tensor


def check_adapter_residence(
    names: Sequence[str], received: Sequence[Sequence[dict]], version: Optional[int], totals: AdapterTotals
) -> None:
    """Every engine worker serves the adapter just sent: its read-back of the LoRA buffers it will compute with
    (``resident``, :func:`rlhf.rollout.vllm.adapters.install_adapter`) equals :class:`AdapterTotals`. A worker of
    a tensor-parallel engine holds a slice of each module, so only its receipt (:func:`check_delivery`) is checked.

    Raises:
        WorkerError: naming the first engine worker that holds no adapter, or another one.
    """
    for name, workers in zip(names, received):
        for w, got in enumerate(workers):
            resident = got.get("resident")
            if resident is None:
                raise WorkerError(f"{name} worker {w} installed no adapter for version {version}")
            if got.get("tensor_parallel_size", 1) != 1:
                continue
            for key, want in (("sum_a", totals.sum_a), ("sum_b", totals.sum_b)):
                if not math.isclose(resident[key], want, rel_tol=RESIDENCE_RTOL):
                    raise WorkerError(
                        f"{name} worker {w} does not serve the adapter of version {version}: its LoRA buffers sum "
                        f"to {key}={resident[key]!r}, the adapter sent to {want!r} ({resident.get('modules')} "
                        f"modules resident)"
                    )


def _engine_dtypes(named: Named) -> Named:
    """The weights as the engines hold them: vLLM runs no float64, so a float64 policy (``strategy.precision=fp64``,
    whose engines run in float32) sends float32; any other dtype is sent as it is."""
    for name, tensor in named:
        yield name, tensor.float() if tensor.dtype == torch.float64 else tensor


def _fitting(buffer: Optional[torch.Tensor], group, bucket_bytes: int, device: torch.device) -> torch.Tensor:
    """``buffer`` when ``group`` fits it, else a new one with room for a full bucket (alignment padding
    included) or for ``group`` if larger."""
    size = layout(group)[1]
    if buffer is not None and buffer.numel() >= size:
        return buffer
    return torch.empty(max(size, bucket_bytes + ALIGN), dtype=torch.uint8, device=device)


def make_senders(
    method: str,
    engines: Sequence,
    engine_workers: Sequence[int],
    num_ranks: int,
    bucket_bytes: int,
    backend: str,
    timeouts: Optional[SyncTimeouts] = None,
) -> List[Optional[_Sender]]:
    """One entry per policy rank (``None``: the rank only takes part in the ZeRO-3 gathers)."""
    if method == "ipc":
        if len(engines) != num_ranks:
            raise ValueError(
                f"ipc weight sync needs one engine per policy rank; got {len(engines)} engines for {num_ranks} ranks"
            )
        return [IpcSender(engine, r, bucket_bytes, timeouts) for r, engine in enumerate(engines)]
    if method == "broadcast":
        first: _Sender = BroadcastSender(engines, engine_workers, bucket_bytes, backend, timeouts)
    elif method == "object_store":
        first = ObjectStoreSender(engines, bucket_bytes, timeouts)
    else:
        raise ValueError(f"unknown weight-sync method {method!r}")
    return [first] + [None] * (num_ranks - 1)
