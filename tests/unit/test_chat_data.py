"""Conversational rows and chat templates: exact loss masks from token offsets, row checks with file:line, the RL
prompt rendering, and the tokenizer / reward-model checks that run before any actor starts. No Ray here."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from rlhf.config.schema import ConfigError
from rlhf.data.chat import ChatFormatter, ChatTemplateError, load_template, split_implicit_prompt
from rlhf.data.formats import chat_formatter, pair_fields, prompt_fields, sft_fields
from rlhf.data.io import DataError, read_rows
from rlhf.data.tokenize import RowError, tokenize_pairs, tokenize_sft
from rlhf.data.vocab import check_tokenizer
from rlhf.models.checks import check_scalar_head
from rlhf.rollout.prompts import prepare_prompts


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _conv(*turns):
    roles = {"s": "system", "u": "user", "a": "assistant"}
    return [{"role": roles[r], "content": c} for r, c in turns]


TWO_TURNS = _conv(("s", "Add."), ("u", "12+7="), ("a", "19"), ("u", "3+4="), ("a", "7"))


def _assistant_spans_by_token(tokenizer, ids):
    """Independent reference: walk the ChatML token stream and mark every token from the one after
    ``<|im_start|>assistant\\n`` through the closing ``<|im_end|>``."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    mask, i = [0] * len(ids), 0
    while i < len(ids):
        if ids[i] == start:
            j = ids.index(newline[0], i)  # end of the role line
            role = tokenizer.decode(ids[i + 1 : j])
            close = ids.index(end, j)
            if role == "assistant":
                for t in range(j + 1, close + 1):
                    mask[t] = 1
            i = close + 1
        else:
            i += 1
    return mask


def test_mask_is_exactly_the_assistant_turns(tokenizer):
    chat = ChatFormatter(tokenizer)
    enc = chat.encode(TWO_TURNS, [2, 4])
    assert list(enc.loss_mask) == _assistant_spans_by_token(tokenizer, list(enc.input_ids))
    trained = tokenizer.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m])
    assert trained == "19<|im_end|>7<|im_end|>"
    # The template writes the BOS itself; the tokenizer must not add a second one.
    assert enc.input_ids[0] == tokenizer.bos_token_id and enc.input_ids[1] != tokenizer.bos_token_id
    assert enc.input_ids.count(tokenizer.bos_token_id) == 1


def test_last_turn_only_and_prompt_ids_prefix(tokenizer):
    chat = ChatFormatter(tokenizer)
    enc = chat.encode(TWO_TURNS, [4])
    assert tokenizer.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m]) == "7<|im_end|>"
    # What generation is given (the conversation so far + the generation prompt) is exactly the tokens before the
    # trained turn: training and sampling see the same ids.
    prompt = chat.prompt_ids(TWO_TURNS[:4])
    first = enc.loss_mask.index(1)
    assert list(enc.input_ids[:first]) == prompt


def test_template_that_rewrites_earlier_turns_is_refused_for_all_turns(tokenizer):
    # Like reasoning templates that drop earlier assistant turns' content once a later turn follows.
    rewriting = (
        "{%- for m in messages -%}{%- if m['role'] == 'assistant' and not loop.last -%}"
        "{{- '<|im_start|>assistant\\n...<|im_end|>\\n' -}}{%- else -%}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    chat = ChatFormatter(tokenizer, rewriting, "x.jinja")
    with pytest.raises(ValueError, match="data.assistant_turns=last"):
        chat.encode(TWO_TURNS, [2, 4])
    enc = chat.encode(TWO_TURNS, [4])
    assert tokenizer.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m]) == "7<|im_end|>"


