"""Environments hosted by a pool of Ray actors, stepped in batches, with a per-step timeout.

Episode ``e`` lives on actor ``e % num_actors``, which keeps ``{episode id: LocalEpisode}`` (one fresh
environment instance per episode). A batched call sends one remote call per actor carrying that actor's episodes,
which it runs one after another; actors run in parallel. Results come back in input order.

Failures are :class:`EnvError` naming the spec, the episode, the turn and the cause, never a Ray traceback:

* an environment that raises (or returns a malformed outcome): the error names the original exception;
* one that takes longer than ``step_timeout_s`` in one ``reset`` or ``step`` (measured inside the actor; the call
  runs in a thread there, so code that needs the main thread, e.g. ``signal.alarm``, will not work): "hung for more
  than X s in step (turn 2 of episode 5)"; the actor is killed and replaced, and the other episodes it hosted are
  lost (stepping them is an error that says so; reset them). If the actor itself stops answering (a C extension
  that holds the GIL), the pool gives up after ``step_timeout_s`` per episode it sent plus a grace, likewise;
* an actor process that dies (a crash in native code, ``os._exit``): likewise replaced.

After an :class:`EnvError` from :meth:`EnvironmentPool.step` the episodes of that call are in an unspecified
state (some may have taken their turn): close or reset them. ``import ray`` happens inside the pool's methods, so
importing this module stays light.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from rlhf.envs.agents import run_agents
from rlhf.envs.base import EnvError, LocalEpisode, Observation, StepOutcome
from rlhf.envs.loading import absolute_spec, is_agent, load_environment
from rlhf.utils.actors import ActorSet, Hung, timed_call

__all__ = ["EnvironmentPool"]

_GRACE_S = 10.0  # the driver's backstop waits this much longer than the actors' own per-step timeouts


class _EnvActor:
    """The body of one pool actor (a plain class; the pool wraps it with ``ray.remote``).

    Every method returns ``(results, broken)``: one entry per item, a value or the :class:`EnvError` for that
    item (``None`` for items not run after a hang), and whether a call hung (the actor must then be replaced: the
    stuck thread cannot be stopped).
    """

    def __init__(self, spec: str, load_spec: str, step_timeout_s: float, index: int = 0) -> None:
        self.spec, self.step_timeout_s, self.index = spec, step_timeout_s, index
        self.episodes: Dict[int, LocalEpisode] = {}
        self.load_error: Optional[EnvError] = None
        try:
            self.cls: Any = load_environment(load_spec)
        except EnvError as e:
            self.cls, self.load_error = None, e

    def __repr__(self) -> str:
        # Ray prefixes the output it forwards from this actor with its repr: "(env actor 0 pid=..., ip=...)"
        return f"env actor {self.index}"

    def ready(self) -> Optional[EnvError]:
        return self.load_error

    def _run(
        self, items: Sequence[Tuple[int, Any]], call: Callable[[int, Any], Any], turn_of: Callable[[int], int]
    ) -> Tuple[List[Any], bool]:
        results: List[Any] = [None] * len(items)
        for k, (episode, payload) in enumerate(items):
            try:
                results[k] = timed_call(functools.partial(call, episode, payload), self.step_timeout_s, "rlhf-env-call")
            except Hung:
                turn = turn_of(episode)
                phase = "reset" if turn == 0 else "step"
                results[k] = EnvError(
                    f"environment {self.spec!r} hung for more than {self.step_timeout_s:g} s in "
                    f"{phase} (turn {turn} of episode {episode})",
                    self.spec,
                    episode,
                    turn,
                )
                return results, True
            except EnvError as e:
                results[k] = e
            except Exception as e:  # a bug of ours rather than the environment's; still name the episode
                results[k] = EnvError(
                    f"environment {self.spec!r}: episode {episode} failed in the pool: {type(e).__name__}: {e}",
                    self.spec,
                    episode,
                )
        return results, False

    def reset(self, items: Sequence[Tuple[int, Mapping[str, Any]]]) -> Tuple[List[Any], bool]:
        def call(episode: int, row: Mapping[str, Any]) -> Observation:
            old = self.episodes.pop(episode, None)
            if old is not None:
                old.close()
            try:
                env = self.cls()
            except Exception as e:
                raise EnvError(
                    f"environment {self.spec!r} raised {type(e).__name__}: {e} in its constructor "
                    f"(turn 0 of episode {episode})",
                    self.spec,
                    episode,
                    0,
                ) from e
            fresh = LocalEpisode(env, self.spec, episode)
            observation = fresh.reset(row)
            self.episodes[episode] = fresh
            return observation

        return self._run(items, call, lambda episode: 0)

    def step(self, items: Sequence[Tuple[int, Tuple[str, Tuple[int, ...]]]]) -> Tuple[List[Any], bool]:
        def call(episode: int, payload: Tuple[str, Tuple[int, ...]]) -> StepOutcome:
            return self.episodes[episode].step(*payload)

        return self._run(items, call, lambda episode: self.episodes[episode].turn + 1)

    def agents(self, items: Sequence[Tuple[int, Tuple[str, Mapping[str, Any]]]]) -> Tuple[List[Any], bool]:
        """Run the agent function (``env.spec`` naming one) once per ``(episode, (base_url, row))``, all at once
        (:func:`rlhf.envs.agents.run_agents`)."""
        if not is_agent(self.cls):
            raise EnvError(f"environment {self.spec!r} is a class, not an agent function: use reset and step")
        return run_agents(self.cls, self.spec, items, self.step_timeout_s)

    def close(self, items: Sequence[Tuple[int, None]]) -> Tuple[List[Any], bool]:
        def call(episode: int, _: None) -> None:
            found = self.episodes.pop(episode, None)
            if found is not None:
                found.close()

        return self._run(items, call, lambda episode: self.episodes[episode].turn if episode in self.episodes else 0)


class EnvironmentPool:
    """``num_actors`` Ray actors hosting episodes of the environment named by ``spec``.

    Args:
        spec: ``path/to/file.py:Class`` or ``package.module:Class`` (a relative path is resolved here, against this
            process's working directory). A module spec must be importable in the actors.
        num_actors: how many actors; episode ``e`` lives on actor ``e % num_actors``.
        cpus_per_actor: Ray CPUs each actor reserves.
        step_timeout_s: the longest one ``reset`` or ``step`` of one episode may take.
        start_timeout_s: the longest an actor may take to start and load the environment class.

    Raises:
        EnvError: if the spec is malformed or an actor cannot load the class (naming the spec and the reason).
    """

    def __init__(
        self,
        spec: str,
        num_actors: int,
        cpus_per_actor: float = 1.0,
        step_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        import ray  # lazy: keeps `import rlhf.envs` light

        if not isinstance(num_actors, int) or isinstance(num_actors, bool) or num_actors < 1:
            raise ValueError(f"EnvironmentPool: num_actors must be a positive int, got {num_actors!r}")
        if not step_timeout_s > 0 or not start_timeout_s > 0 or not cpus_per_actor >= 0:
            raise ValueError(
                f"EnvironmentPool: step_timeout_s and start_timeout_s must be > 0 and cpus_per_actor "
                f">= 0, got {step_timeout_s!r}, {start_timeout_s!r}, {cpus_per_actor!r}"
            )
        self.spec, self.num_actors = spec, num_actors
        self.step_timeout_s, self.start_timeout_s = float(step_timeout_s), float(start_timeout_s)
        self._load_spec = absolute_spec(spec)
        self._turns: Dict[int, int] = {}  # live episode -> turns taken
        self._lost: Dict[int, str] = {}  # episode -> why it was lost (its actor was replaced)
        self._actors = ActorSet(
            ray.remote(num_cpus=cpus_per_actor, max_restarts=0)(_EnvActor),
            lambda i: (spec, self._load_spec, self.step_timeout_s, i),
            num_actors,
            self.start_timeout_s,
            lambda why: EnvError(f"environment {spec!r}: {why}", spec),
        )

    # ------------------------------------------------------------------------------------------------ actors

    def _replace_actor(self, index: int, reason: str) -> None:
        for episode in [e for e in self._turns if e % self.num_actors == index]:
            del self._turns[episode]
            self._lost[episode] = reason
        self._actors.replace(index)

    def _call(
        self, method: str, items: Sequence[Tuple[int, Any]], what: str, errors: str = "raise", concurrent: bool = False
    ) -> List[Any]:
        """Send ``items`` (``(episode, payload)``) to their actors, one remote call per actor; the per-item results
        in input order. Raises the first failure (in input order) as an :class:`EnvError`, after replacing any
        actor that hung or died; with ``errors="return"`` each failed item's :class:`EnvError` takes its place in
        the results instead (every item of a replaced actor fails: its episodes are gone with it). ``concurrent``:
        an actor runs its items at once (agents), so one timeout bounds them all."""
        import ray  # lazy: keeps `import rlhf.envs` light

        if errors not in ("raise", "return"):
            raise ValueError(f"EnvironmentPool: errors must be 'raise' or 'return', got {errors!r}")
        by_actor: Dict[int, List[int]] = {}
        for position, (episode, _) in enumerate(items):
            by_actor.setdefault(episode % self.num_actors, []).append(position)
        refs = {
            getattr(self._actors[a], method).remote([items[p] for p in positions]): a
            for a, positions in by_actor.items()
        }
        longest = (1 if concurrent else max(len(p) for p in by_actor.values())) if by_actor else 0
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=self.step_timeout_s * longest + _GRACE_S)
        results: List[Any] = [None] * len(items)
        failures: Dict[int, EnvError] = {}  # position -> error
        replace: Dict[int, str] = {}  # actor -> why
        for ref in pending:
            a = refs[ref]
            episodes = [items[p][0] for p in by_actor[a]]
            turns = [self._turn_for(e, what) for e in episodes]
            error = EnvError(
                f"environment {self.spec!r}: the actor hosting episodes {episodes} did not answer "
                f"within {self.step_timeout_s * longest + _GRACE_S:g} s in {what} (turns {turns})",
                self.spec,
                episodes[0],
                turns[0],
            )
            failures.update({p: error for p in by_actor[a]})
            replace[a] = str(error)
        for ref in ready:
            a, positions = refs[ref], by_actor[refs[ref]]
            try:
                values, broken = ray.get(ref)
            except ray.exceptions.RayError as e:  # the actor died (its process crashed or exited)
                episodes = [items[p][0] for p in positions]
                turns = [self._turn_for(e_, what) for e_ in episodes]
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                error = EnvError(
                    f"environment {self.spec!r}: the actor hosting episodes {episodes} died in {what} "
                    f"(turns {turns}): {type(e).__name__}: {first}",
                    self.spec,
                    episodes[0],
                    turns[0],
                )
                failures.update({p: error for p in positions})
                replace[a] = str(error)
                continue
            for p, value in zip(positions, values):
                if isinstance(value, EnvError):
                    failures[p] = value
                    if broken:
                        replace[a] = str(value)
                else:
                    results[p] = value
            if broken and errors == "return":  # the items after the hung one never ran, the ones before are lost
                for p in positions:  # with the actor
                    failures.setdefault(
                        p,
                        EnvError(
                            f"environment {self.spec!r}: episode {items[p][0]} was lost with its actor: {replace[a]}",
                            self.spec,
                            items[p][0],
                        ),
                    )
        for a, reason in replace.items():  # the stuck call dies with its actor
            self._replace_actor(a, reason)
        if failures and errors == "raise":
            raise failures[min(failures)]
        return [failures.get(p, value) for p, value in enumerate(results)]

    def _turn_for(self, episode: int, what: str) -> int:
        return 0 if what in ("reset", "agent") else self._turns.get(episode, 0) + (what == "step")

    # --------------------------------------------------------------------------------------------------- API

    def reset(
        self, rows: Sequence[Mapping[str, Any]], episode_ids: Optional[Sequence[int]] = None, errors: str = "raise"
    ) -> List[Observation]:
        """Start one episode per row and return the first observations, in order.

        Args:
            rows: prompt rows; each environment's ``reset`` receives all of its row's columns as a ``dict``.
            episode_ids: the episodes' ids (distinct ints >= 0), ``range(len(rows))`` by default. An id that is
                live already is restarted (its old instance is closed); a lost one comes back.
            errors: ``raise`` the first failure; ``return`` each failed episode's :class:`EnvError` in its place
                (that episode is not live).
        """
        rows = list(rows)
        ids = list(range(len(rows))) if episode_ids is None else list(episode_ids)
        self._check_ids(ids, len(rows), "rows")
        try:
            observations = self._call("reset", [(e, dict(row)) for e, row in zip(ids, rows)], "reset", errors)
        finally:
            for e in ids:
                self._lost.pop(e, None)
                self._turns.pop(e, None)
        for e, observation in zip(ids, observations):
            if not isinstance(observation, EnvError):
                self._turns[e] = 0
        return observations

    def step(
        self,
        episode_ids: Sequence[int],
        responses: Sequence[str],
        response_ids: Optional[Sequence[Sequence[int]]] = None,
        errors: str = "raise",
    ) -> List[StepOutcome]:
        """One turn of each listed episode (all sent together), the outcomes in input order.

        Args:
            episode_ids: live episodes (reset, not finished, not closed), distinct.
            responses: the policy's answer text per episode.
            response_ids: its token ids per episode (empty tuples when not given).
            errors: ``raise`` the first failure; ``return`` each failed (or lost) episode's :class:`EnvError` in
                its place, the others' outcomes as usual.
        """
        ids = list(episode_ids)
        self._check_ids(ids, len(responses), "responses")
        token_ids = [()] * len(ids) if response_ids is None else [tuple(int(t) for t in r) for r in response_ids]
        if len(token_ids) != len(ids):
            raise ValueError(f"EnvironmentPool.step: {len(ids)} episodes but {len(token_ids)} response_ids")
        out: List[Any] = [None] * len(ids)
        sent = []
        for k, e in enumerate(ids):
            problem = self._not_steppable(e)
            if problem is None:
                sent.append(k)
            elif errors == "raise":
                raise problem
            else:
                out[k] = problem
        items = [(ids[k], (str(responses[k]), token_ids[k])) for k in sent]
        try:
            outcomes = self._call("step", items, "step", errors) if items else []
        finally:  # an attempted turn counts even if it failed (unspecified state): later messages stay in step
            for k in sent:
                if ids[k] in self._turns:
                    self._turns[ids[k]] += 1
        for k, outcome in zip(sent, outcomes):
            out[k] = outcome
        return out

    def _not_steppable(self, episode: int) -> Optional[EnvError]:
        """Why ``episode`` cannot take a turn (lost with a replaced actor, or not live), or ``None``."""
        if episode in self._lost:
            return EnvError(
                f"environment {self.spec!r}: episode {episode} was lost (its actor was replaced after: "
                f"{self._lost[episode]}); reset it",
                self.spec,
                episode,
            )
        if episode not in self._turns:
            return EnvError(
                f"environment {self.spec!r}: episode {episode} is not live (reset it first)", self.spec, episode
            )
        return None

    def run_agents(self, urls: Sequence[str], rows: Sequence[Mapping[str, Any]], errors: str = "raise") -> List[Any]:
        """Episode ``i`` runs the agent function on ``urls[i]`` (its endpoint) and ``rows[i]``; every actor runs its
        episodes at once, the actors in parallel. Returns each episode's :class:`~rlhf.envs.agents.AgentResult` in
        order; ``errors`` as in :meth:`step` (a failure is an :class:`EnvError` naming the agent and episode)."""
        if len(urls) != len(rows):
            raise ValueError(f"EnvironmentPool.run_agents: {len(urls)} endpoints for {len(rows)} rows")
        self._check_ids(list(range(len(rows))), len(rows), "rows")
        items = [(e, (str(url), dict(row))) for e, (url, row) in enumerate(zip(urls, rows))]
        return self._call("agents", items, "agent", errors, concurrent=True)

    def close(self, episode_ids: Sequence[int]) -> None:
        """End the listed episodes (their environments' ``close`` runs); unknown or lost ids are ignored."""
        ids = [e for e in episode_ids if e in self._turns]
        for e in episode_ids:
            self._lost.pop(e, None)
        try:
            if ids:
                self._call("close", [(e, None) for e in ids], "close")
        finally:
            for e in ids:
                self._turns.pop(e, None)

    def shutdown(self) -> None:
        """Kill the actors (idempotent); the pool cannot be used afterwards."""
        self._actors.kill_all()
        self._turns.clear()

    def __enter__(self) -> "EnvironmentPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _check_ids(self, ids: List[int], n: int, what: str) -> None:
        if self._actors.closed:
            raise EnvError(f"environment {self.spec!r}: the pool is shut down", self.spec)
        if len(ids) != n:
            raise ValueError(f"EnvironmentPool: {len(ids)} episode ids but {n} {what}")
        if any(not isinstance(e, int) or isinstance(e, bool) or e < 0 for e in ids):
            raise ValueError(f"EnvironmentPool: episode ids must be ints >= 0, got {ids}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"EnvironmentPool: episode ids must be distinct, got {ids}")
