"""The agent examples (examples/agents) against a scripted client that answers with the real ``openai`` response
types: the calculator agent's tool loop (a call run and its result sent back, a bad call answered with an error,
the call limit), the retry agent's hint and retry, and the calculator's warm-up rows rendered with the tools
template, the call trained on. The examples train for real with ``examples/agents/run.sh``; this keeps their code
from rotting between runs. No Ray, no server."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

AGENTS = Path(__file__).resolve().parents[2] / "examples" / "agents"


def _load(name: str):
    sys.path.insert(0, str(AGENTS))  # data.py imports the calculator agent's tool schema by name
    try:
        spec = importlib.util.spec_from_file_location(f"_example_{name}", AGENTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(AGENTS))


def _reply(content=None, calls=()):
    from openai.types.chat import ChatCompletion

    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for k, (name, arguments) in enumerate(calls)
        ]
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}
    return ChatCompletion.model_validate(
        {"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "policy", "choices": [choice]}
    )


class Scripted:
    """``client.chat.completions.create`` (async) answering with ``replies`` in order; records each request."""

    def __init__(self, *replies):
        self.replies, self.requests = list(replies), []
        self.chat = self.completions = self

    async def create(self, **request):
        self.requests.append(copy.deepcopy(request))
        return self.replies.pop(0)


ROW = {"prompt": [{"role": "user", "content": "37*48="}], "answer": "1776"}


def test_the_calculator_agent_runs_the_call_and_sends_its_result_back():
    agent = _load("calculator_agent")
    client = Scripted(_reply(calls=[("mul", json.dumps({"a": 37, "b": 48}))]), _reply("1776"))
    assert asyncio.run(agent.run(client, ROW)) == 1.0
    first, second = client.requests
    assert first["tools"] == agent.TOOLS and first["messages"] == ROW["prompt"]
    call_turn, result = second["messages"][1:]
    assert call_turn.tool_calls[0].function.name == "mul"  # the client's own message object, echoed
    assert result == {"role": "tool", "tool_call_id": "call_0", "content": "1776"}


def test_a_bad_call_gets_an_error_result_and_the_call_limit_ends_the_episode():
    agent = _load("calculator_agent")
    bad = [("mul", "not json"), ("add", "{}"), ("mul", '{"a": 1}')]
    client = Scripted(*[_reply(calls=[c]) for c in bad])
    assert asyncio.run(agent.run(client, ROW)) == 0.0
    assert len(client.requests) == agent.MAX_CALLS + 1
    results = [m["content"] for m in client.requests[-1]["messages"] if isinstance(m, dict) and m["role"] == "tool"]
    assert results == ["error: JSONDecodeError", "error: no tool 'add'"]
    assert agent.call_tool("mul", '{"a": 1}') == "error: KeyError"
    wrong = Scripted(_reply("1700"))  # an answer without a call: scored on its first integer
    assert asyncio.run(agent.run(wrong, ROW)) == 0.0


@pytest.mark.parametrize("answers, reward", [(["7"], 1.0), (["5", "7"], 0.5), (["5", "9"], 0.0)])
def test_the_retry_agent_hints_and_retries_once(answers, reward):
    agent = _load("retry_agent")
    client = Scripted(*[_reply(a) for a in answers])
    row = {"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"}
    assert asyncio.run(agent.run(client, row)) == reward
    if len(answers) > 1:
        assert client.requests[1]["messages"][-1] == {"role": "user", "content": "higher"}


def test_the_calculator_warm_up_rows_train_on_the_call_and_the_copied_result(tiny_model):
    from transformers import AutoTokenizer

    from rlhf.data.chat import ChatFormatter
    from rlhf.models.tiny import TOOLS_CHAT_TEMPLATE

    data = _load("data")
    rows = data.calculator_sft_rows(40, seed=0)
    called = [r for r in rows if len(r["messages"]) == 4]
    assert 10 < len(called) < 40  # both kinds: calls (60%) and direct answers
    chat = ChatFormatter(AutoTokenizer.from_pretrained(tiny_model), template=TOOLS_CHAT_TEMPLATE)
    row = called[0]
    a, b = json.loads(row["messages"][1]["tool_calls"][0]["function"]["arguments"]).values()
    assert row["messages"][0]["content"] == f"{a}*{b}=" and row["messages"][-1]["content"] == str(a * b)
    enc = chat.encode(row["messages"], [1, 3], tools=row["tools"])
    trained = chat.tokenizer.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m])
    call = json.dumps({"name": "mul", "arguments": {"a": a, "b": b}})
    assert trained == f"<tool_call>\n{call}\n</tool_call><|im_end|>{a * b}<|im_end|>"
    prompts = data.calculator_prompt_rows(8, seed=1)
    for r in prompts:
        x, y = r["prompt"][0]["content"].rstrip("=").split("*")
        assert int(r["answer"]) == int(x) * int(y)


def test_the_docs_minimal_agent_is_the_example_file():
    """docs/algorithms/agents.md shows examples/agents/minimal_agent.py as its my_agent.py, whole: the page's
    commands (dry-run in test_submit_commands.py) run the example a user copies."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "algorithms" / "agents.md").read_text(encoding="utf-8")
    shown = re.search(r"```python\n(# my_agent\.py.*?)```", page, re.S)
    assert shown is not None
    assert shown.group(1) == (root / "examples" / "agents" / "minimal_agent.py").read_text(encoding="utf-8")
