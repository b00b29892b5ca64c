"""An agent written against the ``openai`` client, trained by ``train_ppo`` through the endpoint
(docs/algorithms/agents.md).

The game is the retry example's (examples/multi_turn/retry.py), as agent code: ask the sum; a wrong answer gets
``higher`` or ``lower`` as the user's next message, and one retry. Reward 1.0 right first time, 0.5 right on the
retry, 0.0 otherwise. Nothing here knows about RL: the same function runs against any OpenAI-compatible server
(``python examples/agents/retry_agent.py --base-url http://localhost:8000/v1`` plays a few rows against one).

The file imports nothing the environment actors lack (``openai``, the standard library): it is loaded by spec,
``env.spec=examples/agents/retry_agent.py:run``.
"""

from __future__ import annotations

import re

FIRST, RETRY = 1.0, 0.5


def first_integer(text: str):
    match = re.search(r"-?\d+", text or "")
    return int(match.group()) if match else None


async def run(client, row) -> float:
    """One episode: ``row`` is the prompt row (``prompt``: the question as chat messages, ``answer``: the sum)."""
    messages = list(row["prompt"]) if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
    answer = int(row["answer"])
    for attempt in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        message = reply.choices[0].message
        got = first_integer(message.content)
        if got == answer:
            return FIRST if attempt == 0 else RETRY
        hint = "a number" if got is None else ("higher" if got < answer else "lower")
        messages += [message, {"role": "user", "content": hint}]
    return 0.0


if __name__ == "__main__":  # play against any OpenAI-compatible server
    import argparse
    import asyncio

    import openai

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    args = parser.parse_args()
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused")
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)} for a, b in ((3, 4), (12, 9))]
    print([asyncio.run(run(client, row)) for row in rows])
