"""The row lengths of a batch's attention mask, known on the host, so that a forward on the device lays out its rows
without reading the device.

A forward needs to know where each row's padding starts: transformers reads the mask back to decide whether it has
padding at all (one read when it has none, two when it has), and a packed forward reads the row lengths to size the
packed sequence. On a GPU each read makes the host wait until the device has run everything queued, at the start of
every micro-batch's forward: the host can never queue one micro-batch ahead of the device. The batch was on the host
a moment before (a trainer rank copies it in, :meth:`rlhf.distributed.worker.TrainerWorker._upload`), so its row
lengths are free there. :func:`remember_row_lengths` records them against the device mask, for as long as that
tensor lives; :func:`row_lengths` finds them again for the mask or any view of it with the same elements in the
same order (a ``(B, 2, T)`` pair mask reshaped to ``(2B, T)``), and answers ``None`` for anything else (a slice, a
copy, a mask never recorded): the forward then reads the device as before. A mask recorded here must not be written
in place afterwards (nothing in the project does).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from rlhf.utils.host_reads import host_side

Tensor = torch.Tensor


@dataclass(frozen=True)
class _Recorded:
    mask: "weakref.ref[Tensor]"  # the device mask, while it lives
    numel: int
    width: int
    lengths: List[int]  # per row of the mask flattened to (-1, width)


_RECORDED: Dict[int, _Recorded] = {}  # by the device mask's data pointer


def remember_row_lengths(device_mask: Tensor, host_mask: Tensor) -> None:
    """Record the row lengths of ``host_mask`` (a host tensor holding the values of ``device_mask``, the mask of
    ``(..., T)`` right-padded rows) for ``device_mask``, while it lives. A mask that is not right-padded (1 on a
    prefix of each row) is not recorded: its forward reads the device, and refuses it if it packs."""
    if device_mask.numel() == 0 or not device_mask.is_contiguous() or host_mask.shape != device_mask.shape:
        return
    width = host_mask.shape[-1]
    with host_side():
        rows = host_mask.reshape(-1, width)
        lengths = rows.long().sum(-1)
        if not torch.equal(torch.arange(width)[None, :] < lengths[:, None], rows.bool()):
            return
        row_lengths = lengths.tolist()
    key = device_mask.data_ptr()

    def forget(ref: "weakref.ref[Tensor]") -> None:
        recorded = _RECORDED.get(key)
        if recorded is not None and recorded.mask is ref:  # not a newer mask recorded at the same address
            del _RECORDED[key]

    _RECORDED[key] = _Recorded(weakref.ref(device_mask, forget), device_mask.numel(), width, row_lengths)


def row_lengths(mask: Tensor) -> Optional[List[int]]:
    """The real tokens of each row of ``mask`` (``(R, T)``, or any shape flattened to ``(-1, T)``) from the host, if
    :func:`remember_row_lengths` recorded them for it (or for a tensor it views, element for element); else ``None``.
    """
    recorded = _RECORDED.get(mask.data_ptr())
    if recorded is None or mask.numel() != recorded.numel or mask.shape[-1] != recorded.width:
        return None
    original = recorded.mask()
    if original is None or original.data_ptr() != mask.data_ptr() or not mask.is_contiguous():
        return None
    return recorded.lengths
