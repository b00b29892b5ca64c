"""An agent's requests to the endpoint, kept token-in / token-out and assembled into one trained episode.

An agent resends its whole conversation with each chat request. Rendering it again and tokenizing it would drift
from what the policy sampled (Qwen3's template drops earlier ``<think>`` blocks; text re-encoded can take other
tokens: rlhf/rollout/episodes.py says why). So the endpoint keeps, per episode, every exchange: the exact prompt
ids the engine was given, the ids it sampled and their log-probs. A request that **continues** the last exchange
(its messages are that exchange's messages, then the assistant reply the endpoint returned, then new messages) is
given to the engine as ``last prompt + last response + the new messages' tokens``, where only the new messages are
rendered: the template's turn closing after the sampled reply, then what the template writes for the new messages
(tool results, a user turn) and the generation prompt. The episode trained on is then the chain of these exchanges:
prompt, response, observation, response, ... exactly the tokens the engine saw and sampled.

A request that does not continue the last exchange (the agent rewrote or dropped earlier messages, or changed the
reply) is rendered whole: the episode's chain breaks there (:attr:`EpisodeTranscript.breaks`, naming the request
and the message), and ``rollout.on_prefix_mismatch`` says what the trained episode is: ``error`` names the episode,
the request and the first differing message; ``truncate`` trains the chain up to the break.

A completion request (``/completions``) carries its whole prompt as text or token ids, with no messages: it continues
the last exchange when its prompt ids start with that exchange's prompt ids and sampled response ids (a token prefix,
:meth:`EpisodeTranscript.continues_ids`); the ids after them are the observation. A chat request after a completion
breaks the chain (messages cannot be matched against tokens); a completion after a chat exchange continues it when
its ids extend that exchange's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from rlhf.rollout.episodes import Episode, EpisodeError, first_difference

Messages = List[Dict[str, Any]]
#: ``render(messages, tools, add_generation_prompt) -> token ids``: the chat template's render, as the endpoint does it
RenderIds = Callable[[Messages, Optional[list], bool], List[int]]


@dataclass(frozen=True)
class Exchange:
    """One request and its sampled reply: ``prompt_ids`` as given to the engine, ``response_ids`` and their
    sampling ``response_logps`` as sampled; ``messages`` and ``reply`` (the assistant message returned) in their
    normalised form (:func:`normalise`); ``continues``: whether it extends the previous exchange's tokens. A
    completion exchange has no ``messages`` (``()``) and its ``reply`` is the text returned."""

    prompt_ids: Tuple[int, ...]
    response_ids: Tuple[int, ...]
    response_logps: Tuple[float, ...]
    finish_reason: str
    messages: Tuple[str, ...]
    reply: str
    continues: bool


#: what a message is to a chat template; a client's other fields (``refusal``, ``annotations``, ``audio``, ...) are not
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def normalise(message: Dict[str, Any]) -> str:
    """A chat message as compared between requests: its :data:`MESSAGE_KEYS` as JSON with keys sorted, ``None``
    values and empty ``tool_calls`` dropped, ``content`` ``None`` as ``""``, and each tool call's ``arguments``
    parsed (an agent may echo ``{"a": 1}`` as ``{"a":1}``) and its ``id`` / ``type`` left out (clients rewrite
    them). So a reply echoed as the client's message object compares equal to the reply returned."""
    m = {k: v for k, v in dict(message).items() if v is not None and k in MESSAGE_KEYS}
    m["content"] = m.get("content") or ""
    calls = []
    for call in m.pop("tool_calls", None) or []:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append({"name": function.get("name"), "arguments": arguments})
    if calls:
        m["tool_calls"] = calls
    return json.dumps(m, sort_keys=True, default=str)


