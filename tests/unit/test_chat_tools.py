"""Conversational rows with tool use (OpenAI / TRL layout): an assistant's ``tool_calls``, ``tool`` results and a row's
``tools`` schemas, rendered with the tiny tokenizer and its tool-calling template (rlhf.models.tiny); the loss mask
covers exactly the assistant turns, a turn that only calls a tool included; bad rows are refused with file:line; the
SFT reader and the RL prompt reader render each row's tools. No Ray."""

from __future__ import annotations

import json

import pytest

from rlhf.data.chat import ChatFormatter, check_messages
from rlhf.data.formats import prompt_fields, sft_fields
from rlhf.data.io import DataError, read_rows
from rlhf.models.tiny import TOOLS_CHAT_TEMPLATE, write_tools_template

MUL_TOOL = {
    "type": "function",
    "function": {
        "name": "mul",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [MUL_TOOL]
USER = {"role": "user", "content": "What is 37*48?"}


def _conversation(arguments):
    """user -> assistant tool call (no text) -> tool result -> assistant answer."""
    call = {"id": "call_0", "type": "function", "function": {"name": "mul", "arguments": arguments}}
    return [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "name": "mul", "content": "1776"},
        {"role": "assistant", "content": "37*48=1776"},
    ]


CONVERSATION = _conversation({"a": 37, "b": 48})


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatFormatter(tokenizer, template=TOOLS_CHAT_TEMPLATE)


def _template_ids(tokenizer, messages, tools, generation_prompt=False):
    """The reference: the tokenizer's own apply_chat_template, its text tokenized in one piece."""
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=TOOLS_CHAT_TEMPLATE,
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _assistant_mask(tokenizer, ids):
    """Independent reference: walk the ChatML token stream (the template writes a tool result as a ``user`` turn)
    and mark every token from the one after ``<|im_start|>assistant\\n`` through the closing ``<|im_end|>``."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    (newline,) = tokenizer("\n", add_special_tokens=False)["input_ids"]
    mask, i = [0] * len(ids), 0
    while i < len(ids):
        if ids[i] != start:
            i += 1
            continue
        j = ids.index(newline, i)  # end of the role line
        close = ids.index(end, j)
        if tokenizer.decode(ids[i + 1 : j]) == "assistant":
            mask[j + 1 : close + 1] = [1] * (close - j)
        i = close + 1
    return mask


def _masked_runs(tokenizer, ids, mask):
    """The decoded text of each run of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    runs += [current] if current else []
    return [tokenizer.decode(r) for r in runs]


def test_a_tool_use_conversation_renders_as_the_template_does(tokenizer, chat):
    enc = chat.encode(CONVERSATION, [1, 3], tools=TOOLS)
    assert list(enc.input_ids) == _template_ids(tokenizer, CONVERSATION, TOOLS)
    text = tokenizer.decode(enc.input_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "mul"' in text  # the row's tools are in the header
    assert "<tool_response>\n1776\n</tool_response>" in text


def test_the_mask_is_both_assistant_turns_the_tool_call_included(tokenizer, chat):
    enc = chat.encode(CONVERSATION, [1, 3], tools=TOOLS)
    ids = list(enc.input_ids)
    assert list(enc.loss_mask) == _assistant_mask(tokenizer, ids)
    assert _masked_runs(tokenizer, ids, enc.loss_mask) == [
        '<tool_call>\n{"name": "mul", "arguments": {"a": 37, "b": 48}}\n</tool_call><|im_end|>',
        "37*48=1776<|im_end|>",
    ]
    # last turn only: the tool call is context
    last = chat.encode(CONVERSATION, [3], tools=TOOLS)
    assert _masked_runs(tokenizer, ids, last.loss_mask) == ["37*48=1776<|im_end|>"]


def test_a_call_turn_starts_at_the_generation_prompt_for_a_tokenizer_that_merges_newlines():
    """A tokenizer whose merges were learned from tool-calling text (examples/agents) and paragraphs has a double
    newline as one token, as real BPE tokenizers (Qwen's) do. The template starts a text-less call right after the
    generation prompt's ``assistant`` line, so the prompt a policy is sampled from is a token prefix of the
    conversation it is trained on; a second newline there would fuse into a token the policy never sees after the
    prompt."""
    from rlhf.models.tiny import build_tokenizer

    base = build_tokenizer()
    corpus = [base.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, chat_template=TOOLS_CHAT_TEMPLATE)]
    merging = build_tokenizer(extra_corpus=corpus * 20 + ["one\n\ntwo"] * 20)
    assert len(merging("\n\n", add_special_tokens=False)["input_ids"]) == 1
    prompt = _template_ids(merging, CONVERSATION[:1], TOOLS, generation_prompt=True)
    whole = _template_ids(merging, CONVERSATION, TOOLS)
    assert whole[: len(prompt)] == prompt
    assert merging.decode(whole[len(prompt)]).startswith("<tool")
    assert len(whole) < len(_template_ids(base, CONVERSATION, TOOLS)) * 0.6  # the tool text is words, not bytes


def test_arguments_as_an_object_or_a_json_string_render_the_same(tokenizer, chat):
    """A JSON-string ``arguments`` is parsed into an object before rendering (as vLLM's server does), so a row's
    spelling of it does not matter, compact spacing included; the row itself is left as it was."""
    reference = chat.encode(CONVERSATION, [1, 3], tools=TOOLS)
    for spelled in (json.dumps({"a": 37, "b": 48}), '{"a":37,"b":48}'):
        row = _conversation(spelled)
        assert chat.encode(row, [1, 3], tools=TOOLS) == reference, spelled
        assert row[1]["tool_calls"][0]["function"]["arguments"] == spelled


def test_a_turn_that_only_calls_a_tool_may_have_null_content(tokenizer, chat):
    messages = [dict(m) for m in CONVERSATION]
    messages[1] = {**messages[1], "content": None}
    check_messages(messages, "messages")
    assert chat.encode(messages, [1, 3], tools=TOOLS) == chat.encode(CONVERSATION, [1, 3], tools=TOOLS)


@pytest.mark.parametrize(
    "message, error",
    [
        ({"role": "assistant", "content": ""}, r"is empty \(no content, no tool_calls\)"),
        ({"role": "assistant", "content": "", "tool_calls": []}, r"is empty"),
        ({"role": "assistant", "tool_calls": {"name": "mul"}}, r"'tool_calls' must be a list of calls, got dict"),
        ({"role": "assistant", "tool_calls": [{"name": "mul"}]}, r"tool_calls\[0\] must be an object with a 'func"),
        (
            {"role": "assistant", "content": 7, "tool_calls": [{"function": {"name": "mul", "arguments": {}}}]},
            r"needs a text or null 'content' beside its tool calls, got int",
        ),
        (
            {"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "mul", "arguments": {}}}]},
            r"tool_calls\[0\]: 'type' must be 'function', got 'code'",
        ),
        ({"role": "user", "content": "x", "tool_calls": []}, r"has 'tool_calls'; only assistant"),
        ({"role": "tool", "content": "1776", "tool_call_id": 0}, r"'tool_call_id' must be text"),
        ({"role": "tool", "content": None}, r"needs a text 'content', got null"),
    ],
)
def test_malformed_tool_messages_are_refused_naming_the_message(message, error):
    with pytest.raises(ValueError, match=r"field 'messages': message 1 \(\w+\)[ :]+" + error):
        check_messages([USER, message], "messages")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _with_call(function):
    return {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [{"function": function}]}]}


