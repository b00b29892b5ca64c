"""A tiny, randomly initialised Qwen2 model with a locally trained tokenizer.

Tests, examples and the demo need a real Hugging Face checkpoint that every part of the stack can load
(transformers for training, vLLM for generation) but the machine has no model hub. This module makes one from
nothing: a byte-level BPE tokenizer trained on the synthetic arithmetic task and a ~0.5M-parameter Qwen2 model.
Both are deterministic in the seed, so two builds are byte-identical and a cached copy can be trusted.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable

from rlhf.atomic import write_text_atomic
from rlhf.synthetic.arithmetic import tokenizer_corpus

if TYPE_CHECKING:  # transformers is heavy; import it only where a function needs it
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
# Order fixes the ids: <pad>=0, <s>=1, </s>=2, <unk>=3.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
# ChatML turn markers (Qwen's), added after the learned vocabulary: plain arithmetic text never contains them, so
# they leave its tokenization unchanged.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
# ChatML with a BOS in front: a template that writes special tokens itself, like most instruct models' templates
# (the tests check the loss mask against it and that no second BOS is added).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# The pieces of the tools templates below: the system turn that lists the tools (its header: the one part they
# differ in), and the turns, an assistant's calls and the tools' results, as Qwen2.5's template writes them.
_TOOLS_SYSTEM = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}"
)
_JSON_TOOLS_HEADER = (
    "{{- '# Tools\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    '{{- \'\n</tools>\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n\' -}}'
)
_SHORT_TOOLS_HEADER = (
    "{{- 'Tools:' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set params = ((fn.get('parameters') or {}).get('properties') or {}) | list -%}"
    "{{- '\n' + fn['name'] + '(' + (params | join(', ')) + ')' -}}"
    "{%- if fn.get('description') -%}{{- ' ' + fn['description'] -}}{%- endif -%}"
    "{%- endfor -%}"
    '{{- \'\nCall: <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n\' -}}'
)
_TOOLS_TURNS = (
    "{%- elif messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first -%}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\n' -}}{%- endif -%}"
    "{{- '<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{{- fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -}}"
    "{{- '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

#: A Qwen-style ChatML template with tool calling (hermes format: ``<tool_call>{json}</tool_call>``) for the tiny
#: model, whose own template (:data:`CHAT_TEMPLATE`) has no ``tools``. Same turns as that template (BOS first,
#: ``<|im_start|>role\n...<|im_end|>\n``); the tools go into the system turn, an assistant's calls into its turn as
#: ``<tool_call>`` blocks and a tool's result into a user turn as ``<tool_response>``, as Qwen2.5's template does.
#: A call with no text before it starts right after ``assistant\n``, the generation prompt, with no second newline:
#: a tokenizer that merges ``\n\n`` would otherwise train a token that crosses the prompt/reply boundary, one the
#: model never sees after the generation prompt.
TOOLS_CHAT_TEMPLATE = _TOOLS_SYSTEM + _JSON_TOOLS_HEADER + _TOOLS_TURNS

#: :data:`TOOLS_CHAT_TEMPLATE` with a short tools header: one line per tool, ``name(arg, ...) description``, where
#: that template writes each tool's whole JSON schema. The tiny model has 512 positions, and its tokenizer spells
#: most text byte by byte: one two-argument tool with a description takes 319 tokens of JSON header, and 111 here,
#: which leaves an episode its room. Same turns and calls, so the hermes parser reads the replies as it does there.
#: The template ``python -m rlhf.cli.make_assets`` writes as ``tools.jinja``, for ``env.chat_template`` (the agent
#: endpoint) and ``data.chat_template`` (a tool-calling warm-up).
SHORT_TOOLS_CHAT_TEMPLATE = _TOOLS_SYSTEM + _SHORT_TOOLS_HEADER + _TOOLS_TURNS


def write_tools_template(path: str, template: str = TOOLS_CHAT_TEMPLATE) -> str:
    """Write ``template`` (:data:`TOOLS_CHAT_TEMPLATE`, or :data:`SHORT_TOOLS_CHAT_TEMPLATE`) to ``path`` (a
    ``.jinja`` file for ``data.chat_template`` / ``env.chat_template``) and return it."""
    return write_text_atomic(path, template)


# vLLM's CPU attention backend rejects head sizes below this.
MIN_HEAD_DIM = 32


def build_tokenizer(
    vocab_size: int = 512, model_max_length: int = 512, extra_corpus: Iterable[str] = ()
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the arithmetic task corpus.

    The initial alphabet is all 256 byte symbols, so any text encodes without ``<unk>``; merges are learned
    only from the task corpus. No post-processor adds BOS/EOS: the data pipeline appends EOS itself.

    The normalizer and pre-tokenizer are the ones ``transformers.Qwen2Tokenizer`` builds (NFC, then Qwen's
    split regex, then byte-level mapping without its own regex). ``AutoTokenizer`` - and vLLM, which calls it -
    always loads a ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer`` and rebuilds that pipeline around the
    saved vocab and merges, ignoring the pre-tokenizer in ``tokenizer.json``. Training with the same pipeline
    makes ``tokenizer.json``, ``AutoTokenizer`` and vLLM tokenize identically. The regex splits every digit
    into its own pre-token, so numbers are spelled digit by digit and a prompt's tokens are always a prefix of
    prompt+response tokens.

    Args:
        vocab_size: Exact vocabulary size; what the corpus does not fill is reserved tokens.
        model_max_length: Recorded in the tokenizer config.
        extra_corpus: More texts to learn merges from (e.g. an example's tool-call format, so that
            ``{"name": "mul", "arguments": {`` is a few tokens rather than one per byte). Empty by default, which
            keeps the tokenizer that the demo and tests use byte-identical.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with pad/bos/eos/unk set and right padding.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*tokenizer_corpus(), *extra_corpus], trainer=trainer)
    # Digits are never merged, so the corpus yields far fewer than `vocab_size` tokens. Fill the rest with
    # reserved tokens so that every embedding row of the model is a real token: an untrained policy samples all
    # ids, and an id the tokenizer does not know decodes to nothing (or to None in convert_ids_to_tokens).
    # They are not special, so decoded text shows them and a response containing one is visibly malformed.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
    n_reserved = vocab_size - tok.get_vocab_size()
    tok.add_tokens([AddedToken(f"<|reserved_{i}|>", special=False, normalized=False) for i in range(n_reserved)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=CHAT_TEMPLATE,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="right",
        model_max_length=model_max_length,
    )


def build_tiny_model(
    out_dir: str,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 384,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    extra_corpus: Iterable[str] = (),
) -> str:
    """Write a tiny random Qwen2 causal LM and its tokenizer to ``out_dir``.

    Args:
        out_dir: Destination directory (created; existing files of the same name are overwritten).
        seed: Seed for the weight initialisation; the same seed gives byte-identical safetensors.
        hidden_size: Model width.
        num_layers: Number of decoder layers.
        num_heads: Attention heads; ``hidden_size / num_heads`` must be at least 32 for vLLM on CPU.
        num_kv_heads: Key/value heads (grouped-query attention); must divide ``num_heads``.
        intermediate_size: MLP width.
        vocab_size: Embedding rows, equal to the tokenizer's vocabulary size (padded with reserved tokens).
        max_position_embeddings: Longest sequence the model is configured for.
        extra_corpus: More texts for the tokenizer's merges (:func:`build_tokenizer`).

    Returns:
        ``out_dir``.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    head_dim = hidden_size // num_heads
    assert head_dim >= MIN_HEAD_DIM, f"head_dim {head_dim} < {MIN_HEAD_DIM}: vLLM's CPU attention rejects it"
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, max_position_embeddings, extra_corpus)
    # One embedding row per token, no more (see build_tokenizer) and no fewer (that would crash lookups).
    assert len(tokenizer) == vocab_size, f"tokenizer has {len(tokenizer)} tokens, vocab_size is {vocab_size}"

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # Initialisation draws from the global torch RNG; fork it so a caller's RNG state is neither used nor moved.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
