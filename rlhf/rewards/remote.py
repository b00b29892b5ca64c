"""A reward served over HTTP: batches of samples POSTed as JSON to a scoring service (a judge model, a sandbox).

Protocol. Each request is a ``POST`` of ``{"prompts": [...], "responses": [...], <column>: [...], ...}`` (every
column of the prompt rows, sliced to the batch) with ``Content-Type: application/json``; the answer must be
``200`` with ``{"rewards": [one finite number per sample]}``.

Behaviour (:class:`HttpReward`):

* the samples are cut into consecutive batches of ``batch_size``, up to ``concurrency`` requests in flight;
* a request of ``n`` samples may take ``max(min_timeout_s, n * timeout_s)`` seconds per socket operation
  (connecting, each read: the standard library's timeout, not a deadline on the whole exchange);
* connection errors, timeouts, ``429`` and ``5xx`` are retried up to ``retries`` times, after
  ``backoff_s * 2**attempt`` seconds (capped at ``max_backoff_s``, plus up to 10% random jitter so that many
  clients do not retry in step);
* any other status, or a malformed answer (not JSON, no ``rewards`` list, the wrong length, a bool, a non-number
  or a non-finite value), is not retried: the service answered, and asking again would get the same;
* a batch that still failed applies ``on_error`` to each of its samples (see :mod:`rlhf.rewards.results`); the
  message names the URL, the batch's sample range, the status and a clipped body.

Standard library only (``urllib``): no client dependency. Proxies come from the environment (``http_proxy``,
``no_proxy``) unless ``trust_env=False``.
"""

from __future__ import annotations

import http.client
import json
import math
import numbers
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from rlhf.rewards.functions import RewardFunctionError, clip_preview
from rlhf.rewards.results import Failure, OnError, ScoreResult, assemble, check_on_error
from rlhf.utils.specs import clip_plain

__all__ = ["HttpReward"]

_BODY_CHARS = 300  # answer bodies quoted in error messages are cut to this length
_FLOAT32_MAX = 3.4028234663852886e38  # a reward beyond it would become inf in the float32 tensors


class _Problem(Exception):
    """Why one request failed: ``kind`` is ``"error"`` or ``"timeout"``; ``retry`` whether asking again may help."""

    def __init__(self, kind: str, why: str, retry: bool) -> None:
        super().__init__(why)
        self.kind, self.why, self.retry = kind, why, retry


@dataclass(frozen=True)
class _BatchOutcome:
    start: int
    values: Optional[List[float]]  # None: the batch failed
    problem: Optional[_Problem]
    attempts: int


