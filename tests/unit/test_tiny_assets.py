"""Tiny model, tokenizer, synthetic arithmetic task and asset writer, exercised with real HF objects."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rlhf.cli.make_assets import main as make_assets_main
from rlhf.cli.make_assets import make_assets
from rlhf.data.io import read_rows
from rlhf.models.tiny import SHORT_TOOLS_CHAT_TEMPLATE, build_tiny_model
from rlhf.synthetic import arithmetic
from rlhf.synthetic.arithmetic import (
    extract_answer,
    is_correct,
    make_preference_rows,
    make_rl_prompts,
    make_sft_rows,
    reward,
    tokenizer_corpus,
    write_jsonl,
)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two builds with seed 0 and one with seed 1 (building is ~0.1 s once transformers is imported)."""
    base = tmp_path_factory.mktemp("tiny")
    return {
        "a": build_tiny_model(str(base / "a"), seed=0),
        "b": build_tiny_model(str(base / "b"), seed=0),
        "c": build_tiny_model(str(base / "c"), seed=1),
    }


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs: dict[str, str]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dirs["a"])


# --------------------------------------------------------------------------- model


def test_same_seed_gives_identical_files(tiny_dirs: dict[str, str]) -> None:
    files = sorted(os.listdir(tiny_dirs["a"]))
    assert "model.safetensors" in files and "tokenizer.json" in files and "generation_config.json" in files
    assert files == sorted(os.listdir(tiny_dirs["b"]))
    for name in files:
        assert _read(os.path.join(tiny_dirs["a"], name)) == _read(os.path.join(tiny_dirs["b"], name)), name


def test_different_seed_gives_different_weights_same_tokenizer(tiny_dirs: dict[str, str]) -> None:
    a, c = tiny_dirs["a"], tiny_dirs["c"]
    assert _read(os.path.join(a, "model.safetensors")) != _read(os.path.join(c, "model.safetensors"))
    assert _read(os.path.join(a, "tokenizer.json")) == _read(os.path.join(c, "tokenizer.json"))


