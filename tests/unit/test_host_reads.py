"""Host reads (rlhf.utils.host_reads): what the counter catches on a CPU tensor, and a step's metric sums added on
the device (rlhf.objectives.base.DeviceSums) read back once, bit for bit the host's sums."""

from __future__ import annotations

import struct

import pytest
import torch

from rlhf.objectives.base import DeviceSums, add_sums, host_sums
from rlhf.utils.host_reads import HostReads


def test_each_kind_of_host_read_is_counted_and_device_work_is_not():
    x = torch.arange(12.0).reshape(3, 4)
    mask = x > 4
    with HostReads() as reads:
        y = (x * 2).sum(-1).cumsum(0)  # device work: no read
        x.reshape(-1)[torch.tensor([0, 5])]  # an index of longs: sized by its shape, not its data
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 0, 2]), output_size=3)
    assert reads.total == 0 and torch.equal(y, torch.tensor([12.0, 56.0, 132.0]))
    with HostReads() as reads:
        y.sum().item()
        float(y[0])
        if mask.any():
            int(y[1])
        y.tolist()
        y.cpu()
        mask.nonzero()
        x[mask]
        torch.equal(x, x)
    assert reads.by_op == {
        "_local_scalar_dense": 4,
        "tolist": 1,
        "cpu": 1,
        "nonzero": 1,
        "bool-mask index": 1,
        "equal": 1,
    }
    assert reads.total == 9


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def test_device_sums_are_the_host_sums_bit_for_bit_in_one_read():
    """Float32, float64 and integer metrics, some keys given as Python floats in some parts, a -0.0: the device
    sums equal add_sums over the same parts, bit for bit, and the whole step reads back once."""
    gen = torch.Generator().manual_seed(0)
    parts = []
    for i in range(7):
        part = {
            "loss_sum": (torch.randn((), generator=gen) * 1e3).float(),
            "fp64_sum": torch.randn((), generator=gen, dtype=torch.float64) * 1e-3,
            "count": torch.randint(0, 10**6, (), generator=gen),
            "mixed": float(torch.randn((), generator=gen)) if i % 2 else torch.randn((), generator=gen).float(),
            "zero": torch.tensor(-0.0),
        }
        if i == 3:
            part["late"] = torch.tensor(2.5)
        parts.append(part)
    host: dict = {}
    device = DeviceSums()
    for part in parts:
        host = add_sums(host, part)
        device.add(part)
    with HostReads() as reads:
        read = device.read()
    assert reads.by_op == {"tolist": 1}
    assert list(read) == list(host)
    assert {k: _bits(v) for k, v in read.items()} == {k: _bits(v) for k, v in host.items()}
    assert all(type(v) is float for v in read.values())


def test_host_sums_read_each_device_once_and_refuse_a_tensor_of_many_numbers():
    sums = {"a": torch.tensor(1.5), "b": 2.0, "c": torch.tensor(3, dtype=torch.int64)}
    with HostReads() as reads:
        assert host_sums(sums) == {"a": 1.5, "b": 2.0, "c": 3.0}
    assert reads.by_op == {"tolist": 1}
    with pytest.raises(ValueError, match=r"a metric sum is one number, got a tensor of shape \(2,\)"):
        DeviceSums().add({"loss_sum": torch.ones(2)})


def test_a_device_filter_counts_only_reads_of_that_device():
    x = torch.arange(4.0)
    with HostReads("cuda") as reads:  # a host tensor's read waits for no device
        x.sum().item()
        x.tolist()
        x[x > 1]
    assert reads.total == 0
    with HostReads("cpu") as reads:
        x.sum().item()
        x.tolist()
    assert reads.by_op == {"_local_scalar_dense": 1, "tolist": 1}
