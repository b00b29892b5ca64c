"""A tool-using agent written against the ``openai`` client: two-digit multiplication with a ``mul`` tool, trained by
``train_ppo`` through the endpoint (docs/algorithms/agents.md).

It is an ordinary tool-calling loop: the question and the tool's schema go to ``chat.completions.create``; while
the reply calls tools, each call is run and its result sent back as a ``tool`` message; a reply without calls is
the answer. Reward 1.0 if its first integer is the product, else 0.0 (a bad call gets an error result and the
agent goes on; a third call ends the episode with 0.0). Nothing here knows about RL: ``python
examples/agents/calculator_agent.py --base-url URL`` plays a few rows against any OpenAI-compatible server.

Loaded by spec in the environment actors (``env.spec=examples/agents/calculator_agent.py:run``): it imports only
the standard library (the client is given to it).
"""

from __future__ import annotations

import json
import re

#: the tool, as OpenAI's tools parameter takes it; the chat template writes it into the system turn
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "mul",
            "description": "a*b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
MAX_CALLS = 2


def first_integer(text):
    match = re.search(r"-?\d+", text or "")
    return int(match.group()) if match else None


def call_tool(name: str, arguments: str) -> str:
    """The tool's result for one call, or an error the model reads (never an exception: the agent goes on)."""
    if name != "mul":
        return f"error: no tool {name!r}"
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) * int(args["b"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {type(e).__name__}"


async def run(client, row) -> float:
    """One episode: ``row["prompt"]`` the question as chat messages, ``row["answer"]`` the product."""
    messages = list(row["prompt"])
    for _ in range(MAX_CALLS + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=48)
        message = reply.choices[0].message
        if not message.tool_calls:
            return float(first_integer(message.content) == int(row["answer"]))
        messages.append(message)
        for call in message.tool_calls:
            result = call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


if __name__ == "__main__":  # play against any OpenAI-compatible server with tool calls
    import argparse
    import asyncio

    import openai

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    args = parser.parse_args()
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused")
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}*{b}="}], "answer": str(a * b)} for a, b in ((37, 48), (12, 91))
    ]
    print([asyncio.run(run(client, row)) for row in rows])
