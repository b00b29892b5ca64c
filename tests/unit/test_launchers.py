"""``--dry-run`` and the GPU launchers in ``examples/launchers/``, without a GPU and without Ray actors.

* Every launcher's plan fits the cluster its ``# cluster:`` header names (through the real CLI entry), and a
  two-node launcher planned against one node fails with exit 2 naming the placement group or role.
* The PACK simulator: bundles spread over nodes, the freer node preferred, colocated roles' fractional shares,
  two ranks on one device flagged, all-or-nothing groups.
* The runners start their plan (``rlhf.trainers.actors.start_plan``): the requests
  ``rlhf.trainers.online.roles.start_roles`` and the offline runner make (recorded through stand-ins for the worker
  groups, placement groups, engines and environment actors) are the plan's, in its order, and the dry run prints them.
* A dry run imports no Ray at all; the scripts are valid bash.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from shared_helpers import run_main

from rlhf.config import DPORunConfig, RewardModelRunConfig, SFTRunConfig, load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.distributed.packing import InfeasiblePlan, NodeShape, check_feasible, nodes_from_ray, pack, parse_cluster
from rlhf.distributed.resource_plan import ActorPlan, Devices, GroupPlan, ResourcePlan, resolve_devices
from rlhf.trainers.kinds import kind_of

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = sorted(p for p in (ROOT / "examples" / "launchers").glob("*.sh") if p.name != "submit.sh")
ENV = {
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}


@dataclasses.dataclass(frozen=True)
class Launcher:
    path: Path
    cluster: str
    module: str
    config: str


def _launcher(path: Path) -> Launcher:
    """The machine-readable parts of a launcher: ``# cluster: SHAPE``, ``MODULE=...`` and ``CONFIG=...``."""
    text = path.read_text()
    found = {
        key: re.search(pattern, text, re.M)
        for key, pattern in (
            ("cluster", r"^# cluster: *(\S+)"),
            ("module", r"^MODULE=(\S+)"),
            ("config", r"^CONFIG=(\S+)"),
        )
    }
    missing = [key for key, m in found.items() if m is None]
    assert not missing, f"{path.name}: no {missing} line"
    return Launcher(path, *(found[k].group(1) for k in ("cluster", "module", "config")))


def _cli(module: str, argv, capsys, monkeypatch):
    return run_main(module, argv, ROOT, capsys, monkeypatch)


# ------------------------------------------------------------------------------------------------ the launchers


def test_the_launchers_cover_the_recipes_and_their_readme():
    names = {p.stem for p in LAUNCHERS}
    assert {
        "sft_qwen7b_1node",
        "dpo_qwen7b_1node",
        "grpo_qwen7b_1node",
        "grpo_qwen7b_2node_hybrid",
        "grpo_qwen7b_2node_engines",
    } <= names
    readme = (ROOT / "examples" / "launchers" / "README.md").read_text()
    assert all(f"`{p.name}`" in readme for p in LAUNCHERS)


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.stem)
def test_launcher_dry_run_fits_the_cluster_it_names(path, capsys, monkeypatch):
    launcher = _launcher(path)
    assert (ROOT / launcher.config).is_file()
    rc, out, err = _cli(
        launcher.module, ["--config", launcher.config, "--dry-run", "--cluster", launcher.cluster], capsys, monkeypatch
    )
    assert rc == 0, err
    assert f"result: fits on {launcher.cluster}" in out and "WARNING" not in out
    assert "bf16" in out and "nccl" in out and "ZeRO-3" in out  # auto precision / backend on GPUs
    assert "not on this machine (checked at run time)" in out  # the /models and /data placeholders


SUBMIT = ROOT / "examples" / "launchers" / "submit.sh"


