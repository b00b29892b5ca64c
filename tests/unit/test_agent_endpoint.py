"""The agent endpoint (rlhf/rollout/openai/endpoint.py) with the real ``openai`` client, the real HTTP server and vLLM's
renderer on the tiny model; the engines are a stand-in that samples fixed tokens (the endpoint's own logic under
test: token-in chaining, per-request seeds, batching, errors). Real engines: tests/integration/
test_agent_endpoint_engines.py and test_agent_training.py."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace as dataclasses_replace

import pytest

from rlhf.envs.agents import AgentResult, run_agents
from rlhf.rollout.episodes import EpisodeError
from rlhf.rollout.openai.endpoint import AgentEndpoint
from rlhf.rollout.types import Generation, SamplingSpec


class Engines:
    """Answers a request of seed s with ``words[s % len(words)]``, then the chat template's end of turn (as the
    policy stops on it); records the prompts, seeds and lengths asked."""

    def __init__(self, tokenizer, words):
        self.tokenizer, self.words = tokenizer, words
        self.calls: list = []
        self.hold = None

    def generate_each(self, prompt_ids, samplings):
        if self.hold is not None:  # the first call waits (as a busy engine would) until the others have queued
            hold, self.hold = self.hold, None
            hold(len(prompt_ids))
        self.calls.append([(tuple(p), s.seed, s.max_new_tokens) for p, s in zip(prompt_ids, samplings)])
        out = []
        for p, s in zip(prompt_ids, samplings):
            text = self.words[(s.seed or 0) % len(self.words)]
            end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [end]
            ids = ids[: s.max_new_tokens]
            out.append(Generation(tuple(p), tuple(ids), tuple(-0.5 - 0.01 * i for i in range(len(ids))), "stop"))
        return out


@pytest.fixture(scope="module")
def renderer(tiny_model):
    from rlhf.rollout.openai.render import OpenAIRenderer

    return OpenAIRenderer(tiny_model, served_model_name="policy")


@pytest.fixture()
def endpoint(renderer):
    engines = Engines(renderer.tokenizer, ["12", "7 + 5", "hello there"])
    stops = (renderer.tokenizer.eos_token_id, renderer.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    sampling = SamplingSpec(max_new_tokens=16, temperature=1.0, stop_token_ids=stops)
    with AgentEndpoint(renderer, engines.generate_each, sampling) as endpoint:
        endpoint.engines = engines
        yield endpoint


def _render(tokenizer, messages):
    """The whole conversation rendered by the chat template and tokenized in one piece."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _client(url):
    import openai

    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)


def test_a_conversation_is_trained_on_the_tokens_the_engine_saw_and_sampled(endpoint, renderer):
    url = endpoint.open(index=3, seed=100, budget=400)
    client = _client(url)
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    first = client.chat.completions.create(model="policy", messages=messages)
    assert first.choices[0].message.content == "7 + 5"  # seed 100 -> words[100 % 3]
    messages += [first.choices[0].message]  # the client's own message object, echoed as agents do
    messages += [{"role": "user", "content": "Are you sure?"}]
    second = client.chat.completions.create(model="policy", messages=messages, temperature=0.1, max_tokens=40)
    assert second.choices[0].message.content == "hello there"  # seed 101: the episode's second request
    transcript = endpoint.close(url).transcript
    assert [e.continues for e in transcript.exchanges] == [False, True] and not transcript.breaks
    (call1,), (call2,) = endpoint.engines.calls
    tok = renderer.tokenizer
    # the first prompt is the chat template's render; the second extends prompt + sampled reply exactly
    assert list(call1[0]) == _render(tok, messages[:1])
    assert call2[0][: len(call1[0])] == call1[0]
    reply1 = transcript.exchanges[0].response_ids
    assert call2[0][len(call1[0]) : len(call1[0]) + len(reply1)] == reply1
    # here re-rendering the text would give the same ids (no drift): the chain equals the whole render
    messages[1] = {"role": "assistant", "content": first.choices[0].message.content}
    assert list(call2[0]) == _render(tok, messages)
    assert call2[1:] == (101, 16)  # its own seed; max_tokens 40 capped by rollout.max_new_tokens (16)
    episode = transcript.episode()
    assert episode.token_ids == call2[0] + transcript.exchanges[1].response_ids
    assert [s.source for s in episode.segments] == ["policy", "env", "policy"]
    assert episode.segments[2].logps == transcript.exchanges[1].response_logps


