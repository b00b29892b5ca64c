"""Qwen2-shaped random-init models by size, for benchmarks and the one-GPU check at real sizes (no download).

The shapes are Qwen2.5's published configurations (0.5B, 1.5B, 7B: widths, depths, heads, KV heads, the 151,936-token
vocabulary, tied embeddings below 7B), so step times, memory and MFU measured on them are those of the real models;
the weights are random (transformers' own initialisation), which changes no timing. ``tiny``, ``small`` and ``narrow``
are CPU sizes: the first for tests, the second a compute-bound CPU step, the third a step bound by per-parameter host
work (48 layers of width 64: 580 tensors, each of a few thousand elements), where hooks, copies and launches show as
they do on a GPU.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

# Qwen2Config fields per size; every size uses Qwen2's defaults for the rest (RoPE theta, RMSNorm eps, SiLU MLP).
MODEL_SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        tie_word_embeddings=True,
    ),  # fmt: skip
    "narrow": dict(
        hidden_size=64,
        intermediate_size=384,
        num_hidden_layers=48,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),  # fmt: skip
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),  # fmt: skip
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),  # fmt: skip
}


def build_sized_model(
    out_dir: str, size: str, *, seed: int = 0, max_positions: int = 32768, device: Optional[str] = None
) -> str:
    """Write a random-init Qwen2 causal LM of ``size`` (a key of :data:`MODEL_SIZES`) to ``out_dir`` in bf16, with a
    word-level tokenizer over its vocabulary (ids only: benchmarks feed token ids). ``device``: where to initialise
    (``cuda`` takes seconds for a 7B model that takes minutes on a CPU). Returns ``out_dir``."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; valid: {', '.join(MODEL_SIZES)}")
    shape = MODEL_SIZES[size]
    config = Qwen2Config(**shape, max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        model.bfloat16()  # in place
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, shape["vocab_size"])}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )  # fmt: skip
    tokenizer.save_pretrained(out_dir)
    return out_dir
