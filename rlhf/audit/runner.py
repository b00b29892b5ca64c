"""The audit's runs: the first N steps of a config under each factorisation, through the real trainers.

Every run is the user's config with these changes (:func:`audit_overrides`): ``train.max_steps`` = the audit's
steps (RL: RL steps), a temporary ``train.output_dir`` of its own, ``final/`` saved (its weights are compared), no
checkpoints, held-out evaluation, TensorBoard, W&B or progress bar, the health guard warning instead of stopping,
and (``--precision fp64``) ``strategy.precision=fp64``; then the factorisation's ``train.micro_batch_size`` and
``train.num_workers`` (:func:`split_overrides`). fp64 trains on ZeRO 0 only (DeepSpeed's ZeRO 1-3 keep float32
masters), so ``--precision fp64`` runs set ``strategy.zero_stage=0`` too. Keys the run owns are removed from a user
DeepSpeed JSON for the runs (the lint has already checked them against the configured run; every other split, and
fp64, would contradict them).

The runs share one Ray cluster, joined or started here as a training command would (``ray.address`` /
``RAY_ADDRESS``, else a local one); each run's console output goes to ``<label>.log`` next to its output
directory, and not to the audit's console (:func:`run_one`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, TextIO

from rlhf.audit.compare import WeightsDiff
from rlhf.audit.factorizations import Factorization, Fits
from rlhf.config.schema import RunConfig
from rlhf.distributed.cluster import cluster_gpus, init_ray
from rlhf.distributed.resource_plan import resolve_devices
from rlhf.trainers.kinds import kind_of
from rlhf.utils.log import capture
from rlhf.utils.metrics import METRICS_FILE, read_metrics

# Fields of a user DeepSpeed JSON that the run sets (rlhf.distributed.engine.build_ds_config) and that differ
# between factorisations.
_SPLIT_FIELDS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
# Fields that name a precision: checked against the configured one by the lint; an fp64 run would refuse them.
_FP64_FIELDS = ("communication_data_type", "bf16", "fp16", "torch_autocast")


class RunFailed(RuntimeError):
    """A run of the audit failed; ``log`` is its console output's file, ``cause`` the exception."""

    def __init__(self, label: str, cause: BaseException, log: str) -> None:
        super().__init__(f"the {label} run failed: {cause}")
        self.label, self.cause, self.log = label, cause, log


@dataclass(frozen=True)
class RunOutcome:
    factorization: Factorization
    rows: List[dict]
    final_dir: Optional[str]
    seconds: float


def audit_overrides(
    cfg: RunConfig, steps: int, output_dir: str, precision: str = "", deepspeed_config: str = ""
) -> List[str]:
    """What every run of the audit changes in the user's config (module docstring)."""
    t = cfg.train
    max_steps = steps if t.max_steps == -1 else min(steps, t.max_steps)
    out = [
        f"train.max_steps={max_steps}",
        f"train.output_dir={output_dir}",
        "train.overwrite=false",
        "train.resume=false",
        "train.save_final=true",
        "train.save_every=0",
        "train.stop_after_steps=0",
        "train.eval_every=0",
        "train.skip_steps=[]",
        "train.on_failure=exit",
        "data.eval_path=",
        "logging.tensorboard=false",
        "logging.wandb=false",
        "logging.progress_bar=off",
        "logging.console=line",
        f"health.action={'off' if cfg.health.action == 'off' else 'warn'}",
    ]
    if precision == "fp64":  # DeepSpeed trains float64 end to end on ZeRO 0 only (rlhf.config.schema.StrategyConfig)
        out += ["strategy.precision=fp64", "strategy.zero_stage=0", "strategy.offload_optimizer=false"]
    elif precision:
        out.append(f"strategy.precision={precision}")
    if deepspeed_config:
        out.append(f"strategy.deepspeed_config={deepspeed_config}")
    return out