def test_end_of_turn_token_is_found(tokenizer):
    assert ChatFormatter(tokenizer).end_of_turn_ids() == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_template_settings(tokenizer, tmp_path):
    with pytest.raises(ChatTemplateError, match="data.chat_template=none"):
        ChatFormatter(tokenizer, None, "none")
    assert isinstance(ChatTemplateError("x"), ConfigError)  # the CLI reports it as a config error (exit 2)
    no_template = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    no_template.chat_template = None
    with pytest.raises(ChatTemplateError, match="data.chat_template to a .jinja"):
        ChatFormatter(no_template)
    path = tmp_path / "plain.jinja"
    path.write_text(
        "{%- for m in messages -%}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}[assistant]{%- endif -%}"
    )
    chat = ChatFormatter(no_template, load_template(str(path)), str(path))
    enc = chat.encode(_conv(("u", "1+2="), ("a", "3")), [1])
    assert no_template.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m]) == "3</s>"
    with pytest.raises(ChatTemplateError, match="is not a file"):
        load_template(str(tmp_path / "missing.jinja"))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sft_rows_plain_and_conversational(tokenizer, tmp_path):
    rows = [
        {"prompt": "1+2=", "response": "3"},
        {"messages": TWO_TURNS},
        {"prompt": _conv(("u", "5+5=")), "response": _conv(("a", "10"))},
    ]
    path = _write(tmp_path / "sft.jsonl", rows)
    read = read_rows(path, **sft_fields("prompt", "response", "messages"))
    chat = chat_formatter(tokenizer, "auto", read, keys=("messages", "prompt"))
    out = tokenize_sft(
        read, tokenizer, max_length=128, prompt_key="prompt", response_key="response", chat=chat, assistant_turns="all"
    )
    trained = [tokenizer.decode([t for t, m in zip(e.input_ids, e.loss_mask) if m]) for e in out.examples]
    assert trained == ["3</s>", "19<|im_end|>7<|im_end|>", "10<|im_end|>"]
    last = tokenize_sft(
        read, tokenizer, max_length=128, prompt_key="prompt", response_key="response", chat=chat, assistant_turns="last"
    )
    assert (
        tokenizer.decode([t for t, m in zip(last.examples[1].input_ids, last.examples[1].loss_mask) if m])
        == "7<|im_end|>"
    )
    # Plain rows alone need no template at all.
    assert chat_formatter(tokenizer, "none", read[:1], keys=("messages", "prompt")) is None


def test_truncation_keeps_rows_with_a_target_and_skips_the_rest(tokenizer):
    rows = [{"messages": TWO_TURNS}]
    chat = ChatFormatter(tokenizer)
    full = chat.encode(TWO_TURNS, [2, 4])
    first_target = full.loss_mask.index(1)
    kept = tokenize_sft(
        rows, tokenizer, max_length=first_target + 1, prompt_key="prompt", response_key="response", chat=chat
    )
    assert len(kept.examples) == 1 and sum(kept.examples[0].loss_mask) == 1
    gone = tokenize_sft(
        rows, tokenizer, max_length=first_target, prompt_key="prompt", response_key="response", chat=chat
    )
    assert gone.examples == [] and gone.skipped_rows == [0]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "message 0 has role 'robot'; valid roles"),
        ({"messages": [{"role": "user"}]}, "message 0 \\(user\\) needs a text 'content'"),
        ({"prompt": "1+2=", "response": [{"role": "assistant", "content": "3"}]}, "is text but 'response' is messages"),
        ({"prompt": "1+2="}, "missing field 'response'"),
        (
            {"prompt": [{"role": "user", "content": "1+2="}], "response": [{"role": "user", "content": "3"}]},
            "'response': message 0 has role 'user'; completions hold assistant messages",
        ),
        (
            {"txt": "x", "id": 3},
            "expected 'messages' \\(a conversation\\), 'prompt' with 'response' or 'completion', or 'text' .* "
            "\\(the row's fields: id, txt\\). Did you mean 'txt'\\?",
        ),
    ],
)
def test_bad_sft_rows_name_file_and_line(tmp_path, row, message):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "1+2=", "response": "3"}, row])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{message}"):
        read_rows(path, **sft_fields("prompt", "response", "messages"))