@pytest.mark.parametrize("path", LAUNCHERS + [SUBMIT], ids=lambda p: p.stem)
def test_launcher_script_is_valid_bash_and_submits_a_ray_job(path):
    """Each launcher hands its module and config to submit.sh, which does the dry run or the Ray job."""
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert os.access(path, os.X_OK)
    text = path.read_text()
    if path != SUBMIT:
        assert "set -euo pipefail" in text and 'submit.sh" "${BASH_SOURCE[0]}" "$MODULE" "$CONFIG" "$@"' in text
        return
    for needed in (
        "set -euo pipefail",
        "RAY_AUTH_MODE=",
        "ray job submit",
        "--working-dir .",
        "--runtime-env-json",
        "DRY_RUN",
        "--dry-run --cluster",
        "NCCL_SOCKET_IFNAME",
    ):
        assert needed in text, f"{path.name}: no {needed!r}"


def test_the_documented_dry_run_output_is_current(capsys, monkeypatch):
    """docs/multinode.md shows the 2-node hybrid launcher's dry run verbatim."""
    doc = (ROOT / "docs" / "multinode.md").read_text()
    shown = doc.split("`DRY_RUN=1 examples/launchers/grpo_qwen7b_2node_hybrid.sh` prints:\n\n```\n", 1)[1]
    launcher = _launcher(ROOT / "examples" / "launchers" / "grpo_qwen7b_2node_hybrid.sh")
    rc, out, _ = _cli(
        launcher.module, ["--config", launcher.config, "--dry-run", "--cluster", launcher.cluster], capsys, monkeypatch
    )
    assert rc == 0 and shown.split("\n```", 1)[0] == out.rstrip("\n"), "regenerate the example in docs/multinode.md"


def test_the_grpo_launchers_reward_reads_the_final_answer():
    sys.path.insert(0, str(ROOT / "examples" / "launchers"))
    try:
        from math_reward import correct_answer
    finally:
        sys.path.pop(0)
    responses = ["3 + 4 = 7, so \\boxed{1,200}", "It is 72.", "\\boxed{71} (not 72)", "no number"]
    assert correct_answer(["q"] * 4, responses, ["1200", "She earns #### 72", "72", "5"]) == [1.0, 1.0, 0.0, 0.0]


def test_two_node_hybrid_launcher_on_one_node_fails_naming_the_group(capsys, monkeypatch):
    launcher = _launcher(ROOT / "examples" / "launchers" / "grpo_qwen7b_2node_hybrid.sh")
    rc, out, err = _cli(
        launcher.module, ["--config", launcher.config, "--dry-run", "--cluster", "1x8gpu"], capsys, monkeypatch
    )
    assert rc == 2 and "does NOT fit on 1x8gpu" in out and "NOT PLACED" in out
    assert err.count("\n") == 1 and err.startswith(
        "error: cannot place placement group policy+reference+rollout (roles policy, reference, rollout)"
    )


def test_separate_engines_on_one_node_fail_naming_the_engines(capsys, monkeypatch):
    launcher = _launcher(ROOT / "examples" / "launchers" / "grpo_qwen7b_2node_engines.sh")
    rc, _, err = _cli(
        launcher.module, ["--config", launcher.config, "--dry-run", "--cluster", "1x8gpu"], capsys, monkeypatch
    )
    assert rc == 2 and err.startswith("error: cannot place rollout actor 0 of 4 ({CPU: 8, GPU: 2} each")


