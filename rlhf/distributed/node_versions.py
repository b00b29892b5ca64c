"""Every node of the Ray cluster reports its library versions before any actor starts.

The driver checks its own install before Ray starts (``rlhf.utils.versions.check_versions``), but actors run on
the nodes' installs: one Ray task per alive node, pinned there and holding no CPU (it must run on a cluster the
run's actors will fill), returns the node's :class:`~rlhf.utils.versions.NodeReport`, and
``cluster_problems`` compares them with the supported ranges and with the driver's. A node that does not answer
within ``timeout_s`` is named, not waited for.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

from rlhf.utils.log import get_logger
from rlhf.utils.versions import NodeReport, cluster_problems, local_report, raise_cluster_problems

log = get_logger(__name__)

REPORT_TIMEOUT_S = 120.0  # a fresh worker process per node: seconds; a node's runtime_env install can take longer

# Nodes whose installs passed for a (packages, uses_gpus, attn_implementation): a driver that runs several trainings
# on one cluster (the audit, with_restarts) asks the same nodes once. A replaced node comes back with a new id.
_PASSED: Dict[Tuple[Tuple[str, ...], bool, str], Set[str]] = {}


def _report_here(ip: str, gpus: float) -> NodeReport:
    """The Ray task's body: this node's report (``ip`` and ``gpus`` as ``ray.nodes()`` gives them)."""
    return local_report(ip, gpus)


def node_reports(timeout_s: float = REPORT_TIMEOUT_S, node_ids: Sequence[str] = ()) -> List[NodeReport]:
    """The :class:`NodeReport` of every alive node (or of ``node_ids``), each from a task run on that node.

    Raises:
        UnsupportedVersionError: a node did not answer within ``timeout_s``, or its report failed; the message
            names every such node by its address.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive") and (not node_ids or n["NodeID"] in node_ids)]
    task = ray.remote(num_cpus=0, max_retries=0)(_report_here)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            n["NodeManagerAddress"], float(n.get("Resources", {}).get("GPU", 0.0))
        )
        for n in nodes
    ]
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    reports, failures = [], []
    for node, ref in zip(nodes, refs):
        ip = node["NodeManagerAddress"]
        if ref not in ready:
            ray.cancel(ref, force=True)
            failures.append(
                f"node {ip}: did not report its library versions within {timeout_s:g} s (is its raylet "
                f"up and its Python environment importable?)"
            )
            continue
        try:
            reports.append(ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - a broken install there: named with its error's last line
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            failures.append(f"node {ip}: its library-version report failed: {last}")
    if failures:
        raise_cluster_problems(failures)
    return reports


def check_node_versions(
    packages: Sequence[str],
    uses_gpus: bool,
    attn_implementation: str = "auto",
    timeout_s: float = REPORT_TIMEOUT_S,
    started_here: bool = False,
) -> None:
    """Before any actor starts: every alive node has ``packages`` within their supported ranges and at the
    driver's releases, a CUDA torch where the run uses GPUs, and (warned, or refused with
    ``model.attn_implementation=flash_attention_2``) a working flash-attn on its GPU nodes.

    ``started_here``: a cluster without GPUs that this process started (``rlhf.distributed.cluster.started_here``).
    Its one node is this machine and its workers run this interpreter, so the driver's own report is the node's: no
    task, which would start worker processes of its own (Ray started two; 2-3 s of CPU each, seconds before the first
    actor).

    Raises:
        UnsupportedVersionError: one line per problem, each naming its node's address.
    """
    import ray

    key = (tuple(packages), bool(uses_gpus), attn_implementation)
    passed = _PASSED.setdefault(key, set())
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in passed]
    new = [n["NodeID"] for n in nodes]
    if not new:
        return
    if started_here:
        reports = [local_report(n["NodeManagerAddress"], 0.0) for n in nodes]
    else:
        reports = node_reports(timeout_s, new)
    problems, warnings = cluster_problems(
        local_report("the driver", 0.0), reports, packages, uses_gpus, attn_implementation
    )
    for line in warnings:
        log.warning(f"warning: {line}")
    raise_cluster_problems(problems)
    passed.update(new)
