"""Connecting to Ray: join ``ray.address`` / ``RAY_ADDRESS`` (e.g. under ``ray job submit``), or start a local
cluster sized for the run's actors."""
from __future__ import annotations

import os
import sys
from typing import Dict

# DeepSpeed JIT-compiles its CPU communication op (~1 min on 2 cores) into TORCH_EXTENSIONS_DIR. torch's default,
# ~/.cache/torch_extensions, is shared by every checkout and venv of a machine, and a build is keyed by its source
# paths: two checkouts used in turn rebuilt it on every switch. One cache per environment (the venv's own
# directory, `make install` fills it) is built once. Set for this process too: an in-process engine loads it here.
TORCH_EXTENSIONS_DIR = os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# Environment every actor gets; DS_ACCELERATOR is added for CPU-only groups.
ACTOR_ENV = {
    "TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS_DIR,
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # DeepSpeed calls torch.distributed APIs that torch 2.13 marks deprecated, once per collective.
    "PYTHONWARNINGS": "ignore::FutureWarning",
}


def init_ray(address: str = "", num_cpus: int = -1, needed_cpus: float = 1.0) -> str:
    """Initialise Ray once per driver process; returns ``"local"`` or the address joined."""
    import ray

    if ray.is_initialized():
        return "existing"
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, log_to_driver=True)
        return address
    cpus = local_num_cpus(num_cpus, needed_cpus)
    # address="local": always a new local cluster, as documented. Without it Ray would try to join whatever
    # `ray start` last left in /tmp/ray/ray_current_cluster on this machine, even a cluster long gone.
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": dict(ACTOR_ENV)})
    return "local"


def local_num_cpus(num_cpus: int, needed_cpus: float) -> int:
    """Logical CPUs of a local cluster: ``ray.num_cpus`` when set, else this machine's cores or, when the run's
    actors ask for more, that many (they take turns on the cores; ``--dry-run`` plans against the same number)."""
    return num_cpus if num_cpus > 0 else max(os.cpu_count() or 1, int(needed_cpus + 0.999))


def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0))


def actor_env(gpus_per_worker: float) -> Dict[str, str]:
    env = dict(ACTOR_ENV)
    if gpus_per_worker <= 0:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def actor_placement() -> Dict[str, object]:
    """Where the calling actor runs: its node, placement group id (``None`` if none) and the resources it holds."""
    import ray

    ctx = ray.get_runtime_context()
    return {"node": ctx.get_node_id(), "placement_group": ctx.get_placement_group_id(),
            "resources": dict(ctx.get_assigned_resources())}
