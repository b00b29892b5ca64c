"""Multi-node placement on a simulated cluster (several Ray nodes on this machine, ``ray.cluster_utils``), and the
cluster manifests in ``ray_cluster/`` parse and point at real entry points."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from rl_helpers import greedy_reference
from rl_reference_math import clipped_adamw_first_step, weight_agreement
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]

# The reference forward passes this module runs in the test process, on one thread.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Runs in its own process: the session's Ray cluster must not be the one joined.
SCRIPT = r"""
import json, os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
import ray, torch
from ray.cluster_utils import Cluster
from rlhf.batch import Batch
from rlhf.distributed.cluster import actor_env
from rlhf.distributed.engine import EngineSpec, OptimSpec
from rlhf.distributed.group import GroupResources, WorkerGroup
from rlhf.models.loading import ModelSpec
from rlhf.objectives.sft import SFTObjective
from rlhf.rollout.vllm.engines import RolloutEngines
from rlhf.rollout.vllm.engine import VLLMSpec
from rlhf.rollout.types import SamplingSpec

model_path, out_dir = sys.argv[1], sys.argv[2]
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
for _ in range(2):
    cluster.add_node(num_cpus=2)
ray.init(address=cluster.address, log_to_driver=False)
cluster.wait_for_nodes()
# Two ranks of 2 CPUs: no node holds both, so PACK must spread them over two nodes.
group = WorkerGroup("policy", GroupResources(num_workers=2, cpus_per_worker=2, env_vars=actor_env(0)), "gloo")
group.build(ModelSpec(path=model_path), EngineSpec(zero_stage=3, precision="fp32", micro_batch_size=1,
                                                   grad_accum_steps=1), OptimSpec(lr=1e-3, total_steps=1))
ids = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 9, 2, 0]])
mb = Batch(input_ids=ids, attention_mask=(ids > 0).long(), loss_mask=torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0]]))
objective = SFTObjective()
results = group.train_step([[mb.slice(0, 1)], [mb.slice(1, 2)]], objective, objective.count(mb))
# The policy fills both worker nodes: the engine can only go on the head node. Its weights reach it by a
# broadcast over the weight-sync group across nodes.
engines = RolloutEngines(VLLMSpec(model_path=model_path, max_model_len=64), num_engines=1, cpus_per_engine=1,
                         env_vars=actor_env(0))
engines.connect_weight_sync(group, "broadcast", bucket_bytes=1 << 20, backend="gloo")
sync = group.push_weights()
group.save_pretrained(os.path.join(out_dir, "trained"))
gens = engines.generate([[1, 5, 6], [1, 8, 9, 4]], SamplingSpec(max_new_tokens=5, temperature=0.0))
print("RESULT " + json.dumps({"nodes": [p["node"] for p in group.placements()],
                  "engine_nodes": [p["node"] for p in engines.placements()],
                  "grad_norms": [r.grad_norm for r in results], "lr": results[0].lr, "sync": sync,
                  "generations": [[list(g.prompt_ids), list(g.response_ids), list(g.response_logps)] for g in gens],
                  "alive_nodes": len([n for n in ray.nodes() if n["Alive"]])}), flush=True)
