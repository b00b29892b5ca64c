"""Adapter-only LoRA sync (``model.lora.sync=adapter``): its key, the sender's residence check, the engine's rank, the
adapter's names and config, and ``bench/lora_sync.py``'s size arithmetic (against the tiny model's real counts).
The engines and training runs are tests/integration/test_lora_sync.py."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from rlhf.config import ConfigError, SFTRunConfig, load_config
from rlhf.distributed.engine import iter_full_state
from rlhf.distributed.errors import WorkerError
from rlhf.models.lora import LoraSpec, adapter_named_tensors, adapter_sync_config, apply_lora, is_adapter_tensor
from rlhf.rollout.vllm.engine import VLLMSpec, engine_lora_rank, llm_options
from rlhf.rollout.weights.senders import AdapterTotals, check_adapter_residence

ROOT = Path(__file__).resolve().parents[2]
BASE = ["model.path=m", "data.train_path=d"]


def test_the_sync_key_names_itself_when_it_cannot_work():
    assert load_config(SFTRunConfig, None, BASE).model.lora.sync == "merged"
    assert load_config(SFTRunConfig, None, [*BASE, "model.lora.r=8", "model.lora.sync=adapter"]).model.lora.sync
    bad = {
        ("model.lora.sync=adapter",): "model.lora.sync is adapter, which needs LoRA on",
        ("model.lora.r=640", "model.lora.sync=adapter"): "model.lora.sync is adapter, which needs LoRA on with a rank "
        "vLLM serves (0 < model.lora.r <= 512); model.lora.r is 640",
        ("model.lora.r=8", "model.lora.sync=adapters"): "model.lora.sync",
    }
    for overrides, message in bad.items():
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            load_config(SFTRunConfig, None, [*BASE, *overrides])


def test_the_engine_takes_the_smallest_vllm_rank_that_holds_the_adapter():
    assert [engine_lora_rank(r) for r in (1, 4, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="above vLLM's largest max_lora_rank 512"):
        engine_lora_rank(513)
    options = llm_options(VLLMSpec(model_path="m", max_lora_rank=16), cuda=False)
    assert (options["enable_lora"], options["max_lora_rank"], options["max_loras"]) == (True, 16, 1)
    assert "enable_lora" not in llm_options(VLLMSpec(model_path="m"), cuda=False)
    # the base survives a hybrid engine's sleep only at level 1: an adapter sync does not resend it
    assert (VLLMSpec(model_path="m").sleep_level, VLLMSpec(model_path="m", max_lora_rank=8).sleep_level) == (2, 1)


@pytest.fixture(scope="module")
def peft_model(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return apply_lora(model, LoraSpec(r=4, alpha=8, target_modules=("q_proj", "up_proj")), "causal_lm", seed=0)


def test_only_the_adapter_is_gathered_and_sent_under_peft_names(peft_model):
    kept = list(iter_full_state(peft_model, zero_stage=0, keep=is_adapter_tensor))
    assert kept and all(".lora_A." in n or ".lora_B." in n for n, _ in kept)
    assert len(kept) == 2 * 2 * 2  # 2 layers x (q, up) x (A, B)
    names = [n for n, _ in adapter_named_tensors(kept)]
    assert all(
        re.fullmatch(r"base_model\.model\.model\.layers\.\d\.\w+\.\w+_proj\.lora_[AB]\.weight", n) for n in names
    )
    config = adapter_sync_config(LoraSpec(r=4, alpha=8), peft_model.state_dict())
    assert config == {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "up_proj"],
        "bias": "none",
        "use_rslora": False,
    }
    with pytest.raises(ValueError, match="no LoRA A tensors"):
        adapter_sync_config(LoraSpec(r=4), ["model.layers.0.self_attn.q_proj.weight"])


def _adapter(scaling):
    a, b = torch.tensor([[0.5, -1.5]]), torch.tensor([[2.0], [-0.25]])
    totals = AdapterTotals(scaling)
    list(totals.count([("m.q_proj.lora_A.weight", a), ("m.q_proj.lora_B.weight", b), ("m.norm.weight", b)]))
    return totals


def test_the_adapter_totals_are_what_vllm_holds():
    totals = _adapter(2.0)  # vLLM multiplies B by alpha / r once; a tensor that is neither A nor B is not counted
    assert (totals.sum_a, totals.sum_b) == (2.0, 4.5)


def test_a_worker_whose_lora_buffers_differ_is_named_with_the_version():
    totals = _adapter(2.0)
    good = {"resident": {"sum_a": 2.0, "sum_b": 4.5 * (1 + 1e-9), "modules": 1}}
    check_adapter_residence(["rollout engine 0"], [[good]], 3, totals)
    stale = {"resident": {"sum_a": 2.0, "sum_b": 4.0, "modules": 1}}
    with pytest.raises(WorkerError, match=r"^rollout engine 1 worker 0 does not serve the adapter of version 3"):
        check_adapter_residence(["rollout engine 0", "rollout engine 1"], [[good], [stale]], 3, totals)
    with pytest.raises(WorkerError, match=r"^rollout engine 0 worker 1 installed no adapter for version 3"):
        check_adapter_residence(["rollout engine 0"], [[good, {"version": 3}]], 3, totals)
    # a tensor-parallel worker holds a slice of every module: its receipt is checked, not its sums
    check_adapter_residence(["rollout engine 0"], [[{**stale, "tensor_parallel_size": 2}]], 3, totals)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_lora_sync", ROOT / "bench" / "lora_sync.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through its module
    spec.loader.exec_module(module)
    return module


def test_the_on_paper_sizes_count_what_the_tiny_model_and_peft_hold(tiny_model, peft_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    bench = _bench()
    c = AutoConfig.from_pretrained(tiny_model)
    shape = bench.DecoderShape(
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        vocab=c.vocab_size,
        tied=c.tie_word_embeddings,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    wrapped = apply_lora(model, LoraSpec(r=8), "causal_lm", seed=0)  # all-linear
    assert shape.adapter_parameters(8) == sum(p.numel() for n, p in wrapped.named_parameters() if ".lora_" in n)
    assert bench.QWEN25_7B.parameters() == pytest.approx(7.61e9, rel=2e-3)  # Qwen2.5-7B's model card: 7.61B


def test_dry_run_says_an_rl_run_syncs_the_adapter_alone(tiny_model, rl_prompts, capsys):
    from rlhf.cli.dry_run import dry_run
    from rlhf.config.rl_schema import RLRunConfig

    overrides = [
        f"model.path={tiny_model}",
        f"data.train_path={rl_prompts}",
        "reward.functions=[rlhf.synthetic.arithmetic:reward]",
        "model.lora.r=8",
    ]
    for sync in ("merged", "adapter"):
        cfg = load_config(RLRunConfig, "grpo_tiny", [*overrides, f"model.lora.sync={sync}"])
        dry_run(cfg, "train_ppo", cluster="1x4cpu")
        said = "RL weight syncs send the adapter alone (model.lora.sync=adapter)" in capsys.readouterr().out
        assert said == (sync == "adapter")


def test_an_adapter_sync_is_refused_where_there_are_no_engines(tiny_model, tmp_path):
    from shared_helpers import uneven_pair_rows, write_jsonl

    from rlhf.config import DPORunConfig
    from rlhf.trainers.kinds import kind_of
    from rlhf.trainers.preflight import preflight

    pairs = write_jsonl(tmp_path / "pairs.jsonl", uneven_pair_rows(4, seed=0))
    overrides = [f"model.path={tiny_model}", f"data.train_path={pairs}", "model.lora.r=8", "model.lora.sync=adapter"]
    cfg = load_config(DPORunConfig, None, overrides)
    with pytest.raises(ConfigError, match=r"^model.lora.sync is adapter, but rlhf.cli.train_dpo has no rollout"):
        preflight(cfg, kind_of(cfg), here=True)
