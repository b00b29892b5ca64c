"""The OpenAI rendering layer (rlhf.rollout.openai.render) with vLLM's real renderer and derenderer on the tiny model:
prompts equal the tokenizer's own chat template, responses carry exactly the sampled ids and log-probs, hermes tool
calls are parsed, bad requests come back as vLLM's error responses. No engine, no Ray."""

from __future__ import annotations

import json
import shutil

import pytest

from rlhf.rollout.openai.render import TOOLS_CHAT_TEMPLATE, OpenAIRenderer, RenderError
from rlhf.rollout.types import Generation

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
USER = [{"role": "user", "content": "12+7="}]


@pytest.fixture(scope="module")
def plain(tiny_model):
    """The tokenizer's own template, no tool parser."""
    return OpenAIRenderer(tiny_model, served_model_name="tiny")


@pytest.fixture(scope="module")
def hermes(tiny_model):
    return OpenAIRenderer(tiny_model, tool_parser="hermes", chat_template=TOOLS_CHAT_TEMPLATE, served_model_name="tiny")


def _template_ids(tokenizer, messages, **kwargs):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return tuple(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _ids(tokenizer, text):
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def test_construction_reads_no_weights_and_starts_no_process(tiny_model, tmp_path):
    import psutil

    no_weights = tmp_path / "config_only"
    shutil.copytree(tiny_model, no_weights, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    renderer = OpenAIRenderer(str(no_weights), max_model_len=64)  # would fail on the first weight it tried to read
    # none started; one that was there may have ended meanwhile (an earlier test's Ray processes, in this process)
    assert {p.pid for p in psutil.Process().children(recursive=True)} - children == set()
    rendered = renderer.render_chat({"messages": USER})
    assert rendered.prompt_ids == _template_ids(renderer.tokenizer, USER)
    assert rendered.sampling.max_tokens == 64 - len(rendered.prompt_ids)  # the engine's context, not the model's


def test_chat_prompt_is_the_tokenizers_chat_template(plain, hermes):
    rendered = plain.render_chat({"model": "anything", "messages": USER})
    assert rendered.prompt_ids == _template_ids(plain.tokenizer, USER)
    assert rendered.conversation == USER

    # with tools, and a history holding an assistant's call and the tool's answer
    history = USER + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 7}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "19"},
    ]
    for messages in (USER, history):
        rendered = hermes.render_chat({"messages": messages, "tools": [ADD_TOOL]})
        expected = _template_ids(hermes.tokenizer, messages, tools=[ADD_TOOL], chat_template=TOOLS_CHAT_TEMPLATE)
        assert rendered.prompt_ids == expected
    text = hermes.tokenizer.decode(rendered.prompt_ids)
    assert '"name": "add"' in text and '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 7}}' in text
    assert "<tool_response>\n19\n</tool_response>" in text


