"""Packing policy weights into buckets for the vLLM engines (the CPU / object-store path).

The policy's full parameters (ZeRO-3 shards gathered, see :func:`rlhf.distributed.engine.iter_full_state`) are
grouped into buckets of about ``bucket_bytes`` each; a bucket travels as one contiguous byte payload plus
metadata, because torch tensors cannot cross vLLM's ``collective_rpc`` as they are, and one payload per bucket
costs one serialisation instead of one per parameter (OpenRLHF's per-parameter broadcast is its known
bottleneck, issues #533/#647). On the engine side the names stay HF checkpoint names: vLLM's own
``model.load_weights`` maps them onto its fused layers (qkv, gate_up).

On GPUs the same buckets are broadcast over NCCL instead (see ``rlhf.rollout.vllm_extension``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, List, Tuple

import torch

_ALIGN = 16  # every tensor starts on a 16-byte boundary so it can be viewed in place as any dtype
_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                          torch.int64, torch.int32, torch.uint8, torch.bool)}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightBucket:
    metas: Tuple[TensorMeta, ...]
    payload: bytes

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    def to_wire(self) -> Tuple[list, bytes]:
        """Plain lists and bytes: vLLM's RPC serializer (msgspec) turns dataclasses into dicts."""
        return [[m.name, m.dtype, list(m.shape), m.offset, m.nbytes] for m in self.metas], self.payload

    @staticmethod
    def from_wire(metas: list, payload: bytes) -> "WeightBucket":
        return WeightBucket(tuple(TensorMeta(n, d, tuple(s), o, b) for n, d, s, o, b in metas), payload)


def pack_bucket(named: Iterable[Tuple[str, torch.Tensor]]) -> WeightBucket:
    metas, chunks, offset = [], [], 0
    for name, tensor in named:
        tensor = tensor.detach().cpu().contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"cannot pack {name}: unsupported dtype {tensor.dtype}")
        raw = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        metas.append(TensorMeta(name, dtype, tuple(tensor.shape), offset, len(raw)))
        padding = -len(raw) % _ALIGN
        chunks += [raw, bytes(padding)]
        offset += len(raw) + padding
    return WeightBucket(tuple(metas), b"".join(chunks))


def unpack_bucket(bucket: WeightBucket) -> List[Tuple[str, torch.Tensor]]:
    """The bucket's tensors (CPU; they share one buffer, so copy before keeping one beyond the load)."""
    buffer = torch.frombuffer(bytearray(bucket.payload), dtype=torch.uint8) if bucket.payload else None
    out = []
    for m in bucket.metas:
        dtype = _DTYPES[m.dtype]
        if m.nbytes == 0:
            out.append((m.name, torch.empty(m.shape, dtype=dtype)))
            continue
        out.append((m.name, buffer[m.offset:m.offset + m.nbytes].view(dtype).reshape(m.shape)))
    return out


def iter_buckets(named: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[WeightBucket]:
    """Group tensors in order into buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket alone)."""
    pending: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield pack_bucket(pending)
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield pack_bucket(pending)