@pytest.mark.parametrize(
    "bad, error",
    [
        (_with_call({"arguments": {"a": 1}}), r"message 1 \(assistant\): tool_calls\[0\]: 'function.name' must be"),
        (_with_call({"name": "mul", "arguments": "[37, 48]"}), r"tool_calls\[0\]: 'function.arguments' must be an obj"),
        (_with_call({"name": "mul", "arguments": "a=37"}), r"'function.arguments' must be an object or a JSON string"),
        (_with_call({"name": "mul", "arguments": 37}), r"'function.arguments' must be an object .*got int"),
        ({"messages": CONVERSATION, "tools": '{"type": "function"}'}, r"field 'tools' must be a list of tool schemas"),
        ({"messages": CONVERSATION, "tools": "[1]"}, r"field 'tools': tool 0 must be an object"),
        ({"messages": CONVERSATION, "tools": "[{"}, r"field 'tools' is not valid JSON"),
        ({"messages": CONVERSATION, "tools": {"type": "function"}}, r"field 'tools' must be .*got (dict|object)"),
    ],
)
def test_bad_tool_rows_are_refused_with_file_and_line(tmp_path, bad, error):
    good = {"messages": CONVERSATION, "tools": TOOLS}
    path = _write(tmp_path / "bad.jsonl", [good, bad])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{error}"):
        read_rows(path, **sft_fields("prompt", "response", "messages"))
    prompt_row = {"prompt": [USER], "tools": bad["tools"]} if "tools" in bad else {"prompt": bad["messages"]}
    path = _write(tmp_path / "bad_prompts.jsonl", [{"prompt": [USER], "tools": TOOLS}, prompt_row])
    with pytest.raises(DataError, match=rf"bad_prompts.jsonl:2: .*{error}"):
        read_rows(path, **prompt_fields("prompt"))