def test_a_rewritten_history_breaks_the_chain_and_is_named(endpoint):
    url = endpoint.open(index=5, seed=0, budget=400)
    client = _client(url)
    messages = [{"role": "user", "content": "Hi"}]
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    rewritten = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": reply}]
    client.chat.completions.create(model="policy", messages=rewritten + [{"role": "user", "content": "and?"}])
    transcript = endpoint.close(url).transcript
    assert transcript.breaks == ["request 2: message 1 differs from the one sent before (the agent rewrote it)"]
    with pytest.raises(EpisodeError, match="episode 5: request 2: message 1 differs"):
        transcript.episode()
    truncated = transcript.episode("truncate")
    assert truncated.truncated and truncated.turns == 1


def test_concurrent_episodes_are_batched_and_keep_their_own_seeds(endpoint):
    urls = [endpoint.open(index=i, seed=10 * i, budget=400) for i in range(6)]
    answers = {}

    def agent(i, url):
        out = _client(url).chat.completions.create(model="policy", messages=[{"role": "user", "content": str(i)}])
        answers[i] = out.choices[0].message.content

    def others_queued(taken):
        deadline = time.monotonic() + 30
        while endpoint.batcher.pending.qsize() < len(urls) - taken and time.monotonic() < deadline:
            time.sleep(0.01)

    endpoint.engines.hold = others_queued
    threads = [threading.Thread(target=agent, args=(i, u)) for i, u in enumerate(urls)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    assert answers == {i: ["12", "7 + 5", "hello there"][(10 * i) % 3] for i in range(6)}
    # the first call's requests, then all the others, which queued while the engines were busy, in one call
    assert len(endpoint.engines.calls) == 2 and sum(len(c) for c in endpoint.engines.calls) == len(urls)
    assert sorted(seed for call in endpoint.engines.calls for _, seed, _ in call) == [0, 10, 20, 30, 40, 50]
    # agent/endpoint_s is wall time, within the agents' own; the requests' summed seconds count the overlap (the 5
    # requests queued together) 5 times: measured 0.14-0.27 s of wall time against 0.42-0.49 s summed
    assert 0 < endpoint.busy.seconds() <= elapsed and endpoint.busy.seconds() < endpoint.stats.seconds


def test_the_busy_clock_is_the_union_of_the_requests_intervals_not_their_sum():
    """agent/endpoint_s: requests over [0, 3], [1, 2] and [5, 6.5] are 4.5 s of wall time (their sum: 5.5 s); a
    span still open counts up to now."""
    from rlhf.rollout.openai.endpoint import BusyClock

    now = [0.0]
    clock = BusyClock(lambda: now[0])
    first, second = clock.busy(), clock.busy()
    first.__enter__()  # t = 0
    now[0] = 1.0
    second.__enter__()
    now[0] = 2.0
    second.__exit__(None, None, None)
    assert clock.seconds() == 2.0  # the first request is still in flight
    now[0] = 3.0
    first.__exit__(None, None, None)
    now[0] = 5.0
    assert clock.seconds() == 3.0  # idle from 3 to 5: not counted
    with clock.busy():
        now[0] = 6.5
    assert clock.seconds() == 4.5 and clock.active == 0
    with pytest.raises(RuntimeError), clock.busy():  # a request that fails still leaves
        now[0] = 7.0
        raise RuntimeError("the engines died")
    assert clock.seconds() == 5.0 and clock.active == 0


def test_errors_come_back_as_openai_errors(endpoint):
    import openai

    url = endpoint.open(index=0, seed=0, budget=400)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        _client(url).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.BadRequestError, match="stop") as refused:  # the engines cannot stop on strings
        _client(url).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], stop=["."])
    assert refused.value.body["param"] == "stop"
    endpoint.close(url)
    with pytest.raises(openai.NotFoundError, match="no open episode"):
        _client(url).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    capped = endpoint.open(index=2, seed=0, budget=400, max_requests=1)  # rollout.max_turns
    first = _client(capped).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    again = [{"role": "user", "content": "x"}, first.choices[0].message, {"role": "user", "content": "y"}]
    with pytest.raises(openai.BadRequestError, match=r"episode 2 has made its 1 requests \(rollout.max_turns\)"):
        _client(capped).chat.completions.create(model="policy", messages=again)
    tight = endpoint.open(index=1, seed=0, budget=5)
    with pytest.raises(openai.BadRequestError, match="no room left in its 5-token budget"):
        _client(tight).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])