def test_a_launcher_script_dry_run_in_a_subprocess():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(ENV, DRY_RUN="1", PYTHON=sys.executable)
    proc = subprocess.run(
        [str(ROOT / "examples" / "launchers" / "grpo_qwen7b_2node_engines.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "node 0: bundles 0-7 (GPUs 0-7)" in proc.stdout  # policy + reference on the first node
    assert "node 1: actors 0-3 (GPUs 0-7)" in proc.stdout  # the 4 two-GPU engines on the second
    assert "weight sync: broadcast" in proc.stdout and "nccl process group" in proc.stdout
    assert (
        "  schedule: synchronous: each step generates its samples, then trains (rollout.max_staleness=0)" in proc.stdout
    )


def test_dry_run_imports_no_ray_here_or_simulated(tmp_path):
    """Neither a simulated cluster nor this machine needs Ray: it is not even imported (so nothing is started)."""
    code = (
        "import sys; from rlhf.cli.train_ppo import main; "
        "rc = [main(['--config', 'grpo_tiny', 'model.path=/m', 'data.train_path=/d', '--dry-run', *extra]) "
        "for extra in ([], ['--cluster', '2x8gpu'])]; print('RC', rc, 'RAY', 'ray' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**env, **ENV}, capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "RC [0, 0] RAY False" in proc.stdout
    assert "cluster: this machine (the local Ray cluster a run here would start" in proc.stdout


def test_every_cli_documents_dry_run_and_cluster(capsys):
    from rlhf.distributed.packing import DEFAULT_CPUS_PER_GPU

    for module in ("train_sft", "train_rm", "train_dpo", "train_ppo"):
        with pytest.raises(SystemExit) as exit_:
            importlib.import_module(f"rlhf.cli.{module}").main(["--help"])
        assert exit_.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "--dry-run" in text and "--cluster SHAPE" in text and "2x8gpu:96cpu" in text
        assert f"{DEFAULT_CPUS_PER_GPU} CPUs per GPU" in text


def test_cluster_needs_dry_run(capsys):
    from rlhf.cli.train_sft import main

    with pytest.raises(SystemExit) as exit_:
        main(["--config", "sft_tiny", "model.path=/m", "data.train_path=/d", "--cluster", "1x8gpu"])
    assert exit_.value.code == 2 and "--cluster only applies to a --dry-run" in capsys.readouterr().err


def test_dry_run_checks_what_exists_here(tiny_model, tmp_path, capsys, monkeypatch):
    """A path found here passes the runner's check; a contradicting DeepSpeed JSON and a bad model directory are
    refused as a real run would; a bad --cluster says the syntax."""
    base = [
        "--config",
        "dpo_tiny",
        f"model.path={tiny_model}",
        "data.train_path=/data/pairs.jsonl",
        "--dry-run",
        "--cluster",
        "1x4cpu",
    ]
    rc, out, _ = _cli("rlhf.cli.train_dpo", base, capsys, monkeypatch)
    assert rc == 0 and re.search(r"model\.path +\S+ +found", out) and "fp32 (strategy.precision=auto)" in out
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3}, "communication_data_type": "fp16"}')
    rc, _, err = _cli("rlhf.cli.train_dpo", [*base, f"strategy.deepspeed_config={ds}"], capsys, monkeypatch)
    assert rc == 2 and "zero_optimization.stage" in err and "communication_data_type" in err
    rc, _, err = _cli("rlhf.cli.train_dpo", [*base, f"model.path={tmp_path}"], capsys, monkeypatch)
    assert rc == 2 and "model.path" in err and "no config.json" in err
    rc, _, err = _cli("rlhf.cli.train_dpo", [*base[:-1], "2x8"], capsys, monkeypatch)
    assert rc == 2 and "NxGgpu[:Ccpu]" in err
    rc, _, err = _cli(
        "rlhf.cli.train_ppo",
        [
            "--config",
            "grpo_tiny",
            "model.path=/m",
            "data.train_path=/d",
            "colocate.engine_sleep=on",
            "colocate.hybrid_engine=true",
            "--dry-run",
            "--cluster",
            "1x4cpu",
        ],
        capsys,
        monkeypatch,
    )
    assert rc == 2 and "colocate.engine_sleep=on needs GPU engines" in err


# ------------------------------------------------------------------------------------------- the PACK simulator


def _group(roles, n, cpus=1.0, gpus=1.0):
    return GroupPlan(roles=tuple(roles), num_bundles=n, cpus=cpus, gpus=gpus)


def _plan(*requests):
    return ResourcePlan(requests=tuple(requests), actors=())


def test_parse_cluster_shapes():
    assert parse_cluster("2x8gpu") == (NodeShape(64.0, 8),) * 2
    assert parse_cluster("2x8gpu:96cpu") == (NodeShape(96.0, 8),) * 2
    assert parse_cluster("1x4cpu") == (NodeShape(4.0, 0),)
    assert parse_cluster("1x16cpu+2x8gpu") == (NodeShape(16.0, 0), NodeShape(64.0, 8), NodeShape(64.0, 8))
    for bad in ("2x8", "8gpu", "2x0gpu", "2x8gpu:cpu", ""):
        with pytest.raises(ValueError, match="NxGgpu"):
            parse_cluster(bad)


def test_pack_spreads_a_group_over_nodes_when_one_cannot_hold_it():
    packing = pack(_plan(_group(["policy"], 12)), parse_cluster("2x8gpu"))
    slots = packing.slots[0]
    assert [s.node for s in slots] == [0] * 8 + [1] * 4
    assert [s.gpu_ids for s in slots] == [(i,) for i in range(8)] + [(i,) for i in range(4)]
    assert packing.free == ((56.0, (0.0,) * 8), (60.0, (0.0,) * 4 + (1.0,) * 4))


def test_pack_starts_a_group_on_the_freer_node():
    """Ray's LeastResourceScorer: the node with the largest free fraction gets the first bundle, and the rest join it
    while they fit (so the 4-bundle group stays whole on node 1, not split 4 + 0 onto node 0's leftovers)."""
    packing = pack(_plan(_group(["policy"], 4), _group(["reference"], 4)), parse_cluster("2x8gpu"))
    assert [s.node for s in packing.slots[0]] == [0] * 4
    assert [s.node for s in packing.slots[1]] == [1] * 4


def test_colocated_roles_take_fractional_shares_of_one_bundle():
    cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            "model.path=/m",
            "data.train_path=/d",
            "train.num_workers=2",
            "rollout.num_engines=2",
            "colocate.hybrid_engine=true",
            "colocate.policy_reference=true",
            "strategy.cpus_per_worker=3",
        ],
    )
    plan = kind_of(cfg).plan(cfg, gpus_per_worker=1.0)
    (group,) = plan.groups
    assert (group.name, group.num_bundles, group.bundle, group.share) == (
        "policy+reference+rollout",
        2,
        {"CPU": 3.0, "GPU": 1.0},
        3,
    )
    assert [(a.role, a.cpus, a.gpus, a.group) for a in plan.actors] == [
        (role, 1.0, pytest.approx(1 / 3), group.name) for role in ("policy", "rollout", "reference")
    ]
    packing = pack(plan, parse_cluster("1x2gpu"))
    assert packing.feasible and packing.shared_devices() == []  # three roles on one device is the point
    assert [s.gpu_ids for s in packing.slots[0]] == [(0,), (1,)]