class HttpReward:
    """A reward source whose values come from an HTTP service (protocol in the module docstring).

    Use :meth:`score` for the rewards together with the failed mask and the counts; calling the object with the
    reward-function signature ``(prompts, responses, **columns) -> list of floats`` lets it stand in a
    :class:`~rlhf.rewards.functions.RewardSource` (its ``**columns`` receives every column); there ``on_error="drop"``
    cannot be expressed, so a dropped sample raises, and :attr:`last_result` holds the last call's result.

    Args:
        url: the endpoint (``http://`` or ``https://``).
        batch_size: samples per request.
        timeout_s: seconds per sample in a request (the request's timeout is ``n * timeout_s``, at least
            ``min_timeout_s``).
        retries: how many times a failed request is sent again (0: once only).
        backoff_s: seconds before the first retry, doubling each time (capped at ``max_backoff_s``).
        concurrency: requests in flight at once.
        on_error: ``"fail"``, ``"drop"`` or a stand-in reward (see :mod:`rlhf.rewards.results`).
        weight: the source's weight in :attr:`ScoreResult.total`.
        headers: extra request headers (an ``Authorization`` token, ...).
        trust_env: take proxies from the environment.

    Raises:
        ValueError: for a bad argument, naming it.
    """

    def __init__(
        self,
        url: str,
        batch_size: int = 32,
        timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        concurrency: int = 4,
        on_error: OnError = "fail",
        weight: float = 1.0,
        min_timeout_s: float = 1.0,
        max_backoff_s: float = 30.0,
        headers: Optional[Mapping[str, str]] = None,
        trust_env: bool = True,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpReward: url must start with http:// or https://, got {url!r}")
        for arg, count, low in (
            ("batch_size", batch_size, 1),
            ("retries", retries, 0),
            ("concurrency", concurrency, 1),
        ):
            if not isinstance(count, int) or isinstance(count, bool) or count < low:
                raise ValueError(f"HttpReward: {arg} must be an int >= {low}, got {count!r}")
        for arg, number in (("timeout_s", timeout_s), ("min_timeout_s", min_timeout_s)):
            if isinstance(number, bool) or not isinstance(number, numbers.Real) or not 0 < number < math.inf:
                raise ValueError(f"HttpReward: {arg} must be a positive number of seconds, got {number!r}")
        for arg, number in (("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s), ("weight", weight)):
            if isinstance(number, bool) or not isinstance(number, numbers.Real) or not math.isfinite(number):
                raise ValueError(f"HttpReward: {arg} must be a finite number, got {number!r}")
        if backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(f"HttpReward: backoff_s and max_backoff_s must be >= 0, got {backoff_s}, {max_backoff_s}")
        self.url, self.batch_size, self.retries, self.concurrency = url, batch_size, retries, concurrency
        self.timeout_s, self.min_timeout_s = float(timeout_s), float(min_timeout_s)
        self.backoff_s, self.max_backoff_s, self.weight = float(backoff_s), float(max_backoff_s), float(weight)
        self.on_error: OnError = check_on_error(on_error, "HttpReward: on_error")
        self.headers = {"Content-Type": "application/json", **dict(headers or {})}
        handlers = [] if trust_env else [urllib.request.ProxyHandler({})]
        self._opener = urllib.request.build_opener(*handlers)
        self._jitter = random.Random()
        self.last_result: Optional[ScoreResult] = None

    @property
    def name(self) -> str:
        """The source's name in metrics and messages: ``http:<url>``."""
        return f"http:{self.url}"

    def __repr__(self) -> str:
        return f"HttpReward({self.url!r}, batch_size={self.batch_size}, on_error={self.on_error!r})"

    # --------------------------------------------------------------------------------------------------- API

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], columns: Optional[Mapping[str, Sequence]] = None
    ) -> ScoreResult:
        """Score ``N`` samples; the values (float32 ``(N,)`` under :attr:`name`), masks and counts.

        Raises:
            RewardFunctionError: with ``on_error="fail"`` for the first failed batch (naming URL, sample range,
                status and body); always for misaligned inputs, a column named ``prompts`` or ``responses``, or
                one that JSON cannot encode.
        """
        began = time.perf_counter()
        prompts, responses = [str(p) for p in prompts], [str(r) for r in responses]
        n = len(prompts)
        cols = self._check_columns(n, len(responses), columns or {})
        spans = [(s, min(s + self.batch_size, n)) for s in range(0, n, self.batch_size)]
        bodies = [self._body(prompts, responses, cols, s, e) for s, e in spans]
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(spans)))) as pool:
            outcomes = list(pool.map(self._send, [s for s, _ in spans], [e - s for s, e in spans], bodies))
        values: List[Optional[float]] = [None] * n
        failures: List[Failure] = []
        for (s, e), out in zip(spans, outcomes):
            if out.values is not None:
                values[s:e] = out.values
                continue
            assert out.problem is not None  # set whenever values is None
            tries = f"{out.attempts} attempt{'s' if out.attempts > 1 else ''}"
            for i in range(s, e):
                failures.append(
                    Failure(
                        i,
                        self.name,
                        out.problem.kind,
                        f"HTTP reward {self.url} failed on samples {s}..{e - 1} "
                        f"(sample {i}: prompt={clip_preview(prompts[i])}"
                        f"; response={clip_preview(responses[i])}) after {tries}: {out.problem.why}",
                    )
                )
        retried = sum(out.attempts - 1 for out in outcomes)
        result = assemble(
            [(self.name, self.weight)],
            {self.name: values},
            failures,
            self.on_error,
            time.perf_counter() - began,
            retried,
        )
        self.last_result = result
        return result

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **columns: Sequence) -> List[float]:
        """The reward-function form: one float per sample (see the class docstring for ``"drop"``)."""
        result = self.score(prompts, responses, columns)
        if bool(result.failed.any()):
            first = result.failures[0].message
            raise RewardFunctionError(
                f"{first}; on_error='drop' needs the failed mask, which the reward-function form cannot return: "
                f"use HttpReward.score"
            )
        return result.per_source[self.name].tolist()

    # ---------------------------------------------------------------------------------------------- requests

    def _check_columns(self, n: int, n_responses: int, columns: Mapping[str, Sequence]) -> Dict[str, list]:
        cols = {key: list(column) for key, column in columns.items()}
        if n_responses != n or any(len(column) != n for column in cols.values()):
            raise RewardFunctionError(
                f"HTTP reward {self.url}: got {n} prompts, {n_responses} responses and columns of lengths "
                f"{ {key: len(column) for key, column in cols.items()} }; each needs one value per prompt"
            )
        for key, column in cols.items():
            if key in ("prompts", "responses"):
                raise RewardFunctionError(
                    f"HTTP reward {self.url}: a column may not be named {key!r} (the request uses that key)"
                )
            try:
                json.dumps(column)
            except (TypeError, ValueError) as e:
                raise RewardFunctionError(
                    f"HTTP reward {self.url}: column {key!r} cannot be sent as JSON ({e})"
                ) from None
        return cols

    @staticmethod
    def _body(prompts: List[str], responses: List[str], cols: Dict[str, list], s: int, e: int) -> bytes:
        payload = {"prompts": prompts[s:e], "responses": responses[s:e], **{k: c[s:e] for k, c in cols.items()}}
        return json.dumps(payload).encode("utf-8")

    def _send(self, start: int, n: int, body: bytes) -> _BatchOutcome:
        """POST one batch, retrying what may succeed on a second try."""
        attempt = 0
        while True:
            try:
                return _BatchOutcome(start, self._post(body, n), None, attempt + 1)
            except _Problem as problem:
                if not problem.retry or attempt >= self.retries:
                    return _BatchOutcome(start, None, problem, attempt + 1)
            delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
            time.sleep(delay * (1.0 + 0.1 * self._jitter.random()))
            attempt += 1

    def _post(self, body: bytes, n: int) -> List[float]:
        timeout = max(self.min_timeout_s, n * self.timeout_s)
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with self._opener.open(request, timeout=timeout) as answer:
                status, text = answer.status, answer.read()
        except urllib.error.HTTPError as e:
            status, text = e.code, _read(e)
        except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as e:
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            if isinstance(reason, TimeoutError):
                raise _Problem("timeout", f"no answer within {timeout:g} s (timed out)", True) from None
            raise _Problem("error", f"connection failed: {type(reason).__name__}: {reason}", True) from None
        if status != 200:
            retry = status == 429 or status >= 500
            raise _Problem(
                "error", f"status {status}: {clip_preview(text.decode('utf-8', 'replace'), _BODY_CHARS)}", retry
            )
        return _parse(text, n, status)


def _read(error: urllib.error.HTTPError) -> bytes:
    try:
        return error.read()
    except Exception:  # the body of an error answer is only quoted
        return b""


def _parse(text: bytes, n: int, status: int) -> List[float]:
    """The ``rewards`` of an answer, or a :class:`_Problem` (not retried) saying what is wrong with it."""
    quoted = clip_preview(text.decode("utf-8", "replace"), _BODY_CHARS)

    def bad(what: str) -> _Problem:
        return _Problem("error", f"status {status} but {what}; body: {quoted}", False)

    try:
        answer = json.loads(text)
    except ValueError:
        raise bad("the body is not JSON") from None
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    if not isinstance(rewards, list):
        raise bad('the body is not an object with a "rewards" list')
    if len(rewards) != n:
        raise bad(f"{len(rewards)} rewards for {n} samples")
    out = []
    for i, value in enumerate(rewards):
        try:
            number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
        except OverflowError:  # an int beyond float range
            number = math.inf
        if not math.isfinite(number) or abs(number) > _FLOAT32_MAX:
            raise bad(f"reward {i} of the batch is {clip_plain(repr(value), 80)}, not a finite float32 number")
        out.append(number)
    return out