def test_a_completion_chain_sent_as_token_ids_is_trained_on_the_tokens_sampled(endpoint, renderer):
    tok = renderer.tokenizer
    url = endpoint.open(index=4, seed=100, budget=400)
    client = _client(url)
    question = "Q: What is 7 + 5?\nA:"
    first = client.completions.create(model="policy", prompt=question, extra_body={"return_token_ids": True})
    assert first.choices[0].text == "7 + 5"  # seed 100 -> words[100 % 3], its stop token left out of the text
    prompt1, reply1 = list(first.choices[0].prompt_token_ids), list(first.choices[0].token_ids)
    assert prompt1 == tok(question, add_special_tokens=False)["input_ids"]  # the text prompt, tokenized as it is
    assert reply1[-1] == tok.convert_tokens_to_ids("<|im_end|>")  # the ids returned include the stop token
    observation = tok("\nQ: Are you sure?\nA:", add_special_tokens=False)["input_ids"]
    second = client.completions.create(
        model="policy", prompt=prompt1 + reply1 + observation, max_tokens=40, extra_body={"return_token_ids": True}
    )
    assert second.choices[0].text == "hello there"  # seed 101: the episode's second request
    transcript = endpoint.close(url).transcript
    assert [e.continues for e in transcript.exchanges] == [False, True] and not transcript.breaks
    assert [e.messages for e in transcript.exchanges] == [(), ()]
    (call1,), (call2,) = endpoint.engines.calls
    assert call1[1:] == (100, 16) and call2 == (tuple(prompt1 + reply1 + observation), 101, 16)  # cap: 16
    episode = transcript.episode()
    assert episode.token_ids == call2[0] + tuple(second.choices[0].token_ids)
    assert [s.source for s in episode.segments] == ["policy", "env", "policy"]
    assert episode.segments[1].ids == tuple(observation)
    assert episode.segments[0].logps == transcript.exchanges[0].response_logps


def test_a_completion_text_prompt_that_appends_the_reply_text_drifts_and_the_break_is_named(endpoint, renderer):
    tok = renderer.tokenizer
    url = endpoint.open(index=6, seed=100, budget=400)
    client = _client(url)
    question = "Q: What is 7 + 5?\nA:"
    reply = client.completions.create(model="policy", prompt=question).choices[0].text
    client.completions.create(model="policy", prompt=question + reply + "\nQ: Are you sure?\nA:")
    transcript = endpoint.close(url).transcript
    assert [e.continues for e in transcript.exchanges] == [False, False]
    # the text leaves out the sampled stop token: the prompts part where it stood, after the question and reply
    at = len(tok(question, add_special_tokens=False)["input_ids"]) + len(
        tok(reply, add_special_tokens=False)["input_ids"]
    )
    assert transcript.breaks == [
        f"request 2: its prompt does not extend the last request's prompt and reply: they differ at token {at} "
        f"(of the {at + 1} it must start with)"
    ]
    with pytest.raises(EpisodeError, match="episode 6: request 2: its prompt does not extend"):
        transcript.episode()
    assert transcript.episode("truncate").turns == 1


def test_completion_asks_an_episode_cannot_hold_are_refused_by_field(endpoint):
    import openai

    url = endpoint.open(index=0, seed=0, budget=400)
    with pytest.raises(openai.BadRequestError, match="n must be 1") as refused:
        _client(url).completions.create(model="policy", prompt="x", n=2)
    assert refused.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="one prompt") as refused:
        _client(url).completions.create(model="policy", prompt=["x", "y"])
    assert refused.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="stop") as refused:
        _client(url).completions.create(model="policy", prompt="x", stop=["."])
    assert refused.value.body["param"] == "stop"
    assert endpoint.engines.calls == [] and endpoint.close(url).transcript.exchanges == []


def test_a_chat_request_after_a_completion_breaks_the_chain_and_says_why(endpoint):
    url = endpoint.open(index=2, seed=0, budget=400)
    client = _client(url)
    client.completions.create(model="policy", prompt="Hi")
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
    transcript = endpoint.close(url).transcript
    assert transcript.breaks == ["request 2: a chat request after a completion request (prompt tokens)"]


