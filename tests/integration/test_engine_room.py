"""Rollout engines that the local Ray cluster cannot place fail at once, naming the ``rollout.*`` keys, instead of
waiting for ever on engines Ray keeps pending (the session's cluster has 8 logical CPUs on one node)."""

from __future__ import annotations

import re
import threading
import time

import pytest

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.mark.parametrize("num_engines,cpus_per_engine", [(1, 9.0), (2, 5.0)], ids=["one_too_big", "two_beside"])
def test_engines_that_cannot_be_placed_fail_promptly(num_engines, cpus_per_engine):
    """9 CPUs: more than the node has; 2 x 5: each would fit alone, not both. Before the check, the first hung on
    an infeasible actor and the second on a pending one; the bound here is a hang's, not the check's speed."""
    from rlhf.distributed.packing import InfeasiblePlan
    from rlhf.rollout.vllm.engine import VLLMSpec
    from rlhf.rollout.vllm.engines import RolloutEngines

    outcome = {}

    def start():
        try:
            RolloutEngines(VLLMSpec(model_path="/nonexistent"), num_engines, cpus_per_engine=cpus_per_engine)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            outcome["error"] = exc

    began = time.monotonic()
    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "RolloutEngines is still waiting on engines Ray cannot place"
    error = outcome.get("error")
    assert isinstance(error, InfeasiblePlan), repr(error)
    # actor 1 of 2 on an idle cluster; actor 0 if an earlier test of the session still holds CPUs
    assert re.search(
        rf"cannot place rollout actor [0-{num_engines - 1}] of {num_engines} "
        rf"\({{CPU: {cpus_per_engine:g}}} each",
        str(error),
    ), str(error)
    assert str(error).endswith(
        f"rollout.num_engines={num_engines} engines x rollout.cpus_per_engine="
        f"{cpus_per_engine:g} CPUs each: lower them, or add nodes"
    )
    print(f"failed after {time.monotonic() - began:.2f} s: {error}")
