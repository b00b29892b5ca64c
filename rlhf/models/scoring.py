"""Using a trained reward model: load the saved HF directory and score (prompt, completion) texts or conversations.

Tokenization and pooling match training exactly (prompt with special tokens, completion + EOS, score at the
last real token found from the attention mask), so a pair scored here ranks as it did in training.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from rlhf.batch import pad_sequences
from rlhf.data.chat import ChatFormatter, check_messages
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
    prompt_ids = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    completion_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if add_eos else []
    return score_ids(model, [p + c + eos for p, c in zip(prompt_ids, completion_ids)], _pad_id(tokenizer), batch_size)


@torch.no_grad()
def score_conversations(
    model: torch.nn.Module,
    tokenizer,
    conversations: Sequence[Sequence[dict]],
    batch_size: int = 32,
    template: Optional[str] = None,
) -> torch.Tensor:
    """Scores ``(N,)`` of whole conversations (lists of ``{role, content}`` messages ending with the answer scored),
    rendered with the chat template as a reward model trained on conversational pairs saw them (``template``: the
    text of a ``data.chat_template`` file; None: the tokenizer's own, which ``train_rm`` saves with the model)."""
    chat = ChatFormatter(tokenizer, template)
    seqs = [
        list(chat.encode(list(check_messages(c, f"conversations[{i}]")), ()).input_ids)
        for i, c in enumerate(conversations)
    ]
    return score_ids(model, seqs, _pad_id(tokenizer), batch_size)


@torch.no_grad()
def score_ids(model: torch.nn.Module, seqs: Sequence[List[int]], pad_id: int, batch_size: int = 32) -> torch.Tensor:
    """Scores ``(N,)`` of token sequences: the scalar head at each sequence's last token, ``batch_size`` at a time."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        ids = pad_sequences(chunk, pad_id).to(device)
        mask = pad_sequences([[1] * len(s) for s in chunk], 0, ids.shape[1]).to(device)
        out.append(last_token_values(scalar_head_values(model, ids, mask), mask).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