def test_a_streamed_request_is_the_same_reply_and_continues_the_chain(endpoint, renderer):
    """``stream=true`` (chat and completions): the reply the client accumulates from the chunks, its finish reason,
    log-probs, token ids and usage are the unstreamed request's; the episode records it the same way, so the next
    request continues its chain. Errors are plain JSON errors, as without streaming."""
    import openai

    url = endpoint.open(index=1, seed=100, budget=400)
    client = _client(url)
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    ask = dict(model="policy", messages=messages, logprobs=True, extra_body={"return_token_ids": True})
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    said = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in said) == "7 + 5"  # seed 100, as unstreamed
    assert [c.choices[0].finish_reason for c in said] == [None, "stop"] and said[0].choices[0].delta.role == "assistant"
    plain = _client(endpoint.open(index=2, seed=100, budget=400)).chat.completions.create(**ask)
    assert said[0].choices[0].logprobs.content == plain.choices[0].logprobs.content
    assert said[0].choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert said[0].model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    messages += [{"role": "assistant", "content": "7 + 5"}, {"role": "user", "content": "Are you sure?"}]
    again = client.chat.completions.create(model="policy", messages=messages, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == "hello there"  # seed 101
    transcript = endpoint.close(url).transcript
    assert [e.continues for e in transcript.exchanges] == [False, True] and not transcript.breaks
    completion = _client(endpoint.open(index=3, seed=100, budget=400))
    text = [c.choices[0].text for c in completion.completions.create(model="policy", prompt="Q:", stream=True)]
    assert text == ["7 + 5", ""]
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        completion.chat.completions.create(model="policy", messages=messages, n=2, stream=True)


def test_a_streamed_tool_call_accumulates_to_the_unstreamed_message(renderer, tiny_model):
    """With tools and the hermes parser, the openai client's own stream accumulator
    (``client.chat.completions.stream``) ends with the same tool call as the unstreamed request."""
    from rlhf.rollout.openai.render import TOOLS_CHAT_TEMPLATE, OpenAIRenderer

    hermes = OpenAIRenderer(tiny_model, tool_parser="hermes", chat_template=TOOLS_CHAT_TEMPLATE, served_model_name="p")
    call = '<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    engines = Engines(hermes.tokenizer, [call])
    stops = (hermes.tokenizer.eos_token_id, hermes.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    tools = [{"type": "function", "function": {"name": "mul", "parameters": {"type": "object", "properties": {}}}}]
    ask = dict(model="p", messages=[{"role": "user", "content": "3*4="}], tools=tools)
    with AgentEndpoint(hermes, engines.generate_each, SamplingSpec(max_new_tokens=96, stop_token_ids=stops)) as ep:
        plain = _client(ep.open(index=0, seed=0, budget=400)).chat.completions.create(**ask)
        with _client(ep.open(index=1, seed=0, budget=400)).chat.completions.stream(**ask) as stream:
            streamed = stream.get_final_completion()
    (expected,), (got,) = plain.choices[0].message.tool_calls, streamed.choices[0].message.tool_calls
    assert (got.function.name, got.function.arguments) == (expected.function.name, expected.function.arguments)
    assert got.function.arguments == '{"a": 3, "b": 4}' and got.id  # an id to answer it with (each request's own)
    assert streamed.choices[0].finish_reason == plain.choices[0].finish_reason == "tool_calls"


def test_stream_chunks_carry_every_field_of_the_reply():
    from openai.types.chat import ChatCompletionChunk

    from rlhf.rollout.openai.stream import chat_chunks, completion_chunks, events, take_stream

    body = {"messages": [], "stream": True, "stream_options": {"include_usage": True}}
    assert take_stream(body) == (True, True) and body == {"messages": []}
    assert take_stream({"stream": False, "stream_options": {}}) == (False, False)  # the renderer's to refuse
    message = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "think",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    head = {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "prompt_token_ids": [1, 2]}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls", "token_ids": [5]}
    chunks = chat_chunks({**head, "choices": [choice], "usage": {"prompt_tokens": 2}})
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert [c.object for c in parsed] == ["chat.completion.chunk"] * 2
    delta = parsed[0].choices[0].delta
    assert delta.tool_calls[0].index == 0 and delta.tool_calls[0].function.name == "f"
    assert delta.model_extra["reasoning_content"] == "think" and parsed[0].choices[0].model_extra["token_ids"] == [5]
    assert parsed[1].choices[0].finish_reason == "tool_calls" and parsed[0].model_extra["prompt_token_ids"] == [1, 2]
    texts = completion_chunks({**head, "choices": [{"index": 0, "text": "4", "finish_reason": "stop"}]}, True)
    assert [c["choices"] for c in texts][:2] == [
        [{"index": 0, "text": "4", "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}],
    ]
    assert texts[-1]["choices"] == [] and texts[-1]["usage"] is None
    lines = list(events(chunks))
    assert lines[-1] == "data: [DONE]\n\n" and all(line.startswith("data: {") for line in lines[:-1])


def test_an_echoed_reply_compares_equal_whatever_the_client_adds_or_reformats():
    from rlhf.rollout.transcripts import normalise

    returned = {
        "role": "assistant",
        "content": None,
        "reasoning": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}],
    }
    echoed = {  # as a client sends its message object back: other ids, fields of its own, compact JSON
        "role": "assistant",
        "content": "",
        "annotations": [],
        "refusal": None,
        "tool_calls": [{"id": "x", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}],
    }
    assert normalise(echoed) == normalise(returned)
    changed = dict(echoed, tool_calls=[{"function": {"name": "add", "arguments": '{"a": 2}'}}])
    assert normalise(changed) != normalise(returned)


# ---------------------------------------------------------------------------------------------------------------
# Agent functions as the environment actors run them (rlhf.envs.agents.run_agents), against this endpoint
# ---------------------------------------------------------------------------------------------------------------


async def _async_agent(client, row):
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["q"]}])
    if row["q"] == "hang":
        await asyncio.sleep(60)
    if row["q"] == "raise":
        raise RuntimeError("the tool is down")
    return AgentResult(len(reply.choices[0].message.content), info={"q": row["q"]}) if row["q"] != "bool" else True