def test_chat_response_returns_the_sampled_ids_and_logprobs(hermes):
    tok = hermes.tokenizer
    rendered = hermes.render_chat({"messages": USER, "n": 2, "logprobs": True, "return_token_ids": True})
    done = _ids(tok, "19") + (tok.eos_token_id,)
    cut = _ids(tok, "1+2")  # hit max_tokens: no stop token to hide
    gens = [
        Generation(rendered.prompt_ids, done, (-0.5, -0.25, -0.125), "stop"),
        Generation(rendered.prompt_ids, cut, (-1.0, -2.0, -4.0), "length"),
    ]
    out = hermes.chat_response(rendered, gens, request_id="chatcmpl-1", created=1700000000)

    assert (out["id"], out["object"], out["created"], out["model"]) == (
        "chatcmpl-1",
        "chat.completion",
        1700000000,
        "tiny",
    )
    assert out["prompt_token_ids"] == list(rendered.prompt_ids)
    first, second = out["choices"]
    # a tool parser keeps special tokens in the text it parses: the EOS is still left out, as vLLM's detokenizer does
    assert (first["message"]["content"], first["finish_reason"], first["stop_reason"]) == ("19", "stop", None)
    assert (second["message"]["content"], second["finish_reason"]) == ("1+2", "length")
    for choice, gen in zip(out["choices"], gens):
        assert choice["token_ids"] == list(gen.response_ids)  # the EOS included: the trainer scores it
        assert [c["logprob"] for c in choice["logprobs"]["content"]] == list(gen.response_logps)
        assert "tool_calls" not in choice["message"]
    assert [c["token"] for c in first["logprobs"]["content"]] == ["1", "9", tok.eos_token]
    n_prompt = len(rendered.prompt_ids)
    assert out["usage"]["prompt_tokens"] == n_prompt
    assert out["usage"]["completion_tokens"] == 6
    assert out["usage"]["total_tokens"] == n_prompt + 6

    # not asked: no ids, no log-probs
    rendered = hermes.render_chat({"messages": USER})
    out = hermes.chat_response(rendered, gens[:1], request_id="chatcmpl-2", created=0)
    assert out["prompt_token_ids"] is None
    assert out["choices"][0]["token_ids"] is None and out["choices"][0]["logprobs"] is None


def test_a_stop_token_other_than_eos_is_hidden_and_reported(hermes):
    tok = hermes.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    rendered = hermes.render_chat({"messages": USER})
    gen = Generation(rendered.prompt_ids, _ids(tok, "19") + (im_end,), (-0.5, -0.5, -0.5), "stop")
    choice = hermes.chat_response(rendered, [gen], "c", 0, stop_token_ids=(im_end,))["choices"][0]
    assert (choice["message"]["content"], choice["stop_reason"]) == ("19", im_end)
    # a response that is its stop token alone has empty text
    gen = Generation(rendered.prompt_ids, (tok.eos_token_id,), (-0.5,), "stop")
    assert hermes.chat_response(rendered, [gen], "c", 0)["choices"][0]["message"]["content"] == ""


