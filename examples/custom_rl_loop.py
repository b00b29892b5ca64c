"""A custom online-RL loop from the toolkit's parts (the Python API): RLOO with a reward computed in the driver.

Run from the repo root: ``.venv/bin/python examples/custom_rl_loop.py`` (under a minute on 2 CPU cores; on GPUs
see docs/custom_loops.md). It prints one line per RL step::

    step 10  reward 0.170  loss 0.0000  grad_norm 0.013  logp mismatch 1.9e-07

and a last line ``done: reward 0.153 -> 0.172 over 20 steps; largest logp mismatch 2.4e-07``. The reward is the
share of the response's characters that are digits; on the random tiny model it creeps up slowly (a random
512-token model has far to go). The point is the wiring: swap in your model, prompts and reward. The log-prob
mismatch is mean |trainer log-prob - vLLM log-prob| over the response tokens: ~1e-7 from step 2 on shows that
the previous step's weight sync landed in the engine.

The loop body is the algorithm: generate -> reward -> old log-probs (``score_batch``) -> RLOO advantages over the
whole rollout (``advantages_for``) -> one optimizer step (``train_batch``, which cuts the batch into micro-batches
and normalizes the loss over all of it) -> weight sync. docs/custom_loops.md walks it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, List, Optional

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def digit_share(text: str) -> float:
    """The reward: the share of the response's characters that are digits."""
    text = text.strip()
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def main(
    steps: int = 20,
    prompts_per_step: int = 8,
    samples_per_prompt: int = 8,
    micro_batch_size: int = 16,
    lr: float = 2e-3,
    work_dir: Optional[str] = None,
) -> List[Dict[str, float]]:
    """``steps`` RLOO steps of ``prompts_per_step x samples_per_prompt`` samples, one optimizer step each;
    returns one record per step (``reward``, ``loss``, ``grad_norm``, ``logp_mismatch``)."""
    from transformers import AutoTokenizer

    from rlhf.distributed.cluster import actor_env, init_ray
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.group import GroupResources, WorkerGroup
    from rlhf.models.loading import ModelSpec
    from rlhf.models.tiny import build_tiny_model
    from rlhf.rl import (
        PolicyObjective,
        RolloutEngines,
        SamplingSpec,
        TokenLogps,
        VLLMSpec,
        advantages_for,
        logp_mismatch,
        rollout_batch,
    )
    from rlhf.synthetic.arithmetic import make_rl_prompts

    model_dir = build_tiny_model(os.path.join(work_dir or tempfile.mkdtemp(prefix="custom-rl-"), "model"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in make_rl_prompts(prompts_per_step * steps, seed=0)]
    group_ids = [p for p in range(prompts_per_step) for _ in range(samples_per_prompt)]  # sample j answers p

    init_ray(needed_cpus=2)  # joins a Ray that is already up (a notebook, a test session, `ray job submit`)
    policy = WorkerGroup("policy", GroupResources(num_workers=1, env_vars=actor_env(0)), backend="gloo")
    engines = None
    try:
        # one optimizer step per RL step: the whole rollout batch, in micro-batches of micro_batch_size
        policy.build(
            ModelSpec(path=model_dir),
            EngineSpec.for_global_batch(len(group_ids), micro_batch_size, 1),
            OptimSpec(lr=lr, total_steps=steps),
        )
        engines = RolloutEngines(VLLMSpec(model_path=model_dir, max_model_len=64), num_engines=1, env_vars=actor_env(0))
        # once: the policy's rank 0 and the engine form the weight-sync group (gloo here, NCCL on GPUs)
        engines.connect_weight_sync(policy, "broadcast", bucket_bytes=64 << 20, backend="gloo")
        objective, history = PolicyObjective(), []
        for step in range(steps):
            chunk = prompts[step * prompts_per_step : (step + 1) * prompts_per_step]
            sampling = SamplingSpec(max_new_tokens=6, seed=1000 * step, stop_token_ids=(tokenizer.eos_token_id,))
            generations = engines.generate([chunk[p] for p in group_ids], sampling)
            rewards = [digit_share(tokenizer.decode(g.response_ids, skip_special_tokens=True)) for g in generations]
            batch = rollout_batch(generations, tokenizer.pad_token_id)
            batch = batch.replace(old_logps=policy.score_batch(batch, TokenLogps()))
            batch, _ = advantages_for(batch, rewards, group_ids, estimator="rloo")
            result = policy.train_batch(batch, objective, schedule_step=step)
            policy.push_weights()
            history.append(
                {
                    "step": step + 1,
                    "reward": sum(rewards) / len(rewards),
                    "loss": result.metrics["loss"],
                    "grad_norm": result.grad_norm,
                    "logp_mismatch": logp_mismatch(batch),
                }
            )
            print(
                "step {step:2d}  reward {reward:.3f}  loss {loss:.4f}  grad_norm {grad_norm:.3f}  "
                "logp mismatch {logp_mismatch:.1e}".format(**history[-1]),
                flush=True,
            )
    finally:
        if engines is not None:
            engines.shutdown()
        policy.shutdown()
    print(
        f"done: reward {history[0]['reward']:.3f} -> {history[-1]['reward']:.3f} over {steps} steps; "
        f"largest logp mismatch {max(h['logp_mismatch'] for h in history):.1e}",
        flush=True,
    )
    return history


if __name__ == "__main__":
    main()
