"""Helpers shared by tests in ``tests/unit`` and ``tests/integration`` (``from shared_helpers import ...``: the root
``conftest.py`` puts ``tests/`` on ``sys.path``). Kept out of ``conftest.py`` because ``tests/unit/conftest.py`` is a
second module named ``conftest``: ``from conftest import`` would find whichever was imported last."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import random
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Tuple


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(str(rng.randrange(10)) for _ in range(rng.randint(lo, hi)))


def uneven_sft_rows(n: int, seed: int) -> list[dict]:
    """Addition rows whose responses have very different lengths (1 to ~40 tokens), so micro-batches pad
    differently under every factorisation."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(30), rng.randrange(30)
        rows.append({"prompt": f"{a}+{b}=", "response": f"{a + b} {_digits(rng, 0, 18)}".strip()})
    return rows


def uneven_pair_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(30), rng.randrange(30)
        rows.append(
            {
                "prompt": f"{a}+{b}=",
                "chosen": f"{a + b} {_digits(rng, 0, 12)}".strip(),
                "rejected": f"{a + b + rng.randint(1, 5)} {_digits(rng, 0, 18)}".strip(),
                "margin": float(rng.randint(1, 3)),
            }
        )
    return rows


def uneven_unpaired_rows(n: int, seed: int) -> list[dict]:
    """KTO rows (TRL's unpaired layout): a sum prompt, a right (desirable) or wrong (undesirable) answer of uneven
    length; about 3 in 5 desirable."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(30), rng.randrange(30)
        good = rng.random() < 0.6
        answer = a + b if good else a + b + rng.randint(1, 5)
        rows.append({"prompt": f"{a}+{b}=", "completion": f"{answer} {_digits(rng, 0, 16)}".strip(), "label": good})
    return rows


def uneven_sft_batch(tokenizer, n: int, seed: int, max_length: int = 64):
    """:func:`uneven_sft_rows` tokenized and collated as the SFT trainer does: one ``(n, T)`` batch."""
    from rlhf.data.tokenize import collate_sft, tokenize_sft

    rows = uneven_sft_rows(n, seed=seed)
    examples = tokenize_sft(rows, tokenizer, max_length=max_length, prompt_key="prompt", response_key="response")
    return collate_sft(examples.examples, tokenizer.pad_token_id)


def uneven_pair_batch(tokenizer, n: int, seed: int, max_length: int = 64):
    """:func:`uneven_pair_rows` tokenized and collated as the DPO trainer does: one ``(n, 2, T)`` batch."""
    from rlhf.data.tokenize import collate_pairs, tokenize_pairs

    examples = tokenize_pairs(
        uneven_pair_rows(n, seed=seed),
        tokenizer,
        max_length=max_length,
        prompt_key="prompt",
        chosen_key="chosen",
        rejected_key="rejected",
    )
    return collate_pairs(examples.examples, tokenizer.pad_token_id)


def kill_an_actor_once(checkpoint_dir: str, title: str, while_saving: bool = False):
    """A thread that SIGKILLs one live actor process titled ``title...`` (Ray names an actor's process
    ``ray::<Class>``) once ``checkpoint_dir`` exists (``while_saving``: once its ``.tmp`` is being written): a real
    crash. A test process runs one training at a time, so its live actors belong to that run. Returns the thread
    and a dict that gets the killed ``pid``."""
    import signal
    import threading
    import time

    import psutil

    killed = {}

    def watch():
        deadline = time.time() + 300
        watched = (checkpoint_dir + ".tmp", checkpoint_dir) if while_saving else (checkpoint_dir,)
        while time.time() < deadline and not any(map(os.path.isdir, watched)):
            time.sleep(0.02)
        # Only this test process's own actors (its local Ray cluster's workers descend from it): a parallel
        # test process's run is left alone.
        for proc in psutil.Process().children(recursive=True):
            try:
                cmdline = proc.cmdline()
            except psutil.Error:
                continue
            if cmdline and cmdline[0].startswith(title):
                killed["pid"] = proc.pid
                os.kill(proc.pid, signal.SIGKILL)
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, killed


def wait_until_dead(handle, timeout_s: float = 120.0) -> None:
    """``ray.kill`` is asynchronous: on a loaded machine a call made right after it can still be served."""
    import time

    import ray

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed actor still answers")


def wait_until(condition, timeout_s: float = 60.0) -> None:
    """``ray.kill`` is asynchronous: wait for its effect, failing after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "still not so after the kill"
        time.sleep(0.2)