# Lets the hung thread of _sync_agent go once its test is done: a thread still asleep held its test process's exit
# (the interpreter joins the agents' pool threads) for up to a minute.
_RELEASE_HUNG = threading.Event()


def _sync_agent(client, row):
    if row["q"] == "hang":
        _RELEASE_HUNG.wait(60)  # hung past any timeout here, until the test releases it
        return 0.0
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["q"]}])
    return float(len(reply.choices[0].message.content))


@pytest.mark.parametrize("agent", [_async_agent, _sync_agent])
def test_agents_run_at_once_and_each_failure_names_its_episode(endpoint, agent):
    rows = [{"q": "ok"}, {"q": "hang"}, {"q": "raise"}, {"q": "bool"}, {"q": "fine"}]
    urls = [endpoint.open(index=i, seed=10 * i, budget=400) for i in range(len(rows))]
    started = time.perf_counter()
    _RELEASE_HUNG.clear()
    try:
        results, stuck = run_agents(agent, "agents.py:run", list(enumerate(zip(urls, rows))), timeout_s=2.0)
    finally:
        _RELEASE_HUNG.set()
    assert time.perf_counter() - started < 6  # all at once: one timeout, not one per agent
    words = ["12", "7 + 5", "hello there"]
    assert results[0].reward == len(words[0]) and results[4].reward == len(words[40 % 3])
    assert "ran for more than 2 s (env.step_timeout_s) (episode 1)" in str(results[1])
    if agent is _async_agent:
        assert results[0].info == {"q": "ok"} and not stuck  # a hung coroutine is cancelled
        assert "raised RuntimeError: the tool is down (episode 2)" in str(results[2])
        assert "returned a bad result: an agent's reward must be a finite real number (not a bool" in str(results[3])
    else:
        assert stuck  # a hung thread cannot be stopped: its actor must be replaced
    for url in urls:
        endpoint.close(url)


