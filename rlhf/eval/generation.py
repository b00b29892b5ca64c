"""Greedy-decoding accuracy of a causal LM on prompts with checkable answers (HF ``generate``, CPU-friendly).

The online RL pipeline generates with vLLM; this evaluator deliberately uses plain transformers so that it is
an independent check of a saved ``final/`` directory.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch


@torch.no_grad()
def greedy_completions(model_dir: str, prompts: Sequence[str], max_new_tokens: int = 8,
                       batch_size: int = 64) -> List[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs: List[str] = []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(list(prompts[i:i + batch_size]), return_tensors="pt", padding=True)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        outputs += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return outputs


def accuracy(model_dir: str, rows: Sequence[Dict[str, str]], is_correct: Callable[[str, str], bool],
             prompt_key: str = "prompt", answer_key: str = "answer", max_new_tokens: int = 8) -> float:
    """Fraction of ``rows`` whose greedy completion ``is_correct`` against the row's answer."""
    completions = greedy_completions(model_dir, [r[prompt_key] for r in rows], max_new_tokens)
    return sum(is_correct(c, r[answer_key]) for c, r in zip(completions, rows)) / max(1, len(rows))