def test_the_sft_reader_renders_each_rows_tools(tiny_model, tokenizer, tmp_path):
    """The reader train_sft uses (rlhf.trainers.offline.sft): tools as a list or as a JSON string, arguments as an
    object or a string, and a row without tools, each rendered with its own tools and masked on its assistant turns."""
    from rlhf.config import SFTRunConfig, load_config
    from rlhf.trainers.offline.sft import _read

    rows = [
        {"messages": CONVERSATION, "tools": TOOLS},
        {"messages": _conversation('{"a": 37, "b": 48}'), "tools": json.dumps(TOOLS)},
        {"messages": [USER, {"role": "assistant", "content": "1776"}]},
    ]
    path = _write(tmp_path / "sft.jsonl", rows)
    template = write_tools_template(str(tmp_path / "tools.jinja"))
    cfg = load_config(
        SFTRunConfig,
        None,
        [f"model.path={tiny_model}", f"data.train_path={path}", f"data.chat_template={template}"],
    )
    read = _read(cfg, tokenizer, path, "train")
    assert read.skipped_rows == []
    expected = [
        _template_ids(tokenizer, CONVERSATION, TOOLS),
        _template_ids(tokenizer, CONVERSATION, TOOLS),
        _template_ids(tokenizer, rows[2]["messages"], None),
    ]
    assert [list(e.input_ids) for e in read.examples] == expected
    assert [list(e.loss_mask) for e in read.examples] == [_assistant_mask(tokenizer, ids) for ids in expected]
    assert "<tools>" not in tokenizer.decode(read.examples[2].input_ids)