def test_a_template_that_drops_earlier_reasoning_breaks_the_chain_at_the_token_it_rewrites():
    """Qwen3's template drops an assistant turn's <think> block once a later user turn follows (prime-rl #1334,
    verl #6719): re-rendering the conversation no longer extends the tokens sampled, and the break says where."""
    import re

    from rlhf.rollout.transcripts import EpisodeTranscript, Exchange, normalise

    def render(messages, tools, add_generation_prompt):  # characters as token ids
        text = ""
        for i, m in enumerate(messages):
            content = m["content"]
            if m["role"] == "assistant" and i < len(messages) - 1:
                content = re.sub(r"<think>.*?</think>", "", content)
            text += f"<{m['role']}>{content}</end>"
        return [ord(c) for c in text + ("<assistant>" if add_generation_prompt else "")]

    transcript = EpisodeTranscript(index=4)
    first = [{"role": "user", "content": "2+2="}]
    prompt, _ = transcript.prompt_for(first, None, render(first, None, True), render, [ord(c) for c in "</end>"])
    reply = {"role": "assistant", "content": "<think>easy</think>4"}
    sampled = tuple(ord(c) for c in reply["content"] + "</end>")
    transcript.add(Exchange(tuple(prompt), sampled, (-0.1,) * len(sampled), "stop", (normalise(first[0]),),
                            normalise(reply), False))  # fmt: skip
    second = [*first, reply, {"role": "user", "content": "sure?"}]
    whole, continues = transcript.prompt_for(
        second, None, render(second, None, True), render, [ord(c) for c in "</end>"]
    )
    assert not continues and whole == render(second, None, True)  # the engine gets the template's render
    at = len("<user>2+2=</end><assistant>")  # where <think> was
    assert transcript.breaks == [
        "request 2: the chat template renders the conversation so far differently once message 3 follows (it "
        f"rewrites earlier turns: the renders differ at token {at} of {len(render(second[:2], None, False))})"
    ]
    transcript.add(Exchange(tuple(whole), (1,), (-0.2,), "stop", (), "", continues))
    with pytest.raises(EpisodeError, match="episode 4: request 2: the chat template renders"):
        transcript.episode()
    assert transcript.episode("truncate").turns == 1  # the chain up to the rewrite


# ---------------------------------------------------------------------------------------------------------------
# A step's episodes (rlhf.rollout.agent.AgentRollout) over this endpoint, the agents run in this process
# ---------------------------------------------------------------------------------------------------------------


class LocalPool:
    """The environment pool's ``run_agents`` as its actors run it (rlhf.envs.agents.run_agents), in this process."""

    def __init__(self, agent):
        self.agent = agent

    def run_agents(self, urls, rows, errors="raise"):
        results, _ = run_agents(self.agent, "agents.py:run", list(enumerate(zip(urls, rows))), timeout_s=30.0)
        return results


async def _asks_twice(client, row):
    """Asks, then asks again after the reply; ``row["rewrite"]``: with its first message changed (a broken chain)."""
    messages = [{"role": "user", "content": row["q"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    if row["rewrite"]:
        messages = [{"role": "user", "content": row["q"] + "!"}]
    messages += [first.choices[0].message, {"role": "user", "content": "sure?"}]
    await client.chat.completions.create(model="policy", messages=messages)
    return 1.0


def test_a_steps_broken_chains_are_counted_every_step_zero_when_none(endpoint, renderer):
    from rlhf.rollout.agent import AgentRollout
    from rlhf.rollout.prompts import PromptSet

    rows = [{"q": "2 + 2", "rewrite": False}, {"q": "3 + 4", "rewrite": True}]
    prompts = PromptSet([[1, 2], [3, 4]], ["a", "b"], {}, 0, 0, env_rows=rows)
    episodes = AgentRollout(LocalPool(_asks_twice), endpoint, renderer.tokenizer, 400, 4, "truncate", "fail")
    sampling = dataclasses_replace(endpoint.sampling, seed=7)
    started = time.perf_counter()
    broken = episodes(None, prompts, [0, 1, 1, 0], sampling, step=1).metrics
    elapsed = time.perf_counter() - started
    assert broken["episode/broken_chains"] == 2.0  # both episodes of row 1
    assert broken["episode/ended_prefix_mismatch"] == 0.5  # the same episodes, as a share: cut by truncate
    assert broken["agent/requests"] == 8 and 0 < broken["agent/endpoint_s"] <= elapsed
    assert broken["agent/request_s_sum"] > 0
    whole = episodes(None, prompts, [0, 0], sampling, step=2).metrics
    assert whole["episode/broken_chains"] == 0.0 and whole["episode/ended_prefix_mismatch"] == 0.0  # logged: 0
    assert whole["agent/requests"] == 4  # this step's requests only
