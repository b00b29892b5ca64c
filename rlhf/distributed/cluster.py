"""Connecting to Ray: join ``ray.address`` / ``RAY_ADDRESS`` (e.g. under ``ray job submit``), or start a local
cluster sized for the run's actors; on a cluster without GPUs, compile DeepSpeed's CPU communication op once before
the first actor needs it."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from typing import Any, Dict, Optional

from rlhf.distributed.op_lock import build_guard
from rlhf.hub import hub_env
from rlhf.utils.log import get_logger

log = get_logger(__name__)

# DeepSpeed JIT-compiles its CPU communication op (~1 min on 2 cores) into TORCH_EXTENSIONS_DIR. torch's default,
# ~/.cache/torch_extensions, is shared by every checkout and venv of a machine, and a build is keyed by its source
# paths: two checkouts used in turn rebuilt it on every switch. One cache per environment (the venv's own
# directory, `make install` fills it) is built once. Set for this process too: an in-process engine loads it here.
TORCH_EXTENSIONS_DIR = os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# Environment every actor gets; DS_ACCELERATOR is added for CPU-only groups, and the driver's hub settings
# (rlhf.hub.hub_env: cache directory, HF_HUB_OFFLINE) so that workers resolve the run's pinned snapshots as it did.
ACTOR_ENV = {
    "TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS_DIR,
    "TORCH_NO_COMPILER_WRAPPER": "1",  # the op's build key as the driver built it, whatever PATH (_BUILD_ENV)
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # DeepSpeed calls torch.distributed APIs that torch 2.13 marks deprecated, once per collective.
    "PYTHONWARNINGS": "ignore::FutureWarning",
}


# When the driver connects, a local cluster's raylet starts idle Python workers (up to its CPUs; Ray's
# prestart_worker_first_driver) for tasks to come. Every actor here asks for a runtime environment of its own
# (actor_env: its variables), which such a worker does not have, so each was started, imported Ray (1-3 s of CPU)
# and waited idle to the end of the run. The raylet starts a worker when one is due.
LOCAL_SYSTEM_CONFIG: Dict[str, Any] = {"prestart_worker_first_driver": False}

# The GCS address of the local cluster init_ray started in this process (see started_here), once it has.
_started: Dict[str, str] = {}


def init_ray(address: str = "", num_cpus: int = -1, needed_cpus: float = 1.0) -> str:
    """Initialise Ray once per driver process; returns ``"local"``, ``"existing"`` or the address joined.

    On a cluster without GPUs the trainer ranks run DeepSpeed's CPU accelerator: its communication op is compiled
    here, once, before any actor starts (``ensure_cpu_comm_op``), rather than silently inside the first actor.
    """
    import ray

    if ray.is_initialized():
        joined = "existing"
    elif address or os.environ.get("RAY_ADDRESS", ""):
        joined = address or os.environ["RAY_ADDRESS"]
        ray.init(address=joined, log_to_driver=True)
    else:
        # address="local": always a new local cluster, as documented. Without it Ray would try to join whatever
        # `ray start` last left in /tmp/ray/ray_current_cluster on this machine, even a cluster long gone.
        ray.init(
            address="local",
            num_cpus=local_num_cpus(num_cpus, needed_cpus),
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {**ACTOR_ENV, **hub_env()}},
            _system_config=LOCAL_SYSTEM_CONFIG,
        )
        joined = "local"
        _started["gcs_address"] = ray.get_runtime_context().gcs_address
    if cluster_gpus() == 0:
        ensure_cpu_comm_op()
    return joined


def started_here() -> bool:
    """Whether the cluster this process is connected to is the local one :func:`init_ray` started here (a later
    ``init_ray`` of the same process returns ``"existing"`` for it): one node, this machine, whose workers run this
    process's interpreter."""
    import ray

    return ray.is_initialized() and _started.get("gcs_address") == ray.get_runtime_context().gcs_address


def local_num_cpus(num_cpus: int, needed_cpus: float) -> int:
    """Logical CPUs of a local cluster: ``ray.num_cpus`` when set, else this machine's cores or, when the run's
    actors ask for more, that many (they take turns on the cores; ``--dry-run`` plans against the same number)."""
    return num_cpus if num_cpus > 0 else max(os.cpu_count() or 1, int(needed_cpus + 0.999))


def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0))


