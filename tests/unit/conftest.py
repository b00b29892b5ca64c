"""The unit tier (``make test-fast``): no Ray cluster, no actors, no training run. A test here that asks for the
``ray_session`` fixture or calls ``ray.init`` in this process fails: it belongs in ``tests/integration`` (where every
test is marked ``slow``). Subprocesses are not watched: a test that launches a CLI which starts a cluster belongs
there too. Helpers come from ``tests/shared_helpers.py`` (not ``from conftest import``: this file is a second module
named ``conftest``)."""

from __future__ import annotations

import sys

import pytest

_MOVE = "it starts Ray: move the test to tests/integration"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):  # before any fixture is set up: the session's Ray cluster is never started
    if "ray_session" in getattr(item, "fixturenames", ()):
        pytest.fail(f"{item.nodeid} uses the ray_session fixture: {_MOVE}", pytrace=False)


def _ray_is_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


@pytest.fixture(autouse=True)
def _no_ray_in_unit_tests(request, monkeypatch):
    # A test process also runs integration files (``--dist loadfile``): the session's cluster may already be up
    # when a unit test starts, and is theirs. Only a cluster this test started is its fault.
    up_before = _ray_is_up()
    ray = sys.modules.get("ray")
    if ray is not None:  # already imported: refuse ray.init at the call

        def refused(*args, **kwargs):
            raise AssertionError(f"ray.init called by a unit test: {_MOVE}")

        monkeypatch.setattr(ray, "init", refused)
    yield
    if not up_before and _ray_is_up():  # imported and started by the test itself
        sys.modules["ray"].shutdown()
        pytest.fail(f"{request.node.nodeid} left a Ray cluster running: {_MOVE}", pytrace=False)