@pytest.mark.parametrize("trainer", ["dpo", "reward_model"])
def test_the_pair_readers_render_each_rows_tools_with_both_sides(tiny_model, tokenizer, tmp_path, trainer):
    """DPO and reward-model rows (their trainers' readers, data.tools_key=functions): the chosen tool call and the
    rejected answer are each rendered after the same tools header, trained on their answer only; a row without
    tools has no header; a bad ``tools`` is refused with file and line."""
    import importlib

    from rlhf.config import DPORunConfig, RewardModelRunConfig, load_config

    module = importlib.import_module(f"rlhf.trainers.offline.{trainer}")
    prompt, chosen, rejected = [USER], CONVERSATION[1:2], [{"role": "assistant", "content": "1700"}]
    rows = [
        {"prompt": prompt, "chosen": chosen, "rejected": rejected, "functions": TOOLS},
        {"prompt": prompt, "chosen": chosen, "rejected": rejected},
    ]
    path = _write(tmp_path / "pairs.jsonl", rows)
    template = write_tools_template(str(tmp_path / "tools.jinja"))
    cls = DPORunConfig if trainer == "dpo" else RewardModelRunConfig
    overrides = [f"model.path={tiny_model}", f"data.chat_template={template}", "data.tools_key=functions"]
    cfg = load_config(cls, None, [*overrides, f"data.train_path={path}"])
    with_tools, without = module._read(cfg, tokenizer, path, "train").examples
    for example, tools in ((with_tools, TOOLS), (without, None)):
        for side, answer in ((example.chosen, chosen), (example.rejected, rejected)):
            ids = _template_ids(tokenizer, prompt + answer, tools)
            assert list(side.input_ids) == ids
            assert list(side.loss_mask) == _assistant_mask(tokenizer, ids)
    assert '"name": "mul"' in tokenizer.decode(with_tools.chosen.input_ids[: with_tools.chosen.loss_mask.index(1)])
    assert "<tools>" not in tokenizer.decode(without.rejected.input_ids)
    bad = _write(tmp_path / "bad.jsonl", [rows[0], {**rows[0], "functions": "[{"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: .*field 'functions' is not valid JSON"):
        module._read(cfg, tokenizer, bad, "train")


def test_an_rl_prompt_with_tools_renders_as_the_agents_first_request(tiny_model, tokenizer, tmp_path):
    """RL prompts (rlhf.trainers.online.runner, data.tools_key=functions): the prompt ids are the template's render with
    the row's tools and the generation prompt, the same ids as vLLM's OpenAI renderer gives the request an agent
    sends first ({"messages": prompt, "tools": tools})."""
    from rlhf.config import load_config
    from rlhf.config.rl_schema import RLRunConfig
    from rlhf.rollout.openai.render import OpenAIRenderer
    from rlhf.trainers.online.prompts import read_prompts

    system = {"role": "system", "content": "Use the tools."}
    rows = [
        {"prompt": [USER], "functions": TOOLS, "answer": "1776"},
        {"prompt": [system, USER], "functions": json.dumps(TOOLS), "answer": "1776"},
        {"prompt": [USER], "answer": "1776"},
    ]
    path = _write(tmp_path / "prompts.jsonl", rows)
    template = write_tools_template(str(tmp_path / "tools.jinja"))
    cfg = load_config(
        RLRunConfig,
        None,
        [
            f"model.path={tiny_model}",
            f"data.train_path={path}",
            f"data.chat_template={template}",
            "data.tools_key=functions",
            "rollout.max_prompt_length=512",  # the tools' header alone is longer than the default 64
            "reward.functions=[rlhf.synthetic.arithmetic:reward]",
        ],
    )
    prompts = read_prompts(cfg, tokenizer, "data.train_path", path, "train")
    assert (prompts.skipped, prompts.truncated) == (0, 0)
    tools = [TOOLS, TOOLS, None]
    expected = [_template_ids(tokenizer, r["prompt"], t, generation_prompt=True) for r, t in zip(rows, tools)]
    assert prompts.prompt_ids == expected
    assert (
        prompts.texts[1].endswith("<|im_start|>assistant\n")
        and "Use the tools.\n\n# Tools\n<tools>" in prompts.texts[1]
    )
    assert "<tools>" not in prompts.texts[2]
    assert prompts.env_rows[1]["functions"] == json.dumps(TOOLS)  # an agent gets the row as it was read

    renderer = OpenAIRenderer(
        tiny_model, tool_parser="hermes", chat_template=TOOLS_CHAT_TEMPLATE, served_model_name="tiny"
    )
    for row, ids in zip(rows[:2], prompts.prompt_ids):
        assert list(renderer.render_chat({"messages": row["prompt"], "tools": TOOLS}).prompt_ids) == ids
