"""The row layouts people download, read as they are: every example of docs/your_model_and_data.md's layout table
through its trainer's reading path, each new layout equal to the explicit row it means, and the errors of a row
that fits no layout (file, line, every field of the row, the key to set). No Ray."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlhf.config import DPORunConfig, RewardModelRunConfig, SFTRunConfig, load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.data.chat import ChatFormatter
from rlhf.data.formats import text_prompts_note
from rlhf.data.io import DataError
from rlhf.trainers.offline import dpo, kto, reward_model, sft
from rlhf.trainers.online import prompts as rl_prompts

DOC = Path(__file__).resolve().parents[2] / "docs" / "your_model_and_data.md"
READERS = {
    "sft": (SFTRunConfig, "sft_tiny", sft._read),
    "dpo": (DPORunConfig, "dpo_tiny", dpo._read),
    "rm": (RewardModelRunConfig, "rm_tiny", reward_model._read),
    "kto": (DPORunConfig, "dpo_tiny", kto._read),  # with dpo.loss_type=kto (the table's settings)
    "rl": (RLRunConfig, "grpo_tiny", None),
}
TRAINERS = {
    "SFT": ("sft",),
    "DPO, reward model": ("dpo", "rm"),
    "reward model": ("rm",),
    "KTO": ("kto",),
    "RL": ("rl",),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _conv(*turns):
    roles = {"s": "system", "u": "user", "a": "assistant"}
    return [{"role": roles[r], "content": c} for r, c in turns]


def _read(kind, tiny_model, tokenizer, tmp_path, rows, *settings):
    """``rows`` read through trainer ``kind``'s own reading path, configured by its preset and ``settings``."""
    path = tmp_path / f"{kind}-{len(list(tmp_path.iterdir()))}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cls, preset, read = READERS[kind]
    extra = ["reward.functions=[m:f]", "rollout.max_prompt_length=128"] if kind == "rl" else []
    cfg = load_config(cls, preset, [f"model.path={tiny_model}", f"data.train_path={path}", *extra, *settings])
    if kind == "rl":
        return rl_prompts.read_prompts(cfg, tokenizer, "data.train_path", str(path), "train")
    return read(cfg, tokenizer, str(path), "train")


def _documented_layouts():
    """``(trainer, layout, example row, settings)`` of each row of the docs' layout table."""
    text = DOC.read_text(encoding="utf-8")
    table = text.split("## Layouts read as they are", 1)[1].split("\n\n")[2]
    rows = []
    for line in table.splitlines()[2:]:
        trainer, layout, example, setting = [c.strip() for c in line.strip("|").split(" | ")]
        settings = re.findall(r"\b(\w+\.\w+=\S+?)(?=[ `])", setting.split("(")[0] + " ")
        rows.append((trainer, layout, json.loads(example.strip("`")), settings))
    return rows


def test_the_docs_table_lists_each_trainers_layouts():
    layouts = {(t, name) for t, name, _, _ in _documented_layouts()}
    assert len(layouts) == 24
    assert ("KTO", "unpaired, conversational (TRL)") in layouts
    assert ("SFT", "conversation with tool calls (TRL / OpenAI)") in layouts
    assert ("DPO, reward model", "conversational with tool calls") in layouts
    assert ("RL", "conversational prompt with tools") in layouts
    for name in ("UltraFeedback-binarized", "Anthropic HH-RLHF", "implicit prompt, text (TRL)"):
        assert ("DPO, reward model", name) in layouts
    assert ("SFT", "plain text (TRL language modeling)") in layouts
    assert ("RL", "question column, chat-templated (GSM8K)") in layouts


@pytest.mark.parametrize("trainer, layout, row, settings", _documented_layouts(), ids=lambda v: str(v)[:40])
def test_every_documented_layout_reads_through_its_trainer(
    tiny_model, tokenizer, tmp_path, trainer, layout, row, settings
):
    for kind in TRAINERS[trainer]:
        out = _read(kind, tiny_model, tokenizer, tmp_path, [row, row], *settings)
        if kind == "rl":
            assert len(out.prompt_ids) == 2 and out.prompt_ids[0] and out.columns["answer"] == [row["answer"]] * 2
            continue
        assert len(out.examples) == 2 and out.skipped_rows == [], (kind, layout)
        example = out.examples[0]
        if kind == "sft":
            assert example.num_targets > 0
        elif kind == "kto":  # two copies of the row: each is the other's mismatch
            assert example.completion.num_targets > 0 and example.mismatched == example.completion
            label = row.get("label", row.get("thumbs_up"))
            assert [e.desirable for e in out.examples] == [label, label]
        else:
            assert example.chosen.num_targets > 0 and example.rejected.num_targets > 0
            assert example.chosen.input_ids != example.rejected.input_ids


def _pair(tiny_model, tokenizer, tmp_path, row):
    (example,) = _read("dpo", tiny_model, tokenizer, tmp_path, [row]).examples
    return example


def test_ultrafeedback_rows_are_the_explicit_conversational_pair(tiny_model, tokenizer, tmp_path):
    user = _conv(("u", "2+2="))
    ultra = {
        "prompt": "2+2=",
        "chosen": user + _conv(("a", "4")),
        "rejected": user + _conv(("a", "5")),
        "score_chosen": 9.0,
        "score_rejected": 2.0,
    }
    explicit = {"prompt": user, "chosen": _conv(("a", "4")), "rejected": _conv(("a", "5"))}
    assert _pair(tiny_model, tokenizer, tmp_path, ultra) == _pair(tiny_model, tokenizer, tmp_path, explicit)
    # A text prompt before assistant-only answers is that one user turn.
    short = {"prompt": "2+2=", "chosen": _conv(("a", "4")), "rejected": _conv(("a", "5"))}
    assert _pair(tiny_model, tokenizer, tmp_path, short) == _pair(tiny_model, tokenizer, tmp_path, explicit)


