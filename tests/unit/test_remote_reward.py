"""HttpReward against a real HTTP server on loopback: answers in order, concurrent batches, retries on 503, timeouts
on a slow or hung service with each failure policy, no retry on 400 or a malformed answer."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Dict, List, Tuple

import pytest
import torch
from shared_helpers import Service

from rlhf.rewards.functions import RewardFunctionError, RewardSource, compute_rewards
from rlhf.rewards.remote import HttpReward

PROMPTS = [f"p{i}" for i in range(7)]
RESPONSES = ["a", "bb", "ccc", "dddd", "", "ffffff", "g"]
ANSWERS = ["a", "x", "ccc", "x", "", "x", "x"]


def expected_reward(response: str, answer: str) -> float:
    """What the test service computes: length plus a bonus for a match (distinct per sample, so order shows)."""
    return len(response) + (0.5 if response == answer else 0.0)


def correct(payload: Dict[str, Any]) -> Tuple[int, bytes]:
    rewards = [expected_reward(r, a) for r, a in zip(payload["responses"], payload["answer"])]
    return 200, json.dumps({"rewards": rewards}).encode()


@pytest.fixture
def serve():
    started: List[Service] = []

    def start(behave):
        started.append(Service(behave))
        return started[-1]

    yield start
    for service in started:
        service.close()


def reward(url: str, **kw: Any) -> HttpReward:
    # Generous unless a test wants a timeout: a loaded CPU must not turn a good answer into a retry.
    kw = {"timeout_s": 2.0, "min_timeout_s": 0.05, "backoff_s": 0.01, "trust_env": False, **kw}
    return HttpReward(url, **kw)


def test_values_come_back_in_order_with_columns_sliced_per_batch(serve):
    service = serve(lambda s, payload: correct(payload))
    result = reward(service.url, batch_size=3, concurrency=2).score(PROMPTS, RESPONSES, {"answer": ANSWERS})
    want = torch.tensor([expected_reward(r, a) for r, a in zip(RESPONSES, ANSWERS)])
    name = f"http:{service.url}"
    assert torch.equal(result.per_source[name], want) and torch.equal(result.total, want)
    assert not result.failed.any() and not result.substituted.any()
    assert (result.errors, result.timeouts, result.retries) == (0, 0, 0)
    batches = sorted(service.calls, key=lambda c: c["prompts"][0])
    assert [c["prompts"] for c in batches] == [PROMPTS[0:3], PROMPTS[3:6], PROMPTS[6:7]]
    assert [c["answer"] for c in batches] == [ANSWERS[0:3], ANSWERS[3:6], ANSWERS[6:7]]


def test_batches_are_sent_concurrently(serve):
    both_in = threading.Barrier(2, timeout=5)  # each request waits for the other: only concurrent requests pass

    def behave(service, payload):
        try:
            both_in.wait()
        except threading.BrokenBarrierError:
            return 500, b"alone"
        return correct(payload)

    service = serve(behave)
    r = reward(service.url, batch_size=2, concurrency=2, retries=0, timeout_s=5.0)  # the barrier waits 5 s
    result = r.score(PROMPTS[:4], RESPONSES[:4], {"answer": ANSWERS[:4]})
    assert result.per_source[r.name].tolist() == [expected_reward(x, a) for x, a in zip(RESPONSES[:4], ANSWERS[:4])]


def test_503_is_retried_and_counted(serve):
    def behave(service, payload):
        return (503, b"busy") if len(service.calls) <= 2 else correct(payload)

    service = serve(behave)
    result = reward(service.url, batch_size=8, retries=3).score(PROMPTS, RESPONSES, {"answer": ANSWERS})
    assert len(service.calls) == 3 and result.retries == 2 and result.errors == 0
    assert result.total.tolist() == [expected_reward(r, a) for r, a in zip(RESPONSES, ANSWERS)]


def test_a_slow_service_times_out_after_retries_and_the_stand_in_is_used(serve):
    def behave(service, payload):
        time.sleep(0.6)  # past the request's timeout: 2 samples x 0.1 s
        return correct(payload)

    service = serve(behave)
    r = reward(service.url, batch_size=2, retries=1, on_error=-1.0, timeout_s=0.1)
    result = r.score(PROMPTS[:2], RESPONSES[:2])
    assert result.total.tolist() == [-1.0, -1.0] and result.substituted.tolist() == [True, True]
    assert (result.timeouts, result.errors, result.retries, len(service.calls)) == (2, 0, 1, 2)
    assert "no answer within 0.2 s" in result.failures[0].message


def hang_on_marked_prompts(service, payload):
    if "hang" in payload["prompts"]:
        service.release.wait()
    return correct(payload)


@pytest.mark.parametrize("on_error", ["fail", "drop", 0.25])
def test_a_hung_service_applies_the_policy_to_its_batch_only(serve, on_error):
    service = serve(hang_on_marked_prompts)
    prompts = ["ok", "ok", "hang", "ok", "ok"]
    r = reward(service.url, batch_size=2, retries=1, on_error=on_error, timeout_s=0.25)
    if on_error == "fail":
        with pytest.raises(RewardFunctionError) as caught:
            r.score(prompts, RESPONSES[:5], {"answer": ANSWERS[:5]})
        message = str(caught.value)
        assert service.url in message and "samples 2..3" in message and "after 2 attempts" in message
        assert "'hang'" in message and "no answer within 0.5 s" in message
        return
    result = r.score(prompts, RESPONSES[:5], {"answer": ANSWERS[:5]})
    good = [expected_reward(x, a) for x, a in zip(RESPONSES[:5], ANSWERS[:5])]
    # >= 1: a good batch that a loaded CPU slowed past 0.5 s is retried too (and then answers)
    assert result.timeouts == 2 and result.retries >= 1 and [f.index for f in result.failures] == [2, 3]
    if on_error == "drop":
        assert result.failed.tolist() == [False, False, True, True, False]
        assert result.total.tolist() == [good[0], good[1], 0.0, 0.0, good[4]]
    else:
        assert not result.failed.any() and result.substituted.tolist() == [False, False, True, True, False]
        assert result.total.tolist() == [good[0], good[1], 0.25, 0.25, good[4]]


def test_400_is_not_retried_and_names_status_and_body(serve):
    service = serve(lambda s, payload: (400, b'{"error": "unknown field answer"}'))
    with pytest.raises(RewardFunctionError) as caught:
        reward(service.url, batch_size=4, retries=3).score(PROMPTS, RESPONSES, {"answer": ANSWERS})
    message = str(caught.value)
    assert len(service.calls) == 2  # one per batch, none again
    assert "status 400" in message and "unknown field answer" in message and "samples 0..3" in message


@pytest.mark.parametrize(
    "body, what",
    [
        (b"<html>oops</html>", "not JSON"),
        (b'{"scores": [1, 2]}', '"rewards" list'),
        (b'{"rewards": [1.0]}', "1 rewards for 2 samples"),
        (b'{"rewards": [1.0, NaN]}', "reward 1 of the batch is nan"),
        (b'{"rewards": [true, 1.0]}', "reward 0 of the batch is True"),
        (b'{"rewards": [1e39, 1.0]}', "not a finite float32"),
    ],
)
def test_a_malformed_answer_is_an_error_without_retry(serve, body, what):
    service = serve(lambda s, payload: (200, body))
    result = reward(service.url, batch_size=2, retries=3, on_error="drop").score(PROMPTS[:2], RESPONSES[:2])
    assert len(service.calls) == 1 and result.retries == 0
    assert result.failed.tolist() == [True, True] and result.errors == 2
    assert what in result.failures[0].message and "status 200" in result.failures[0].message


def test_connection_refused_is_retried_then_fails_naming_the_url():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    result = reward(url, retries=2, on_error="drop").score(["p"], ["r"])
    assert result.retries == 2 and result.errors == 1 and result.failed.tolist() == [True]
    assert url in result.failures[0].message and "connection failed" in result.failures[0].message


def test_the_function_form_works_inside_compute_rewards(serve):
    service = serve(lambda s, payload: correct(payload))
    r = reward(service.url, batch_size=3)
    total, per_source = compute_rewards([RewardSource(r.name, r, 2.0)], PROMPTS, RESPONSES, {"answer": ANSWERS})
    assert torch.equal(per_source[r.name], r.score(PROMPTS, RESPONSES, {"answer": ANSWERS}).total)
    assert torch.equal(total, 2.0 * per_source[r.name])
    service_404 = serve(lambda s, payload: (404, b"no such route"))
    dropping = reward(service_404.url, on_error="drop")
    with pytest.raises(RewardFunctionError, match="use HttpReward.score"):
        dropping(["p"], ["r"])
    assert dropping.last_result is not None and dropping.last_result.failed.tolist() == [True]


def test_bad_arguments_and_columns_are_named():
    with pytest.raises(ValueError, match="on_error"):
        HttpReward("http://127.0.0.1:1/", on_error="ignore")
    with pytest.raises(ValueError, match="batch_size"):
        HttpReward("http://127.0.0.1:1/", batch_size=0)
    with pytest.raises(ValueError, match="url"):
        HttpReward("127.0.0.1:1")
    r = HttpReward("http://127.0.0.1:1/")
    with pytest.raises(RewardFunctionError, match="column 'when' cannot be sent as JSON"):
        r.score(["p"], ["r"], {"when": [object()]})
    with pytest.raises(RewardFunctionError, match="may not be named 'prompts'"):
        r.score(["p"], ["r"], {"prompts": ["x"]})