def actor_env(gpus_per_worker: float) -> Dict[str, str]:
    env = {**ACTOR_ENV, **hub_env()}  # read now: a driver may set its hub cache after importing this module
    if gpus_per_worker <= 0:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def actor_placement() -> Dict[str, object]:
    """Where the calling actor runs: its node, placement group id (``None`` if none) and the resources it holds."""
    import ray

    ctx = ray.get_runtime_context()
    return {
        "node": ctx.get_node_id(),
        "placement_group": ctx.get_placement_group_id(),
        "resources": dict(ctx.get_assigned_resources()),
    }


# ---------------------------------------------------------------------------- DeepSpeed's CPU communication op

SHM_COMM_OP = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME: the op's directory and library name
OP_NAME = "DeepSpeed's CPU communication op"
BUILD_MESSAGE = "compiling DeepSpeed's CPU communication op, first run only, ~1 min"
# The bound on a build and on waiting for another process's build or load of the op: a build takes ~1 min on
# 2 busy cores (one at a time); fifteen times that is a hung compiler or a wedged machine, not a slow build.
BUILD_WAIT_S = 900.0
# torch's build file names the compiler as ``ccache c++`` when ccache or sccache is on PATH, and ninja recompiles
# when that line changes. PATH is the shell's: a job's driver and actors get the Ray head's, a local run the user's,
# and where only one has ccache the op is rebuilt on every switch. Every build here goes without the wrapper.
_BUILD_ENV = {"TORCH_NO_COMPILER_WRAPPER": "1"}
# What every CPU trainer rank does on its first DeepSpeed engine (deepspeed/comm/torch.py build_shm_op); run in a
# child process so that the driver imports no DeepSpeed and the build sees the CPU accelerator.
_BUILD_CODE = "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load(verbose=False)"


def _comm_op_inputs() -> Optional[Dict[str, Any]]:
    """This environment's op sources and torch headers as torch's build file names them, found without importing
    DeepSpeed; ``None`` when DeepSpeed is not installed or the op is not built here (it is Linux-only)."""
    import importlib.util

    ds, torch_spec = importlib.util.find_spec("deepspeed"), importlib.util.find_spec("torch")
    if sys.platform != "linux" or ds is None or torch_spec is None:
        return None
    # Both are packages (find_spec found their directories), so their search locations are set.
    assert ds.submodule_search_locations is not None and torch_spec.submodule_search_locations is not None
    # DeepSpeed passes absolute source paths under deepspeed/ops (OpBuilder.deepspeed_src_path), torch its headers
    comm = os.path.join(os.path.abspath(ds.submodule_search_locations[0]), "ops", "csrc", "cpu", "comm")
    return {
        "sources": [os.path.join(comm, name) for name in ("shm_interface.cpp", "shm.cpp")],
        "torch_include": os.path.join(os.path.abspath(torch_spec.submodule_search_locations[0]), "include"),
        # torch's compiler line (cpp_extension.get_cxx_compiler; no ccache wrapper under _BUILD_ENV)
        "cxx": shlex.join([os.environ.get("CXX", "c++")]),
    }


def cpu_comm_op_built(extensions_dir: str = "") -> bool:
    """Whether DeepSpeed's CPU communication op is compiled in ``extensions_dir`` (default ``TORCH_EXTENSIONS_DIR``)
    for this environment, by file checks only.

    torch (``cpp_extension.load``) builds into ``<dir>/deepspeed_shm_comm/`` with ninja, which recompiles when the
    build file changes (other source paths or torch headers, i.e. another DeepSpeed or torch install; another
    ``CXX``; the ``-O2 -fopenmp`` flags are fixed) or a source is newer than the library. The same tests here:
    the library exists, is newer than its build file and sources, and the build file names this environment's
    sources, torch headers and compiler. Nothing in it depends on the working directory (every path is DeepSpeed's
    or torch's, absolute), so a job running from Ray's copy of the checkout finds the local run's build.
    """
    inputs = _comm_op_inputs()
    if inputs is None:
        return True  # nothing that DeepSpeed would build
    build_dir = os.path.join(extensions_dir or TORCH_EXTENSIONS_DIR, SHM_COMM_OP)
    ninja_file = os.path.join(build_dir, "build.ninja")
    try:
        built = os.path.getmtime(os.path.join(build_dir, SHM_COMM_OP + ".so"))
        newest_input = max(os.path.getmtime(path) for path in [ninja_file, *inputs["sources"]])
        with open(ninja_file, encoding="utf-8") as f:
            rules = f.read()
    except OSError:
        return False
    names_this_env = (
        all(f": compile {src}\n" in rules for src in inputs["sources"])
        and f"-isystem {inputs['torch_include']} " in rules
        and f"\ncxx = {inputs['cxx']}\n" in rules
    )
    return names_this_env and built >= newest_input