def live_placement_groups() -> set:
    """The ids of this Ray cluster's placement groups not removed."""
    import ray

    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def run_main(module: str, argv, cwd, capsys, monkeypatch):
    """``python -m <module> argv...`` in this process, from ``cwd`` and outside any Ray cluster:
    ``(exit status, stdout, stderr)``."""
    import importlib

    monkeypatch.chdir(cwd)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc = importlib.import_module(module).main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def load_example(path, name: str):
    """Import the example file ``path`` as module ``name``. Its objects go to the Ray workers by value, as they do
    when the example runs as ``__main__`` (the workers cannot import a module from ``examples/``)."""
    import ray

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module loader for {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module


@contextlib.contextmanager
def tee_stdout():
    """What the block prints, passed on to stdout and kept: ``with tee_stdout() as printed: ...; printed.getvalue()``
    (for module-scoped fixtures, which have no ``capsys``)."""
    printed = _Tee(sys.stdout)
    with contextlib.redirect_stdout(printed):
        yield printed


class _Tee(io.StringIO):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def write(self, text):
        self.out.write(text)
        return super().write(text)

    def flush(self):
        self.out.flush()


def float64_model(path: str):
    """A causal LM from ``path`` computing in float64 throughout, for split-vs-whole checks of the objectives'
    arithmetic that float32 rounding would blur (sums of mixed-sign terms: 1.5e-6 relative between splits in float32,
    ~1e-15 here). transformers' Qwen2RMSNorm rounds its output to float32 whatever the model's dtype, so inputs that
    differ by float64 rounding (another padding width) can round to float32 values one ulp (6e-8) apart: its forward
    is replaced by the same formula in the input's dtype. The rotary cos/sin, transformers' other float32 step, is a
    function of the position only: the same bits in every layout."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen2RMSNorm"]
    assert norms, f"no Qwen2RMSNorm in {path}: revisit float64_model"

    def in_own_dtype(norm):  # w * h / sqrt(mean(h^2) + eps), transformers' formula without the float32 cast
        return lambda h: norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    for norm in norms:
        norm.forward = in_own_dtype(norm)
    return model


def comm_op_links(extensions_dir) -> int:
    """Builds of DeepSpeed's CPU communication op recorded by ninja under ``extensions_dir``: one link of the
    library per build (0 when it was never built there)."""
    from rlhf.distributed.cluster import SHM_COMM_OP

    log = os.path.join(str(extensions_dir), SHM_COMM_OP, ".ninja_log")
    if not os.path.isfile(log):
        return 0
    with open(log, encoding="utf-8") as f:
        return sum(1 for line in f.read().splitlines() if line.split("\t")[3:4] == [f"{SHM_COMM_OP}.so"])


def tiny_qwen_config(vocab: int):
    """The one-layer Qwen2 config the objective tests compute on: sdpa attention (as runs load), pad id 0.

    Not eager: transformers' eager attention takes its softmax in float32 whatever the model's dtype, and float32's
    vectorised softmax rounds a row differently at another padded width (its SIMD tail moves; where depends on the
    CPU's vector width). On an AMD EPYC a float64 row alone and padded to 10 columns then differed by 2.5e-8 in its
    logits, and the float64 references (compared at 1e-11) failed; sdpa computes in float64 (1e-17)."""
    import transformers

    # mypy reads the config's fields-only __init__ (dataclass_transform); at run time the config's __init__ passes
    # other keywords, attn_implementation among them, to its __post_init__ (transformers' wrap_init_to_accept_kwargs)
    return transformers.Qwen2Config(  # type: ignore[call-arg]
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        attn_implementation="sdpa",
    )


def tiny_float64_policy(vocab: int):
    """A causal LM of :func:`tiny_qwen_config` in float64, initialised under ``torch.manual_seed(0)``."""
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(tiny_qwen_config(vocab)).double()


def padded_rows(lengths, vocab: int, gen):
    """``(input_ids, attention_mask, loss_mask)`` of right-padded rows of ``(prompt, response)`` token counts: ids
    drawn from ``gen`` in ``1 .. vocab - 1`` (never the pad id 0), attention on every real token, the loss mask on
    the response's."""
    import torch

    width = max(p + r for p, r in lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attn, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(lengths):
        ids[i, : p + r] = torch.randint(1, vocab, (p + r,), generator=gen)
        attn[i, : p + r] = 1
        loss_mask[i, p : p + r] = 1
    return ids, attn, loss_mask


class Service:
    """A ThreadingHTTPServer on 127.0.0.1 whose answer to each POST is ``behave(service, payload)`` (a reward
    service for the HTTP reward's tests: correct, slow, failing or hung as ``behave`` decides)."""

    def __init__(self, behave: Callable[["Service", Dict[str, Any]], Tuple[int, bytes]]) -> None:
        self.calls: List[Dict[str, Any]] = []
        self.lock, self.release = threading.Lock(), threading.Event()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.calls.append(payload)
                status, body = behave(service, payload)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client gave up (timed out) meanwhile
                    pass

            def log_message(self, *args: Any) -> None:  # keep the test output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.release.set()  # hung handlers return
        self.httpd.shutdown()
        self.httpd.server_close()


def one_rank_worker(
    label: str,
    model_path: str,
    zero_stage: int,
    rows: int,
    micro: int,
    total_steps: int,
    lr: float,
    precision: str = "bf16",
):
    """A built one-rank ``TrainerWorker`` (in a :func:`saved_by_subprocess` process, after its process group):
    ``rows`` rows a step in micro-batches of ``micro``, AdamW at ``lr``, clipping at 1.0."""
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.worker import TrainerWorker
    from rlhf.models.loading import ModelSpec

    worker = TrainerWorker(label, 0, 1)
    worker.build(
        ModelSpec(path=model_path, precision=precision),
        EngineSpec(zero_stage=zero_stage, precision=precision, micro_batch_size=micro, grad_accum_steps=rows // micro),
        OptimSpec(lr=lr, total_steps=total_steps, max_grad_norm=1.0),
    )
    return worker


# What every engine run imports: the fork server imports it once (below). Beyond the packages, what an engine's build
# imports on first use (~1,900 modules, ~3 s of every run): transformers' auto classes, quantizers and losses, and
# DeepSpeed's engine, its op loading (torch.utils.cpp_extension) and its Muon check (torch's compiler stack).
_ENGINE_IMPORTS = [
    "torch",
    "deepspeed",
    "transformers",
    "rlhf.distributed.worker",
    "rlhf.models.loading",
    "pytest",
    "torch.utils.cpp_extension",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.quantizers.auto",
    "transformers.loss.loss_utils",
    "deepspeed.runtime.engine",
    # not deepspeed.runtime.zero.muon: TrainEngine loads it with torch.compile off (rlhf.utils.startup), and that
    # is what the forks run (tests/unit/test_one_rank_stage.py checks it)
    "deepspeed.module_inject",
]
_ENGINE_PROCESSES: List[Any] = []


def _engine_processes():
    """The ``forkserver`` multiprocessing context whose server imported :data:`_ENGINE_IMPORTS` once: every engine
    run forks from that server, a fresh process (no process group, no DeepSpeed globals set) that skips the ~4 s of
    imports a new interpreter spends before its first engine. One server per test process, started on first use:
    what those modules read from the environment as they are imported is the environment of that moment."""
    import multiprocessing

    if not _ENGINE_PROCESSES:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_ENGINE_IMPORTS)
        _ENGINE_PROCESSES.append(context)
    return _ENGINE_PROCESSES[0]


def _run_in_engine_process(
    paths: List[str], module: str, function: str, model: str, out: str, port: int, log: str, environ: Dict[str, str]
):
    """In the forked process: the caller's environment (the server has the one it started with), its output into
    ``log``, then ``function(model, out, port)`` of ``module``. What the server imported is frozen out of the garbage
    collector's reach (none of it is garbage): DeepSpeed's BF16 optimizer collects a dozen times as it builds
    (``see_memory_usage``), and each collection walked those ~400,000 objects (0.3 s)."""
    import gc
    import importlib

    gc.freeze()
    os.environ.clear()
    os.environ.update(environ)
    written = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(written, 1)
    os.dup2(written, 2)
    sys.path[:0] = paths
    getattr(importlib.import_module(module), function)(model, out, port)


def saved_by_subprocess(test_file: str, function: str, model: str, out, timeout_s: float = 600):
    """``function(model, out, port)`` of the test module ``test_file`` run in a fresh process (its own one-rank
    process group on a free ``port``: a test process may already have one; forked from :func:`_engine_processes`'
    server, so without a new interpreter's imports), then what it saved to ``out`` with ``torch.save``."""
    import socket

    import torch

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    name = os.path.splitext(os.path.basename(test_file))[0]
    paths = [os.path.dirname(os.path.abspath(test_file)), os.path.dirname(os.path.abspath(__file__))]
    log = f"{out}.log"
    process = _engine_processes().Process(
        target=_run_in_engine_process, args=(paths, name, function, model, str(out), port, log, dict(os.environ))
    )
    process.start()
    process.join(timeout_s)
    if process.exitcode is None:
        process.kill()
        process.join()
    with open(log, errors="replace") as f:
        output = f.read()
    assert process.exitcode == 0, f"{name}.{function} exited {process.exitcode}:\n{output[-6000:]}"
    return torch.load(out)


def subprocess_fixture(test_file: str, function: str = "_train", name: str = "trained"):
    """A module-scoped fixture ``name``: what ``function`` of the test module ``test_file`` saved, run once by
    :func:`saved_by_subprocess` on the session's tiny model. In the module:
    ``trained = subprocess_fixture(__file__)``."""
    import pytest

    def fixture(tiny_model, tmp_path_factory):
        stem = os.path.splitext(os.path.basename(test_file))[0]
        return saved_by_subprocess(test_file, function, tiny_model, tmp_path_factory.mktemp(stem) / "results.pt")

    return pytest.fixture(scope="module", name=name)(fixture)


def preflight(cfg, *args, **kwargs):
    """:func:`rlhf.trainers.preflight.preflight` of ``cfg`` under its trainer's descriptor, looked up by the config's
    class as the command lines do (the core takes the descriptor; only the layer above the trainers looks it up)."""
    from rlhf.trainers.kinds import kind_of
    from rlhf.trainers.preflight import preflight as run_preflight

    return run_preflight(cfg, kind_of(cfg), *args, **kwargs)


def random_sft_step(worker, generator, rows: int, micro: int, width: int = 16, vocab: int = 500):
    """One optimizer step of ``worker`` (a built ``TrainerWorker``) on ``rows`` random right-padded SFT rows of 3 to
    ``width`` tokens, every real token a target, cut into micro-batches of ``micro`` rows (each trimmed to its longest
    row) -> ``(RankStepResult, micro-batches)``."""
    import torch

    from rlhf.batch import Batch
    from rlhf.objectives.sft import SFTObjective

    lengths = torch.randint(3, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width) < lengths[:, None]).long()
    ids = torch.randint(4, vocab, (rows, width), generator=generator) * mask
    batch = Batch(input_ids=ids, attention_mask=mask, loss_mask=mask)
    cut = [batch.select(range(i, i + micro)).trim() for i in range(0, rows, micro)]
    objective = SFTObjective()
    return worker.train_step(cut, objective, sum(objective.count(m) for m in cut)), cut


def host_reads_outside_modules(model, fn: Callable[[], Any]) -> Tuple[Any, int]:
    """``fn()`` and how many host reads (``rlhf.utils.host_reads``) it made outside every forward of ``model``'s
    modules: the reads an objective adds around the model (transformers' mask code reads inside the forward)."""
    from rlhf.utils.host_reads import HostReads

    inside, depth, entered = [0], [0], [0]

    def before(module, args):
        if depth[0] == 0:
            entered[0] = reads.total
        depth[0] += 1

    def after(module, args, output):
        depth[0] -= 1
        if depth[0] == 0:
            inside[0] += reads.total - entered[0]

    hooks = [m.register_forward_pre_hook(before) for m in model.modules()]
    hooks += [m.register_forward_hook(after) for m in model.modules()]
    try:
        with HostReads() as reads:
            out = fn()
    finally:
        for hook in hooks:
            hook.remove()
    return out, reads.total - inside[0]


def counting(fn: Callable[..., Any], out: List[Tuple[int, int]]) -> Callable[..., Any]:
    """``fn``, appending ``(ops, host reads)`` to ``out`` at each call: the aten operations that compute (views and
    detaches only relabel memory; a multi-tensor one counts once, as it is one launch on a GPU) and the host reads
    (``rlhf.utils.host_reads``) it made."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701 (torch exports it nowhere else)

    from rlhf.utils.host_reads import HostReads

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += not func.is_view
            return func(*args, **(kwargs or {}))

    def counted(*args, **kwargs):
        ops, reads = Ops(), HostReads()
        with ops, reads:
            result = fn(*args, **kwargs)
        out.append((ops.count, reads.total))
        return result

    return counted


def count_wrapper_steps(optimizer) -> List[Tuple[int, int]]:
    """Wrap ``optimizer.step`` (a DeepSpeed bf16 wrapper's) so that each call appends ``(ops, host reads)``
    (:func:`counting`) to the list returned, less those of the torch optimizer's step inside it (unfused on a CPU: a
    Python loop of its own)."""
    counts: List[Tuple[int, int]] = []
    inner: List[Tuple[int, int]] = []
    wrapper_step = optimizer.step
    optimizer.optimizer.step = counting(optimizer.optimizer.step, inner)

    def less_inner(*args, **kwargs):
        before = len(counts)
        result = counting(wrapper_step, counts)(*args, **kwargs)
        ops, reads = counts[before]
        inner_ops, inner_reads = inner.pop() if inner else (0, 0)  # a skipped step runs no inner step
        counts[before] = (ops - inner_ops, reads - inner_reads)
        return result

    optimizer.step = less_inner
    return counts


def bf16_step_trace(worker, steps: int, rows: int, micro: int, masters: Callable[[Any], List[Any]]) -> Dict[str, Any]:
    """``steps`` random SFT steps of ``worker`` (a built one-rank bf16 ``TrainerWorker``, max_grad_norm 1.0), the
    first half clipping and the rest not (its ``clip_grad`` raised), then one step whose gradient holds a NaN. Returns
    per step ``(the optimizer's norm, the norm logged, the loss sum, whether the step was applied)``, the weights and
    float32 masters (``masters(optimizer)``) before the poisoned step and the weights after it, per step the ops
    and host reads of the wrapper's step (:func:`count_wrapper_steps`), and the last step's micro-batches
    (``last_micro``: not for ``torch.save``)."""
    import torch

    from rlhf.distributed.engine import iter_full_state

    optimizer = worker.engine.engine.optimizer
    counts = count_wrapper_steps(optimizer)
    gen, trace = torch.Generator().manual_seed(0), []
    for step in range(steps + 1):
        if step == steps // 2:
            optimizer.clip_grad = 1e9  # from here nothing clips
        if step == steps:
            clean = {n: t.clone() for n, t in iter_full_state(worker.model, worker.zero_stage)}
            clean_masters = [t.detach().clone() for t in masters(optimizer)]
            weight = worker.model.get_parameter("model.layers.1.mlp.down_proj.weight")
            hook = weight.register_hook(lambda grad: grad * float("nan"))
        result, last_micro = random_sft_step(worker, gen, rows, micro)
        norm = optimizer._global_grad_norm
        trace.append((float(norm), result.grad_norm, result.sums["loss_sum"], worker.engine.last_step_applied))
    hook.remove()
    return {
        "trace": trace,
        "clean": clean,
        "masters": clean_masters,
        "after_poisoned_step": {n: t.clone() for n, t in iter_full_state(worker.model, worker.zero_stage)},
        "counts": counts,
        "parameters": sum(1 for p in worker.model.parameters() if p.requires_grad),
        "optimizer": type(optimizer).__name__,
        "last_micro": last_micro,
    }


def assert_the_poisoned_step_was_skipped(run: Dict[str, Any], steps: int) -> None:
    """For a :func:`bf16_step_trace` run: every clean step applied, the poisoned one skipped with its norm reported
    infinite, and the weights after it those before it."""
    import torch

    assert [applied for *_, applied in run["trace"]] == [True] * steps + [False]
    assert run["trace"][-1][1] == float("inf")
    for name, weight in run["clean"].items():
        assert torch.equal(run["after_poisoned_step"][name], weight), name
