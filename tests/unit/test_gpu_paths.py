"""Device-dependent choices on the GPU path, shown through their CPU twins and stand-ins (issue #23): the optimizer a
CUDA worker builds, vLLM's eager mode and sleep level, the hybrid engine's wake-up order around the weight sync,
hybrid + broadcast refused on GPUs, a broken flash-attn falling back to sdpa, and one IPC handle per buffer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.config.schema import ConfigError


# ------------------------------------------------------------------ optimizer
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).double()


def test_a_cuda_worker_builds_torch_fused_adamw_which_needs_no_build(monkeypatch):
    """The GPU optimizer is torch's AdamW with ``fused=True`` (DeepSpeed's FusedAdam, built by nvcc at first use,
    was chosen before: its construction fails here). Its update is the CPU path's AdamW: one step of each, from the
    same weights and gradients, in float64 (torch's fused kernel also runs on CPU)."""
    from rlhf.distributed.engine import OptimSpec, _make_optimizer

    optim = OptimSpec(lr=0.1, total_steps=1, weight_decay=0.1)
    models, optimizers = [], []
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        model = _model()
        opt = _make_optimizer(model, optim, offload=False)
        assert type(opt) is torch.optim.AdamW and bool(opt.defaults["fused"]) is cuda
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # parameter_groups kept
        models.append(model)
        optimizers.append(opt)
    monkeypatch.undo()
    for model, opt in zip(models, optimizers):
        for p in model.parameters():
            p.grad = torch.linspace(-1.0, 1.0, p.numel(), dtype=torch.float64).view(p.shape)
        opt.step()
    for fused, plain in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ vLLM engine options and sleep
def test_eager_on_cpu_only():
    from rlhf.rollout.vllm.engine import VLLMSpec, llm_options

    spec = VLLMSpec(model_path="m")
    gpu, cpu = llm_options(spec, cuda=True), llm_options(spec, cuda=False)
    assert gpu["enforce_eager"] is False and cpu["enforce_eager"] is True
    assert {k: v for k, v in gpu.items() if k != "enforce_eager"} == {
        k: v for k, v in cpu.items() if k != "enforce_eager"
    }


class _FakeLLM:
    def __init__(self, log):
        self.log = log

    def sleep(self, **kwargs):
        self.log.append(("sleep", kwargs))

    def wake_up(self, **kwargs):
        self.log.append(("wake_up", kwargs))


def _engine(sleep_mode: bool, log: list):
    from rlhf.rollout.vllm.engine import VLLMEngine, VLLMSpec

    engine = object.__new__(VLLMEngine)  # no vLLM: the methods under test only use spec and llm
    engine.spec, engine.llm = VLLMSpec(model_path="m", enable_sleep_mode=sleep_mode), _FakeLLM(log)
    return engine


def test_the_engine_sleeps_at_level_2_and_wakes_weights_then_kv_cache():
    log: list = []
    engine = _engine(True, log)
    engine.sleep()
    engine.wake_weights()
    engine.wake_kv_cache()
    assert log == [("sleep", {"level": 2}), ("wake_up", {"tags": ["weights"]}), ("wake_up", {"tags": ["kv_cache"]})]
    off: list = []
    cpu = _engine(False, off)  # the CPU twin: sleep mode off, the same calls do nothing
    cpu.sleep(), cpu.wake_weights(), cpu.wake_kv_cache()
    assert off == []


class _Recorder:
    def __init__(self, name, log, **attrs):
        self.name, self.log = name, log
        self.__dict__.update(attrs)

    def __getattr__(self, call):
        def method(*args):
            self.log.append(f"{self.name}.{call}")
            return {"push_weights": {"bytes": 1.0}, "sleep": [2**20]}.get(call)

        return method


@pytest.mark.parametrize("sleeps,trainers_sleep", [(True, True), (True, False), (False, False)])
def test_push_weights_empties_the_trainers_caches_wakes_weights_syncs_then_wakes_the_kv_cache(
    sleeps, trainers_sleep, caplog
):
    """With ``colocate.trainer_sleep`` the ranks on the engines' devices sleep after the sync and before the KV
    cache takes the device; the first such sleep is logged."""
    from rlhf.trainers.online.steps import RLActors, RLTrainer

    log: list = []
    trainer = object.__new__(RLTrainer)
    trainer._told_sleep = False
    trainer.actors = RLActors(
        policy=_Recorder("policy", log, role="policy"),
        engines=_Recorder("engines", log, sleeps=sleeps),
        reference=_Recorder("reference", log, role="reference"),
        sleepers=("policy", "reference") if trainers_sleep else (),
    )
    assert trainer.push_weights() == {"bytes": 1.0}
    released = ["policy.release_cached_memory", "reference.release_cached_memory"] if sleeps else []
    slept = ["policy.sleep", "reference.sleep"] if trainers_sleep else []
    assert log == released + ["engines.wake_weights", "policy.push_weights", *slept, "engines.wake_kv_cache"]
    told = "[rl] trainer sleep: policy 1 x 1.0 MiB, reference 1 x 1.0 MiB"
    assert (told in caplog.text) == trainers_sleep
    log.clear()
    trainer.push_weights()
    assert caplog.text.count(told) == trainers_sleep  # once
    log.clear()
    trainer.wake_trainers()
    assert log == (["policy.wake", "reference.wake"] if trainers_sleep else [])


def test_a_worker_empties_its_cuda_cache_only_on_cuda(monkeypatch):
    from rlhf.distributed.worker import TrainerWorker

    emptied: list = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    worker = object.__new__(TrainerWorker)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    worker.release_cached_memory()
    assert emptied == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    worker.release_cached_memory()
    assert emptied == [True]


# ------------------------------------------------------------------ hybrid engine + broadcast
def _rl_cfg(tiny_model, rl_prompts, *extra):
    """The hybrid engine asked to sync by broadcast (refused on GPUs)."""
    from rl_helpers import tiny_rl_config

    hybrid = ("colocate.hybrid_engine=true", "rollout.num_engines=1", "rollout.weight_sync=broadcast")
    return tiny_rl_config(tiny_model, rl_prompts, *hybrid, *extra)


HYBRID_BROADCAST = (
    r"rollout.weight_sync is broadcast, which colocate.hybrid_engine=true cannot use on GPUs: .*"
    r"use rollout.weight_sync=ipc or auto"
)


def test_hybrid_engine_with_broadcast_is_refused_when_the_config_says_gpus(tiny_model, rl_prompts):
    with pytest.raises(ConfigError, match=HYBRID_BROADCAST):
        _rl_cfg(tiny_model, rl_prompts, "strategy.gpus_per_worker=1")
    _rl_cfg(tiny_model, rl_prompts, "strategy.gpus_per_worker=0")  # the CPU twin (gloo) works
    _rl_cfg(tiny_model, rl_prompts)  # auto: the runner decides once the cluster is known


def test_the_runner_refuses_hybrid_broadcast_once_the_cluster_gives_gpus(tiny_model, rl_prompts):
    from rlhf.trainers.online.roles import connect_weight_sync

    class Engines:
        gpus_per_engine = 1.0

        def connect_weight_sync(self, *args):
            raise AssertionError("refused before any group is formed")

    cfg = _rl_cfg(tiny_model, rl_prompts)
    with pytest.raises(ConfigError, match=HYBRID_BROADCAST):
        connect_weight_sync(
            cfg, SimpleNamespace(gpus_per_worker=1.0), SimpleNamespace(engines=Engines(), policy=object())
        )


# ------------------------------------------------------------------ flash-attn detection
def _fake_flash_attn(root, init: str) -> None:
    package = root / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(init)
    (package / "flash_attn_interface.py").write_text("def flash_attn_varlen_func(*args, **kwargs): pass\n")


@pytest.fixture
def fake_cuda(monkeypatch):
    import sys

    from rlhf.utils import device

    monkeypatch.setattr(device, "cuda_available", lambda: True)
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    device.flash_attn_problem.cache_clear()
    yield device
    device.flash_attn_problem.cache_clear()
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        sys.modules.pop(name, None)


def test_a_flash_attn_that_does_not_import_falls_back_to_sdpa_naming_why(fake_cuda, tmp_path, monkeypatch):
    """Found but broken (a wheel for another torch: its extension has an undefined symbol): ``auto`` takes sdpa
    and says why; asking for flash_attention_2 by name is an error with the same reason."""
    _fake_flash_attn(tmp_path, "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match="using sdpa, not flash_attention_2: .*undefined symbol"):
        assert fake_cuda.resolve_attn_implementation("auto", "bf16") == "sdpa"
    with pytest.raises(RuntimeError, match=r"model.attn_implementation=flash_attention_2 .*undefined symbol"):
        fake_cuda.resolve_attn_implementation("flash_attention_2", "bf16")


def test_a_flash_attn_that_imports_is_chosen_on_cuda(fake_cuda, tmp_path, monkeypatch):
    _fake_flash_attn(tmp_path, "")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fake_cuda.resolve_attn_implementation("auto", "bf16") == "flash_attention_2"


def test_an_fp32_model_on_cuda_runs_sdpa_even_with_a_working_flash_attn(fake_cuda, tmp_path, monkeypatch):
    """flash-attn's kernels take bf16/fp16 only: ``auto`` once chose it for an fp32 GPU run, which transformers
    then refused at load. Asked for by name with fp32, it is refused naming the key and why."""
    _fake_flash_attn(tmp_path, "")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [fake_cuda.resolve_attn_implementation("auto", p) for p in ("fp32", "fp64", "fp16")] == [
        "sdpa",
        "sdpa",
        "flash_attention_2",
    ]
    with pytest.raises(
        RuntimeError,
        match=r"^model.attn_implementation=flash_attention_2 needs .*: it runs bf16 or "
        r"fp16 only, and this model is fp32$",
    ):
        fake_cuda.resolve_attn_implementation("flash_attention_2", "fp32")


# ------------------------------------------------------------------ IPC handles
class _IpcEngine:
    """Stands in for an engine actor: ``.remote`` runs at once. Loads like WeightSyncExtension: each distinct
    handle is opened once per update and kept until the update finishes."""

    def __init__(self):
        from rlhf.rollout.weights.ipc import open_shared

        self.handles, self.received, self.opened = [], [], {}
        outer = self

        class Call:
            def __init__(self, fn):
                self.remote = fn

        def load(metas, handle, nbytes):
            from rlhf.rollout.weights.sync import bucket_checksum, metas_from_wire, unpack_bucket

            outer.handles.append(handle)
            if handle not in outer.opened:
                outer.opened[handle] = open_shared(handle)
            data = outer.opened[handle][:nbytes].clone()
            outer.received += [(n, t.clone()) for n, t in unpack_bucket(metas_from_wire(metas), data)]
            outer.record["bytes"] += nbytes
            outer.record["checksum"] += bucket_checksum(data, nbytes)
            return len(metas)

        def begin(version=None):
            self.opened.clear()
            self.record = {"version": version, "bytes": 0, "checksum": 0}

        def finish():
            self.opened.clear()
            return [dict(self.record)]  # one worker's record, as the engine's collective_rpc returns them

        self.begin_weight_update = Call(begin)
        self.finish_weight_update = Call(finish)
        self.load_shared_bucket = Call(load)


def test_ipc_exports_each_buffer_once_per_sync_and_every_bucket_arrives(monkeypatch):
    from rlhf.rollout.weights import senders

    monkeypatch.setattr(senders, "gather", lambda refs, names, call, timeout_s=None: refs)
    exported: list = []
    real_share = senders.share
    monkeypatch.setattr(senders, "share", lambda tensor: exported.append(tensor) or real_share(tensor))
    engine = _IpcEngine()
    sender = senders.IpcSender(engine, 0, bucket_bytes=256)
    sender.connect()
    gen = torch.Generator().manual_seed(0)
    weights = [(f"w{i}", torch.randn(24, generator=gen)) for i in range(10)]  # 96 bytes each: 2 a bucket
    for _sync in range(2):
        engine.handles, engine.received, exported[:] = [], [], []
        stats = sender.send(iter(weights))
        assert stats["buckets"] == 5.0 and len(engine.handles) == 5
        # one export per double buffer and sync (it was one per bucket: a reference, and on CUDA a record, each)
        assert len(exported) == 2 and len(set(engine.handles)) == 2
        assert [n for n, _ in engine.received] == [n for n, _ in weights]
        for (_, got), (_, want) in zip(engine.received, weights):
            assert torch.equal(got, want)


def _rebuild_stand_in(*args):
    """Stands in for torch's ``rebuild_cuda_tensor`` (module level, so a handle naming it pickles): returns the
    arguments it was called with."""
    return args


def test_a_cuda_handle_is_opened_on_the_receivers_current_device(monkeypatch):
    """The CUDA branch of ``open_shared``, which no CPU run reaches otherwise. A function-level
    ``import torch.multiprocessing.reductions`` once made ``torch`` a local name there, so the first real GPU run
    died with UnboundLocalError (found by bench/gpu_check.py on an H200); the device is the receiver's, since Ray
    numbers each actor's visible GPUs from 0."""
    import pickle

    from rlhf.rollout.weights.ipc import _STORAGE_DEVICE_ARG, open_shared

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    sent = ("cls", (4,), (1,), 0, "storage", torch.bfloat16, 0, b"handle", 256)
    opened = open_shared(pickle.dumps(("cuda", _rebuild_stand_in, sent)))
    assert opened[_STORAGE_DEVICE_ARG] == 3
    assert opened[:_STORAGE_DEVICE_ARG] == sent[:_STORAGE_DEVICE_ARG]
    assert opened[_STORAGE_DEVICE_ARG + 1 :] == sent[_STORAGE_DEVICE_ARG + 1 :]


def test_a_bucket_that_never_arrives_stops_the_sync_naming_the_engine(monkeypatch):
    """Every engine worker echoes the version it now holds and a checksum of the bytes it received: an engine that
    dropped a bucket (silent non-delivery, verl #7495 / slime #2280) fails the sync, naming it; one that got every
    bucket passes and the stats carry the version."""
    from rlhf.distributed.errors import WorkerError
    from rlhf.rollout.weights import senders

    monkeypatch.setattr(senders, "gather", lambda refs, names, call, timeout_s=None: refs)
    weights = [(f"w{i}", torch.randn(24, generator=torch.Generator().manual_seed(i))) for i in range(10)]
    engine = _IpcEngine()
    sender = senders.IpcSender(engine, 2, bucket_bytes=256)
    sender.connect()
    assert sender.send(iter(weights), version=3)["version"] == 3.0
    load = engine.load_shared_bucket.remote
    calls = []

    def lossy(metas, handle, nbytes):  # the third bucket is acknowledged but never loaded
        calls.append(nbytes)
        return len(metas) if len(calls) == 3 else load(metas, handle, nbytes)

    engine.load_shared_bucket.remote = lossy
    with pytest.raises(
        WorkerError, match=r"^rollout engine 2 worker 0 did not receive the weight update to version 4: "
    ):
        sender.send(iter(weights), version=4)


def test_the_delivery_checksum_is_exact_and_sees_a_changed_byte():
    from rlhf.rollout.weights.sync import bucket_checksum, pack_bucket

    gen = torch.Generator().manual_seed(0)
    bucket = pack_bucket([("a", torch.randn(5, generator=gen)), ("b", torch.randint(0, 9, (3,), generator=gen))])
    data = bucket.data
    words = [
        int.from_bytes(bytes(data[i : i + 4].tolist()), "little", signed=True) for i in range(0, data.numel() - 3, 4)
    ]
    tail = sum(data[4 * len(words) :].tolist())
    assert bucket_checksum(data, data.numel()) == sum(words) + tail
    assert bucket_checksum(data, 7) == words[0] + sum(data[4:7].tolist())  # a cut bucket: its own sum
    changed = data.clone()
    changed[5] ^= 1
    assert bucket_checksum(changed, changed.numel()) != bucket_checksum(data, data.numel())
