"""The LLM judge's engines: vLLM engines of the judge model (:class:`~rlhf.rollout.vllm.engines.RolloutEngines`, the
rollout's own group) under an :class:`~rlhf.rewards.judge.LLMJudge`. The judge's logic lives in
:mod:`rlhf.rewards.judge`; starting engines is this layer's."""

from __future__ import annotations

from typing import Any, Optional

from rlhf.hub import model_dir
from rlhf.rewards.judge import JudgeSpec, LLMJudge
from rlhf.rollout.types import SamplingSpec
from rlhf.rollout.vllm.engine import VLLMSpec
from rlhf.rollout.vllm.engines import RolloutEngines


def judge_sampling(spec: JudgeSpec, eos_token_id: Optional[int] = None) -> SamplingSpec:
    """The judge's sampling: greedy at ``temperature=0``, else seeded from ``spec.seed`` (request ``i`` uses
    ``seed + i``, whichever engine serves it); stops at the judge's EOS."""
    return SamplingSpec(
        max_new_tokens=spec.max_new_tokens,
        temperature=spec.temperature,
        seed=spec.seed,
        stop_token_ids=() if eos_token_id is None else (eos_token_id,),
    )


def judge_vllm_spec(
    spec: JudgeSpec, dtype: str = "float32", gpu_memory_utilization: float = 0.5, kv_cache_gib: int = 1
) -> VLLMSpec:
    """How each judge engine starts (one GPU each: no tensor parallelism here)."""
    return VLLMSpec(
        model_path=spec.path,
        seed=spec.seed,
        max_model_len=spec.max_model_len,
        dtype=dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_gib=kv_cache_gib,
    )


def start_judge(
    spec: JudgeSpec,
    num_engines: int = 1,
    cpus_per_engine: float = 1.0,
    gpus_per_engine: float = 0.0,
    env_vars: Optional[dict] = None,
    dtype: str = "float32",
    gpu_memory_utilization: float = 0.5,
) -> LLMJudge:
    """Start ``num_engines`` judge engines with resources of their own and the judge over them (needs Ray up).
    :meth:`LLMJudge.shutdown` stops them."""
    from transformers import AutoTokenizer  # lazy: transformers is heavy

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir(spec.path))
    engines = RolloutEngines(
        judge_vllm_spec(spec, dtype, gpu_memory_utilization),
        num_engines,
        cpus_per_engine=cpus_per_engine,
        gpus_per_engine=gpus_per_engine,
        env_vars=env_vars,
    )
    return LLMJudge(spec, engines, tokenizer, judge_sampling(spec, tokenizer.eos_token_id))
