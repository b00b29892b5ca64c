"""Every context a vLLM engine is started with is checked against its model's positions before Ray starts
(``rlhf.trainers.preflight``): the policy engines' ``max_model_len`` (``rollout.max_prompt_length +
max_new_tokens``, or ``rollout.max_episode_tokens + max_new_tokens`` for episodes) and the judge's
(``reward.judge.max_model_len``). The positions are read from the model's ``config.json`` as vLLM derives them
(checked against vLLM itself below); a model whose files are not here is left to vLLM."""

from __future__ import annotations

import json
import shutil

import pytest
from shared_helpers import preflight

from rlhf.config import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.models.checks import Positions, model_positions
from rlhf.trainers.online.checks import check_engine_context

AGENT = "examples/agents/retry_agent.py:run"


def _rl(model, prompts, *overrides):
    return load_config(RLRunConfig, "grpo_tiny", [f"model.path={model}", f"data.train_path={prompts}", *overrides])


def _config(tmp_path, name, **fields) -> str:
    """A model folder holding only a ``config.json`` of ``fields``."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", **fields}))
    return str(folder)


# ------------------------------------------------------------------------------------------------ the positions


def test_positions_are_read_from_config_json_as_vllm_derives_them(tmp_path):
    def positions(**fields):
        return model_positions(_config(tmp_path, f"m{len(list(tmp_path.iterdir()))}", **fields))

    assert positions(max_position_embeddings=512) == Positions(512, "max_position_embeddings 512 in its config.json")
    # a linear or dynamic RoPE scaling stretches the positions; YaRN's and Llama 3's configs already count it
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}
    assert positions(max_position_embeddings=512, rope_parameters=linear) == Positions(
        2048, "max_position_embeddings 512 x RoPE scaling factor 4 in its config.json"
    )
    assert positions(max_position_embeddings=512, rope_scaling={"type": "dynamic", "factor": 2}).limit == 1024
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    assert positions(max_position_embeddings=512, rope_parameters=yarn).limit == 512
    per_layer = {
        "full_attention": {"rope_type": "linear", "factor": 8.0},
        "sliding_attention": {"rope_type": "default"},
    }
    assert positions(max_position_embeddings=512, rope_parameters=per_layer).limit == 4096
    # the smallest length key; a multimodal model's text model; GPT-2's key
    assert positions(max_position_embeddings=4096, seq_length=2048) == Positions(
        2048, "seq_length 2048 in its config.json"
    )
    assert positions(text_config={"max_position_embeddings": 8192}, vision_config={"image_size": 224}) == Positions(
        8192, "text_config.max_position_embeddings 8192 in its config.json"
    )
    assert positions(n_positions=1024).limit == 1024
    # nothing to compare with: no length key, no config.json, an unreadable one
    assert positions(hidden_size=64) is None
    assert model_positions(str(tmp_path / "absent")) is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert model_positions(str(broken)) is None


def test_the_positions_are_the_longest_context_vllm_starts_an_engine_with(tiny_model, tmp_path):
    """vLLM's own model config (as the engines and the agents' endpoint build it, no weights read) accepts
    ``max_model_len`` = the positions read here and refuses one more, for each kind of config."""
    from vllm.engine.arg_utils import EngineArgs

    def accepts(folder, length):
        try:
            EngineArgs(model=folder, max_model_len=length).create_model_config()
        except ValueError as error:
            assert "max_model_len" in str(error)
            return False
        return True

    variants = {
        "plain": {},
        "linear": {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}},
        "yarn": {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 128,
            }
        },
        "rope_scaling": {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    }
    for name, edit in variants.items():
        folder = tmp_path / name
        shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
        config = json.loads((folder / "config.json").read_text())
        config.update(edit)
        (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        limit = model_positions(str(folder)).limit
        assert (accepts(str(folder), limit), accepts(str(folder), limit + 1)) == (True, False), (name, limit)


# ------------------------------------------------------------------------------------------------ the preflight


@pytest.mark.parametrize("here", [True, False], ids=["run", "dry_run"])
def test_an_episode_context_beyond_the_models_positions_is_refused_by_key_before_ray(here, tiny_model, rl_prompts):
    """The docs' old agent command: 1024 + 6 tokens on the tiny model's 512 positions died at engine start."""
    agent = [f"env.spec={AGENT}", "reward.functions=[]", "rollout.max_turns=4"]
    with pytest.raises(ConfigError) as error:
        preflight(_rl(tiny_model, rl_prompts, *agent, "rollout.max_episode_tokens=1024"), here=here)
    assert str(error.value) == (
        "rollout.max_episode_tokens + rollout.max_new_tokens (1024 + 6 = 1030), the policy engines' max_model_len, "
        f"is above the 512 positions of model.path {tiny_model!r} (max_position_embeddings 512 in its config.json): "
        "vLLM would refuse it when the engines start. Lower rollout.max_episode_tokens or rollout.max_new_tokens to "
        "sum to at most 512, or use a model with more positions"
    )
    fits = _rl(tiny_model, rl_prompts, *agent, "rollout.max_episode_tokens=506")  # 506 + 6 = 512: the whole model
    assert fits.engine_context == 512
    preflight(fits, here=here)


def test_a_prompt_and_response_beyond_the_models_positions_is_refused(tiny_model, rl_prompts):
    with pytest.raises(ConfigError) as error:
        preflight(_rl(tiny_model, rl_prompts, "rollout.max_prompt_length=500", "rollout.max_new_tokens=16"))
    assert str(error.value).startswith(
        "rollout.max_prompt_length + rollout.max_new_tokens (500 + 16 = 516), the policy engines' max_model_len, is "
        "above the 512 positions of model.path"
    )
    assert "Lower rollout.max_prompt_length or rollout.max_new_tokens to sum to at most 512" in str(error.value)
    assert (
        _rl(tiny_model, rl_prompts, "rollout.max_prompt_length=496", "rollout.max_new_tokens=16").engine_context == 512
    )


def test_the_judges_context_is_checked_against_the_judges_model(tiny_model, rl_prompts):
    judged = [f"reward.judge.path={tiny_model}"]
    with pytest.raises(ConfigError) as error:
        preflight(_rl(tiny_model, rl_prompts, *judged), here=False)  # reward.judge.max_model_len: 2048 by default
    assert str(error.value) == (
        f"reward.judge.max_model_len (2048), the judge engines' context, is above the 512 positions of "
        f"reward.judge.path {tiny_model!r} (max_position_embeddings 512 in its config.json): vLLM would refuse it "
        f"when the judge's engines start. Lower reward.judge.max_model_len to at most 512 (above "
        f"reward.judge.max_new_tokens=16), or use a judge model with more positions"
    )
    preflight(_rl(tiny_model, rl_prompts, *judged, "reward.judge.max_model_len=512"), here=False)


def test_a_model_whose_files_are_not_here_is_left_to_vllm(tiny_model, rl_prompts, tmp_path, monkeypatch):
    """A hub id with nothing cached and no network, or a path only the cluster has: no positions, no error. A
    cached hub snapshot is read without asking the hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    long = ["rollout.max_prompt_length=4000", "rollout.max_new_tokens=100"]
    check_engine_context(_rl("some-org/some-model", rl_prompts, *long))
    check_engine_context(_rl("/on/the/cluster/model", rl_prompts, *long))
    snapshot = tmp_path / "cache" / "models--some-org--some-model" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_model, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    with pytest.raises(ConfigError, match=r"\(4000 \+ 100 = 4100\).* 512 positions of model.path 'some-org/some-mod"):
        check_engine_context(_rl("some-org/some-model", rl_prompts, *long))


def test_the_dry_run_shows_the_context_against_the_positions(tiny_model, rl_prompts, capsys):
    from rlhf.cli.dry_run import dry_run

    dry_run(_rl(tiny_model, rl_prompts), "train_ppo", cluster="1x4cpu")
    assert (
        "  max_model_len 262 (rollout.max_prompt_length + rollout.max_new_tokens), within the model's 512 positions "
        "(max_position_embeddings 512 in its config.json)\n" in capsys.readouterr().out
    )
    dry_run(_rl("/on/the/cluster/model", rl_prompts), "train_ppo", cluster="1x4cpu")
    assert (
        "max_model_len 262 (rollout.max_prompt_length + rollout.max_new_tokens); the model's positions are checked "
        "by the run (its config.json is not on this machine)\n" in capsys.readouterr().out
    )