def test_preference_rows_explicit_and_implicit_prompt(tokenizer, tmp_path):
    prompt = _conv(("s", "Add."), ("u", "2+2="))
    explicit = {"prompt": prompt, "chosen": _conv(("a", "4")), "rejected": _conv(("a", "5"))}
    implicit = {"chosen": prompt + _conv(("a", "4")), "rejected": prompt + _conv(("a", "5"))}
    path = _write(tmp_path / "pref.jsonl", [explicit, implicit, {"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    rows = read_rows(path, **pair_fields("prompt", "chosen", "rejected"))
    chat = chat_formatter(tokenizer, "auto", rows, keys=("chosen",))
    out = tokenize_pairs(
        rows, tokenizer, max_length=128, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected", chat=chat
    )
    assert out.examples[0] == out.examples[1]  # the two forms are the same pair
    pick = lambda e: tokenizer.decode([t for t, m in zip(e.input_ids, e.loss_mask) if m])  # noqa: E731
    assert (pick(out.examples[0].chosen), pick(out.examples[0].rejected)) == ("4<|im_end|>", "5<|im_end|>")
    assert (pick(out.examples[2].chosen), pick(out.examples[2].rejected)) == ("2</s>", "3</s>")
    with pytest.raises(ValueError, match="share no leading prompt"):
        split_implicit_prompt(_conv(("u", "a"), ("a", "b")), _conv(("u", "c"), ("a", "d")))
    bad = _write(
        tmp_path / "bad.jsonl", [{"prompt": prompt, "chosen": _conv(("u", "4")), "rejected": _conv(("a", "5"))}]
    )
    with pytest.raises(DataError, match=r"bad.jsonl:1: .*'chosen': message 0 has role 'user'"):
        read_rows(bad, **pair_fields("prompt", "chosen", "rejected"))


def test_a_row_the_template_cannot_render_is_named(tokenizer):
    strict = (
        "{%- for m in messages -%}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('roles must alternate user/assistant') }}{%- endif -%}"
        "{{ m['content'] }}{%- endfor -%}"
    )
    chat = ChatFormatter(tokenizer, strict, "strict.jinja")
    rows = [{"messages": _conv(("u", "1"), ("a", "2"))}, {"messages": _conv(("a", "1"), ("u", "2"), ("a", "3"))}]
    with pytest.raises(RowError, match="row 1 \\(0-based\\): the chat template cannot render.*roles must alternate"):
        tokenize_sft(rows, tokenizer, max_length=64, prompt_key="prompt", response_key="response", chat=chat)


def test_rl_prompts_rendered_with_the_generation_prompt(tokenizer, tmp_path):
    rows = [{"prompt": _conv(("s", "Add."), ("u", "2+2=")), "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    path = _write(tmp_path / "prompts.jsonl", rows)
    read = read_rows(path, **prompt_fields("prompt", ("answer",)))
    chat = chat_formatter(tokenizer, "auto", read, keys=("prompt",))
    prompts = prepare_prompts(
        read, tokenizer, prompt_key="prompt", columns=("answer",), max_prompt_length=64, overflow="skip", chat=chat
    )
    assert prompts.texts[0].endswith("<|im_start|>assistant\n") and prompts.texts[1] == "3+3="
    assert prompts.prompt_ids[0] == tokenizer(prompts.texts[0], add_special_tokens=False)["input_ids"]
    assert prompts.prompt_ids[1] == tokenizer("3+3=")["input_ids"]
    assert prompts.stop_token_ids == (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert prompts.columns == {"answer": ["4", "6"]}


def test_tokenizer_checks(tokenizer, tiny_model, tmp_path, capsys):
    from rlhf.config import SFTRunConfig, load_config
    from rlhf.data.vocab import load_tokenizer

    # A model directory without tokenizer files: transformers builds a 1-token tokenizer instead of failing.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_model, name), bare / name)
    cfg = load_config(SFTRunConfig, None, [f"model.path={bare}", "data.train_path=rows.jsonl"])
    with pytest.raises(
        ConfigError,
        match="model.path: the tokenizer loaded from .* has 1 token\\(s\\): the "
        "directory has no usable tokenizer files",
    ):
        load_tokenizer(cfg)
    with_tokenizer = load_config(
        SFTRunConfig, None, [f"model.path={bare}", f"model.tokenizer_path={tiny_model}", "data.train_path=rows.jsonl"]
    )
    assert len(load_tokenizer(with_tokenizer)) == 512
    with pytest.raises(ConfigError, match="512 tokens but the model has 100 embedding rows"):
        check_tokenizer(tokenizer, "model.tokenizer_path", "/t", model_vocab_size=100)
    no_pad = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    no_pad.pad_token = None
    assert check_tokenizer(no_pad, "model.path", "/m").pad_token_id == tokenizer.eos_token_id
    assert "no pad token; padding with its EOS" in capsys.readouterr().out


def test_reward_model_needs_a_scalar_head(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="reward.model_path: .* is not a reward model: .*Qwen2ForCausalLM"):
        check_scalar_head(tiny_model, "reward.model_path", tiny_model)
    config = json.loads(open(f"{tiny_model}/config.json").read())
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(
        json.dumps({**config, "architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}})
    )
    check_scalar_head(str(rm), "reward.model_path", str(rm))
    (rm / "config.json").write_text(
        json.dumps({**config, "architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "a", "1": "b"}})
    )
    with pytest.raises(ConfigError, match="2-label classification head"):
        check_scalar_head(str(rm), "reward.model_path", str(rm))


def test_reward_model_reads_conversational_pairs_with_margins(tokenizer, tmp_path):
    from rlhf.config import RewardModelRunConfig, load_config
    from rlhf.synthetic.arithmetic import make_preference_rows, to_chat_preference
    from rlhf.trainers.offline.reward_model import _read

    rows = to_chat_preference(make_preference_rows(6, seed=0, max_operand=9))
    path = _write(tmp_path / "pref.jsonl", rows)
    cfg = load_config(RewardModelRunConfig, None, ["model.path=m", f"data.train_path={path}", "rm.use_margin=true"])
    out = _read(cfg, tokenizer, path, "train")
    assert [e.margin for e in out.examples] == [r["margin"] for r in rows]
    pick = lambda e: tokenizer.decode([t for t, m in zip(e.input_ids, e.loss_mask) if m])  # noqa: E731
    assert [pick(e.chosen) for e in out.examples] == [r["chosen"][0]["content"] + "<|im_end|>" for r in rows]
    without = [{k: v for k, v in r.items() if k != "margin"} for r in rows]
    with pytest.raises(DataError, match=r"pref2.jsonl:1: missing field 'margin'"):
        _read(cfg, tokenizer, _write(tmp_path / "pref2.jsonl", without), "train")


def test_an_rl_prompt_the_template_refuses_names_its_source(tokenizer, tmp_path):
    from rlhf.config import load_config
    from rlhf.config.rl_schema import RLRunConfig
    from rlhf.trainers.online.prompts import read_prompts

    strict = tmp_path / "strict.jinja"
    strict.write_text(
        "{%- if messages[0]['role'] != 'user' -%}{{ raise_exception('the first message must be the "
        "user') }}{%- endif -%}{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}"
    )
    path = _write(
        tmp_path / "prompts.jsonl",
        [
            {"prompt": _conv(("u", "1+1=")), "answer": "2"},
            {"prompt": _conv(("s", "Add."), ("u", "2+2=")), "answer": "4"},
        ],
    )
    cfg = load_config(
        RLRunConfig,
        None,
        [
            "model.path=m",
            f"data.train_path={path}",
            f"data.chat_template={strict}",
            "reward.functions=[rlhf.synthetic.arithmetic:reward]",
        ],
    )
    with pytest.raises(
        DataError,
        match=r"data.train_path=.*prompts.jsonl: row 1 \(0-based\): the chat template "
        r"cannot render.*the first message must be the user",
    ):
        read_prompts(cfg, tokenizer, "data.train_path", path, "train")


def test_a_chat_template_file_is_saved_with_the_runs_tokenizer(tiny_model, sft_data, tmp_path):
    """data.chat_template=file.jinja: final/ (written with the run's tokenizer) carries the template, so the next
    stage renders the same turns without the file."""
    from transformers import AutoTokenizer

    from rlhf.config import SFTRunConfig, load_config
    from rlhf.data.vocab import load_tokenizer

    template = tmp_path / "turns.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    cfg = load_config(
        SFTRunConfig,
        None,
        [f"model.path={tiny_model}", f"data.train_path={sft_data}", f"data.chat_template={template}"],
    )
    load_tokenizer(cfg).save_pretrained(tmp_path / "final")  # what rlhf.trainers.run.save_final does
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert reloaded.chat_template == template.read_text()
    rendered = reloaded.apply_chat_template([{"role": "user", "content": "2+2="}], tokenize=False)
    assert rendered == "<user>2+2="


@pytest.mark.parametrize("content", ["", "  \n", None])
def test_an_empty_or_null_assistant_turn_is_refused_with_its_line(content, tmp_path):
    from rlhf.data.formats import sft_fields
    from rlhf.data.io import DataError, read_rows

    path = _write(
        tmp_path / "sft.jsonl",
        [
            {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]},
            {"messages": [{"role": "user", "content": "3+3="}, {"role": "assistant", "content": content}]},
        ],
    )
    with pytest.raises(DataError, match=r"sft.jsonl:2: .*message 1 \(assistant\)"):
        read_rows(path, **sft_fields("prompt", "response", "messages"))


def test_a_reward_model_scores_conversations_as_it_was_trained_on_them(tiny_reward_model):
    """score_conversations renders as the reward-model trainer's conversational pairs are rendered: its score of a
    conversation is the model's score of the chosen side tokenize_pairs built from the same turns."""
    import torch

    from rlhf.data.chat import ChatFormatter
    from rlhf.data.tokenize import tokenize_pairs
    from rlhf.models.scoring import load_reward_model, score_conversations, score_ids

    model, tokenizer = load_reward_model(tiny_reward_model)
    prompt = [{"role": "user", "content": "2+2="}]
    good, bad = [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]
    (pair,) = tokenize_pairs(
        [{"prompt": prompt, "chosen": good, "rejected": bad}],
        tokenizer,
        max_length=64,
        prompt_key="prompt",
        chosen_key="chosen",
        rejected_key="rejected",
        chat=ChatFormatter(tokenizer),
    ).examples
    trained = score_ids(model, [list(pair.chosen.input_ids), list(pair.rejected.input_ids)], tokenizer.pad_token_id)
    scored = score_conversations(model, tokenizer, [prompt + good, prompt + bad])
    assert torch.equal(scored, trained)
    with pytest.raises(ValueError, match=r"conversations\[0\]"):
        score_conversations(model, tokenizer, [[{"role": "user", "content": None}]])


# Qwen2.5-Instruct's template behaviour that matters for lengths: a conversation without a system turn gets the
# model's default system prompt (ChatML otherwise, as the tiny model's own template).
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
DEFAULT_SYSTEM_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_the_tiny_presets_keep_chat_rows_with_a_default_system_prompt(tokenizer, tiny_model):
    """sft_tiny / grpo_tiny with a chat model whose template adds a default system prompt (~70 tokens with this
    tokenizer, as with Qwen's): every SFT conversation and every RL prompt fits, none is skipped."""
    from rlhf.config import SFTRunConfig, load_config
    from rlhf.config.rl_schema import RLRunConfig
    from rlhf.synthetic import arithmetic as a

    chat = ChatFormatter(tokenizer, template=DEFAULT_SYSTEM_TEMPLATE)
    system_alone = chat.encode([{"role": "user", "content": ""}], []).input_ids
    assert len(system_alone) > 64  # what the presets allowed before: every such row was dropped or refused
    required = [f"model.path={tiny_model}", "data.train_path=/data/x.jsonl"]
    sft = load_config(SFTRunConfig, "sft_tiny", required)
    rl = load_config(RLRunConfig, "grpo_tiny", required)

    no_system = [{"messages": r["messages"][1:]} for r in a.to_chat_sft(a.make_sft_rows(30, seed=1))]
    kept = tokenize_sft(
        no_system, tokenizer, max_length=sft.data.max_length, prompt_key="prompt", response_key="response", chat=chat
    )
    assert kept.skipped_rows == [] and len(kept.examples) == 30
    assert all(len(e.input_ids) > len(system_alone) for e in kept.examples)

    questions = [{**r, "prompt": r["prompt"][1:]} for r in a.to_chat_prompts(a.make_rl_prompts(30, seed=2))]
    prompts = prepare_prompts(
        questions,
        tokenizer,
        prompt_key="prompt",
        columns=["answer"],
        max_prompt_length=rl.rollout.max_prompt_length,
        overflow=rl.rollout.prompt_overflow,
        chat=chat,
    )
    assert (prompts.skipped, prompts.truncated, len(prompts.prompt_ids)) == (0, 0, 30)
