"""Greedy-decoding accuracy of a causal LM on prompts with checkable answers (HF ``generate``, CPU-friendly).

The online RL pipeline generates with vLLM; this evaluator deliberately uses plain transformers so that it is
an independent check of a saved ``final/`` directory.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch


@torch.no_grad()
def completions(
    model_dir: str,
    prompts: Sequence[str],
    max_new_tokens: int = 8,
    batch_size: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
) -> List[str]:
    """One completion per prompt: greedy when ``temperature == 0``, else sampled (full vocabulary, no top-k/p)
    from a generator seeded with ``seed``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    torch.manual_seed(seed)
    outputs: List[str] = []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(list(prompts[i : i + batch_size]), return_tensors="pt", padding=True)
        gen = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        outputs += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return outputs


def greedy_completions(
    model_dir: str, prompts: Sequence[str], max_new_tokens: int = 8, batch_size: int = 64
) -> List[str]:
    return completions(model_dir, prompts, max_new_tokens, batch_size)


def accuracy(
    model_dir: str,
    rows: Sequence[Dict[str, str]],
    is_correct: Callable[[str, str], bool],
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    max_new_tokens: int = 8,
) -> float:
    """Fraction of ``rows`` whose greedy completion ``is_correct`` against the row's answer."""
    completions = greedy_completions(model_dir, [r[prompt_key] for r in rows], max_new_tokens)
    return sum(is_correct(c, r[answer_key]) for c, r in zip(completions, rows)) / max(1, len(rows))


def sampled_accuracy(
    model_dir: str,
    rows: Sequence[Dict[str, str]],
    is_correct: Callable[[str, str], bool],
    samples_per_prompt: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    max_new_tokens: int = 8,
) -> float:
    """Mean correctness of ``samples_per_prompt`` samples per row at ``temperature`` (pass@1 when sampling), the
    quantity RL's sampled reward measures, on rows the policy need not have trained on."""
    repeated = [r for r in rows for _ in range(samples_per_prompt)]
    outs = completions(
        model_dir, [r[prompt_key] for r in repeated], max_new_tokens, batch_size=256, temperature=temperature, seed=seed
    )
    return sum(is_correct(c, r[answer_key]) for c, r in zip(outs, repeated)) / max(1, len(repeated))