def test_fractional_gpus_per_worker_puts_two_ranks_on_one_device():
    packing = pack(_plan(_group(["policy"], 2, gpus=0.5)), parse_cluster("1x2gpu"))
    assert [s.gpu_ids for s in packing.slots[0]] == [(0,), (0,)]  # Ray's best fit for fractional GPUs
    assert packing.shared_devices() == ["policy ranks 0, 1 share GPU 0 of node 0"]


def test_infeasible_group_is_all_or_nothing_and_named():
    nodes = parse_cluster("2x4gpu:8cpu")
    packing = pack(
        _plan(_group(["policy"], 4), _group(["critic", "reward_model"], 6), ActorPlan("rollout", 1, 1.0, 1.0)), nodes
    )
    assert packing.slots[0] is not None and packing.slots[1] is None and packing.slots[2] is None
    assert packing.failure.startswith(
        "cannot place placement group critic+reward_model (roles critic, reward_model): 6 bundles x {CPU: 1, GPU: 1}"
    )
    assert "node 0: 0 GPU, 4 CPU; node 1: 4 GPU, 8 CPU" in packing.failure  # the free resources, unchanged
    with pytest.raises(InfeasiblePlan, match="critic\\+reward_model"):
        check_feasible(packing)


def test_actors_with_own_resources_take_whole_gpus_and_can_fail():
    packing = pack(_plan(ActorPlan("rollout", 3, 2.0, 2.0)), parse_cluster("1x4gpu"))
    assert not packing.feasible and [s.gpu_ids for s in packing.slots[0] or ()] == []
    assert packing.failure.startswith("cannot place rollout actor 2 of 3 ({CPU: 2, GPU: 2} each")


