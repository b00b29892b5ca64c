"""The generated configuration reference (docs/configuration.md) is current and complete."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rlhf.config import DPORunConfig, describe_keys

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "docs" / "gen_config_reference.py"
REFERENCE = ROOT / "docs" / "configuration.md"


def test_configuration_reference_is_current():
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, f"{result.stderr}\n(run: python docs/gen_config_reference.py)"


def test_configuration_reference_lists_every_dpo_key():
    text = REFERENCE.read_text(encoding="utf-8")
    missing = [key for key, *_ in describe_keys(DPORunConfig) if f"`{key}`" not in text]
    assert not missing, f"keys missing from docs/configuration.md: {missing}"


def test_docs_site_builds_with_no_warnings(tmp_path):
    """``mkdocs build --strict``: every page in the nav exists, every internal link resolves."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for page in (
        "index.html",
        "quickstart/index.html",
        "algorithms/rl/index.html",
        "configuration/index.html",
        "multinode/index.html",
    ):
        assert (tmp_path / "site" / page).is_file(), page
