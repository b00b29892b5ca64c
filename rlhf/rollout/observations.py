"""How an environment's observation text becomes tokens appended to an episode (``rollout.observation_format``).

Either encoder tokenizes each observation **once** and never touches the tokens before it: the policy's sampled
tokens stay as sampled (rlhf/rollout/episodes.py says why re-encoding drifts).

* :class:`TextObservations` (``text``): the text's own tokens, no special tokens added, right after the response.
* :class:`ChatObservations` (``chat``): the observation is a message of ``rollout.observation_role`` in the
  tokenizer's chat template, followed by the generation prompt, so the policy answers it in a fresh assistant turn.
  The template is rendered on a fixed probe conversation with and without the observation message: what it writes
  after a finished assistant turn (e.g. ChatML's ``\\n<|im_start|>user\\n ... <|im_end|>\\n<|im_start|>assistant\\n``)
  is tokenized as one piece around the observation's text. A response that did not end with the template's
  end-of-turn token (cut by ``rollout.max_new_tokens``) gets the template's turn closing as context first.

An encoder has two entry points: ``first(prompt_ids, text, messages, tools)`` returns a prompt with the reset
observation (``messages`` and ``tools``: that prompt's own messages and tool schemas, which a chat encoder renders
again with the observation as the last message), ``encoder(text, response_ids)`` the tokens to append after a
response. A plain function ``encode(text) -> ids`` is accepted wherever an encoder is (:func:`as_encoder`).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Protocol, Sequence, Union, cast

__all__ = ["ObservationEncoder", "TextObservations", "ChatObservations", "as_encoder"]

_MARK = "\u2063observation\u2063"  # a probe content no template writes itself (U+2063, invisible separator)


Messages = Sequence[dict]
Tools = Optional[List[dict]]  # a prompt's tool schemas (the chat template's ``tools``), None for none


class ObservationEncoder(Protocol):
    def first(
        self, prompt_ids: Sequence[int], text: str, messages: Optional[Messages] = None, tools: Tools = None
    ) -> List[int]: ...

    def __call__(self, text: str, response_ids: Sequence[int]) -> List[int]: ...


class TextObservations:
    """Observations as their own text's tokens (``encode(text) -> ids``, e.g. the tokenizer without special
    tokens), appended after the prompt or the response."""

    def __init__(self, encode: Callable[[str], Sequence[int]]) -> None:
        self.encode = encode

    @classmethod
    def of(cls, tokenizer) -> "TextObservations":
        return cls(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])

    def first(
        self, prompt_ids: Sequence[int], text: str, messages: Optional[Messages] = None, tools: Tools = None
    ) -> List[int]:
        return list(prompt_ids) + list(self.encode(text))

    def __call__(self, text: str, response_ids: Sequence[int]) -> List[int]:
        return list(self.encode(text))


def as_encoder(encode: Union[ObservationEncoder, Callable[[str], Sequence[int]]]) -> ObservationEncoder:
    """An encoder as it is; a one-argument function as :class:`TextObservations`."""
    # duck-typed on purpose (not isinstance on the Protocol), so the casts only tell mypy which branch is which
    if hasattr(encode, "first"):
        return cast(ObservationEncoder, encode)
    return TextObservations(cast(Callable[[str], Sequence[int]], encode))


class ChatObservations:
    """Observations as chat messages of ``role`` (see the module docstring).

    Args:
        chat: the prompts' :class:`~rlhf.data.chat.ChatFormatter`.
        role: the observation messages' role (``user``, ``tool``, ``system``).

    Raises:
        ValueError: when the template cannot render an observation turn after an assistant turn as a plain
            continuation (it rewrites earlier turns, or refuses the role), naming the role.
    """

    def __init__(self, chat, role: str) -> None:
        self.chat, self.role = chat, role
        probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        try:
            base = chat.render(probe)
            after = chat.render(probe + [self._message(_MARK)], generation_prompt=True)
        except ValueError as e:
            raise ValueError(f"rollout.observation_role={role}: {e}") from None
        if not after.startswith(base) or _MARK not in after[len(base) :]:
            raise ValueError(
                f"rollout.observation_role={role}: the chat template does not render an observation "
                f"message after an assistant turn as a continuation of the conversation (it rewrites the "
                f"earlier turns); use rollout.observation_format=text"
            )
        self.head, self.tail = after[len(base) :].split(_MARK, 1)
        close = base[base.rindex("2") + 1 :]  # what the template writes after an assistant's text: "<|im_end|>\n"
        self.close_ids = tuple(chat.tokenize(close)) if close else ()

    def _message(self, text: str) -> dict:
        return {"role": self.role, "content": text}

    def first(
        self, prompt_ids: Sequence[int], text: str, messages: Optional[Messages] = None, tools: Tools = None
    ) -> List[int]:
        """The prompt rendered again with the reset observation as its last message, followed by the generation
        prompt (it is the data's own text, never sampled tokens).

        ``prompt_ids`` must be the render of ``messages`` with the tool schemas ``tools`` (the row's, as the prompt
        set rendered it), or its end (``rollout.prompt_overflow=truncate`` keeps a
        long prompt's last ``rollout.max_prompt_length`` tokens): the tokens the prompt set dropped from the start
        are dropped from the new render too, so a truncated prompt stays truncated. The observation itself is
        environment context, counted in the episode's token budget (the caller's, not this encoder's business).

        Raises:
            ValueError: without ``messages``, or when ``prompt_ids`` are not (the end of) their render: the messages
                of another prompt.
        """
        if messages is None:
            raise ValueError(
                "a chat observation at reset is rendered as the prompt's last message: it needs the "
                "prompt's messages (run_episodes(..., prompt_messages=...))"
            )
        whole = self.chat.prompt_ids(list(messages), tools)
        dropped = len(whole) - len(prompt_ids)
        if dropped < 0 or whole[dropped:] != list(prompt_ids):
            raise ValueError(
                f"the prompt's messages render to {len(whole)} tokens that do not end with its "
                f"{len(prompt_ids)} token ids: the messages of another prompt"
                + (", or without its tools?" if tools is None else "?")
            )
        observed = self.chat.prompt_ids(list(messages) + [self._message(text)], tools)
        if observed[:dropped] != whole[:dropped]:  # the tokens a truncation dropped must be the same ones
            raise ValueError(
                "the chat template renders the start of a truncated prompt (rollout.prompt_overflow="
                "truncate) differently once an observation message follows: it cannot take a reset "
                "observation; use rollout.observation_format=text"
            )
        return observed[dropped:]

    def __call__(self, text: str, response_ids: Sequence[int]) -> List[int]:
        return list(self.closing(response_ids)) + self.chat.tokenize(self.head + text + self.tail)

    def closing(self, response_ids: Sequence[int]) -> Sequence[int]:
        """The template's end of the assistant turn still missing after ``response_ids``: what follows its
        end-of-turn token when the response stopped on it, else all of it."""
        c = self.close_ids
        if c and response_ids and response_ids[-1] == c[0]:
            return c[1:]
        return c
