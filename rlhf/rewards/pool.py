"""Reward functions scored in parallel by a pool of Ray actors, with per-sample timeouts and a failure policy.

:func:`rlhf.rewards.functions.compute_rewards` calls each function once on the whole batch, in the driver, with no
timeout: one slow function stalls the RL loop and one hung sample stops it. :class:`RewardPool` instead cuts the
batch into consecutive chunks of ``chunk_size`` samples, spreads the chunks over ``num_workers`` actors (a free
actor takes the next chunk) and puts the results back in input order. Each actor loads the functions itself from
their spec strings (:class:`~rlhf.rewards.functions.RewardFunctionScorer`).

**Timeouts.** One function called on a chunk of ``n`` samples may take ``n * timeout_s`` seconds. If it raises,
hangs, or returns something invalid, it is called again on each sample of the chunk alone (``timeout_s`` each), so
that only the offending samples fail. The call runs in a thread of the actor, so code that needs the main thread
(``signal.alarm``) will not work; a thread that hung cannot be stopped, so an actor with one is killed and replaced
after its chunk. An actor that dies or stops answering (native code holding the GIL) past its chunk's budget plus
``grace_s`` is replaced too, and its chunk is scored again one sample per call, so that again only the samples at
fault fail.

**Failures** (a function that raised, hung, returned a bad value, or took its actor down on a sample) follow
``on_error`` (``"fail"``, ``"drop"`` or a stand-in number; see :mod:`rlhf.rewards.results`); each is counted and its
message names the function spec, the sample index, a clipped prompt and response and the cause (``raised
ZeroDivisionError: ...``, ``hung (> 2 s)``). Misconfigurations (a parameter no column fills, misaligned inputs) are
not sample failures and always raise.

The results do not depend on ``num_workers`` or ``chunk_size`` (for functions that score each sample on its own):
each value is the float32 a function returned, and the total is summed in float64 in source order as in
:func:`~rlhf.rewards.functions.compute_rewards`. ``num_workers=0`` runs the same chunking and timeouts in this
process (a hung thread is then left behind); tests use it. ``import ray`` happens inside the pool's methods.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from rlhf.rewards.functions import (
    REWARD_SPEC,
    RewardFunctionError,
    RewardFunctionScorer,
    RewardSource,
    bind_columns,
    clip_preview,
    result_values,
    split_weight,
)
from rlhf.rewards.results import Failure, OnError, ScoreResult, assemble, check_on_error
from rlhf.utils.actors import ActorSet, Hung, timed_call
from rlhf.utils.log import get_logger
from rlhf.utils.specs import absolute_spec, clip_plain

__all__ = ["RewardPool", "ScoreResult", "check_on_error", "score_chunk"]

log = get_logger(__name__)

# ------------------------------------------------------------------------------------------- one chunk, anywhere


@dataclass(frozen=True)
class ChunkScores:
    """What one chunk came back with (plain Python, cheap to pickle): ``values[name][k]`` is sample ``start + k``'s
    value or ``None`` if it failed; ``broken`` says a thread hung (the actor must be replaced)."""

    start: int
    values: Dict[str, List[Optional[float]]]
    failures: List[Failure]
    broken: bool


def _call_one(
    source: RewardSource, prompts: List[str], responses: List[str], kwargs: Dict[str, list], t: float
) -> Tuple[Optional[List[float]], Optional[Tuple[str, str]]]:
    """The function's float32 values on these samples, or the failure: ``(values, None)`` or ``(None, (kind, why))``."""
    try:
        result = timed_call(
            lambda: source.fn(list(prompts), list(responses), **{k: list(v) for k, v in kwargs.items()}),
            t,
            "rlhf-reward-call",
        )
    except Hung:
        return None, ("timeout", f"hung (> {t:g} s)")
    except Exception as e:
        return None, ("error", f"raised {type(e).__name__}: {clip_plain(str(e), 500)}")
    try:
        return result_values(source, result, prompts, responses).tolist(), None
    except RewardFunctionError as e:
        return None, ("error", f"returned a bad result ({e})")