def test_nodes_from_ray_keeps_alive_nodes():
    rows = [
        {"Alive": True, "Resources": {"CPU": 96.0, "GPU": 8.0}, "NodeManagerAddress": "10.0.0.1"},
        {"Alive": False, "Resources": {"CPU": 96.0, "GPU": 8.0}, "NodeManagerAddress": "10.0.0.2"},
        {"Alive": True, "Resources": {"CPU": 8.0}, "NodeManagerAddress": "10.0.0.3"},
    ]
    assert nodes_from_ray(rows) == (NodeShape(96.0, 8, "10.0.0.1"), NodeShape(8.0, 0, "10.0.0.3"))


def test_devices_resolve_like_the_runner():
    cfg = load_config(SFTRunConfig, "sft_tiny", ["model.path=/m", "data.train_path=/d"])
    assert resolve_devices(cfg.strategy, 8.0) == Devices(1.0, "bf16", "nccl")
    assert resolve_devices(cfg.strategy, 0.0) == Devices(0.0, "fp32", "gloo")


# ------------------------------------------------------------------------ the plan is what the runners ask for


class _Recorder:
    """Stand-ins for ``Placement``, ``WorkerGroup`` and ``RolloutEngines`` that record what they were asked for.

    ``requests``: ``("group", name, bundles, cpus, gpus, share)`` per placement group and ``("own", role, count,
    cpus, gpus)`` per set of actors with their own resources, in creation order; ``actors``: ``(role, count, cpus,
    gpus, group name or None)``, in the order they started. Roles on different placement groups start at the same
    time, so :meth:`seen` compares the roles' order within each group (and among the actors with resources of
    their own) only.
    """

    def __init__(self, monkeypatch):
        self.requests, self.actors, self.holding = [], [], []
        rec = self

        class Placement:
            def __init__(self, name, num_bundles, cpus, gpus=0.0, share=1):
                self.name, self.num_bundles, self.cpus, self.gpus, self.share = name, num_bundles, cpus, gpus, share
                rec.requests.append(("group", name, num_bundles, cpus, gpus, share))

            def remove(self):
                pass

        class WorkerGroup:  # a WorkerGroup without a shared placement makes its own, named after the role
            def __init__(self, role, resources, backend, placement=None, init_timeout_s=None):
                placement = placement or Placement(
                    role, resources.num_workers, resources.cpus_per_worker, resources.gpus_per_worker
                )
                self.role, self.size = role, resources.num_workers
                self.held = set()
                rec.actors.append(
                    (
                        role,
                        self.size,
                        placement.cpus / placement.share,
                        placement.gpus / placement.share,
                        placement.name,
                    )
                )

            def build(self, *args, **kwargs):
                pass

            def hold(self, role, model, engine):
                rec.holding.append((self.role, role, model.path, engine.micro_batch_size))
                self.held.add(role)

            def shutdown(self):
                pass

        class RolloutEngines:
            def __init__(
                self,
                spec,
                num_engines,
                cpus_per_engine=1.0,
                gpus_per_engine=0.0,
                env_vars=None,
                placement=None,
                sleep=False,
                **kwargs,
            ):
                self.size, self.handles = num_engines, []
                self.gpus_per_engine = gpus_per_engine if placement is None else placement.gpus / placement.share
                if placement is None:
                    rec.requests.append(("own", "rollout", num_engines, cpus_per_engine, float(gpus_per_engine)))
                    rec.actors.append(("rollout", num_engines, cpus_per_engine, float(gpus_per_engine), None))
                else:
                    rec.actors.append(
                        (
                            "rollout",
                            num_engines,
                            placement.cpus / placement.share,
                            placement.gpus / placement.share,
                            placement.name,
                        )
                    )

            def shutdown(self):
                pass

        class EnvironmentPool:
            def __init__(self, spec, num_actors, cpus_per_actor=1.0, step_timeout_s=60.0):
                rec.requests.append(("own", "environment", num_actors, cpus_per_actor, 0.0))
                rec.actors.append(("environment", num_actors, cpus_per_actor, 0.0, None))

            def shutdown(self):
                pass

        monkeypatch.setattr("rlhf.distributed.placement.Placement", Placement)
        monkeypatch.setattr("rlhf.distributed.group.WorkerGroup", WorkerGroup)
        monkeypatch.setattr("rlhf.trainers.context.Placement", Placement)  # where RunContext makes them
        monkeypatch.setattr("rlhf.trainers.context.WorkerGroup", WorkerGroup)
        monkeypatch.setattr("rlhf.rollout.vllm.engines.RolloutEngines", RolloutEngines)
        monkeypatch.setattr("rlhf.trainers.online.roles.RolloutEngines", RolloutEngines)  # where the RL roles start
        monkeypatch.setattr("rlhf.trainers.online.roles.EnvironmentPool", EnvironmentPool)

    @staticmethod
    def _by_group(actors):
        """``{group name or None: the actors on it, in order}``."""
        groups = {}
        for actor in actors:
            groups.setdefault(actor[4], []).append(actor)
        return groups

    def seen(self):
        """The requests in creation order, the roles started on each placement group (or with resources of their
        own) in order."""
        return self.requests, self._by_group(self.actors)

    @classmethod
    def of(cls, plan: ResourcePlan):
        """The same records, from a plan."""
        requests = [
            ("group", r.name, r.num_bundles, r.cpus, r.gpus, r.share)
            if isinstance(r, GroupPlan)
            else ("own", r.role, r.count, r.cpus, r.gpus)
            for r in plan.requests
        ]
        return requests, cls._by_group([(a.role, a.count, a.cpus, a.gpus, a.group) for a in plan.actors])


