"""The prompt row an environment's ``reset(row)`` or an agent's ``run(client, row)`` gets, and the dry run's probe of
an agent's reads.

A row holds the prompt and the columns ``env.columns`` and ``reward.columns`` pass, nothing else (the data reader
keeps what the run names). An agent that reads another field used to fail with a bare ``KeyError: 'a'`` at the end
of a long traceback, after the whole start-up; :class:`PromptRow` says which key passes it instead, and
:func:`probe_agent` (``--dry-run``) runs the agent once on the first row with a stand-in client to find such a read
before any actor starts.
"""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Optional

__all__ = ["MissingColumn", "PromptRow", "probe_agent"]


class MissingColumn(KeyError):
    """A field an environment or agent read that its prompt row does not hold."""

    def __init__(self, key: Any, present: tuple) -> None:
        super().__init__(key)
        self.key, self.present = key, present

    def __str__(self) -> str:
        return (
            f"the prompt row has no field {self.key!r}: environments and agents get the prompt and the columns "
            f"env.columns and reward.columns name (this row: {', '.join(map(str, self.present))}); add "
            f"env.columns=[{self.key}] (every row of the data must have it)"
        )


class PromptRow(dict):
    """A prompt row whose missing key names the config key that passes it (:class:`MissingColumn`)."""

    def __missing__(self, key: Any) -> Any:
        raise MissingColumn(key, tuple(self))


def probe_agent(fn: Callable, row: Mapping[str, Any]) -> Optional[str]:
    """Run the agent ``fn`` once on ``row`` with a stand-in client whose every completion is an empty assistant
    message. Returns ``None`` when it ran, or what stopped it (the stand-in answers nothing a real model would, so
    an agent may fail on its reply: that is for the caller to print, not an error).

    Raises:
        MissingColumn: the agent read a field the row does not hold (the run would fail the same way).
    """
    threaded = not inspect.iscoroutinefunction(fn)
    client = _StandInClient(threaded)
    try:
        result = fn(client, PromptRow(row))
        if not threaded:
            asyncio.run(result)
    except MissingColumn:
        raise
    except Exception as e:  # the stand-in's empty replies: a real model's would differ
        return f"{type(e).__name__}: {e}"
    return None


class _StandInClient:
    """The parts of an ``openai`` client an agent calls: ``client.chat.completions.create(...)`` (a coroutine for
    an ``async`` agent) and ``client.completions.create(...)``, each answering an empty assistant message."""

    def __init__(self, threaded: bool) -> None:
        create = _reply if threaded else _async_reply
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=create))
        self.completions = SimpleNamespace(create=create)


def _reply(**_: Any) -> SimpleNamespace:
    message = SimpleNamespace(role="assistant", content="", tool_calls=None)
    choice = SimpleNamespace(index=0, message=message, text="", finish_reason="stop")
    return SimpleNamespace(choices=[choice], usage=None)


async def _async_reply(**kwargs: Any) -> SimpleNamespace:
    return _reply(**kwargs)
