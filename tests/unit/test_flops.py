"""Model FLOPs and MFU (rlhf/utils/flops.py): the parameter count that multiplies activations, tied and untied
heads, the attention term by real row lengths, the device peak table."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhf.models.sizes import MODEL_SIZES
from rlhf.utils.flops import ModelFlops, mfu, peak_tflops


def _model(tied: bool) -> Qwen2ForCausalLM:
    shape = dict(MODEL_SIZES["tiny"], tie_word_embeddings=tied)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**shape))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matmul_parameters(tied):
    """Every parameter but the embedding lookup table; the LM head's matmul once, whether it shares that table."""
    model = _model(tied)
    by_name = dict(model.named_parameters())  # a tied head appears once, under the embedding's name
    table = model.model.embed_tokens.weight.numel()
    expected = sum(p.numel() for n, p in by_name.items() if n != "model.embed_tokens.weight")
    if tied:
        assert "lm_head.weight" not in by_name
        expected += table  # the head's matmul still runs
    flops = ModelFlops.of(model)
    assert flops.matmul_params == expected
    config = model.config
    assert flops.layers == config.num_hidden_layers
    assert flops.attention_width == config.num_attention_heads * (config.hidden_size // config.num_attention_heads)


def test_flops_of_rows():
    """``c * N * S + 2c * L * A * S^2`` per row: uniform rows give the familiar ``(6N + 12 L A S)`` per token; the
    forward-only count is a third of training's."""
    f = ModelFlops(matmul_params=1000, layers=3, attention_width=64)
    assert f.flops([128] * 4) == 4 * 128 * (6 * 1000 + 12 * 3 * 64 * 128)
    assert f.flops([5, 7], training=False) == 2 * 1000 * 12 + 4 * 3 * 64 * (25 + 49)
    assert 3 * f.flops([5, 7], training=False) == f.flops([5, 7])
    assert f.flops([]) == 0


def test_peak_table_and_mfu():
    assert peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0  # the specific name before the generic one
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert peak_tflops("cpu", "bf16") is None
    assert peak_tflops("NVIDIA H200", "fp64") is None
    assert mfu(989e12 * 0.5, 1.0, 989.0) == pytest.approx(0.5)
    assert mfu(1.0, 1.0, None) is None and mfu(1.0, 0.0, 989.0) is None


def test_perf_meter_and_group_metrics():
    """Per rank: seconds, FLOPs and tokens by kind, reset when read. Per group: tokens over the slowest rank's
    seconds, FLOPs over that time and every rank's peak; no MFU without a peak; a kind with no work is absent."""
    from rlhf.utils.flops import PerfMeter, perf_metrics

    meters = [PerfMeter(), PerfMeter()]
    meters[0].add("train", 2.0, 4e12, 1000)
    meters[0].add("train", 1.0, 2e12, 500)
    meters[1].add("train", 2.5, 6e12, 1500)
    meters[1].add("forward", 0.5, 1e12, 800)
    ranks = [m.take() for m in meters]
    assert ranks[0] == {"train": {"seconds": 3.0, "flops": 6e12, "tokens": 1500}}
    assert meters[0].take() == {}  # read once
    out = perf_metrics("policy", ranks, peak=10.0)
    assert out["perf/policy/tokens_per_s"] == round(3000 / 3.0, 1)
    assert out["perf/policy/mfu"] == round(12e12 / (3.0 * 2 * 10e12), 4)
    assert out["perf/policy/forward_tokens_per_s"] == round(800 / 0.5, 1)
    assert out["perf/policy/forward_mfu"] == round(1e12 / (0.5 * 2 * 10e12), 4)
    assert perf_metrics("policy", ranks, peak=None) == {
        "perf/policy/tokens_per_s": 1000.0,
        "perf/policy/forward_tokens_per_s": 1600.0,
    }
    assert perf_metrics("reference", [{}, {}], peak=10.0) == {}