def test_hh_rlhf_prompt_runs_through_the_last_assistant_marker(tiny_model, tokenizer, tmp_path):
    history = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2=\n\nAssistant:"
    # The answers share their first word: the prompt still ends at the marker, not in the shared " 4".
    hh = {"chosen": history + " 4.", "rejected": history + " 4 apples, or 5"}
    explicit = {"prompt": history, "chosen": " 4.", "rejected": " 4 apples, or 5"}
    assert _pair(tiny_model, tokenizer, tmp_path, hh) == _pair(tiny_model, tokenizer, tmp_path, explicit)


def test_implicit_text_prompt_is_cut_before_the_last_shared_whitespace(tiny_model, tokenizer, tmp_path):
    implicit = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    explicit = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    assert _pair(tiny_model, tokenizer, tmp_path, implicit) == _pair(tiny_model, tokenizer, tmp_path, explicit)


def test_sft_completion_and_text_rows(tiny_model, tokenizer, tmp_path):
    read = lambda rows: _read("sft", tiny_model, tokenizer, tmp_path, rows).examples  # noqa: E731
    assert read([{"prompt": "The sky is", "completion": " blue."}]) == read(
        [{"prompt": "The sky is", "response": " blue."}]
    )
    conversation = _conv(("u", "Sky colour?"), ("a", "Blue."))
    assert read([{"prompt": conversation[:1], "completion": conversation[1:]}]) == read([{"messages": conversation}])
    (whole,) = read([{"text": "The sky is blue."}])
    ids = tokenizer("The sky is blue.")["input_ids"] + [tokenizer.eos_token_id]
    assert list(whole.input_ids) == ids
    assert list(whole.loss_mask) == [0] + [1] * (len(ids) - 1)  # every token but the first, which nothing predicts


def test_rl_question_column_through_the_chat_template(tiny_model, tokenizer, tmp_path):
    row = {"question": "3+5=", "answer": "#### 8"}
    templated = _read(
        "rl", tiny_model, tokenizer, tmp_path, [row], "data.prompt_key=question", "data.template_text_prompts=true"
    )
    user_turn = _conv(("u", "3+5="))
    chat = ChatFormatter(tokenizer)
    assert templated.prompt_ids == [chat.prompt_ids(user_turn)]
    assert templated.texts == [chat.render(user_turn, generation_prompt=True)]
    assert templated.columns == {"answer": ["#### 8"]} and templated.chat is not None
    plain = _read("rl", tiny_model, tokenizer, tmp_path, [row], "data.prompt_key=question")
    assert plain.prompt_ids == [tokenizer("3+5=")["input_ids"]] and plain.texts == ["3+5="]
    # Text given as written to a tokenizer with a chat template: the run says which key renders it.
    note = text_prompts_note(plain.env_rows, "question", tokenizer)
    assert note.startswith("1 text prompts (data.prompt_key=question) are given to the model as written"), note
    assert "data.template_text_prompts=true" in note
    assert text_prompts_note(templated.env_rows, "question", tokenizer) == ""


def _error(kind, tiny_model, tokenizer, tmp_path, rows, *settings) -> str:
    with pytest.raises(DataError) as err:
        _read(kind, tiny_model, tokenizer, tmp_path, rows, *settings)
    return str(err.value)


def test_a_row_in_no_layout_names_every_field_and_the_key_to_set(tiny_model, tokenizer, tmp_path):
    message = _error("dpo", tiny_model, tokenizer, tmp_path, [{"question": "2+2=", "good": "4", "bad": "5"}])
    assert message.endswith(
        ".jsonl:1: missing field 'chosen' for a preference pair (the row's fields: bad, good, question). "
        "Set data.chosen_key to the field that holds the preferred answer."
    ), message
    message = _error("rm", tiny_model, tokenizer, tmp_path, [{"chosen": "Yes.", "rejected": "No."}])
    assert "share no prompt" in message and "(the row's fields: chosen, rejected)" in message
    assert message.endswith("Set data.prompt_key to the field that holds the prompt."), message
    message = _error("sft", tiny_model, tokenizer, tmp_path, [{"prompt": "2+2=", "answer": "4"}])
    assert "missing field 'response'" in message and "(the row's fields: answer, prompt)" in message
    assert message.endswith("Set data.response_key to the field that holds the response."), message
    message = _error("rl", tiny_model, tokenizer, tmp_path, [{"question": "2+2=", "answer": "4"}])
    assert "missing field 'prompt' for a prompt row (the row's fields: answer, question)" in message, message


def test_a_reward_column_typo_is_caught_as_the_prompts_are_read(tiny_model, tokenizer, tmp_path):
    rows = [{"question": "2+2=", "answer": "4"}]
    message = _error("rl", tiny_model, tokenizer, tmp_path, rows, "data.prompt_key=question", "reward.columns=[answr]")
    assert message.endswith(
        ".jsonl:1: reward.columns names 'answr' but the row has no such field (the row's fields: answer, question). "
        "Did you mean 'answer'? Set reward.columns to fields the prompt rows have."
    ), message
    # The default column is passed when present: prompts without it still read.
    bare = _read("rl", tiny_model, tokenizer, tmp_path, [{"prompt": "2+2="}])
    assert bare.columns == {} and len(bare.prompt_ids) == 1