def test_hermes_tool_call_is_parsed(hermes):
    tok = hermes.tokenizer
    rendered = hermes.render_chat({"messages": USER, "tools": [ADD_TOOL], "return_token_ids": True})
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    ids = _ids(tok, call) + (tok.eos_token_id,)
    gen = Generation(rendered.prompt_ids, ids, tuple(-0.5 for _ in ids), "stop")
    (choice,) = hermes.chat_response(rendered, [gen], "c", 0)["choices"]

    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["function"]["name"] == "add"
    assert json.loads(tool_call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "tool_calls"  # OpenAI's, for calls made under tool_choice="auto"
    assert choice["token_ids"] == list(ids)

    # tool_choice="none": the same text is content, not a call
    rendered = hermes.render_chat({"messages": USER, "tools": [ADD_TOOL], "tool_choice": "none"})
    (choice,) = hermes.chat_response(rendered, [gen], "c", 0)["choices"]
    assert choice["message"]["content"] == call and "tool_calls" not in choice["message"]


def test_completion_with_text_and_token_id_prompts(plain):
    tok = plain.tokenizer
    rendered = plain.render_completion({"prompt": "12+7=", "max_tokens": 4, "logprobs": 0, "return_token_ids": True})
    assert rendered.prompt_ids == (tuple(tok("12+7=")["input_ids"]),)
    assert rendered.sampling[0].max_tokens == 4

    prompts = [[1, 20, 14], [1, 21]]
    rendered = plain.render_completion({"prompt": prompts, "n": 2, "return_token_ids": True, "logprobs": 0})
    assert rendered.prompt_ids == tuple(tuple(p) for p in prompts)
    nine = _ids(tok, "9")
    gens = [
        [Generation(tuple(p), nine + (tok.eos_token_id,), (-0.5, -0.25), "stop") for _ in range(2)] for p in prompts
    ]
    out = plain.completion_response(rendered, gens, request_id="cmpl-1", created=5)
    assert out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for choice, prompt in zip(out["choices"], [prompts[0], prompts[0], prompts[1], prompts[1]]):
        assert (choice["text"], choice["finish_reason"]) == ("9", "stop")
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == list(nine) + [tok.eos_token_id]
        assert choice["logprobs"]["token_logprobs"] == [-0.5, -0.25]
    assert out["usage"] == {**out["usage"], "prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}


def test_sampling_asks_are_resolved_and_training_overrides_the_distribution(plain, hermes):
    body = {"messages": USER, "temperature": 0.2, "top_p": 0.5, "seed": 7, "max_tokens": 5, "stop_token_ids": [9]}
    rendered = plain.render_chat(body)
    ask = rendered.sampling
    assert (ask.temperature, ask.top_p, ask.seed, ask.max_tokens, ask.stop_token_ids) == (0.2, 0.5, 7, 5, (9,))
    spec = ask.sampling_spec(temperature=1.0, top_p=1.0, top_k=-1)
    assert (spec.temperature, spec.top_p, spec.top_k) == (1.0, 1.0, -1)  # the run's, not the request's
    assert (spec.max_new_tokens, spec.seed, spec.stop_token_ids) == (5, 7, (9,))
    # no max_tokens: the context the prompt leaves (vLLM's rule)
    assert plain.render_chat({"messages": USER}).sampling.max_tokens == (
        plain.model_config.max_model_len - len(rendered.prompt_ids)
    )
    refused = (
        (plain, {"stop": ["\n"]}, "stop"),
        (plain, {"presence_penalty": 0.5}, "presence_penalty"),
        (plain, {"response_format": {"type": "json_object"}}, "response_format"),
        (hermes, {"tools": [ADD_TOOL], "tool_choice": "required"}, "tool_choice"),  # needs guided decoding
    )
    for renderer, extra, field in refused:
        with pytest.raises(RenderError) as caught:
            renderer.render_chat({"messages": USER, **extra}).sampling.sampling_spec(temperature=1.0)
        assert (caught.value.status_code, caught.value.param) == (400, field)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"messages": "12+7="}, "messages", "valid list"),
        ({"messages": USER, "max_tokens": "many"}, "max_tokens", "valid integer"),
        ({"messages": USER, "max_tokens": 100000}, "max_tokens", "max_model_len"),
        ({"messages": [{"role": "user", "content": 12}]}, "messages", "messages"),
    ],
)
def test_a_malformed_request_is_vllms_400(plain, body, param, words):
    with pytest.raises(RenderError) as caught:
        plain.render_chat(body)
    error = caught.value
    assert error.status_code == 400
    assert error.param is not None and error.param.startswith(param)
    assert param in str(error) and words in str(error)
    assert error.to_dict()["error"]["code"] == 400 and error.to_dict()["error"]["param"] == error.param


def test_response_shapes_not_produced_are_refused(plain):
    for field in ("stream", "echo"):
        with pytest.raises(RenderError) as caught:
            plain.render_chat({"messages": USER, field: True})
        assert (caught.value.status_code, caught.value.param) == (400, field)
        with pytest.raises(RenderError) as caught:
            plain.render_completion({"prompt": "1+2=", field: True})
        assert (caught.value.status_code, caught.value.param) == (400, field)


def test_tool_choice_needs_a_configured_parser(plain, hermes):
    body = {"messages": USER, "tools": [ADD_TOOL], "tool_choice": "auto"}
    with pytest.raises(RenderError) as caught:
        plain.render_chat(body)
    assert caught.value.status_code == 400 and "tool-call-parser" in str(caught.value)
    assert hermes.render_chat(body).request.tool_choice == "auto"


def test_a_generation_from_another_prompt_is_refused(plain):
    rendered = plain.render_chat({"messages": USER})
    gen = Generation(rendered.prompt_ids[:-1], (2,), (-0.5,), "stop")
    with pytest.raises(ValueError, match="another prompt"):
        plain.chat_response(rendered, [gen], "c", 0)
