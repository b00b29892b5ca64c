"""Agent code as the environment: ``env.spec`` naming a function ``run(client, row)`` (or ``async def``).

An agent is an episode written as a program rather than as ``reset`` / ``step``: it gets an ``openai`` client whose
``base_url`` is its episode's endpoint (:mod:`rlhf.rollout.openai.endpoint`: the policy, this RL step's weights) and its
prompt row (every column ``env.columns`` and ``reward.columns`` pass), talks to the model as it would to any
OpenAI-compatible server (tool calls included), and returns the episode's reward: a number, or an
:class:`AgentResult` with details to log. The endpoint records every token, so the episode trained on is what the
policy sampled, whatever the agent did with the text.

The environment pool's actors (:class:`rlhf.envs.EnvironmentPool.run_agents`) run their agents concurrently, so the
endpoint can batch their requests: ``async def`` agents on one event loop, plain functions in threads with a
synchronous client. Each agent has ``env.step_timeout_s`` in all; an agent that raises, hangs or returns something
else than a reward is an :class:`~rlhf.envs.EnvError` naming the spec and the episode, and ``env.on_error`` decides
(``fail`` stops the run, ``drop`` ends that episode alone). A hung ``async`` agent is cancelled; a hung plain function
cannot be, so its actor is replaced.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

from rlhf.envs.base import EnvError
from rlhf.envs.rows import PromptRow
from rlhf.utils.actors import Hung, timed_call
from rlhf.utils.specs import clip_plain

__all__ = ["AgentResult", "run_agents"]

#: what an agent's client is told; the endpoint takes no key (it serves this run's own agents)
API_KEY = "rlhf-episode"


@dataclass(frozen=True)
class AgentResult:
    """What an agent returns when a bare reward is not enough.

    Attributes:
        reward: the episode's reward, a finite real number (bools are refused: write ``float(ok)``).
        info: free-form, picklable details (logged, never trained on).
    """

    reward: float
    info: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        r = self.reward
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(float(r)):
            raise ValueError(
                f"an agent's reward must be a finite real number (not a bool; write float(ok)), got "
                f"{type(r).__name__} {clip_plain(repr(r), 80)}"
            )
        object.__setattr__(self, "reward", float(r))
        object.__setattr__(self, "info", dict(self.info))

    @classmethod
    def coerce(cls, value: Any) -> "AgentResult":
        """``value`` if it is an :class:`AgentResult`, else one with ``value`` as the reward."""
        return value if isinstance(value, cls) else cls(value)


def run_agents(
    fn: Callable, spec: str, items: Sequence[Tuple[int, Tuple[str, Mapping[str, Any]]]], timeout_s: float
) -> Tuple[List[Any], bool]:
    """Run ``fn`` once per ``(episode, (base_url, row))``, all at once; returns one :class:`AgentResult` or
    :class:`EnvError` per item, in order, and whether an agent hung in a thread that cannot be stopped (the
    caller's actor must then be replaced). The whole call is bounded by ``timeout_s`` plus a grace."""
    try:
        return timed_call(lambda: asyncio.run(_all(fn, spec, items, timeout_s)), timeout_s + 10.0, "rlhf-agents")
    except Hung:  # the event loop itself is stuck (blocking code inside an async agent)
        return [_hung(spec, episode, timeout_s, "blocked its event loop") for episode, _ in items], True


async def _all(fn: Callable, spec: str, items, timeout_s: float) -> Tuple[List[Any], bool]:
    # plain functions run in threads of a pool of their own: asyncio.run waits for its default executor's threads
    # at the end, and a hung one must not hold the others' results
    threads = ThreadPoolExecutor(max_workers=max(1, len(items)), thread_name_prefix="rlhf-agent")
    try:
        outcomes = await asyncio.gather(*(_one(fn, spec, e, url, row, timeout_s, threads) for e, (url, row) in items))
    finally:
        threads.shutdown(wait=False, cancel_futures=True)
    return [value for value, _ in outcomes], any(stuck for _, stuck in outcomes)


async def _one(
    fn: Callable, spec: str, episode: int, url: str, row: Mapping[str, Any], timeout_s: float, threads: Executor
):
    """One agent: ``(AgentResult or EnvError, whether its thread is stuck)``."""
    import openai  # the agents' client library: only actors that run agents import it

    threaded = not inspect.iscoroutinefunction(fn)
    client: Any
    if threaded:
        client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=timeout_s)
        call = asyncio.get_running_loop().run_in_executor(threads, functools.partial(fn, client, PromptRow(row)))
    else:
        client = openai.AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=timeout_s)
        call = fn(client, PromptRow(row))  # a missing field names env.columns
    try:
        value = await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        return _hung(spec, episode, timeout_s, "ran"), threaded
    except Exception as e:
        return _error(spec, episode, f"raised {type(e).__name__}: {clip_plain(str(e), 500)}"), False
    finally:
        if not threaded:
            await client.close()
    try:
        return AgentResult.coerce(value), False
    except ValueError as e:
        return _error(spec, episode, f"returned a bad result: {e}"), False


def _error(spec: str, episode: int, what: str) -> EnvError:
    return EnvError(f"agent {spec!r} {what} (episode {episode})", spec, episode)


def _hung(spec: str, episode: int, timeout_s: float, how: str) -> EnvError:
    return _error(spec, episode, f"{how} for more than {timeout_s:g} s (env.step_timeout_s)")
