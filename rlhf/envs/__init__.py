"""Multi-turn environments for online RL.

An episode is ``observation = env.reset(row)`` (``row``: all columns of the prompt row), then per turn
``env.step(response, response_ids) -> StepOutcome(observation, reward, done, info)`` until ``done``. An environment
is a class named by a spec like a reward function, ``path/to/file.py:Class`` or ``package.module:Class``
(:func:`load_environment`); :class:`EnvironmentPool` hosts its episodes in Ray actors (they may be slow or hold
state) with a per-step timeout, and every failure is an :class:`EnvError` naming the spec, the episode and the
turn. :class:`LocalEpisode` runs one episode in-process with the same checks. Rule-based rewards and reward
models still score the finished episode. See ``docs/algorithms/multi_turn.md``.

An environment may instead be agent code: a function ``run(client, row)`` (or ``async def``) that talks to the policy
through an OpenAI client and returns the episode's reward (:mod:`rlhf.envs.agents`, ``docs/algorithms/agents.md``).

Importing this package does not import Ray.
"""

from rlhf.envs.agents import AgentResult
from rlhf.envs.base import EnvError, Environment, LocalEpisode, Observation, StepOutcome
from rlhf.envs.loading import load_environment
from rlhf.envs.pool import EnvironmentPool

__all__ = [
    "AgentResult",
    "EnvError",
    "Environment",
    "LocalEpisode",
    "Observation",
    "StepOutcome",
    "load_environment",
    "EnvironmentPool",
]