RL_VARIANTS = {
    "separate": [],
    "policy_reference": ["colocate.policy_reference=true"],
    "reference_in_policy": ["colocate.reference_in_policy=true", "model.ref_path=/ref"],
    "teacher_in_policy": [
        "algo.teacher.path=/t",
        "algo.teacher.mode=loss",
        "colocate.teacher_in_policy=true",
        "colocate.reference_in_policy=true",
        "train.num_workers=2",
    ],
    "hybrid": [
        "train.num_workers=2",
        "rollout.num_engines=2",
        "colocate.hybrid_engine=true",
        "colocate.policy_reference=true",
        "strategy.cpus_per_worker=3",
    ],
    "gae_critic_reward": [
        "algo.advantage_estimator=gae",
        "reward.model_path=/rm",
        "critic.num_workers=2",
        "reward.model_num_workers=2",
        "colocate.critic_reward=true",
        "rollout.num_engines=2",
        "rollout.tensor_parallel_size=2",
        "rollout.cpus_per_engine=2",
    ],
    "gae_apart": ["algo.advantage_estimator=gae", "reward.model_path=/rm", "algo.kl_coef=0", "critic.num_workers=2"],
    "multi_turn": [
        "env.spec=envs.py:Retry",
        "rollout.max_turns=2",
        "rollout.max_prompt_length=16",
        "rollout.max_episode_tokens=32",
        "env.num_actors=3",
        "env.cpus_per_actor=0.5",
    ],
}