def split_overrides(cfg: RunConfig, f: Factorization) -> List[str]:
    """``train.micro_batch_size`` and ``train.num_workers`` of ``f``; online RL: the groups tied to the policy's
    ranks follow (a critic with as many ranks, a colocated reward model, hybrid-engine vLLM engines). Under a token
    budget (``train.max_tokens_per_micro_batch``) the configured run keeps it and the others cut by rows: the
    budget's cut must train as the row cuts do."""
    out = [
        f"train.micro_batch_size={f.micro}",
        f"train.num_workers={f.ranks}",
        f"strategy.sequence_parallel_size={f.sequence}",
    ]
    if cfg.train.max_tokens_per_micro_batch and f.why != "configured":
        out.append("train.max_tokens_per_micro_batch=0")
    return out + kind_of(cfg).audit_overrides(cfg, f.micro, f.ranks)  # the trainer's groups tied to the ranks


def split_fits(cfg: RunConfig) -> Fits:
    """Whether a ``(micro, ranks)`` split fits the trainer's other groups (online RL with a critic: its ranks, tied
    to the policy's or fixed, must divide the global batch too)."""
    kind = kind_of(cfg)
    return lambda micro, ranks: kind.audit_split_fits(cfg, micro, ranks)


def runs_deepspeed_config(user: Optional[dict], workdir: str, fp64: bool = False) -> str:
    """A copy of the user's DeepSpeed JSON for the runs, without the split fields (and for ``--precision fp64``,
    without the precision fields and the ZeRO stage, which the fp64 runs set); ``""`` when none is needed."""
    if not user:
        return ""
    drop = _SPLIT_FIELDS + (_FP64_FIELDS if fp64 else ())
    if not any(k in user for k in drop) and not (fp64 and "stage" in (user.get("zero_optimization") or {})):
        return ""
    copy = {k: v for k, v in user.items() if k not in drop}
    if fp64 and isinstance(copy.get("zero_optimization"), dict):
        copy["zero_optimization"] = {k: v for k, v in copy["zero_optimization"].items() if k != "stage"}
    if fp64 and isinstance(copy.get("data_types"), dict):
        copy["data_types"] = {k: v for k, v in copy["data_types"].items() if k != "grad_accum_dtype"}
    path = os.path.join(workdir, "deepspeed.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(copy, f, indent=1)
    return path


# ----------------------------------------------------------------------------------------------- the cluster


@contextlib.contextmanager
def cluster(cfgs: Sequence) -> Iterator[str]:
    """Join or start Ray once for every run (sized for the largest); yields the precision the runs resolve to.
    A cluster started here is shut down at the end; one that was already up (a test session) is left alone."""
    import ray

    started = not ray.is_initialized()
    first = cfgs[0]
    init_ray(first.ray.address, first.ray.num_cpus, needed_cpus=max(kind_of(c).plan(c, 0.0).needed_cpus for c in cfgs))
    try:
        yield resolve_devices(first.strategy, cluster_gpus()).precision
    finally:
        if started:
            ray.shutdown()


def run_one(train: Callable, cfg: RunConfig, f: Factorization, log_path: str) -> RunOutcome:
    """Train ``cfg`` (one factorisation) with its console output in ``log_path``; its rows and ``final/``.

    The log gets, instead of the console: the run's own lines (the ``rlhf`` logger, :func:`rlhf.utils.log.capture`),
    its actors' output that Ray forwards to the driver (:func:`_actor_output_to`), and the driver's Python
    warnings. The audit's console shows only its own lines.

    Raises:
        RunFailed: The run raised; the caller decides what the cause means (a config error, a dead worker).
    """
    started = time.perf_counter()
    with capture(log_path, console=False) as log:
        try:
            with _actor_output_to(log), _warnings_to(log):
                result = train(cfg)
        except Exception as exc:  # noqa: BLE001 - reported with the run's label and log by the caller
            raise RunFailed(f.label, exc, log_path) from exc
    rows = read_metrics(os.path.join(cfg.train.output_dir, METRICS_FILE))
    return RunOutcome(f, rows, result.final_dir, time.perf_counter() - started)


@contextlib.contextmanager
def _actor_output_to(stream: TextIO) -> Iterator[None]:
    """The actors' stdout and stderr that Ray forwards to this driver go to ``stream`` meanwhile, each line with
    Ray's prefix (``(policy rank 0 pid=..., ip=...)``, the actor's ``__repr__``), instead of the console.

    Ray's driver prints the forwarded lines from a thread of its own, through the handlers of a dispatcher
    (``ray._private.ray_logging.global_worker_stdstream_dispatcher``; its console handler is ``"ray_print_logs"``,
    added by ``ray.init(log_to_driver=True)``, the default). No public API turns the forwarding off for a while on a
    cluster already joined (``log_to_driver`` is read once, at ``ray.init``), so this swaps the console handler
    for one writing to ``stream``, and puts it back after. Ours is added before theirs is removed, and theirs is
    back before ours goes: a batch arriving meanwhile is written twice at worst, never lost. On a Ray without
    that dispatcher the lines stay on the console.
    """
    if "ray" not in sys.modules:  # no cluster joined in this process: nothing is forwarded (and ray stays unloaded)
        yield
        return
    try:
        # ray._private: the dispatcher and Ray's printer of forwarded lines have no public form (docstring)
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher  # noqa: PLC2701
        from ray._private.worker import print_worker_logs  # noqa: PLC2701

        handlers = list(dispatcher.handlers)
    except (ImportError, AttributeError):
        yield
        return
    theirs = [(name, handler) for name, handler in handlers if name == "ray_print_logs"]
    dispatcher.add_handler(_AUDIT_HANDLER, lambda batch: print_worker_logs(batch, stream))
    dispatcher.remove_handler("ray_print_logs")
    try:
        yield
    finally:
        for name, handler in theirs:
            dispatcher.add_handler(name, handler)
        dispatcher.remove_handler(_AUDIT_HANDLER)


_AUDIT_HANDLER = "rlhf_audit_log"


@contextlib.contextmanager
def _warnings_to(stream: TextIO) -> Iterator[None]:
    """The driver's Python warnings (``warnings.warn``, printed on ``sys.stderr``) go to ``stream`` meanwhile,
    formatted as Python prints them."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if file not in (None, sys.stderr):
            shown(message, category, filename, lineno, file, line)
        else:
            stream.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def log_tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


# ----------------------------------------------------------------------------------------------- weights


def weights_diff(ref_dir: Optional[str], other_dir: Optional[str], label: str) -> WeightsDiff:
    """Relative L2 difference ``|a - b| / |a|`` of every tensor of two saved models; the worst one. Tensors are
    read one at a time (a large model is never held twice in memory)."""
    if not ref_dir or not other_dir:
        return WeightsDiff(label, float("inf"), "", "a run saved no final/ weights")
    ref, other = _tensor_files(ref_dir), _tensor_files(other_dir)
    if not ref or set(ref) != set(other):
        only_ref, only_other = sorted(set(ref) - set(other))[:3], sorted(set(other) - set(ref))[:3]
        return WeightsDiff(
            label,
            float("inf"),
            "",
            f"the saved tensors differ (only in the reference: {only_ref}, only in {label}: {only_other})",
        )
    worst, where = 0.0, ""
    for name in sorted(ref):
        a, b = _tensor(ref[name], name), _tensor(other[name], name)
        if a.shape != b.shape:
            return WeightsDiff(label, float("inf"), name, f"{name} has shape {tuple(b.shape)} vs {tuple(a.shape)}")
        rel = float((a - b).norm() / max(float(a.norm()), 1e-12))
        if not rel <= worst:  # NaN is worst too
            worst, where = rel, name
    return WeightsDiff(label, worst, where)


def _tensor_files(directory: str) -> Dict[str, str]:
    from safetensors import safe_open

    names: Dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            names.update({name: path for name in f.keys()})
    return names


def _tensor(path: str, name: str):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name).double()
