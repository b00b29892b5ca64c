"""Using a trained reward model: load the saved HF directory and score (prompt, completion) texts.

Tokenization and pooling match training exactly (prompt with special tokens, completion + EOS, score at the
last real token found from the attention mask), so a pair scored here ranks as it did in training.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from rlhf.batch import pad_sequences
from rlhf.hub import model_dir
from rlhf.models.loading import last_token_values, scalar_head_values


def load_reward_model(path: str, device: str = "cpu") -> Tuple[torch.nn.Module, object]:
    """``(model, tokenizer)`` of a reward model: a directory saved by ``train_rm`` or a hub reference
    (``org/name[@revision]``, resolved through the HF cache by :func:`rlhf.hub.model_dir`)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = model_dir(path)
    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    return model, AutoTokenizer.from_pretrained(directory)


@torch.no_grad()
def score_texts(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str],
    completions: Sequence[str],
    batch_size: int = 32,
    add_eos: bool = True,
) -> torch.Tensor:
    """Scores ``(N,)`` of ``prompts[i] + completions[i]``."""
    device = next(model.parameters()).device
    prompt_ids = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    completion_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if add_eos else []
    seqs: List[List[int]] = [p + c + eos for p, c in zip(prompt_ids, completion_ids)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        ids = pad_sequences(chunk, pad).to(device)
        mask = pad_sequences([[1] * len(s) for s in chunk], 0, ids.shape[1]).to(device)
        out.append(last_token_values(scalar_head_values(model, ids, mask), mask).cpu())
    return torch.cat(out) if out else torch.zeros(0)
