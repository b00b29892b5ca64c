"""A ZeRO-3 build equals a ZeRO-0 build of the same weights: same buffers (dtype and values), same forward.

DeepSpeed's ``zero.Init`` (how ZeRO-3 loads) casts the floating tensors a module's ``__init__`` creates to the
training dtype, so under bf16 the rotary ``inv_freq`` that transformers keeps in float32 became bf16 and every
ZeRO-3 forward differed from the other stages' (``rlhf.models.loading.keep_fp32_buffers``). Each build goes through
``TrainerWorker.build``, the path of every role: the reference and the reward model (frozen), the policy with LoRA
and the critic (trainable engines). On one rank ZeRO-3 gathers each whole weight before using it, so the forward
is the same arithmetic on the same tensors as ZeRO-0's and must be bit-identical (measured: it is).

The builds run in a subprocess on a one-rank gloo group: ``deepspeed.init_distributed`` and zero.Init leave
process-wide state (a process group, patched module classes) that the other tests of this process must not see.
No Ray.
"""

from __future__ import annotations

import pytest
import torch
from shared_helpers import subprocess_fixture

# name: (kind, trainable, lora rank, precision). fp32: zero.Init casts nothing, the config is left as it was.
CASES = {
    "reference": ("causal_lm", False, 0, "bf16"),
    "policy_lora": ("causal_lm", True, 4, "bf16"),
    "reward": ("scalar_head", False, 0, "bf16"),
    "critic": ("scalar_head", True, 0, "bf16"),
    "reference_fp32": ("causal_lm", False, 0, "fp32"),
}
ROWS, LENGTH = 3, 512  # long rows: the rotary angle error of a bf16 inv_freq grows with the position


def _batch():
    """``(ROWS, LENGTH)`` random tokens, right-padded to uneven lengths."""
    from rlhf.batch import Batch

    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, 512, (ROWS, LENGTH), generator=generator)
    lengths = torch.tensor([LENGTH, LENGTH - 100, 37])
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    return Batch(input_ids=input_ids * mask, attention_mask=mask, loss_mask=mask)


def _forward(kind: str):
    """The forward a worker scores with, as a score function: logits ``(B, T, V)`` of a causal LM, per-token values
    ``(B, T)`` of a scalar head, as float32 (bf16 outputs upcast exactly), 0 at padding."""
    from rlhf.models.loading import SCALAR_HEAD, scalar_head_values

    def forward(model, batch):
        if kind == SCALAR_HEAD:
            return scalar_head_values(model, batch.input_ids, batch.attention_mask, packing=False).float()
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return logits.float() * batch.attention_mask[..., None]

    return forward


def _probe(model_path: str, out_path: str, port: int) -> None:
    """Run in the subprocess: every case built on ZeRO 0 and ZeRO 3; saves ``{(case, stage): {"buffers": {name:
    tensor}, "out": forward}}`` to ``out_path``. A one-rank group would build ZeRO 1 for ZeRO 3 (nothing to
    partition, rlhf.distributed.engine.effective_zero_stage): switched off here, the builds are real ZeRO-3 ones."""
    import rlhf.distributed.engine as engine_module
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.worker import TrainerWorker
    from rlhf.models.loading import ModelSpec
    from rlhf.models.lora import LoraSpec

    TrainerWorker("probe", 0, 1).init_process_group("127.0.0.1", port, "gloo", timeout_s=60)
    engine_module.effective_zero_stage = lambda stage, *_: stage
    batch, results = _batch(), {}
    for case, (kind, trainable, rank, precision) in CASES.items():
        for stage in (0, 3):
            worker = TrainerWorker(case, 0, 1)
            worker.build(
                ModelSpec(
                    path=model_path, kind=kind, precision=precision, seed=3, lora=LoraSpec(r=rank) if rank else None
                ),
                EngineSpec(zero_stage=stage, precision=precision, micro_batch_size=ROWS, grad_accum_steps=1),
                OptimSpec(lr=1e-3, total_steps=1) if trainable else None,
            )
            assert worker.zero_stage == stage
            out = worker.score([batch], _forward(kind))[0]
            results[case, stage] = {
                "buffers": {n: b.detach().clone() for n, b in worker.model.named_buffers()},
                "out": out,
            }
    torch.save(results, out_path)


builds = subprocess_fixture(__file__, "_probe", "builds")


