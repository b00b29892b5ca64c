"""A custom training loop from the toolkit's parts (the Python API), here: SFT on a curriculum that feeds
short responses first. Run from the repo root: ``.venv/bin/python examples/custom_loop.py``.

The parts: a :class:`WorkerGroup` of DeepSpeed ranks, the typed :class:`Batch`, an objective that turns a
micro-batch into a loss *sum*, and the rule that the normalizer is counted over the whole global batch before
the first backward. Everything else (ordering, logging, when to stop) is yours.
"""
from __future__ import annotations

import os
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    from transformers import AutoTokenizer

    from rlhf.data.tokenize import collate_sft, tokenize_sft
    from rlhf.distributed.cluster import actor_env, init_ray
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.group import GroupResources, WorkerGroup
    from rlhf.models.loading import ModelSpec
    from rlhf.models.tiny import build_tiny_model
    from rlhf.objectives.base import add_sums
    from rlhf.objectives.sft import SFTObjective
    from rlhf.synthetic.arithmetic import make_sft_rows

    work = tempfile.mkdtemp(prefix="custom-loop-")
    model_dir = build_tiny_model(os.path.join(work, "model"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = tokenize_sft(make_sft_rows(256, seed=0), tokenizer, max_length=32, prompt_key="prompt",
                            response_key="response").examples
    examples.sort(key=lambda e: e.num_targets)  # the curriculum: shortest answers first

    ranks, micro, accum = 2, 4, 2
    global_batch = ranks * micro * accum
    steps = len(examples) // global_batch
    init_ray(needed_cpus=ranks)
    policy = WorkerGroup("policy", GroupResources(num_workers=ranks, env_vars=actor_env(0)), backend="gloo")
    policy.build(ModelSpec(path=model_dir), EngineSpec(zero_stage=2, precision="fp32", micro_batch_size=micro,
                                                       grad_accum_steps=accum),
                 OptimSpec(lr=1e-3, total_steps=steps))
    objective = SFTObjective()
    for step in range(steps):
        rows = list(range(step * global_batch, (step + 1) * global_batch))
        per_rank = [[collate_sft([examples[i] for i in rows[r * micro * accum + m * micro:][:micro]],
                                 tokenizer.pad_token_id) for m in range(accum)] for r in range(ranks)]
        normalizer = sum(objective.count(mb) for rank in per_rank for mb in rank)  # whole global batch
        results = policy.train_step(per_rank, objective, normalizer)
        sums = {}
        for result in results:
            sums = add_sums(sums, result.sums)
        metrics = objective.finalize(sums, normalizer)
        print(f"step {step + 1}/{steps} loss {metrics['loss']:.4f} grad_norm {results[0].grad_norm:.3f}")
    policy.save_pretrained(os.path.join(work, "final"))
    policy.shutdown()
    print(f"saved {work}/final")


if __name__ == "__main__":
    main()