@pytest.mark.parametrize("gpus", [0.0, 1.0], ids=["cpu", "gpu"])
@pytest.mark.parametrize("variant", sorted(RL_VARIANTS))
def test_rl_runner_requests_what_the_plan_says(variant, gpus, monkeypatch, capsys):
    from rlhf.trainers.context import RunContext
    from rlhf.trainers.online.roles import start_roles

    cfg = load_config(RLRunConfig, "grpo_tiny", ["model.path=/m", "data.train_path=/d", *RL_VARIANTS[variant]])
    rec = _Recorder(monkeypatch)
    ctx = RunContext(
        cfg=cfg, precision="bf16" if gpus else "fp32", backend="nccl" if gpus else "gloo", gpus_per_worker=gpus
    )
    plan = kind_of(cfg).plan(cfg, gpus)
    held = kind_of(cfg).reference_held(cfg)
    start_roles(cfg, ctx, plan, total_optimizer_steps=10, reference_held=held)
    assert rec.seen() == _Recorder.of(plan)
    # the held models: loaded by the policy's ranks, each with a frozen group's chunks; no actor of their own
    assert held is variant.endswith("_in_policy")
    expected = {
        "reference_in_policy": [("reference", "/ref")],
        "teacher_in_policy": [("reference", "/m"), ("teacher", "/t")],
    }
    assert rec.holding == [
        ("policy", role, path, cfg.train.micro_batch_size) for role, path in expected.get(variant, [])
    ]
    assert ("reference" in [a.role for a in plan.actors]) is (cfg.algo.kl_coef > 0 and not held)
    # the start-up's seconds, then each role's, in the plan's order
    each = ", ".join(rf"{a.role} \d+\.\d s" for a in plan.actors)
    assert re.search(rf"^\[rl\] roles started in \d+\.\d s \({each}\)$", capsys.readouterr().out, re.M)
    held = sum(r[2] * r[3] for r in rec.requests)  # bundles (or actors) x CPUs
    assert held == pytest.approx(plan.needed_cpus)


OFFLINE = {
    "sft": (SFTRunConfig, "sft_tiny", "rlhf.trainers.offline.sft:build_sft_task", "policy"),
    "rm": (RewardModelRunConfig, "rm_tiny", "rlhf.trainers.offline.reward_model:build_rm_task", "reward_model"),
    "dpo": (DPORunConfig, "dpo_tiny", "rlhf.trainers.offline.dpo:build_dpo_task", "policy"),
    "dpo-held": (DPORunConfig, "dpo_tiny", "rlhf.trainers.offline.dpo:build_dpo_task", "policy"),
}


class _Stop(Exception):
    pass


@pytest.mark.parametrize("kind", sorted(OFFLINE))
def test_offline_runner_requests_what_the_plan_says(kind, tiny_model, sft_data, pair_data, tmp_path, monkeypatch):
    """The offline runner up to its first step (groups built, the DPO reference attached), on stand-ins."""
    from rlhf.trainers import run
    from rlhf.trainers.context import RunContext
    from rlhf.trainers.offline import loop as offline

    cls, preset, builder, role = OFFLINE[kind]
    data = sft_data if kind == "sft" else pair_data
    cfg = load_config(
        cls,
        preset,
        [
            f"model.path={tiny_model}",
            f"data.train_path={data}",
            "train.num_workers=2",
            "train.global_batch_size=4",
            "train.micro_batch_size=1",
            f"train.output_dir={tmp_path}",
            "logging.tensorboard=false",
            "strategy.cpus_per_worker=1.5",
            *(["dpo.ref_mode=online", "dpo.ref_num_workers=3"] if kind == "dpo" else []),
            *(["dpo.ref_mode=online", "dpo.ref_num_workers=0"] if kind == "dpo-held" else []),
        ],
    )
    rec = _Recorder(monkeypatch)
    asked = {}

    def start_cluster(cfg_, packages, needed_cpus):
        asked["cpus"] = needed_cpus
        return RunContext(cfg=cfg_, precision="bf16", backend="nccl", gpus_per_worker=1.0)

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(run, "start_cluster", start_cluster)
    monkeypatch.setattr(run.Run, "train", stop)
    module, fn = builder.split(":")
    with pytest.raises(_Stop):
        offline._run_offline_once(cfg, kind_of(cfg), getattr(importlib.import_module(module), fn))
    assert kind_of(cfg).policy_role == role
    plan = kind_of(cfg).plan(cfg, 1.0)
    assert rec.seen() == _Recorder.of(plan)
    assert asked["cpus"] == pytest.approx(plan.needed_cpus) == pytest.approx(1.5 * (2 + 3 * (kind == "dpo")))
    # dpo.ref_num_workers=0: the policy's ranks load the reference (here the policy's own path), none of its own
    assert rec.holding == ([("policy", "reference", tiny_model, 1)] if kind == "dpo-held" else [])