@dataclass
class EpisodeTranscript:
    """The exchanges of one episode, in order; :meth:`prompt_for` decides how the next request's prompt is made."""

    index: int
    exchanges: List[Exchange] = field(default_factory=list)
    breaks: List[str] = field(default_factory=list)  # why a request did not continue the chain, one line each

    def prompt_for(
        self,
        messages: Messages,
        tools: Optional[list],
        whole: Sequence[int],
        render: RenderIds,
        close_ids: Sequence[int],
    ) -> Tuple[List[int], bool]:
        """The engine prompt for a request with ``messages``, and whether it continues the last exchange.

        ``whole``: the request's own render (every message and the generation prompt), the prompt when it does not
        continue; ``render`` renders the conversation up to the last reply, whose tokens ``whole`` must extend.
        ``close_ids``: what the template writes after an assistant's text (ChatML: ``<|im_end|>`` ``\\n``); after
        a reply that stopped on its first token only the rest is added, after a cut reply all of it."""
        normal = [normalise(m) for m in messages]
        last = self.exchanges[-1] if self.exchanges else None
        why = None
        if last is not None and not last.messages:
            why = f"request {len(self.exchanges) + 1}: a chat request after a completion request (prompt tokens)"
        elif last is not None:
            why = self._why_not_continued(normal, last)
        if last is None or why is not None:
            if why is not None:
                self.breaks.append(why)
            return list(whole), False
        assert last is not None
        done = len(last.messages) + 1  # the earlier messages and the reply: their tokens are the last exchange's
        before = render(messages[:done], tools, False)
        whole = list(whole)
        if whole[: len(before)] != before:
            at = next((i for i, (a, b) in enumerate(zip(before, whole)) if a != b), min(len(before), len(whole)))
            self.breaks.append(
                f"request {len(self.exchanges) + 1}: the chat template renders the conversation so far differently "
                f"once message {done + 1} follows (it rewrites earlier turns: the renders differ at token {at} of "
                f"{len(before)})"
            )
            return whole, False
        close = list(close_ids)
        if close and last.response_ids and last.response_ids[-1] == close[0]:
            close = close[1:]
        # ``before`` ends with the template's closing of the reply: the tokens after it are the new messages'
        tail = whole[len(before) :]
        return list(last.prompt_ids) + list(last.response_ids) + close + tail, True

    def continues_ids(self, prompt_ids: Sequence[int]) -> bool:
        """Whether a completion request's ``prompt_ids`` continue the last exchange: they start with its prompt ids
        and sampled response ids (the ids after them, possibly none, are the observation). A request that does not is
        a break, recorded in :attr:`breaks` naming the request and the first token that differs (counted from 0, as
        :meth:`Episode.extend_to` counts); the first request starts the chain."""
        if not self.exchanges:
            return False
        last = self.exchanges[-1]
        before = tuple(last.prompt_ids) + tuple(last.response_ids)
        at = first_difference(before, tuple(prompt_ids))
        if at is None:
            return True
        where = f"they differ at token {at}" if at < len(prompt_ids) else f"it ends at token {at}"
        self.breaks.append(
            f"request {len(self.exchanges) + 1}: its prompt does not extend the last request's prompt and reply: "
            f"{where} (of the {len(before)} it must start with)"
        )
        return False

    def _why_not_continued(self, normal: List[str], last: Exchange) -> Optional[str]:
        n = len(self.exchanges) + 1
        done = len(last.messages)
        for i, (had, got) in enumerate(zip(last.messages, normal)):
            if had != got:
                return f"request {n}: message {i + 1} differs from the one sent before (the agent rewrote it)"
        if len(normal) <= done:
            return f"request {n}: it has {len(normal)} messages, no more than the last request's {done}"
        if normal[done] != last.reply:
            return (
                f"request {n}: message {done + 1} is not the assistant reply the endpoint returned (the agent "
                f"changed or dropped it)"
            )
        if len(normal) == done + 1:
            return f"request {n}: nothing follows the reply (the same turn asked again)"
        return None

    def add(self, exchange: Exchange) -> None:
        self.exchanges.append(exchange)

    def episode(self, on_mismatch: str = "error") -> Episode:
        """The trained episode: the first exchange's prompt, then each continuing exchange's reply and the new
        tokens between them, up to the first exchange that does not continue (``on_mismatch``: ``error`` raises
        :class:`EpisodeError` naming the episode and why; ``truncate`` ends the episode there)."""
        if on_mismatch not in ("error", "truncate"):
            raise ValueError(f"on_mismatch must be 'error' or 'truncate', got {on_mismatch!r}")
        if not self.exchanges:
            raise EpisodeError(f"episode {self.index}: the agent made no request to the endpoint")
        first = self.exchanges[0]
        episode = Episode(first.prompt_ids, index=self.index)
        episode.add_response(first.response_ids, first.response_logps)
        for k, exchange in enumerate(self.exchanges[1:], start=2):
            if not exchange.continues:
                if on_mismatch == "error":
                    raise EpisodeError(
                        f"episode {self.index}: {self.breaks[0] if self.breaks else f'request {k} starts anew'}; "
                        f"its tokens cannot extend the episode's. Keep the conversation as returned, or train the "
                        f"episode up to there (rollout.on_prefix_mismatch=truncate)"
                    )
                episode.truncated = True
                break
            have = episode.num_tokens
            assert tuple(exchange.prompt_ids[:have]) == episode.token_ids, "a continuation extends the episode"
            episode.add_observation(exchange.prompt_ids[have:])
            episode.add_response(exchange.response_ids, exchange.response_logps)
        return episode