def score_chunk(
    sources: Sequence[RewardSource],
    start: int,
    prompts: Sequence[str],
    responses: Sequence[str],
    columns: Mapping[str, Sequence],
    timeout_s: float,
) -> ChunkScores:
    """Score samples ``start .. start + n - 1`` with every source: a call on the chunk (``n * timeout_s``), and
    after a failure one call per sample (``timeout_s`` each). Raises :class:`RewardFunctionError` only for a
    parameter no column can fill (a misconfiguration, not a sample failure)."""
    prompts, responses, n = list(prompts), list(responses), len(prompts)
    values: Dict[str, List[Optional[float]]] = {}
    failures: List[Failure] = []
    broken = False
    for source in sources:
        binding = bind_columns(source, list(columns))
        kwargs = {param: list(columns[col]) for param, col in binding.items()}
        got, problem = _call_one(source, prompts, responses, kwargs, n * timeout_s) if n else ([], None)
        broken |= problem is not None and problem[0] == "timeout"
        if problem is not None and n == 1:
            out: List[Optional[float]] = [None]
            failures.append(_failure(source.name, start, prompts[0], responses[0], problem))
        elif problem is not None:  # isolate the samples at fault
            out, chunk_problem = [], problem
            for k in range(n):
                one = {param: [column[k]] for param, column in kwargs.items()}
                got, problem = _call_one(source, prompts[k : k + 1], responses[k : k + 1], one, timeout_s)
                broken |= problem is not None and problem[0] == "timeout"
                out.append(None if got is None else got[0])
                if problem is not None:
                    failures.append(_failure(source.name, start + k, prompts[k], responses[k], problem))
            if all(v is not None for v in out):  # worth knowing: the chunk's result was lost for nothing
                log.warning(
                    f"warning: reward function {source.name!r} {chunk_problem[1]} on samples {start}..{start + n - 1} "
                    f"together but scored each of them alone"
                )
        else:
            out = list(got or [])
        values[source.name] = out
    return ChunkScores(start, values, failures, broken)


def _failure(name: str, index: int, prompt: str, response: str, problem: Tuple[str, str]) -> Failure:
    kind, why = problem
    return Failure(
        index,
        name,
        kind,
        f"reward function {name!r} {why} on sample {index}: prompt={clip_preview(prompt)}; "
        f"response={clip_preview(response)}",
    )


# --------------------------------------------------------------------------------------------------- the pool


class _RewardActor:
    """The body of one pool actor (a plain class; the pool wraps it with ``ray.remote``)."""

    def __init__(self, specs: Tuple[str, ...], names: List[str], timeout_s: float, index: int = 0) -> None:
        self.timeout_s, self.index = timeout_s, index
        self.sources: List[RewardSource] = []
        self.load_error: Optional[RewardFunctionError] = None
        try:  # loaded from absolute paths, named as the user wrote them
            loaded = RewardFunctionScorer(specs).load()
            self.sources = [RewardSource(name, s.fn, s.weight) for name, s in zip(names, loaded)]
        except RewardFunctionError as e:
            self.load_error = e

    def __repr__(self) -> str:  # Ray prefixes this actor's forwarded output with it
        return f"reward actor {self.index}"

    def ready(self) -> Optional[RewardFunctionError]:
        return self.load_error

    def score(self, start: int, prompts: List[str], responses: List[str], columns: Dict[str, list]) -> Any:
        try:
            return score_chunk(self.sources, start, prompts, responses, columns, self.timeout_s)
        except RewardFunctionError as e:  # a misconfiguration: the driver raises it as it is
            return str(e)


def absolute_reward_specs(specs: Sequence[str]) -> Tuple[str, ...]:
    """``specs`` with relative file paths made absolute (against this process's working directory), weights kept,
    so that an actor started elsewhere loads the same files."""
    out = []
    for spec in specs:
        name, weight = split_weight(spec)
        out.append(f"{absolute_spec(name, REWARD_SPEC)}@{weight!r}")
    return tuple(out)


