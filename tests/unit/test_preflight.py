"""The one preflight (``rlhf.trainers.preflight``): what a run refuses before its first actor, ``--dry-run`` refuses
too with the same words, except a path that is missing here, which a dry run leaves to the cluster."""

from __future__ import annotations

import pytest
from shared_helpers import preflight

from rlhf.config import SFTRunConfig, load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.trainers.preflight import NOT_HERE


def _sft(model, data, *overrides):
    return load_config(SFTRunConfig, "sft_tiny", [f"model.path={model}", f"data.train_path={data}", *overrides])


def _rl(model, prompts, *overrides):
    return load_config(RLRunConfig, "grpo_tiny", [f"model.path={model}", f"data.train_path={prompts}", *overrides])


def test_a_path_missing_here_is_refused_by_a_run_and_left_to_the_cluster_by_a_dry_run(tiny_model, sft_data, tmp_path):
    missing = str(tmp_path / "on-the-cluster.jsonl")
    cfg = _sft(tiny_model, sft_data, f"data.eval_path={missing}")
    with pytest.raises(ConfigError, match=f"^data.eval_path: '{missing}' does not exist$"):
        preflight(cfg)
    rows = {key: status for key, _, status in preflight(cfg, here=False, precision="fp32")}
    assert rows == {
        "model.path": "found",
        "data.train_path": "found; 21 rows read, each in a layout the trainer reads",
        "data.eval_path": NOT_HERE,
        "train.output_dir": rows["train.output_dir"],
    }
    with pytest.raises(ConfigError, match="^model.path: '/models/m' is not a directory$"):
        preflight(_sft("/models/m", sft_data))
    assert preflight(_sft("/models/m", sft_data), here=False)[0] == ("model.path", "/models/m", NOT_HERE)


@pytest.mark.parametrize("here", [True, False], ids=["run", "dry_run"])
def test_what_is_here_gets_the_same_refusal_from_a_run_and_a_dry_run(here, tiny_model, sft_data, rl_prompts, tmp_path):
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    with pytest.raises(
        ConfigError,
        match=f"^model.path: '{weights_only}' is not an HF model directory "
        r"\(no config.json\)$",
    ):
        preflight(_sft(weights_only, sft_data), here=here)
    with pytest.raises(ConfigError, match=f"^model.tokenizer_path: '{sft_data}' is not a directory$"):
        preflight(_sft(tiny_model, sft_data, f"model.tokenizer_path={sft_data}"), here=here)
    # a causal LM named as the reward model would get a random score head: refused by the dry run as by the run
    with pytest.raises(ConfigError, match="^reward.model_path: .* is not a reward model"):
        preflight(_rl(tiny_model, rl_prompts, f"reward.model_path={tiny_model}"), here=here)
    with pytest.raises(ConfigError, match="^critic.path: .* is not an HF model directory"):
        preflight(
            _rl(
                tiny_model,
                rl_prompts,
                "algo.advantage_estimator=gae",
                "reward.functions=[]",
                f"reward.model_path={tiny_model}",
                f"critic.path={weights_only}",
            ),
            here=here,
        )


def test_a_reward_model_with_a_scalar_head_passes(tiny_model, tiny_reward_model, rl_prompts):
    cfg = _rl(tiny_model, rl_prompts, f"reward.model_path={tiny_reward_model}")
    assert ("reward.model_path", tiny_reward_model, "found") in preflight(cfg)


