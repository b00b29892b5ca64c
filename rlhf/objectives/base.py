"""Protocols shared by the objectives (see the package docstring for the contract)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Protocol, Tuple, Union

import torch

from rlhf.batch import Batch

Sums = Dict[str, float]  # metric sums on the host: what crosses actor boundaries and what finalize reads
# A micro-batch's metric sums as ``loss`` returns them: a value may stay a 0-dim tensor on the batch's device, read
# back once for the whole step (DeviceSums) rather than once per micro-batch (a host read makes a GPU wait).
MicroSums = Mapping[str, Union[float, torch.Tensor]]


class Objective(Protocol):
    """What a worker group trains (docs/custom_loops.md, "Writing an objective").

    ``count(batch)`` is the batch's share of the normalizer (target tokens, sequences, pairs); the group adds it
    over the *whole* global batch before the first backward. ``loss(model, batch)`` returns the micro-batch's
    loss as a *sum* over its units (the group divides it by the global count) and its metric sums.
    ``finalize(sums, normalizer)`` turns metric sums added over any number of micro-batches, ranks and
    optimizer steps into the logged means; it is called once per global quantity. A metric sum ``loss`` returns
    may be a float or a detached 0-dim tensor: a tensor stays on the device until the step's end
    (:class:`DeviceSums`), where every metric of the step is read back in one transfer.

    ``model`` is typed ``Any`` here: a worker passes its ``torch.nn.Module`` or the ``TrainEngine`` wrapping it
    (called like the model, ``.module`` the model), and an objective may annotate it as the module it uses.
    """

    def count(self, batch: Batch) -> int: ...

    def loss(self, model: Any, batch: Batch) -> Tuple[torch.Tensor, MicroSums]: ...

    def finalize(self, sums: MicroSums, normalizer: int) -> Dict[str, float]: ...


class ScoreFn(Protocol):
    """A forward-only computation run on frozen workers (e.g. reference log-probs): ``(model, batch) -> (B, ...)``;
    ``model`` as in :class:`Objective`."""

    def __call__(self, model: Any, batch: Batch) -> torch.Tensor: ...


def add_sums(total: Sums, part: MicroSums) -> Sums:
    """Element-wise sum of two metric-sum dicts (keys of either), on the host."""
    out = dict(total)
    for key, value in part.items():
        out[key] = out.get(key, 0.0) + float(value)
    return out


def host_sums(sums: MicroSums) -> Sums:
    """``sums`` as host floats, every tensor among them read back in one transfer (float64: exact for the float32
    and float64 values and the integer counts metric sums hold)."""
    by_device: Dict[torch.device, Dict[str, torch.Tensor]] = {}
    for key, value in sums.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, {})[key] = _float64(value)
    read: Dict[str, float] = {}
    for tensors in by_device.values():  # one device in a worker; a caller's CPU tensors may sit beside them
        read.update(zip(tensors, torch.stack(list(tensors.values())).tolist()))
    return {key: read[key] if key in read else float(value) for key, value in sums.items()}


class DeviceSums:
    """Metric sums added over the micro-batches of a step where each was computed, read back once.

    A Python float adds on the host; a tensor adds as float64 on its device, with no host read, so a step of any
    number of micro-batches reads its metrics back in one transfer (:meth:`read`). The result is bit for bit
    :func:`add_sums` over the same parts: each tensor is converted to float64 exactly as ``float()`` would, and
    the additions run in the same order in float64 (IEEE addition commutes, so a float meeting a tensor is the
    same sum whichever side it is on).
    """

    def __init__(self) -> None:
        self._sums: Dict[str, Union[float, torch.Tensor]] = {}

    def add(self, part: MicroSums) -> None:
        for key, value in part.items():
            total = self._sums.get(key, 0.0)
            if isinstance(value, torch.Tensor):
                self._sums[key] = _float64(value) + total
            else:  # a float: on the host, or added to a device total as a scalar argument (no transfer)
                self._sums[key] = total + float(value)

    def read(self) -> Sums:
        """The sums as host floats: one device-to-host transfer however many micro-batches were added."""
        return host_sums(self._sums)


def _float64(value: torch.Tensor) -> torch.Tensor:
    """A 0-dim metric tensor as float64 (the exact conversion ``float()`` makes), detached from any graph."""
    if value.numel() != 1:
        raise ValueError(f"a metric sum is one number, got a tensor of shape {tuple(value.shape)}")
    return value.detach().reshape(()).to(torch.float64)


@dataclass
class Totals:
    """An objective's metric sums and normalizer added over pieces of one global quantity (the ranks of a step,
    the optimizer steps of an RL step, the chunks of a held-out set), finalized once: a mean of per-piece means
    would weight a short piece like a long one."""

    sums: Sums = field(default_factory=dict)
    normalizer: int = 0

    def add(self, sums: Sums, normalizer: int) -> None:
        self.sums = add_sums(self.sums, sums)
        self.normalizer += normalizer

    def finalize(self, objective: Objective) -> Dict[str, float]:
        return objective.finalize(self.sums, self.normalizer)


def target_count(loss_mask: torch.Tensor) -> int:
    """Number of target tokens; column 0 is never a target (nothing predicts it)."""
    return int(target_tokens(loss_mask))


def target_tokens(loss_mask: torch.Tensor) -> torch.Tensor:
    """:func:`target_count` as a 0-dim int64 tensor on the mask's device (a metric sum, read with the step's)."""
    return loss_mask[..., 1:].sum()