engines.shutdown()
group.shutdown()
ray.shutdown()
cluster.shutdown()
"""


def test_ranks_train_across_nodes_and_broadcast_weights_to_an_engine_on_another_node(tiny_model, tmp_path):
    """A 2-rank ZeRO-3 policy on two nodes trains a step and broadcasts its weights over the weight-sync group
    (gloo where NCCL would be) to a vLLM engine on a third node; the engine then generates exactly what the
    trained weights generate."""
    script = tmp_path / "multinode.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, str(script), tiny_model, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(ROOT),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(
        next(line[len("RESULT ") :] for line in result.stdout.splitlines() if line.startswith("RESULT "))
    )
    assert report["alive_nodes"] == 3
    assert len(set(report["nodes"])) == 2, report  # one rank per worker node
    assert not set(report["engine_nodes"]) & set(report["nodes"]), report
    # The 2-node ZeRO-3 step is the step one process computes: every rank reports the pre-clip norm of the whole
    # gradient, and the saved weights are one clipped AdamW step from the same model.
    from rlhf.distributed.engine import OptimSpec

    spec = OptimSpec(lr=1e-3, total_steps=1)  # the script's: its defaults are the optimizer settings compared
    want_norm, want = _plain_sft_step(tiny_model, spec)
    print(
        f"[multinode] grad norm {report['grad_norms']} vs plain {want_norm:.9g} "
        f"(rel {abs(report['grad_norms'][0] - want_norm) / want_norm:.1e})"
    )
    assert report["grad_norms"][0] == report["grad_norms"][1] == pytest.approx(want_norm, rel=1e-5), report
    assert want_norm > spec.max_grad_norm  # the clipping binds: part of what is compared
    assert report["lr"] == spec.lr
    _assert_one_step_apart(str(tmp_path / "trained"), want, want_norm, spec)
    assert report["sync"]["method"] == "broadcast" and report["sync"]["tensors"] > 0
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32).eval()
    for prompt, response, logps in report["generations"]:
        want_ids, want_logps = greedy_reference(model, prompt, len(response))
        assert response == want_ids
        assert logps == pytest.approx(want_logps, abs=2e-4)


def _plain_sft_step(model_path: str, spec):
    """The script's SFT step in one process, float64, plain PyTorch: token-mean NLL over the target tokens of both
    rows (row 0 predicts 6 7 2, row 1 predicts 9 2, each after a 2-token prompt), backward, DeepSpeed's clipping at
    ``spec.max_grad_norm`` and one AdamW step with ``spec``'s settings. Returns the pre-clip norm and the model."""
    # sdpa: transformers' eager attention would take its softmax in float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64, attn_implementation="sdpa")
    rows = [([1, 5, 6, 7, 2], 2), ([1, 8, 9, 2], 2)]  # (unpadded ids, prompt length)
    nll, count = 0.0, 0
    for ids, prompt in rows:
        logits = model(input_ids=torch.tensor([ids])).logits[0, prompt - 1 : -1]
        log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        nll = nll - log_p[torch.arange(len(ids) - prompt), torch.tensor(ids[prompt:])].sum()
        count += len(ids) - prompt
    (nll / count).backward()
    norm = clipped_adamw_first_step(
        model,
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        max_grad_norm=spec.max_grad_norm,
    )
    return norm, model


def _assert_one_step_apart(trained_dir: str, want, norm: float, spec) -> None:
    """Every saved weight where the reference step put it, up to fp32 rounding as Adam amplifies it
    (:func:`rl_reference_math.weight_agreement`: 1e-4 of the step, plus a gradient error of 1e-7 of the norm per
    element, fp32's rounding). Measured: up to 1.2e-2 lr (attention key biases, whose gradient is identically 0),
    0.36 of the allowance."""
    from safetensors.torch import load_file

    got = load_file(os.path.join(trained_dir, "model.safetensors"))
    worst_lr, ratio, where = weight_agreement(
        got,
        want,
        lr=spec.lr,
        eps=spec.eps,
        norm=norm,
        max_grad_norm=spec.max_grad_norm,
        update_rtol=1e-4,
        grad_rtol=1e-7,
    )
    print(
        f"[multinode] weights after the step: max |2-node - plain| = {worst_lr:.1e} lr, "
        f"{ratio:.2g} of the allowance ({where})"
    )
    assert ratio <= 1.0, (where, ratio, worst_lr)


@pytest.mark.parametrize("name", ["cluster.yaml", "kuberay-raycluster.yaml", "kuberay-rayjob.yaml"])
def test_cluster_manifests_parse(name):
    doc = yaml.safe_load((ROOT / "ray_cluster" / name).read_text())
    assert isinstance(doc, dict)
    if name.startswith("kuberay"):
        assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob")
        spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        assert spec["headGroupSpec"] and spec["workerGroupSpecs"]
    if name == "kuberay-rayjob.yaml":
        module = doc["spec"]["entrypoint"].split()[2]
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module


