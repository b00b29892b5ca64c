"""The RL prompt set (driver side, no actors): :func:`prepare_prompts` tokenizes the prompt data once, applying
``rollout.max_prompt_length`` (skip or left-truncate, counted). Generations become a train batch in
:mod:`rlhf.rollout.episodes`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rlhf.data.chat import row_tools
from rlhf.data.tokenize import row_errors


@dataclass(frozen=True)
class PromptSet:
    prompt_ids: List[List[int]]
    texts: List[str]  # what reward functions see as the prompt: the text, or the rendered conversation
    columns: Dict[str, List]  # extra fields for reward functions, aligned with prompts
    skipped: int
    truncated: int
    stop_token_ids: Tuple[int, ...] = ()  # generation ends on these: EOS, and the chat template's end of turn
    env_rows: List[Dict[str, Any]] = field(default_factory=list)  # each prompt's row as read: an env's reset(row)
    chat: Any = None  # the ChatFormatter of conversational prompts (None: plain text)
    prompt_key: str = "prompt"
    tools_key: str = "tools"

    @property
    def messages(self) -> List[Optional[list]]:
        """Each prompt's messages (``None`` for a text prompt), indexed like :attr:`prompt_ids`: ``prompt_ids[i]``
        is the render of ``messages[i]`` (its last ``rollout.max_prompt_length`` tokens, when truncated). An
        episode's reset observation is rendered onto its own prompt's messages (rlhf.rollout.sources.EpisodeRollout)."""
        return [row[self.prompt_key] if isinstance(row[self.prompt_key], list) else None for row in self.env_rows]

    @functools.cached_property  # read every step; parsed once
    def tools(self) -> List[Optional[List[dict]]]:
        """Each prompt's tool schemas (its row's ``tools_key`` field; ``None`` for none), indexed like
        :attr:`prompt_ids`: a conversational prompt was rendered with them, and so is its reset observation."""
        return [
            row_tools(row, self.tools_key) if isinstance(row[self.prompt_key], list) else None for row in self.env_rows
        ]


def prepare_prompts(
    rows: Sequence[dict],
    tokenizer,
    *,
    prompt_key: str,
    columns: Sequence[str],
    max_prompt_length: int,
    overflow: str,
    chat=None,
    tools_key: str = "tools",
) -> PromptSet:
    """Tokenize every prompt once: text with the tokenizer's special tokens, messages through ``chat`` (a
    :class:`~rlhf.data.chat.ChatFormatter`) with the row's tool schemas (its ``tools_key`` field, when it has them:
    an agent's first request, which sends them, renders to the same ids) and the generation prompt; apply
    ``max_prompt_length``."""
    plain = [i for i, r in enumerate(rows) if isinstance(r[prompt_key], str)]
    encoded = dict(
        zip(
            plain,
            tokenizer([rows[i][prompt_key] for i in plain], add_special_tokens=True)["input_ids"] if plain else [],
        )
    )
    texts = [r[prompt_key] for r in rows]
    for i, row in enumerate(rows):
        if i not in encoded:  # rendered once: its text is what reward functions see, its ids what the engine gets
            with row_errors(i):
                texts[i] = chat.render(row[prompt_key], generation_prompt=True, tools=row_tools(row, tools_key))
            encoded[i] = chat.tokenize(texts[i])
    keep, ids, skipped, truncated = [], [], 0, 0
    for i in range(len(rows)):
        seq = encoded[i]
        if len(seq) > max_prompt_length:
            if overflow == "skip":
                skipped += 1
                continue
            seq, truncated = seq[-max_prompt_length:], truncated + 1
        keep.append(i)
        ids.append(list(seq))
    present = [c for c in columns if all(c in rows[i] for i in keep)]
    stops = (tokenizer.eos_token_id,) + tuple(
        t for t in (chat.end_of_turn_ids() if chat else ()) if t != tokenizer.eos_token_id
    )
    return PromptSet(
        prompt_ids=ids,
        texts=[texts[i] for i in keep],
        columns={c: [rows[i][c] for i in keep] for c in present},
        skipped=skipped,
        truncated=truncated,
        stop_token_ids=stops,
        env_rows=[dict(rows[i]) for i in keep],
        chat=chat,
        prompt_key=prompt_key,
        tools_key=tools_key,
    )