@pytest.mark.parametrize("here", [True, False], ids=["run", "dry_run"])
def test_a_model_folder_without_weights_is_refused_before_any_actor(here, tiny_model, sft_data, tmp_path):
    """An interrupted copy or download: config.json and the tokenizer, no weights (caught before Ray starts)."""
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(tiny_model, partial, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with pytest.raises(ConfigError, match=f"^model.path: '{partial}' has a config.json but no weights"):
        preflight(_sft(partial, sft_data), here=here)


def test_a_dry_run_reads_the_rows_this_machine_has(tiny_model, sft_data, rl_prompts, tmp_path):
    """Every row through the trainer's layouts, without a tokenizer: a bad row, or a reward.columns typo, is refused
    with its file and line before a run would start its actors."""
    from rlhf.config import DPORunConfig
    from rlhf.data.io import DataError

    rows = {key: status for key, _, status in preflight(_sft(tiny_model, sft_data), here=False)}
    assert rows["data.train_path"] == (
        "found; 21 examples tokenized (0 skipped: no token to train on within data.max_length)"
    )
    rows = {key: status for key, _, status in preflight(_sft("/models/m", sft_data), here=False)}
    assert rows["data.train_path"] == "found; 21 rows read, each in a layout the trainer reads"  # no tokenizer here
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "2+2=", "chosen": "4", "rejected": "5"}\n{"question": "1+1=", "good": "2"}\n')
    cfg = load_config(DPORunConfig, "dpo_tiny", [f"model.path={tiny_model}", f"data.train_path={pairs}"])
    with pytest.raises(DataError, match=r"pairs.jsonl:2: missing field 'chosen' .*the row's fields: good, question"):
        preflight(cfg, here=False)
    with pytest.raises(DataError, match=r"prompts.jsonl:1: reward.columns names 'answr' .*Did you mean 'answer'"):
        preflight(_rl(tiny_model, rl_prompts, "reward.columns=[answr]"), here=False)


def test_a_dry_run_tokenizes_the_data_as_the_run_does(tiny_model, rl_prompts, tmp_path):
    """With the model's tokenizer here, the trainer's own reader runs: a conversational set without a chat template,
    or prompts that rollout.max_prompt_length leaves empty, fail the dry run as they would fail the run."""
    from rlhf.config.schema import ConfigError as Refused
    from rlhf.data.io import DataError

    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]}\n')
    with pytest.raises(Refused, match="data.chat_template=none"):
        preflight(_sft(tiny_model, chat, "data.chat_template=none"), here=False)
    with pytest.raises(DataError, match="every prompt is longer than rollout.max_prompt_length=1"):
        preflight(
            _rl(tiny_model, rl_prompts, "rollout.max_prompt_length=1", "rollout.prompt_overflow=skip"), here=False
        )
    rows = {key: status for key, _, status in preflight(_rl(tiny_model, rl_prompts), here=False)}
    assert rows["data.train_path"].endswith("; 64 prompts tokenized (0 skipped, 0 truncated)"), rows


def test_an_env_columns_typo_is_refused_as_the_rows_are_read(tiny_model, rl_prompts, tmp_path):
    from rlhf.data.io import DataError

    envs = tmp_path / "envs.py"
    envs.write_text(
        "class Retry:\n    def reset(self, row):\n        return ''\n"
        "    def step(self, response, response_ids):\n        return None, 0.0, True, {}\n"
    )
    multi_turn = (
        f"env.spec={envs}:Retry",
        "rollout.max_turns=2",
        "rollout.max_prompt_length=16",
        "rollout.max_episode_tokens=32",
    )
    with pytest.raises(DataError, match=r"prompts.jsonl:1: env.columns names 'answr' .*Did you mean 'answer'"):
        preflight(_rl(tiny_model, rl_prompts, *multi_turn, "env.columns=[answr]"), here=False)
    rows = {
        key: status
        for key, _, status in preflight(_rl(tiny_model, rl_prompts, *multi_turn, "env.columns=[answer]"), here=False)
    }
    assert "64 prompts tokenized" in rows["data.train_path"]


def test_a_held_out_set_that_rollout_max_prompt_length_leaves_empty_is_refused_like_the_training_set(
    tiny_model, rl_prompts, tmp_path
):
    """Else every evaluation, the first before step 1 after every actor started, would sample nothing."""
    from rlhf.data.io import DataError

    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "' + "1+" * 40 + '1=", "answer": "41"}\n')
    cfg = _rl(tiny_model, rl_prompts, f"data.eval_path={long}", "rollout.max_prompt_length=16")
    with pytest.raises(DataError) as error:
        preflight(cfg, here=False)
    assert str(error.value).startswith(f"data.eval_path={long}: every prompt is longer than rollout.max_prompt_len")
    assert "(1 skipped)" in str(error.value)
    rows = {key: status for key, _, status in preflight(_rl(tiny_model, rl_prompts, f"data.eval_path={long}"), False)}
    assert rows["data.train_path"].endswith("64 prompts tokenized (0 skipped, 0 truncated); 1 held-out"), rows
