"""A local cluster that ``init_ray`` starts (rlhf.distributed.cluster) starts no Ray worker before an actor asks for
one: no idle workers prestarted for the driver, and no worker for the library-version check of its one node, which
the driver's own report answers (``started_here``). Run in a subprocess: the test process has the session's
cluster, which init_ray did not start."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json
    import time

    import psutil
    import ray

    from rlhf.distributed.cluster import init_ray, started_here
    from rlhf.distributed.node_versions import check_node_versions
    from rlhf.utils.versions import TRAINING_PACKAGES

    assert init_ray(num_cpus=2) == "local" and started_here()
    assert init_ray() == "existing" and started_here()  # a later init_ray of this process: still its own cluster
    check_node_versions(TRAINING_PACKAGES, uses_gpus=False, started_here=started_here())
    time.sleep(3)  # a prestarted worker shows within a second or two
    workers = [p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith("ray::")]
    ray.shutdown()
    assert not started_here()
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    assert not started_here()  # a cluster started by someone else's ray.init
    ray.shutdown()
    print(json.dumps(workers))
    """
)


def test_a_cluster_init_ray_starts_holds_no_idle_workers():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    processes = json.loads(done.stdout.strip().splitlines()[-1])
    # Ray's own agents were seen (the scan reaches the raylet's children), and no worker: idle ones show as ray::IDLE
    assert "ray::RuntimeEnvAgent" in processes and "ray::IDLE" not in processes, processes
