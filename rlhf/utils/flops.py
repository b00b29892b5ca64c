"""Model FLOPs and MFU: how much of the device's peak a step's useful work used.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM appendix B) counts the FLOPs the model *must* do for the
tokens it trained on, not what the kernels happened to run, over the device's dense peak:

    MFU = sum over rows of (c * N * S_i + 2c * L * A * S_i^2) / seconds / peak

with ``S_i`` each row's real length (padding is not useful work; packing and padding of the same rows therefore
report the same FLOPs and their MFU differs by their speed), ``N`` the parameters that multiply activations (every
parameter except the input embedding table, which is a lookup; the LM head counted once, tied or not), ``L`` layers,
``A = heads x head_dim`` the attention width, and ``c`` = 6 for a training step (forward + backward: 2 + 4 FLOPs per
weight per token) or 2 for a forward-only pass (reference / old-policy log-probs). The attention term is the full
(non-causal) ``QK^T`` and ``AV`` products, as PaLM, Megatron and verl's ``mfu/actor`` count them, so the figures are
comparable with theirs; with uniform rows of length ``S`` it is the familiar ``6N + 12 L A S`` per token.

Peaks are dense (no sparsity) tensor-core rates from the vendors' datasheets, per dtype; a device not in the table
reports no MFU unless the run names its peak (``perf.peak_tflops``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

# Dense peak TFLOP/s by (device-name fragment, dtype). bf16 and fp16 share the tensor-core rate; fp32 is the rate a
# float32 matmul gets with TF32 off (torch's default for matmuls), i.e. the CUDA cores'. First match wins, so the
# more specific names come first.
PEAK_TFLOPS = (
    ("GB200", {"bf16": 2500.0, "fp32": 80.0}),
    ("B200", {"bf16": 2250.0, "fp32": 80.0}),
    ("H200", {"bf16": 989.0, "fp32": 67.0}),
    ("GH200", {"bf16": 989.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "fp32": 67.0}),
    ("H800", {"bf16": 989.0, "fp32": 67.0}),
    ("H20", {"bf16": 148.0, "fp32": 44.0}),
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp32": 90.5}),
    ("A10G", {"bf16": 70.0, "fp32": 31.2}),
    ("A10", {"bf16": 125.0, "fp32": 31.2}),
    ("L4", {"bf16": 121.0, "fp32": 30.3}),
    ("RTX 4090", {"bf16": 165.0, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp32": 35.6}),
)
TRAIN_FLOPS_PER_WEIGHT = 6  # forward 2 + backward 4 (input and weight gradients)
FORWARD_FLOPS_PER_WEIGHT = 2


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOP count of a causal LM needs from its shape.

    Attributes:
        matmul_params: ``N``: parameters that multiply activations (all but the input embedding; the LM head once).
        layers: ``L``, decoder layers.
        attention_width: ``A = num_attention_heads x head_dim``.
    """

    matmul_params: int
    layers: int
    attention_width: int

    @classmethod
    def of(cls, model: Any) -> "ModelFlops":
        """From an HF causal LM (or a DeepSpeed engine around one). Parameter sizes are the full ones under ZeRO-3
        (``ds_numel``); a value head (critic, reward model) is a tiny ``N`` term and counted as any weight."""
        module = getattr(model, "module", model)
        hf_config = getattr(module, "config", None)
        size = lambda p: int(getattr(p, "ds_numel", p.numel()))  # noqa: E731
        total = sum(size(p) for p in module.parameters())
        embedding = getattr(module, "get_input_embeddings", lambda: None)()
        head = getattr(module, "get_output_embeddings", lambda: None)()
        table = getattr(embedding, "weight", None)
        matmul = total - (size(table) if table is not None else 0)
        if head is not None and table is not None and getattr(head, "weight", None) is table:
            matmul += size(table)  # tied: the table is one parameter, the head's matmul still runs
        # An architecture whose config names its shape otherwise counts no attention term (the N term stays exact).
        heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
        head_dim = int(getattr(hf_config, "head_dim", None) or (getattr(hf_config, "hidden_size", 0) // max(heads, 1)))
        layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
        return cls(matmul_params=matmul, layers=layers, attention_width=heads * head_dim)

    def flops(self, row_lengths: Iterable[int], training: bool = True) -> float:
        """Model FLOPs of one pass over rows of these real lengths (forward + backward when ``training``)."""
        c = TRAIN_FLOPS_PER_WEIGHT if training else FORWARD_FLOPS_PER_WEIGHT
        tokens = squares = 0
        for length in row_lengths:
            tokens += int(length)
            squares += int(length) ** 2
        return float(c * self.matmul_params * tokens + 2 * c * self.layers * self.attention_width * squares)


def peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """The dense peak of a device (``torch.cuda.get_device_name()``) for a run's precision, or ``None`` when the
    device is not in :data:`PEAK_TFLOPS` (a CPU, an unknown GPU) or the precision has no tensor-core rate (fp64)."""
    key = "bf16" if precision in ("bf16", "fp16") else precision
    for fragment, peaks in PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            return peaks.get(key)
    return None


def mfu(flops: float, seconds: float, peak: Optional[float]) -> Optional[float]:
    """``flops / seconds`` as a fraction of ``peak`` TFLOP/s (``None`` without a peak or a duration)."""
    if not peak or seconds <= 0:
        return None
    return flops / seconds / (peak * 1e12)


HELD = "held:"  # the prefix of a pass on a frozen model a trained model's process holds (held_pass)


def held_pass(role: str) -> str:
    """The kind of pass on the frozen model of ``role`` a trained model's process holds (a reference, a teacher):
    its metrics are that role's own, ``perf/<role>/forward_*``, as its own group's would be."""
    return HELD + role


class PerfMeter:
    """A rank's work since it was last read: seconds spent, model FLOPs and real tokens, per kind of pass (``train``:
    optimizer steps, ``forward``: scoring, :func:`held_pass`: scoring on a held model). Only counted rows are
    added (a lockstep filler is work, not useful work)."""

    def __init__(self) -> None:
        self.totals: Dict[str, List[float]] = {}

    def add(self, kind: str, seconds: float, flops: float, tokens: float) -> None:
        total = self.totals.setdefault(kind, [0.0, 0.0, 0.0])
        total[0] += seconds
        total[1] += flops
        total[2] += tokens

    def take(self) -> Dict[str, Dict[str, float]]:
        """What was added since the last call, by kind; the meter starts again from nothing."""
        taken = {kind: {"seconds": s, "flops": f, "tokens": t} for kind, (s, f, t) in self.totals.items()}
        self.totals = {}
        return taken


def perf_metrics(role: str, ranks: Sequence[Dict[str, Dict[str, float]]], peak: Optional[float]) -> Dict[str, float]:
    """A group's ``perf/<role>/...`` metrics from its ranks' :meth:`PerfMeter.take`: ``tokens_per_s`` (real tokens of
    every rank over the slowest rank's seconds: the ranks run in lockstep) and ``mfu`` (their model FLOPs over that
    time and every rank's ``peak`` TFLOP/s; absent without a peak) for optimizer steps, ``forward_tokens_per_s`` and
    ``forward_mfu`` for scoring passes; the passes on a model held as another role as ``perf/<that role>/forward_*``."""
    out: Dict[str, float] = {}
    held = sorted({kind for rank in ranks for kind in rank if kind.startswith(HELD)})
    kinds = [("train", role, ""), ("forward", role, "forward_")] + [(k, k[len(HELD) :], "forward_") for k in held]
    for kind, name, prefix in kinds:
        parts = [rank[kind] for rank in ranks if kind in rank]
        seconds = max((p["seconds"] for p in parts), default=0.0)
        if seconds <= 0:
            continue
        out[f"perf/{name}/{prefix}tokens_per_s"] = round(sum(p["tokens"] for p in parts) / seconds, 1)
        utilisation = mfu(sum(p["flops"] for p in parts), seconds * len(ranks), peak)
        if utilisation is not None:
            out[f"perf/{name}/{prefix}mfu"] = round(utilisation, 4)
    return out