def ensure_cpu_comm_op(extensions_dir: str = "", wait_s: float = BUILD_WAIT_S) -> bool:
    """Compile DeepSpeed's CPU communication op into ``extensions_dir`` (default ``TORCH_EXTENSIONS_DIR``, the
    directory every actor is given) unless it is there, saying so; returns whether this call compiled it.

    Every process that loads the op afterwards (actors, test processes) finds it built. Processes that start a
    build at once do not build twice: they take turns on the op's guard (:mod:`rlhf.distributed.op_lock`), the
    second finds the op built. A lock that a killed build left (``<dir>/deepspeed_shm_comm/lock``: torch's, on
    which every later load would spin for ever, built or not) is removed, saying so; a wait on a live build says
    whom it waits for and gives up after ``wait_s``. Nodes other than the driver's build their own copy in their
    first actor (``load_cpu_comm_op``), saying so too.

    Raises:
        RuntimeError: the build failed (no C++ compiler, no ninja); the message ends with the compiler's output.
        op_lock.OpLockTimeout: another process's build or lock outlasted ``wait_s``; the message names the lock.
    """
    extensions_dir = extensions_dir or TORCH_EXTENSIONS_DIR
    build_dir = os.path.join(extensions_dir, SHM_COMM_OP)
    if cpu_comm_op_built(extensions_dir) and not os.path.exists(os.path.join(build_dir, "lock")):
        return False  # the usual case: no import, no output
    if _comm_op_inputs() is None:
        return False
    with build_guard(build_dir, wait_s, OP_NAME, _say):
        if cpu_comm_op_built(extensions_dir):
            return False
        _say(f"{BUILD_MESSAGE} (into {extensions_dir})")
        start = time.time()
        env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=extensions_dir, **_BUILD_ENV)
        try:
            done = subprocess.run(
                [sys.executable, "-c", _BUILD_CODE], env=env, capture_output=True, text=True, timeout=wait_s
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(
                f"compiling {OP_NAME} into {extensions_dir} took over {wait_s:.0f} s; stopped. If "
                f"{build_dir}/lock is left, the next run removes it"
            ) from e
        if done.returncode != 0:
            raise RuntimeError(
                f"compiling {OP_NAME} into {extensions_dir} failed "
                f"(exit {done.returncode}):\n{_tail(done.stdout + done.stderr)}"
            )
    _say(f"DeepSpeed's CPU communication op is ready ({time.time() - start:.0f} s)")
    return True


def load_cpu_comm_op(extensions_dir: str = "", wait_s: float = BUILD_WAIT_S) -> None:
    """Load DeepSpeed's CPU communication op in this process (a CPU trainer rank, before
    ``deepspeed.init_distributed``), under the op's guard: a lock a killed build left is removed, a wait on another
    rank's build or load is bounded and named, and a build here (a node other than the driver's) is announced.

    DeepSpeed keeps the loaded op (``OpBuilder._loaded_ops``): its own load in ``init_distributed`` then takes no
    lock. Does nothing where DeepSpeed would not load it (no ShareMemCommBuilder for the accelerator, or not
    compatible).

    Raises:
        op_lock.OpLockTimeout: another process's build or lock outlasted ``wait_s``; the message names the lock.
    """
    extensions_dir = extensions_dir or TORCH_EXTENSIONS_DIR
    if _comm_op_inputs() is None:
        return
    os.environ.update(_BUILD_ENV, TORCH_EXTENSIONS_DIR=extensions_dir)  # where torch's load builds, as guarded
    with build_guard(os.path.join(extensions_dir, SHM_COMM_OP), wait_s, OP_NAME, _say):
        if not cpu_comm_op_built(extensions_dir):
            _say(f"{BUILD_MESSAGE} (into {extensions_dir} on {socket.gethostname()})")
        _deepspeed_load()


def _deepspeed_load() -> None:
    # What deepspeed/comm/torch.py build_shm_op does, without its print (init_distributed prints it once)
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)


def _say(line: str) -> None:
    # on stderr (a warning's level): a slow one-off build that the user should know of, not a line of the run's output
    log.warning(line)


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
