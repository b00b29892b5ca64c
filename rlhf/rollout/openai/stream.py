"""``stream=true`` for the agent endpoint: a finished response sent as OpenAI's server-sent events.

The engines sample a whole reply in one call, and the episode is recorded from that reply, so a streamed request
is served as the same request unstreamed: its response is then cut into the chunks OpenAI's protocol defines, one
``data: {...}`` event each, then ``data: [DONE]``. Per choice, a chunk with everything the reply says (role, text,
tool calls with their whole arguments, log-probs, token ids), then a chunk with its ``finish_reason``; with
``stream_options.include_usage``, a last chunk with the usage and no choices. The protocol leaves how a reply is
split into chunks to the server, so a client that accumulates deltas (the ``openai`` package, agent frameworks)
gets the same message as without streaming; it gets it all at once rather than token by token.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List, Mapping, Tuple

__all__ = ["take_stream", "chat_chunks", "completion_chunks", "events"]

# what a chunk carries at its top level besides id / object / created / model (vLLM's extensions included)
_CHUNK_KEYS = ("system_fingerprint", "prompt_token_ids")


def take_stream(body: Any) -> Tuple[bool, bool]:
    """``(stream, include_usage)`` of a request body, removing ``stream`` and ``stream_options`` from it when
    ``stream`` is true (the request is then served unstreamed); a body without ``stream: true`` is left as it is
    (``stream_options`` without it is the renderer's to refuse)."""
    if not isinstance(body, dict) or body.get("stream") is not True:
        return False, False
    body.pop("stream")
    options = body.pop("stream_options", None) or {}
    return True, bool(isinstance(options, Mapping) and options.get("include_usage"))


def _head(response: Mapping[str, Any], kind: str) -> Dict[str, Any]:
    head = {k: response[k] for k in ("id", "created", "model")}
    head["object"] = kind
    head.update({k: response[k] for k in _CHUNK_KEYS if response.get(k) is not None})
    return head


def _usage_chunk(head: Mapping[str, Any], response: Mapping[str, Any]) -> Dict[str, Any]:
    return {**head, "choices": [], "usage": response.get("usage")}


def chat_chunks(response: Mapping[str, Any], include_usage: bool = False) -> List[Dict[str, Any]]:
    """A ``chat.completion`` response (a dict) as ``chat.completion.chunk`` dicts, in order."""
    head = _head(response, "chat.completion.chunk")
    chunks = []
    for choice in response["choices"]:
        message = choice["message"]
        delta: Dict[str, Any] = {"role": message.get("role") or "assistant", "content": message.get("content")}
        if message.get("reasoning_content") is not None:
            delta["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        said = {"index": choice["index"], "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None}
        if choice.get("token_ids") is not None:
            said["token_ids"] = choice["token_ids"]
        chunks.append({**head, "choices": [said]})
        ended = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        if choice.get("stop_reason") is not None:
            ended["stop_reason"] = choice["stop_reason"]
        chunks.append({**head, "choices": [ended]})
    return chunks + ([_usage_chunk(head, response)] if include_usage else [])


def completion_chunks(response: Mapping[str, Any], include_usage: bool = False) -> List[Dict[str, Any]]:
    """A ``text_completion`` response (a dict) as its streamed ``text_completion`` dicts, in order."""
    head = _head(response, "text_completion")
    chunks = []
    for choice in response["choices"]:
        said = {k: v for k, v in choice.items() if k not in ("finish_reason", "stop_reason")}
        chunks.append({**head, "choices": [{**said, "finish_reason": None}]})
        ended = {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
        if choice.get("stop_reason") is not None:
            ended["stop_reason"] = choice["stop_reason"]
        chunks.append({**head, "choices": [ended]})
    return chunks + ([_usage_chunk(head, response)] if include_usage else [])


def events(chunks: List[Dict[str, Any]]) -> Iterator[str]:
    """Server-sent events: ``data: <chunk JSON>`` each, then ``data: [DONE]``."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"
