"""An environment's or agent's prompt row names ``env.columns`` for a field it lacks, and ``--dry-run`` runs an agent
once on the first row to find such a read before any actor starts (issue #37, item 4)."""

from __future__ import annotations

import pytest

from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.envs.agents import run_agents
from rlhf.envs.rows import MissingColumn, PromptRow, probe_agent
from rlhf.rollout.prompts import PromptSet
from rlhf.trainers.online.prompts import probe_row_reads

AGENTS = """
def reads_a(client, row):
    return float(row["a"])

async def asks(client, row):
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return float(reply.choices[0].message.content == row["answer"])

def parses(client, row):
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return float(int(reply.choices[0].message.content))
"""


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    path = tmp_path_factory.mktemp("agents") / "agents.py"
    path.write_text(AGENTS)
    namespace: dict = {}
    exec(AGENTS, namespace)
    return path, namespace


def test_a_missing_field_names_env_columns_and_a_present_one_reads_as_a_dict():
    row = PromptRow({"prompt": "1+1=", "answer": "2"})
    assert row["answer"] == "2" and row.get("a") is None and dict(row) == {"prompt": "1+1=", "answer": "2"}
    with pytest.raises(KeyError) as caught:
        row["a"]
    assert isinstance(caught.value, MissingColumn)
    assert str(caught.value) == (
        "the prompt row has no field 'a': environments and agents get the prompt and the columns env.columns and "
        "reward.columns name (this row: prompt, answer); add env.columns=[a] (every row of the data must have it)"
    )


def test_the_probe_finds_a_missing_read_and_runs_sync_and_async_agents(agents):
    _, ns = agents
    row = {"prompt": "1+1=", "answer": "2"}
    with pytest.raises(MissingColumn, match=r"add env.columns=\[a\]"):
        probe_agent(ns["reads_a"], row)
    assert probe_agent(ns["asks"], row) is None  # an async agent, awaited on the stand-in client
    assert probe_agent(ns["parses"], row) == "ValueError: invalid literal for int() with base 10: ''"


def test_an_agent_that_reads_a_missing_field_fails_in_one_line_naming_env_columns(agents):
    _, ns = agents
    (outcome,), stuck = run_agents(ns["reads_a"], "agents.py:reads_a", [(3, ("http://127.0.0.1:9/v1", {"p": 1}))], 5.0)
    assert not stuck and "\n" not in str(outcome)
    assert str(outcome).startswith("agent 'agents.py:reads_a' raised MissingColumn: the prompt row has no field 'a'")
    assert str(outcome).endswith("(episode 3)")


def test_the_dry_run_refuses_an_agent_reading_a_field_no_key_passes(agents):
    path, _ = agents
    base = ["model.path=/m", "data.train_path=/d.jsonl", "rollout.max_episode_tokens=300", "rollout.max_turns=2"]
    prompts = PromptSet([[1, 2]], ["1+1="], {}, 0, 0, env_rows=[{"prompt": "1+1=", "answer": "2"}])
    cfg = load_config(RLRunConfig, "grpo_tiny", [*base, f"env.spec={path}:reads_a"])
    with pytest.raises(ConfigError, match=r"^env.columns: agent .*reads_a read a field of prompt row 0 it does not"):
        probe_row_reads(cfg, prompts)
    cfg = load_config(RLRunConfig, "grpo_tiny", [*base, f"env.spec={path}:asks"])
    assert probe_row_reads(cfg, prompts) == "; the agent ran on row 0 (stand-in replies)"
    cfg = load_config(RLRunConfig, "grpo_tiny", [*base, f"env.spec={path}:parses"])
    assert "until the stand-in's empty reply stopped it (ValueError" in probe_row_reads(cfg, prompts)
