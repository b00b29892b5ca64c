"""LoRA (model.lora.*) end to end on real Ray ranks and DeepSpeed engines: SFT, DPO and GRPO from the trainers' own
code path.

- SFT: one global batch split (micro x GA x ranks) = (4,1,1) on ZeRO 0 and (1,1,2) packed in micro-batches of at
  most 48 tokens on ZeRO 3 logs the same numbers and ends with the same weights; the ZeRO-3 run stopped after step 7
  and resumed from its adapter-only checkpoint ends bit-identical to it; ``final/`` holds the merged model and
  ``final/adapter``, which PEFT loads onto the base to give the merged model's outputs.
- DPO: the reference is the policy's own frozen base (no reference workers), precomputed on 1 rank, or another
  ``model.ref_path`` with the base's weights held in the 2 ZeRO-3 ranks of the LoRA policy and scored online: the
  same numbers; step 1's reward margin is 0 up to float32 rounding (adapters start at B = 0).
- Reward model: the scalar head trains whole next to the adapters and travels with them.

GRPO with LoRA and the weight sync into vLLM (merged and adapter-only) are tests/integration/test_lora_sync.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from offline_helpers import (
    _assert_same_runs,
    _assert_same_weights,
    _overrides,
    _rows,
    _weights,
    assert_dpo_policy_is_the_reference,
)
from resume_helpers import _assert_identical, _stop_and_resume

from rlhf.config.loader import load_config
from rlhf.config.schema import DPORunConfig, SFTRunConfig

pytestmark = pytest.mark.usefixtures("ray_session")

LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj,up_proj]")


@pytest.fixture(scope="module")
def sft_runs(tiny_model, sft_data, tmp_path_factory):
    from rlhf.trainers.offline.sft import train_sft

    base = tmp_path_factory.mktemp("lora_sft")
    splits = {
        "4x1x1-z0": (4, 1, 0, ()),
        "1x2x2-z3-packed": (1, 2, 3, ("train.packing=true", "train.max_tokens_per_micro_batch=48")),
    }
    runs = {}
    for name, (micro, ranks, zero, extra) in splits.items():
        out = str(base / name)
        overrides = lambda o, m=micro, r=ranks, z=zero, e=extra: _overrides(  # noqa: E731
            tiny_model, sft_data, o, 4, m, r, z, epochs=2, lr=2e-3, extra=(*LORA, *e)
        )
        runs[name] = (out, train_sft(load_config(SFTRunConfig, overrides=overrides(out))), overrides)
    return runs


def test_lora_sft_factorisations_agree_and_train_only_the_adapters(sft_runs, tiny_model):
    rows = {name: _rows(out) for name, (out, _, _) in sft_runs.items()}
    _assert_same_runs(rows, ("loss", "grad_norm", "lr"))
    first = next(iter(rows.values()))
    assert len(first) == 10 and first[-1]["loss"] < first[0]["loss"]
    finals = [result.final_dir for _, result, _ in sft_runs.values()]
    _assert_same_weights(finals)
    trained, base = _weights(finals[0]), _weights(tiny_model)
    assert set(trained) == set(base)  # the merged model: the base's names, no adapter tensors
    moved = {k for k in base if not torch.equal(trained[k], base[k])}
    assert moved and all(k.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight")) for k in moved), moved


def test_lora_sft_resumes_bit_identically_from_adapter_only_checkpoints(sft_runs, tmp_path):
    from rlhf.trainers.checkpoint import Checkpoints
    from rlhf.trainers.offline.sft import train_sft

    out, _, overrides = sft_runs["1x2x2-z3-packed"]
    split = str(tmp_path / "split")
    _stop_and_resume(SFTRunConfig, None, train_sft, overrides, split, stop_after=7)
    _assert_identical(out, split)
    step, directory = Checkpoints(split, keep=1).complete()[-1]
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files)
    model_bytes = sum(
        os.path.getsize(os.path.join(out, "final", f))
        for f in os.listdir(os.path.join(out, "final"))
        if f.endswith(".safetensors")
    )
    assert size < model_bytes  # the adapters and their Adam state only, not the frozen base


def test_lora_final_adapter_loads_onto_the_base_as_the_merged_model(sft_runs, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = sft_runs["4x1x1-z0"][1].final_dir
    with open(os.path.join(final, "adapter", "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        4,
        8,
        ["q_proj", "up_proj", "v_proj"],
    )
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), os.path.join(final, "adapter")
    ).eval()
    ids = torch.tensor([[5, 17, 30, 41, 8, 99, 12]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_lora_dpo_against_the_frozen_base_without_reference_workers(tiny_model, pair_data, tmp_path, capsys):
    from rlhf.trainers.kinds import kind_of
    from rlhf.trainers.offline.dpo import train_dpo

    # another model.ref_path (a copy of the base's weights) held in the LoRA policy's processes: the same numbers
    reference_copy = shutil.copytree(tiny_model, tmp_path / "reference")
    runs = {}
    for name, (micro, ranks, zero, mode, reference) in {
        "4x1x1-z2-pre": (4, 1, 2, "precompute", ("dpo.ref_num_workers=2",)),
        "1x2x2-z3-online-held": (1, 2, 3, "online", (f"model.ref_path={reference_copy}", "dpo.ref_num_workers=0")),
    }.items():
        out = str(tmp_path / name)
        extra = (*LORA, f"dpo.ref_mode={mode}", "dpo.beta=0.5", *reference)
        cfg = load_config(
            DPORunConfig,
            overrides=_overrides(tiny_model, pair_data, out, 4, micro, ranks, zero, epochs=1, lr=2e-3, extra=extra),
        )
        assert [a.role for a in kind_of(cfg).plan(cfg, 0.0).actors] == ["policy"]  # no reference workers asked for
        train_dpo(cfg)
        runs[name] = _rows(out)
    assert "reference log-probs precomputed for 19 pairs on the policy's frozen base (LoRA)" in capsys.readouterr().out
    _assert_same_runs(runs, ("loss", "grad_norm", "rewards/margin", "rewards/accuracy"), dpo_beta=0.5)
    # each step's reference passes ran on the held copy (logged as its role), the base's precompute before step 1
    assert all("perf/reference/forward_tokens_per_s" in row for row in runs["1x2x2-z3-online-held"])
    assert not any(key.startswith("perf/reference/") for key in runs["4x1x1-z2-pre"][0])
    rows = runs["4x1x1-z2-pre"]
    # step 1: the adapters start at B = 0, so the policy is its base, the reference: a margin of float32 rounding
    assert_dpo_policy_is_the_reference(rows[0], beta=0.5)
    assert abs(rows[-1]["rewards/margin"]) > 1e-2  # then it trains away from the base (0.28 seen at step 4)


def test_lora_reward_model_trains_its_head_whole_next_to_the_adapters(tiny_model, pair_data, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from rlhf.config.schema import RewardModelRunConfig
    from rlhf.trainers.offline.reward_model import train_reward_model

    out = str(tmp_path / "rm")
    result = train_reward_model(
        load_config(
            RewardModelRunConfig,
            overrides=_overrides(tiny_model, pair_data, out, 4, 2, 2, 3, epochs=3, lr=5e-3, extra=LORA),
        )
    )
    rows = _rows(out)
    epoch_loss = [sum(r["loss"] for r in rows if r["epoch"] == e) / 4 for e in (1, 2, 3)]  # the same 16 pairs
    assert len(rows) == 12 and epoch_loss[2] < epoch_loss[0], epoch_loss
    adapter = load_file(os.path.join(result.final_dir, "adapter", "adapter_model.safetensors"))
    assert any("score" in name for name in adapter)  # the head's trained copy travels with the adapter
    with open(os.path.join(result.final_dir, "adapter", "adapter_config.json")) as f:
        assert "score" in json.load(f)["modules_to_save"]
    merged = AutoModelForSequenceClassification.from_pretrained(result.final_dir, num_labels=1).eval()
    moved = {
        k
        for k, v in _weights(tiny_model).items()
        if k in merged.state_dict() and not torch.equal(merged.state_dict()[k], v)
    }
    assert moved and all(k.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight")) for k in moved), moved