def test_slurm_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(ROOT / "ray_cluster" / "slurm.sbatch")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_job_submit_against_a_locally_started_head(tiny_model, sft_data, tmp_path):
    """A real Ray job: ``ray start --head`` in its own process group, ``ray job submit --working-dir .`` of the SFT
    CLI, the job joins that cluster (RAY_ADDRESS set by the job supervisor) and writes final/.

    DeepSpeed's CPU communication op, built by a local run of this checkout, is neither rebuilt nor announced by the
    job, which runs from Ray's unpacked copy of the upload (another source path), nor by a local run after it."""
    import time

    from shared_helpers import comm_op_links

    from rlhf.distributed.cluster import BUILD_MESSAGE, TORCH_EXTENSIONS_DIR

    local_run = [sys.executable, "-c", _LOCAL_OP_USE]
    before = subprocess.run(local_run, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert before.returncode == 0, before.stderr[-3000:]
    builds = comm_op_links(TORCH_EXTENSIONS_DIR)
    assert builds >= 1

    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "token"  # Ray 2.60 heads use token auth; the job client must send the token
    gcs, dashboard, agent = _free_port(), _free_port(), _free_port()
    # Its own temp dir (short: Ray's socket paths have a length limit), so that this head does not become the
    # machine's "current cluster" that a later plain `ray.init()` would try to join.
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    head = subprocess.Popen(
        [
            str(bin_dir / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            f"--dashboard-port={dashboard}",
            "--num-cpus=3",
            "--include-dashboard=true",
            # not the default 52365, which the tests' own local cluster's agent already holds:
            # the job API would answer, with no agent to run the job ("No available agent")
            f"--dashboard-agent-listen-port={agent}",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    out = tmp_path / "job-run"
    try:
        address = f"http://127.0.0.1:{dashboard}"
        for _ in range(120):  # the dashboard's job API takes a few seconds to come up
            probe = subprocess.run(
                [str(bin_dir / "ray"), "job", "list", "--address", address], env=env, capture_output=True, text=True
            )
            if probe.returncode == 0:
                break
            time.sleep(1)
        submit = [
            str(bin_dir / "ray"),
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            ".",
            "--",
            sys.executable,
            "-m",
            "rlhf.cli.train_sft",
            f"model.path={tiny_model}",
            f"data.train_path={sft_data}",
            f"train.output_dir={out}",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "train.max_steps=3",
            "logging.tensorboard=false",
        ]
        job = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=400, cwd=str(ROOT))
        assert job.returncode == 0, (job.stdout[-3000:], job.stderr[-3000:])
        assert "succeeded" in job.stdout + job.stderr
        assert (out / "final" / "model.safetensors").is_file()
        with open(out / "metrics.jsonl") as f:
            assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
        assert BUILD_MESSAGE not in job.stdout + job.stderr
        assert comm_op_links(TORCH_EXTENSIONS_DIR) == builds, "the job rebuilt the op a local run had built"
        after = subprocess.run(local_run, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert after.returncode == 0 and BUILD_MESSAGE not in after.stdout + after.stderr, after.stderr[-3000:]
        assert comm_op_links(TORCH_EXTENSIONS_DIR) == builds, "a local run after the job rebuilt the op"
    finally:
        _stop_process_group(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


# What a local run does with the op: the driver's check (builds it when absent), then a CPU trainer rank's guarded load
# and DeepSpeed's own (TrainerWorker.init_process_group).
_LOCAL_OP_USE = (
    "from rlhf.distributed.cluster import ensure_cpu_comm_op, load_cpu_comm_op; ensure_cpu_comm_op(); "
    "load_cpu_comm_op(); from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None"
)


def _stop_process_group(head, grace_s: float = 2.0) -> None:
    """SIGTERM to the head's process group (--block: stopping `ray start` stops this head's processes only), then,
    after ``grace_s``, SIGKILL to whatever of it is left: on SIGTERM the GCS server and the autoscaler monitor take
    ~25 s to exit (measured), idle time this test has no use for once its assertions are made."""
    import signal
    import time

    os.killpg(head.pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and _group_alive(head.pid):
        time.sleep(0.2)
    if _group_alive(head.pid):
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    head.wait(timeout=60)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies, exited but not yet reaped, do not count)."""
    import psutil

    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False
