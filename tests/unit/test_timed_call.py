"""rlhf.utils.actors.timed_call, which both actor pools run user code through: a value or the code's own exception
comes back; code still running at the timeout is Hung, and the caller goes on while it runs. No Ray."""

from __future__ import annotations

import threading
import time

import pytest

from rlhf.utils.actors import Hung, timed_call


def test_the_value_comes_back_from_the_thread():
    names = []

    def fn():
        names.append(threading.current_thread().name)
        return 42

    assert timed_call(fn, 5.0, "rlhf-test-call") == 42
    assert names == ["rlhf-test-call"]  # it ran in its own thread, named for a stack dump


def test_the_codes_own_exception_is_raised_as_it_was():
    class Odd(Exception):
        pass

    def fn():
        raise Odd("bad sample 3")

    with pytest.raises(Odd, match="bad sample 3"):
        timed_call(fn, 5.0, "rlhf-test-call")


def test_code_still_running_at_the_timeout_is_hung_and_left_behind():
    release = threading.Event()
    began = time.monotonic()
    with pytest.raises(Hung):
        timed_call(lambda: release.wait(30), 0.2, "rlhf-test-hang")
    waited = time.monotonic() - began
    assert 0.2 <= waited < 20  # gave up at the timeout, not when the code finished
    assert any(t.name == "rlhf-test-hang" and t.daemon for t in threading.enumerate())  # still running, daemon
    release.set()