def test_dry_run_prints_the_requests_the_runner_makes(monkeypatch, capsys):
    from rlhf.trainers.context import RunContext
    from rlhf.trainers.online.roles import start_roles

    overrides = ["model.path=/m", "data.train_path=/d", *RL_VARIANTS["gae_critic_reward"]]
    rc, out, err = _cli(
        "rlhf.cli.train_ppo",
        ["--config", "grpo_tiny", *overrides, "--dry-run", "--cluster", "1x8gpu"],
        capsys,
        monkeypatch,
    )
    assert rc == 0, err
    rec = _Recorder(monkeypatch)
    cfg = load_config(RLRunConfig, "grpo_tiny", overrides)
    start_roles(
        cfg, RunContext(cfg=cfg, precision="bf16", backend="nccl", gpus_per_worker=1.0), kind_of(cfg).plan(cfg, 1.0), 10
    )
    printed = out.split("placement groups")[1].split("actors:")[0]
    for i, request in enumerate(rec.requests, 1):
        kind, name, count, cpus, gpus = request[:5]
        what = "bundle" if kind == "group" else "actor"
        line = f"  {i}. {name}: {count} {what}{'s' if count > 1 else ''} x {{CPU: {cpus:g}, GPU: {gpus:g}}}"
        assert line in printed, (line, printed)
    for role, count, cpus, gpus, group in rec.actors:
        assert re.search(
            rf"^  {role} +{count} \w+ +\{{CPU: {cpus:.3g}, GPU: {gpus:.3g}\}} each +"
            + (rf"\w+ r on bundle r of {re.escape(group)}$" if group else "own resources$"),
            out,
            re.M,
        )


def test_a_role_without_a_starter_is_refused_before_anything_starts():
    from rlhf.trainers.actors import start_plan

    started = []
    plan = ResourcePlan(
        requests=(_group(["policy"], 2),),
        actors=(ActorPlan("policy", 2, 1.0, 0.0, "policy"), ActorPlan("critic", 2, 1.0, 0.0, "policy")),
    )
    with pytest.raises(ValueError, match=r"no starter for the plan's role\(s\) \['critic'\]"):
        start_plan(plan, None, {"policy": lambda actors, placement: started.append(actors)})
    assert started == []


# ------------------------------------------------------------------------ the roles start at the same time


def test_chains_run_at_the_same_time_each_in_its_order():
    """Two chains meet at a barrier only if they run at once; each chain's calls run one after another, in order."""
    from rlhf.trainers.actors import start_chains

    meet = threading.Barrier(2, timeout=10)
    done = []

    def call(name, wait=False):
        def run():
            if wait:
                meet.wait()  # a BrokenBarrierError after 10 s if the other chain waits for this one
            done.append(name)
            return name

        return run

    results = start_chains([[call("a1", wait=True), call("a2")], [call("b1"), call("b2", wait=True), call("b3")]])
    assert results == [["a1", "a2"], ["b1", "b2", "b3"]]
    assert done.index("a1") < done.index("a2") and done.index("b1") < done.index("b2") < done.index("b3")


def test_one_chain_runs_in_the_callers_thread():
    from rlhf.trainers.actors import start_chains

    assert start_chains([[threading.current_thread]]) == [[threading.current_thread()]]


def test_a_failed_start_waits_for_the_other_chains_then_raises_the_first_in_order(capsys):
    """The later chain fails first in time; the earlier one's failure is raised, after both chains ended (what
    started is registered for shutdown before the caller unwinds)."""
    from rlhf.trainers.actors import start_chains

    ended, later_failed = [], threading.Event()

    def first_chain():
        later_failed.wait(10)
        ended.append("first")
        raise RuntimeError("first chain")

    def later_chain():
        later_failed.set()
        raise KeyError("later chain")

    with pytest.raises(RuntimeError, match="first chain"):
        start_chains([[first_chain], [later_chain, lambda: ended.append("never")]])
    assert ended == ["first"]
    assert "warning: another role failed to start too: 'later chain'" in capsys.readouterr().err
