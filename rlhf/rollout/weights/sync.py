"""Policy weights in buckets: the one layout every weight-sync transport sends to the vLLM engines.

The policy's full parameters (ZeRO-3 shards gathered, see :func:`rlhf.distributed.engine.iter_full_state`) are
packed in order into buckets of about ``bucket_bytes``: one flat ``uint8`` tensor per bucket, every tensor at a
16-byte-aligned offset so that the receiver can view it in place as its own dtype, plus a list of
:class:`TensorMeta`. One bucket costs one transfer instead of one per parameter (OpenRLHF's per-parameter
broadcast is its known bottleneck, issues #533/#647). The transports (``rlhf.rollout.weights.senders``) differ only in
how the bucket's bytes travel: a broadcast over a process group (NCCL / gloo), a CUDA-IPC / shared-memory handle, or
the Ray object store. On the engine side the names stay HF checkpoint names: vLLM's own ``model.load_weights``
maps them onto its fused layers (qkv, gate_up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

ALIGN = 16  # every tensor starts on a 16-byte boundary so it can be viewed in place as any dtype
DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightBucket:
    """Packed tensors. ``data``: ``(nbytes,)`` uint8 on the packing device; tensor ``i`` is
    ``data[metas[i].offset : metas[i].offset + metas[i].nbytes]`` viewed as ``metas[i].dtype``."""

    metas: Tuple[TensorMeta, ...]
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def wire_metas(self) -> list:
        """Plain lists: vLLM's RPC serializer (msgspec) turns dataclasses into dicts."""
        return [[m.name, m.dtype, list(m.shape), m.offset, m.nbytes] for m in self.metas]


def metas_from_wire(wire: list) -> Tuple[TensorMeta, ...]:
    return tuple(TensorMeta(n, d, tuple(s), o, b) for n, d, s, o, b in wire)


def _dtype_name(name: str, tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise TypeError(f"cannot pack {name}: unsupported dtype {tensor.dtype}")
    return dtype


def layout(named: Sequence[Tuple[str, torch.Tensor]]) -> Tuple[Tuple[TensorMeta, ...], int]:
    """Each tensor's place in a bucket, and the bucket's size in bytes (a multiple of :data:`ALIGN`)."""
    metas, offset = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        metas.append(TensorMeta(name, _dtype_name(name, tensor), tuple(tensor.shape), offset, nbytes))
        offset += nbytes + (-nbytes % ALIGN)
    return tuple(metas), offset


def pack_bucket(
    named: Sequence[Tuple[str, torch.Tensor]], device: Optional[torch.device] = None, out: Optional[torch.Tensor] = None
) -> WeightBucket:
    """Copy ``named`` into one flat buffer: ``out[:size]`` when given (a reused or shared buffer), else a new
    one on ``device`` (default: the first tensor's device)."""
    named = list(named)
    metas, size = layout(named)
    if out is None:
        device = device or (named[0][1].device if named else torch.device("cpu"))
        data = torch.zeros(size, dtype=torch.uint8, device=device)
    else:
        if out.numel() < size:
            raise ValueError(f"bucket of {size} bytes does not fit a buffer of {out.numel()}")
        data = out[:size]
    for meta, (_, tensor) in zip(metas, named):
        if meta.nbytes:
            data[meta.offset : meta.offset + meta.nbytes].copy_(_as_bytes(tensor))
    return WeightBucket(metas, data)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def unpack_bucket(metas: Sequence[TensorMeta], data: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of ``data`` (copy one before keeping it beyond the buffer's life)."""
    out = []
    for m in metas:
        dtype = DTYPES[m.dtype]
        if m.nbytes == 0:
            out.append((m.name, torch.empty(m.shape, dtype=dtype, device=data.device)))
            continue
        out.append((m.name, data[m.offset : m.offset + m.nbytes].view(dtype).reshape(m.shape)))
    return out


def bucket_groups(
    named: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Tensors in order, grouped to at most ``bucket_bytes`` each (a larger tensor gets a bucket alone)."""
    pending: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield pending
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes + (-nbytes % ALIGN)
    if pending:
        yield pending


def bucket_checksum(data: torch.Tensor, nbytes: int) -> int:
    """An exact checksum of the first ``nbytes`` bytes of a ``(>= nbytes,)`` uint8 tensor (a packed bucket): the
    sum of its 32-bit words, then of its last ``nbytes % 4`` bytes, as a Python int (< 2**59 for any bucket up to
    1 GiB, summed in int64 on the tensor's device, one value read back).

    The same bytes give the same number on any device and transport; a bucket lost, cut, stale or sent to the wrong
    engine changes it. A check of delivery, not a cryptographic hash (reordered words sum the same). ``data`` must
    start 4-byte aligned, as every bucket does (a buffer's start, ``ALIGN``)."""
    words = nbytes // 4
    total = int(data[: 4 * words].view(torch.int32).sum(dtype=torch.int64)) if words else 0
    if nbytes % 4:
        total += int(data[4 * words : nbytes].to(torch.int64).sum())
    return total


def bucket_to_bytes(bucket: WeightBucket) -> bytes:
    """The bucket's bytes for the object store (a GPU bucket is copied to host)."""
    return bucket.data.cpu().numpy().tobytes()


def bucket_from_bytes(payload: bytes) -> torch.Tensor:
    """A writable CPU ``(nbytes,)`` uint8 tensor over ``payload``'s bytes."""
    if not payload:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def resolve_weight_sync(method: str, *, hybrid_engine: bool, gpus_per_engine: float) -> str:
    """The transport ``rollout.weight_sync`` selects: ``ipc`` | ``broadcast`` | ``object_store``.

    ``auto``: CUDA IPC for the hybrid engine on GPUs (engine ``r`` shares policy rank ``r``'s device, so a handle
    replaces a copy); otherwise a broadcast over a process group (NCCL on GPUs, gloo on CPU). The runner falls
    back from ``auto`` to ``object_store`` only when that group cannot be formed (reported at start-up).
    """
    if method != "auto":
        return method
    return "ipc" if hybrid_engine and gpus_per_engine > 0 else "broadcast"