class RewardPool:
    """Reward functions named by specs, scored by ``num_workers`` Ray actors (see the module docstring).

    Args:
        scorer: a :class:`~rlhf.rewards.functions.RewardFunctionScorer` or its specs (``SPEC`` or ``SPEC@WEIGHT``);
            relative file paths are resolved here, against this process's working directory.
        num_workers: actors; 0 scores in this process (same chunking and timeouts, one chunk after another).
        chunk_size: samples per chunk (one remote call per chunk).
        timeout_s: seconds one function may take per sample.
        on_error: ``"fail"``, ``"drop"`` or a number (the stand-in reward); see the module docstring.
        cpus_per_worker: Ray CPUs each actor reserves.
        start_timeout_s: the longest an actor may take to start and load the functions.
        grace_s: how much longer than its chunk's budget the driver waits for an actor before replacing it.

    Raises:
        RewardFunctionError: for a malformed spec, or one that an actor (or this process) cannot load.
        ValueError: for a bad argument, naming it.
    """

    def __init__(
        self,
        scorer: Union[RewardFunctionScorer, Sequence[str]],
        num_workers: int = 2,
        chunk_size: int = 16,
        timeout_s: float = 10.0,
        on_error: OnError = "fail",
        cpus_per_worker: float = 1.0,
        start_timeout_s: float = 120.0,
        grace_s: float = 10.0,
    ) -> None:
        for arg, value, low in (("num_workers", num_workers, 0), ("chunk_size", chunk_size, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"RewardPool: {arg} must be an int >= {low}, got {value!r}")
        for arg, number in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s), ("grace_s", grace_s)):
            if isinstance(number, bool) or not isinstance(number, numbers.Real) or not 0 < number < math.inf:
                raise ValueError(f"RewardPool: {arg} must be a positive number of seconds, got {number!r}")
        if isinstance(cpus_per_worker, bool) or not isinstance(cpus_per_worker, numbers.Real) or cpus_per_worker < 0:
            raise ValueError(f"RewardPool: cpus_per_worker must be a number >= 0, got {cpus_per_worker!r}")
        scorer = scorer if isinstance(scorer, RewardFunctionScorer) else RewardFunctionScorer(tuple(scorer))
        self.on_error: OnError = check_on_error(on_error, "RewardPool: on_error")
        self.num_workers: int = num_workers
        self.chunk_size: int = chunk_size
        self.timeout_s: float = float(timeout_s)
        self.start_timeout_s: float = float(start_timeout_s)
        self.grace_s: float = float(grace_s)
        self.names: List[str] = scorer.names
        self._weights: List[Tuple[str, float]] = [
            (name, split_weight(spec)[1]) for name, spec in zip(self.names, scorer.specs)
        ]
        self._specs: Tuple[str, ...] = absolute_reward_specs(scorer.specs)
        self._sources: List[RewardSource] = []
        self._actors: Optional[ActorSet] = None
        if num_workers == 0:
            self._sources = scorer.load()
            return
        import ray  # lazy: keeps `import rlhf.rewards` light

        self._actors = ActorSet(
            ray.remote(num_cpus=float(cpus_per_worker), max_restarts=0)(_RewardActor),
            lambda i: (self._specs, self.names, self.timeout_s, i),
            num_workers,
            self.start_timeout_s,
            lambda why: RewardFunctionError(f"reward pool ({', '.join(self.names)}): {why}"),
        )

    # ------------------------------------------------------------------------------------------------ actors

    def _budget(self, n: int) -> float:
        """The longest a chunk of ``n`` may take in an actor: every source on the chunk, then on each sample."""
        return len(self.names) * (2 * n if n > 1 else 1) * self.timeout_s

    # --------------------------------------------------------------------------------------------------- API

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], columns: Optional[Mapping[str, Sequence]] = None
    ) -> ScoreResult:
        """Score ``N`` samples with every function; the result in input order (see :class:`ScoreResult`).

        Args:
            prompts: ``N`` prompts. responses: ``N`` responses. columns: ``{field: N values}`` as for
                :func:`~rlhf.rewards.functions.compute_rewards`.

        Raises:
            RewardFunctionError: with ``on_error="fail"`` for the first failed sample; always for misaligned
                inputs, a parameter no column fills, or a pool that is shut down.
        """
        began = time.perf_counter()
        prompts, responses = list(prompts), list(responses)
        n = len(prompts)
        cols: Dict[str, list] = {key: list(column) for key, column in (columns or {}).items()}
        if len(responses) != n or any(len(column) != n for column in cols.values()):
            raise RewardFunctionError(
                f"reward pool: got {n} prompts, {len(responses)} responses and columns of lengths "
                f"{ {key: len(column) for key, column in cols.items()} }; each needs one value per prompt"
            )
        spans = [(s, min(s + self.chunk_size, n)) for s in range(0, n, self.chunk_size)]
        if self.num_workers == 0:
            chunks = [
                score_chunk(self._sources, s, prompts[s:e], responses[s:e], _rows(cols, s, e), self.timeout_s)
                for s, e in spans
            ]
        else:
            chunks = self._run_on_actors(spans, prompts, responses, cols)
        values: Dict[str, List[Optional[float]]] = {name: [None] * n for name in self.names}
        failures: List[Failure] = []
        for chunk in chunks:
            for name, got in chunk.values.items():
                values[name][chunk.start : chunk.start + len(got)] = got
            failures.extend(chunk.failures)
        return assemble(self._weights, values, failures, self.on_error, time.perf_counter() - began)

    def _run_on_actors(
        self, spans: List[Tuple[int, int]], prompts: List[str], responses: List[str], columns: Dict[str, list]
    ) -> List[ChunkScores]:
        """Chunks to free actors until all are back; a lost chunk comes back as one chunk per sample."""
        import ray  # lazy: keeps `import rlhf.rewards` light

        actors = self._actors
        if actors is None or actors.closed:
            raise RewardFunctionError("reward pool: the pool is shut down")
        queue, free = list(spans), list(range(self.num_workers))
        flying: Dict[Any, Tuple[int, int, int, float]] = {}  # ref -> (actor, start, end, deadline)
        done: List[ChunkScores] = []
        while queue or flying:
            while queue and free:
                a, (s, e) = free.pop(0), queue.pop(0)
                ref = actors[a].score.remote(s, prompts[s:e], responses[s:e], _rows(columns, s, e))
                flying[ref] = (a, s, e, time.monotonic() + self._budget(e - s) + self.grace_s)
            wait = max(0.0, min(d for *_, d in flying.values()) - time.monotonic())
            ready, _ = ray.wait(list(flying), num_returns=1, timeout=wait)
            for ref in ready:
                a, s, e, _ = flying.pop(ref)
                try:
                    got = ray.get(ref)
                except ray.exceptions.RayError as err:  # the actor died (a crash in native code, os._exit)
                    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    lost = f"died ({type(err).__name__}: {clip_plain(first, 300)})"
                    queue += self._lost(a, s, e, lost, "error", prompts, responses, done)
                    free.append(a)
                    continue
                if isinstance(got, str):  # a misconfiguration: raise it as it is
                    raise RewardFunctionError(got)
                done.append(got)
                if got.broken:  # a thread still hangs in it
                    actors.replace(a)
                free.append(a)
            now = time.monotonic()
            for ref, (a, s, e, deadline) in list(flying.items()):
                if deadline <= now:
                    del flying[ref]
                    lost = f"did not answer within {self._budget(e - s) + self.grace_s:g} s"
                    queue += self._lost(a, s, e, lost, "timeout", prompts, responses, done)
                    free.append(a)
        return done

    def _lost(
        self, a: int, s: int, e: int, why: str, kind: str, prompts: List[str], responses: List[str], done: list
    ) -> List[Tuple[int, int]]:
        """Replace actor ``a`` that lost chunk ``s:e``; the chunk's samples to score again one by one, or (a chunk of
        one) that sample's failure, for every function, added to ``done``."""
        assert self._actors is not None
        self._actors.replace(a)
        if e - s > 1:
            return [(k, k + 1) for k in range(s, e)]
        problem = (kind, f"(or another function on the same sample) made its worker fail: the actor {why}")
        failures = [_failure(name, s, prompts[s], responses[s], problem) for name in self.names]
        done.append(ChunkScores(s, {name: [None] for name in self.names}, failures, False))
        return []

    def shutdown(self) -> None:
        """Kill the actors (idempotent); the pool cannot be used afterwards."""
        if self._actors is not None:
            self._actors.kill_all()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _rows(columns: Mapping[str, list], s: int, e: int) -> Dict[str, list]:
    return {key: column[s:e] for key, column in columns.items()}