def test_build_does_not_move_the_callers_rng(tmp_path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(str(tmp_path / "m"), seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_config_head_dim_and_ids(tiny_dirs: dict[str, str], tokenizer) -> None:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(tiny_dirs["a"])
    assert config.model_type == "qwen2"
    assert config.hidden_size // config.num_attention_heads >= 32
    assert config.tie_word_embeddings is False
    assert config.attention_dropout == 0.0
    assert (config.pad_token_id, config.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    gen = GenerationConfig.from_pretrained(tiny_dirs["a"])
    assert gen.eos_token_id == tokenizer.eos_token_id and gen.pad_token_id == tokenizer.pad_token_id


def test_small_head_dim_is_rejected(tmp_path) -> None:
    with pytest.raises(AssertionError, match="head_dim 16"):
        build_tiny_model(str(tmp_path / "m"), hidden_size=64, num_heads=4)


def test_model_loads_and_runs_forward(tiny_dirs: dict[str, str], tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["a"])
    model.eval()
    batch = tokenizer(["1+2=3", "12+19=31"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, -1].item() == tokenizer.pad_token_id  # right padding
    with torch.no_grad():
        out = model(**batch, labels=batch["input_ids"])
    assert out.logits.shape == (2, batch["input_ids"].shape[1], model.config.vocab_size)
    assert torch.isfinite(out.logits).all()
    # A random model is close to uniform over the vocabulary.
    assert abs(out.loss.item() - torch.log(torch.tensor(float(model.config.vocab_size))).item()) < 1.0


# --------------------------------------------------------------------------- tokenizer


def _task_strings() -> list[str]:
    texts = list(tokenizer_corpus())
    for row in make_preference_rows(200, seed=3):
        texts += [row["prompt"], row["chosen"], row["rejected"], row["prompt"] + row["chosen"]]
    return texts


def test_tokenizer_round_trips_task_strings_and_arbitrary_text(tokenizer) -> None:
    for text in _task_strings() + [" hello\n\tworld ", "Café ü 😀", "a + b = 12, 3-4"]:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        assert tokenizer.unk_token_id not in ids, text
        assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens(tiny_dirs: dict[str, str], tokenizer) -> None:
    from transformers import AutoConfig

    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "</s>"
    assert tokenizer.bos_token == "<s>" and tokenizer.unk_token == "<unk>"
    assert len({tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id}) == 3
    assert tokenizer.padding_side == "right"
    # No implicit BOS/EOS: the data pipeline decides where EOS goes.
    assert tokenizer("1+1=")["input_ids"] == tokenizer("1+1=", add_special_tokens=False)["input_ids"]
    assert len(tokenizer) == AutoConfig.from_pretrained(tiny_dirs["a"]).vocab_size


def test_prompt_tokens_are_a_prefix_of_prompt_plus_response(tokenizer) -> None:
    for row in make_sft_rows(300, seed=4):
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        full_ids = tokenizer(row["prompt"] + row["response"])["input_ids"]
        assert full_ids[: len(prompt_ids)] == prompt_ids
        assert full_ids[len(prompt_ids) :] == tokenizer(row["response"])["input_ids"]


def test_saved_tokenizer_json_matches_auto_tokenizer(tiny_dirs: dict[str, str], tokenizer) -> None:
    # AutoTokenizer (and vLLM) rebuild a qwen2 tokenizer's pipeline; the saved file must agree with it.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(tiny_dirs["a"], "tokenizer.json"))
    for text in _task_strings() + [" x  y\n\nz", "Ünïcödé 42"]:
        assert raw.encode(text).ids == tokenizer(text)["input_ids"], text


def test_every_model_id_decodes_to_a_token(tokenizer) -> None:
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    assert None not in tokens
    assert tokenizer.decode([len(tokenizer) - 1]).startswith("<|reserved_")


# --------------------------------------------------------------------------- synthetic task


def test_sft_rows_are_correct_and_in_range() -> None:
    rows = make_sft_rows(500, seed=0, max_operand=20)
    assert len(rows) == 500
    for row in rows:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["prompt"] == f"{int(a)}+{int(b)}="
        assert 0 <= int(a) <= 20 and 0 <= int(b) <= 20
        assert row["response"] == str(int(a) + int(b))
        assert set(row) == {"prompt", "response"}


def test_preference_rows_chosen_correct_rejected_wrong() -> None:
    rows = make_preference_rows(1000, seed=0)
    margins = set()
    for row in rows:
        a, b = map(int, row["prompt"].removesuffix("=").split("+"))
        assert row["chosen"] == str(a + b)
        assert row["rejected"] != row["chosen"]
        assert int(row["rejected"]) >= 0 and row["rejected"] == str(int(row["rejected"]))
        assert not is_correct(row["rejected"], row["chosen"])
        assert row["margin"] in (1.0, 2.0) and float(row["margin"]).is_integer()
        if row["margin"] == 1.0:
            assert abs(int(row["rejected"]) - (a + b)) <= 2
        margins.add(row["margin"])
    assert margins == {1.0, 2.0}
    # Digit swaps occur (e.g. 21 -> 12), and are plausible-looking wrong answers.
    assert any(r["rejected"] == r["chosen"][::-1] for r in rows if len(r["chosen"]) == 2)


def test_rl_prompts_have_string_answers() -> None:
    rows = make_rl_prompts(100, seed=0, max_operand=5)
    for row in rows:
        a, b = map(int, row["prompt"].removesuffix("=").split("+"))
        assert isinstance(row["answer"], str) and row["answer"] == str(a + b)
        assert a <= 5 and b <= 5


@pytest.mark.parametrize("make", [make_sft_rows, make_preference_rows, make_rl_prompts])
def test_sampling_is_seeded_and_ignores_global_rng(make) -> None:
    import random

    random.seed(1)
    first = make(50, seed=7)
    random.seed(2)
    assert make(50, seed=7) == first
    assert make(50, seed=8) != first


def test_bad_max_operand_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_operand"):
        make_sft_rows(3, seed=0, max_operand=0)


@pytest.mark.parametrize(
    ("response", "expected"),
    [("19", "19"), ("  19\n", "19"), ("19</s>", "19"), ("abc 7 and 8", "7"), ("-3", "-3"), ("none", None), ("", None)],
)
def test_extract_answer(response: str, expected: str | None) -> None:
    assert extract_answer(response) == expected


def test_is_correct_and_reward() -> None:
    assert is_correct("19", "19") and is_correct(" 19 ", "19") and is_correct("07", "7")
    assert not is_correct("18", "19") and not is_correct("", "19") and not is_correct("-19", "19")
    assert not is_correct("191", "19")
    assert reward(["1+1=", "2+2=", "3+3="], ["2", "5", "x"], ["2", "4", "6"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 prompts"):
        reward(["a", "b"], ["1"], ["1"])


def test_reward_is_one_exactly_on_sft_responses() -> None:
    rows = make_sft_rows(50, seed=1)
    prefs = make_preference_rows(50, seed=1)
    assert (
        reward([r["prompt"] for r in rows], [r["response"] for r in rows], [r["response"] for r in rows]) == [1.0] * 50
    )
    assert (
        reward([r["prompt"] for r in prefs], [r["rejected"] for r in prefs], [r["chosen"] for r in prefs]) == [0.0] * 50
    )


def test_write_jsonl_round_trip_and_atomicity(tmp_path) -> None:
    path = tmp_path / "sub" / "rows.jsonl"
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "é", "response": "ü"}]
    assert write_jsonl(path, rows) == str(path)
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == rows

    def exploding():
        yield {"prompt": "x"}
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_jsonl(path, exploding())
    # The old file is intact and no temporary file is left behind.
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == rows
    assert os.listdir(path.parent) == ["rows.jsonl"]


# --------------------------------------------------------------------------- make_assets


def test_make_assets_writes_skips_and_forces(tmp_path, capsys) -> None:
    out = str(tmp_path / "assets")
    paths = make_assets(out, seed=0, num_sft=20, num_pref=30, num_prompts=10, num_eval_prompts=5, max_operand=9)
    assert set(paths) == {
        "model",
        "sft",
        "preference",
        "unpaired",
        "prompts",
        "eval_prompts",
        "sft_chat",
        "preference_chat",
        "prompts_chat",
        "tools_template",
    }
    assert os.path.isfile(os.path.join(paths["model"], "model.safetensors"))
    assert _read(paths["tools_template"]) == SHORT_TOOLS_CHAT_TEMPLATE.encode()  # the model's ChatML, with tools
    assert len(read_rows(paths["sft"], ["prompt", "response"])) == 20
    pref = read_rows(paths["preference"], ["prompt", "chosen", "rejected"], ["margin"], types={"margin": (int, float)})
    assert len(pref) == 30 and all("margin" in r for r in pref)
    prompts = read_rows(paths["prompts"], ["prompt", "answer"])
    evals = read_rows(paths["eval_prompts"], ["prompt", "answer"])
    assert len(prompts) == 10 and len(evals) == 5
    assert [r["prompt"] for r in evals] != [r["prompt"] for r in prompts[:5]]  # a different draw
    # The conversational files are the same draws as messages.
    chat_sft = read_rows(paths["sft_chat"], ["messages"], types={"messages": (list,)})
    plain_sft = read_rows(paths["sft"], ["prompt", "response"])
    assert [r["messages"][1:3] for r in chat_sft] == [
        [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}] for r in plain_sft
    ]
    assert sum(len(r["messages"]) == 5 for r in chat_sft) == 20 // 3  # every third asks a second question
    chat_prompts = read_rows(paths["prompts_chat"], ["prompt", "answer"], types={"prompt": (list,)})
    assert [(r["prompt"][-1]["content"], r["answer"]) for r in chat_prompts] == [
        (r["prompt"], r["answer"]) for r in prompts
    ]
    chat_pref = read_rows(
        paths["preference_chat"],
        ["prompt", "chosen", "rejected"],
        types={k: (list,) for k in ("prompt", "chosen", "rejected")},
    )
    assert [r["chosen"][0]["content"] for r in chat_pref] == [r["chosen"] for r in pref]
    # KTO's thumbs-up / down rows: each pair's chosen answer desirable, its rejected one not
    unpaired = read_rows(paths["unpaired"], ["prompt", "completion"], ["label"])
    assert [(r["completion"], r["label"]) for r in unpaired[:2]] == [
        (pref[0]["chosen"], True),
        (pref[0]["rejected"], False),
    ]
    assert len(unpaired) == 60 and sum(r["label"] for r in unpaired) == 30

    # Existing outputs are kept (even with other sizes) ...
    before = _read(paths["sft"])
    assert make_assets(out, num_sft=7)["sft"] == paths["sft"]
    assert _read(paths["sft"]) == before
    # ... unless forced; the CLI prints what it wrote.
    assert make_assets_main(["--out", out, "--num-sft", "7", "--force"]) == 0
    assert len(read_rows(paths["sft"], ["prompt", "response"])) == 7
    printed = capsys.readouterr().out
    assert f"wrote   {paths['sft']} (7 rows)" in printed and paths["model"] in printed
    assert not [n for n in os.listdir(out) if n.startswith(".model-")]  # no temp dir left behind


def test_make_assets_help_and_the_readme_name_every_file_it_writes(tmp_path, capsys) -> None:
    """A user picks the next command's files from ``--help``: each output, with what reads it (the presets named
    there exist); the README, where the assets are introduced, names the chat template and the chat files."""
    import re

    from rlhf.config.loader import available_presets

    out = tmp_path / "assets"
    make_assets(str(out), num_sft=3, num_pref=3, num_prompts=3, num_eval_prompts=3)
    with pytest.raises(SystemExit) as exit_:
        make_assets_main(["--help"])
    assert exit_.value.code == 0
    listed = capsys.readouterr().out.split("writes, under --out:\n", 1)[1]
    names = re.findall(r"^  (\S+)", listed, re.M)
    assert sorted(names) == sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
    assert "chat template" in listed and "512 positions" in listed
    presets = set(re.findall(r"\((\w+_tiny)\)", listed))
    assert {"sft_chat_tiny", "agent_tiny", "grpo_tiny"} <= presets <= set(available_presets())
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    introduced = readme.split("- **Tiny local assets**", 1)[1].split("\n- **", 1)[0]
    for name in ("chat template", "sft_chat.jsonl", "prompts_chat.jsonl", "tools.jinja", "sft_chat_tiny", "agent_tiny"):
        assert name in introduced, name


def test_make_assets_is_deterministic(tmp_path) -> None:
    a = make_assets(str(tmp_path / "a"), seed=3, num_sft=10, num_pref=10, num_prompts=10, num_eval_prompts=10)
    b = make_assets(str(tmp_path / "b"), seed=3, num_sft=10, num_pref=10, num_prompts=10, num_eval_prompts=10)
    for key in ("sft", "preference", "prompts", "eval_prompts"):
        assert _read(a[key]) == _read(b[key]), key
    model_a = os.path.join(a["model"], "model.safetensors")
    assert _read(model_a) == _read(os.path.join(b["model"], "model.safetensors"))


def test_default_max_operand_is_small() -> None:
    assert arithmetic.DEFAULT_MAX_OPERAND == 20