@pytest.mark.parametrize("case", list(CASES))
def test_zero3_buffers_have_the_dtype_and_values_of_zero0(builds, case):
    zero0, zero3 = builds[case, 0]["buffers"], builds[case, 3]["buffers"]
    assert zero0 and zero0.keys() == zero3.keys()
    for name, buf in zero0.items():
        assert zero3[name].dtype == buf.dtype, (case, name, zero3[name].dtype, buf.dtype)
        assert torch.equal(zero3[name], buf), (case, name)
    rotary = [buf for name, buf in zero0.items() if name.endswith("rotary_emb.inv_freq")]
    assert len(rotary) == 1 and rotary[0].dtype == torch.float32  # transformers keeps it float32 on ZeRO 0


@pytest.mark.parametrize("case", list(CASES))
def test_zero3_forward_equals_zero0_bitwise(builds, case):
    zero0, zero3 = builds[case, 0]["out"], builds[case, 3]["out"]
    assert zero0.shape == zero3.shape and zero0.abs().max() > 0
    diff = (zero3.double() - zero0.double()).abs().max().item()
    assert torch.equal(zero3, zero0), f"{case}: ZeRO-3 forward differs from ZeRO-0 by up to {diff:.3g}"


class _Router(torch.nn.Module):
    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
        self.register_buffer("bias", torch.zeros(2, dtype=dtype))  # the weights' dtype in an ordinary build
        self.register_buffer("freq", torch.zeros(2, dtype=torch.float32))
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


class _Model(torch.nn.Module):
    _keep_in_fp32_modules_strict = ["bias"]  # transformers' list, which DeepSpeed's "auto" setting reads

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.gate = _Router(dtype)
        self.norm = torch.nn.Module()
        self.norm.register_buffer("freq", torch.zeros(2, dtype=dtype))  # same name as gate.freq, not float32


def _patterns(config):
    return config["data_types"]["keep_in_fp32_modules"]


def test_float32_weights_leave_the_zero3_config_as_it_was():
    """fp32 (and fp64) weights: zero.Init casts nothing and ``load_model`` builds no skeleton; the function itself
    returns the very same config when no buffer is to be kept in float32."""
    from rlhf.models.loading import keep_fp32_buffers, zero3_buffer_dtypes

    config = {"zero_optimization": {"stage": 3}, "data_types": {"grad_accum_dtype": "fp32"}}
    assert keep_fp32_buffers(config, {"a.b": torch.bfloat16}) is config
    assert zero3_buffer_dtypes(_Model(torch.float32), config)["gate.freq"] == torch.float32


def test_only_the_float32_buffers_are_named_each_by_the_suffixes_no_other_buffer_has():
    from rlhf.models.loading import keep_fp32_buffers, zero3_buffer_dtypes

    none_kept = {"data_types": {"keep_in_fp32_modules": []}}
    dtypes = zero3_buffer_dtypes(_Model(), none_kept)
    assert dtypes == {"gate.bias": torch.bfloat16, "gate.freq": torch.float32, "norm.freq": torch.bfloat16}
    # "freq" alone would also match norm.freq at its owner: only the longer suffixes name gate.freq
    assert _patterns(keep_fp32_buffers(none_kept, dtypes)) == [r"^gate\.freq$"]


@pytest.mark.parametrize("setting", ["auto", ["gate.bias"], ["bias"]])
def test_what_deepspeeds_own_setting_keeps_stays_kept(setting):
    """The list replaces DeepSpeed's ``keep_in_fp32_modules`` ("auto" by default: the model's
    ``_keep_in_fp32_modules_strict``), so what that setting would keep is named too."""
    from rlhf.models.loading import keep_fp32_buffers, zero3_buffer_dtypes

    config = {} if setting == "auto" else {"data_types": {"keep_in_fp32_modules": setting}}
    dtypes = zero3_buffer_dtypes(_Model(), config)
    assert dtypes["gate.bias"] == torch.float32 and dtypes["norm.freq"] == torch.bfloat16
    assert _patterns(keep_fp32_buffers(config, dtypes)) == [r"^bias$", r"^gate\.bias$", r"^gate\.freq$"]


def test_a_buffer_zero_init_left_in_another_dtype_is_refused_by_name():
    from rlhf.models.loading import check_buffer_dtypes

    model = _Model()
    check_buffer_dtypes(model, {"gate.freq": torch.float32, "gate.bias": torch.bfloat16})
    with pytest.raises(RuntimeError, match=r"gate\.bias is torch\.bfloat16, expected torch\.float32.*zero_stage"):
        check_buffer_dtypes(model, {"gate.bias": torch.float32})
