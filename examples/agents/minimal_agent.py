# my_agent.py
# The smallest agent run (docs/algorithms/agents.md, "Point an existing agent at the run"): it asks the sum its
# prompt row holds, asks the model to check it, and is rewarded when the checked answer is right.
CHECK = "Check it and reply with only the number."


async def run(client, row):  # or a plain def with a synchronous client
    messages = list(row["prompt"])  # the prompt column: the conversation the agent opens with
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message, {"role": "user", "content": CHECK}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    answer = (second.choices[0].message.content or "").strip()
    return float(answer == str(row["answer"]))  # or AgentResult(reward, info={...})
