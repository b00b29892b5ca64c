"""Every shipped cluster file (``ray_cluster/``) can host every shipped launcher (``examples/launchers/``).

The resources each file gives Ray are read from the file itself -- the ``#SBATCH`` lines and the ``ray start``
flags of ``slurm.sbatch``, the pods' ``resources.limits`` / ``rayStartParams`` of the KubeRay manifests (KubeRay
starts Ray with the container's limits unless ``rayStartParams`` says otherwise), the ``# cluster:`` line of
``cluster.yaml`` (the local provider cannot declare node types; Ray detects each machine's hardware) -- and every
launcher's ``--dry-run`` is packed onto that node shape, with as many GPU nodes as the launcher names.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Optional

import pytest
import yaml
from shared_helpers import run_main

from rlhf.distributed.packing import parse_cluster

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_DIR = ROOT / "ray_cluster"
LAUNCHERS = sorted(p for p in (ROOT / "examples" / "launchers").glob("*.sh") if p.name != "submit.sh")


@dataclasses.dataclass(frozen=True)
class Declared:
    """What one cluster file gives Ray: GPU nodes (count, GPUs, CPUs, memory) and an optional CPU-only head."""

    gpu_nodes: int
    gpus: int
    cpus: float
    memory: Optional[str]  # as written (``256Gi``, ``0`` = the whole node for SLURM); None: not declared
    head_cpus: float = 0.0  # a head node without GPUs (KubeRay); 0: the head is one of the GPU nodes

    def shape(self, gpu_nodes: int) -> str:
        """The ``--cluster`` shape with ``gpu_nodes`` GPU nodes of this file's kind."""
        head = f"1x{self.head_cpus:g}cpu+" if self.head_cpus else ""
        return f"{head}{gpu_nodes}x{self.gpus}gpu:{self.cpus:g}cpu"


def _sbatch_value(text: str, key: str) -> Optional[str]:
    m = re.search(rf"^#SBATCH --{key}=(\S+)", text, re.M)
    return m.group(1) if m else None


def read_slurm(path: Path) -> Declared:
    """``#SBATCH --nodes / --gpus-per-node / --cpus-per-task / --mem``, as each node's ``ray start`` passes them on."""
    text = path.read_text()
    found = {}
    for flag in ("cpus", "gpus"):
        values = re.findall(rf'--num-{flag}="?([^"\s]+)"?', text)
        # every node's ray start (the head's and the workers') passes the same number
        assert len(values) == 2 and len(set(values)) == 1, f"{path.name}: ray start --num-{flag}: {values}"
        found[flag] = values[0]

    def resolve(flag: str, env: str, key: str) -> str:
        # $SLURM_CPUS_PER_TASK / ${SLURM_GPUS_PER_NODE:-0} are what the #SBATCH line asks for
        return _sbatch_value(text, key) if env in flag else flag

    cpus = resolve(found["cpus"], "SLURM_CPUS_PER_TASK", "cpus-per-task")
    gpus = resolve(found["gpus"], "SLURM_GPUS_PER_NODE", "gpus-per-node")
    return Declared(
        gpu_nodes=int(_sbatch_value(text, "nodes")), gpus=int(gpus), cpus=float(cpus), memory=_sbatch_value(text, "mem")
    )


def _pod(group: dict) -> dict:
    """Ray's resources for one pod of a KubeRay group: rayStartParams first, else the container's limits."""
    container = group["template"]["spec"]["containers"][0]
    limits = container["resources"]["limits"]
    params = group.get("rayStartParams") or {}
    return {
        "cpus": float(params.get("num-cpus", limits["cpu"])),
        "gpus": int(params.get("num-gpus", limits.get("nvidia.com/gpu", 0))),
        "memory": limits.get("memory"),
    }


def read_kuberay(path: Path) -> Declared:
    spec = yaml.safe_load(path.read_text())["spec"]
    spec = spec.get("rayClusterSpec", spec)  # a RayJob wraps the RayCluster spec
    head = _pod(spec["headGroupSpec"])
    (workers,) = spec["workerGroupSpecs"]
    worker = _pod(workers)
    assert head["gpus"] == 0, f"{path.name}: the head is for the driver; no training actor should land there"
    assert workers["minReplicas"] == workers["replicas"] == workers["maxReplicas"]
    return Declared(
        gpu_nodes=int(workers["replicas"]),
        gpus=worker["gpus"],
        cpus=worker["cpus"],
        memory=worker["memory"],
        head_cpus=head["cpus"],
    )


def read_ray_up(path: Path) -> Declared:
    """``cluster.yaml``: its machines (head + workers, all GPU nodes) and the ``# cluster: NxGgpu:Ccpu`` line that
    says what each must have (the local provider cannot declare node types; Ray detects the hardware)."""
    text = path.read_text()
    config = yaml.safe_load(text)
    machines = 1 + len(config["provider"]["worker_ips"])
    m = re.search(r"^# cluster: *(\d+)x(\d+)gpu:(\d+)cpu\b", text, re.M)
    assert m, f"{path.name}: no '# cluster: NxGgpu:Ccpu' line saying what each machine must have"
    assert int(m.group(1)) == machines, f"{path.name}: '# cluster:' names {m.group(1)} machines, not {machines}"
    assert not re.search(r"--num-(cpus|gpus)", text), "a forced count would contradict the '# cluster:' line"
    return Declared(gpu_nodes=machines, gpus=int(m.group(2)), cpus=float(m.group(3)), memory=None)


CLUSTER_FILES = {
    "slurm.sbatch": read_slurm,
    "kuberay-raycluster.yaml": read_kuberay,
    "kuberay-rayjob.yaml": read_kuberay,
    "cluster.yaml": read_ray_up,
}


def _launcher(path: Path):
    text = path.read_text()
    cluster, module, config = (
        re.search(p, text, re.M).group(1) for p in (r"^# cluster: *(\S+)", r"^MODULE=(\S+)", r"^CONFIG=(\S+)")
    )
    return cluster, module, config


@pytest.mark.parametrize("name", sorted(CLUSTER_FILES))
def test_cluster_file_declares_gpu_nodes_the_projects_way(name):
    declared = CLUSTER_FILES[name](CLUSTER_DIR / name)
    assert declared.gpus == 8 and declared.gpu_nodes >= 2
    if name == "slurm.sbatch":  # the job takes whole 8-GPU nodes: all of their memory, not the site's default
        assert declared.memory == "0"
    if name.startswith("kuberay"):
        assert declared.memory is not None


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda p: p.stem)
@pytest.mark.parametrize("name", sorted(CLUSTER_FILES))
def test_every_launcher_fits_every_cluster_file(name, launcher, capsys, monkeypatch):
    declared = CLUSTER_FILES[name](CLUSTER_DIR / name)
    named, module, config = _launcher(launcher)
    needed = len([n for n in parse_cluster(named) if n.gpus])
    assert needed <= declared.gpu_nodes, f"{launcher.name} needs {needed} GPU nodes, {name} has {declared.gpu_nodes}"
    shape = declared.shape(needed)
    rc, out, err = run_main(module, ["--config", config, "--dry-run", "--cluster", shape], ROOT, capsys, monkeypatch)
    assert rc == 0 and f"result: fits on {shape}" in out, f"{launcher.name} on {name} ({shape}): {err.strip()}"
