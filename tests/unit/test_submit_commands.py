"""One cluster-submit command everywhere, and the documented local commands run.

* Every ``ray job submit`` command in the README, ``docs/``, ``examples/`` and ``ray_cluster/`` is the one
  command: ``RAY_AUTH_MODE=token ray job submit --address http://HOST:8265 --working-dir . -- ENTRY`` (the
  launchers add only ``--runtime-env-json`` with NCCL settings). Its entry points exist, and their configs pass
  ``--dry-run`` against the cluster their launcher names.
* Each launcher, run against a stand-in ``ray``, submits exactly that (token auth, from the repository root), and
  ``examples/launchers/README.md`` shows what it submits verbatim.
* The local commands of the README, the quickstart and ``examples/sft_then_dpo.sh`` run at tiny sizes:
  ``make_assets`` for real, the trainers with ``--dry-run`` (no Ray, no actors) on the assets it wrote.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
from shared_helpers import run_main

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_DIR = ROOT / "examples" / "launchers"
LAUNCHERS = sorted(p for p in LAUNCHER_DIR.glob("*.sh") if p.name != "submit.sh")
# Every file that may show a submit command (submit.sh is run below instead: its command is built from variables).
SOURCES = sorted(
    {
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "examples").rglob("*.md"),
        *(ROOT / "examples").rglob("*.sh"),
        *(p for p in (ROOT / "ray_cluster").iterdir() if p.is_file()),
    }
    - {LAUNCHER_DIR / "submit.sh"}
)
# Where a reader looks for it: each must show the whole command at least once.
MUST_SHOW = (
    "README.md",
    "docs/quickstart.md",
    "docs/multinode.md",
    "examples/sft_then_dpo.sh",
    "examples/launchers/README.md",
    "ray_cluster/README.md",
    "ray_cluster/cluster.yaml",
    "ray_cluster/kuberay-raycluster.yaml",
)

# The one command, up to its entry point: the token-auth client mode, the head's dashboard, the checkout uploaded.
AUTH = "RAY_AUTH_MODE=token"
ADDRESSES = ("http://HEAD_IP:8265", "http://127.0.0.1:8265")  # a head's address, or KubeRay's port-forward
OPTIONS = ["--address", "ADDRESS", "--working-dir", "."]
NCCL_ENV = '{"env_vars": {"NCCL_DEBUG": "WARN"}}'  # what submit.sh adds with no NCCL variable set


def _commands(path: Path) -> List[str]:
    """The ``ray job submit`` commands shown in ``path``: a code line (continuations joined, comment markers and
    trailing comments dropped) or an inline code span. A bare mention (`` `ray job submit` ``) is not one."""
    text = re.sub(r"\\\n\s*(#\s*)?", " ", path.read_text(encoding="utf-8"))
    found = []
    for line in text.splitlines():
        if "ray job submit" not in line:
            continue
        assert line.count("`") % 2 == 0, f"{path.relative_to(ROOT)}: a command wraps inside `...`: {line!r}"
        spans = re.findall(r"`([^`]*ray job submit[^`]*)`", line) if "`" in line else [line]
        for span in spans:
            command = re.sub(r"\s+#\s.*$", "", re.sub(r"^\s*#?\s*", "", span)).strip()
            if command != "ray job submit":
                found.append(command)
    return found


DOCUMENTED: List[Tuple[str, str]] = [(str(p.relative_to(ROOT)), c) for p in SOURCES for c in _commands(p)]


def _split(command: str) -> Tuple[List[str], List[str], List[str]]:
    """``(environment and program, options, entry point)`` of a submit command."""
    words = shlex.split(command)
    assert "--" in words, f"no `--` before the entry point: {command}"
    cut = words.index("--")
    head, entry = words[:cut], words[cut + 1 :]
    start = head.index("ray")
    return head[: start + 3], head[start + 3 :], entry


def _normalised_options(options: List[str]) -> List[str]:
    options = list(options)
    if "--runtime-env-json" in options:  # the launchers' NCCL settings: the only option allowed in addition
        at = options.index("--runtime-env-json")
        assert set(json.loads(options[at + 1])) == {"env_vars"}, options[at + 1]
        del options[at : at + 2]
    if "--address" in options:
        at = options.index("--address") + 1
        assert options[at] in ADDRESSES, f"--address {options[at]}: use one of {ADDRESSES}"
        options[at] = "ADDRESS"
    return options


def _cluster_of(config: str) -> str:
    """The ``# cluster:`` shape of the launcher that goes with a launcher config, else ``""`` (this machine)."""
    launcher = (ROOT / config).with_suffix(".sh")
    if not launcher.is_file():
        return ""
    return re.search(r"^# cluster: *(\S+)", launcher.read_text(), re.M).group(1)


def _main(module: str, argv: List[str], cwd: Path, capsys, monkeypatch) -> Tuple[int, str, str]:
    return run_main(module, argv, cwd, capsys, monkeypatch)


# ------------------------------------------------------------------------------------------------ the one command


def test_every_page_shows_the_whole_submit_command():
    showing = {source for source, _ in DOCUMENTED}
    missing = [name for name in MUST_SHOW if name not in showing]
    assert not missing, f"no full `ray job submit` command in {missing}"


@pytest.mark.parametrize("source,command", DOCUMENTED, ids=[f"{s}:{i}" for i, (s, _) in enumerate(DOCUMENTED)])
def test_a_documented_submit_command_is_the_one_command(source, command):
    program, options, entry = _split(command)
    assert program == [AUTH, "ray", "job", "submit"], f"{source}: {command}"
    assert _normalised_options(options) == OPTIONS, f"{source}: {command}"
    if entry[:2] == ["python", "-m"]:
        assert entry[2].startswith("rlhf.cli.") and importlib.util.find_spec(entry[2]), f"{source}: {entry}"
    else:
        assert entry[0] == "bash" and (ROOT / entry[1]).is_file(), f"{source}: entry point {entry}"
        assert subprocess.run(["bash", "-n", str(ROOT / entry[1])]).returncode == 0


ENTRIES = [_split(c)[2] for _, c in DOCUMENTED if "--" in shlex.split(c)]
TRAINING_ENTRIES = sorted({tuple(e[2:]) for e in ENTRIES if e[:2] == ["python", "-m"] and "--config" in e})


@pytest.mark.parametrize("entry", TRAINING_ENTRIES, ids=[" ".join(e) for e in TRAINING_ENTRIES])
def test_a_submitted_training_command_passes_its_dry_run(entry, capsys, monkeypatch):
    """Run from the repository root, which ``--working-dir .`` makes the job's working directory."""
    module, *argv = entry
    config = argv[argv.index("--config") + 1]
    cluster = _cluster_of(config)
    rc, out, err = _main(
        module, argv + ["--dry-run"] + (["--cluster", cluster] if cluster else []), ROOT, capsys, monkeypatch
    )
    assert rc == 0, err
    assert "result: fits on" in out


# ---------------------------------------------------------------------------------------------- the launchers


FAKE_RAY = """#!PYTHON
import json, os, sys
with open(os.environ["FAKE_RAY_OUT"], "w") as f:
    json.dump({"argv": sys.argv[1:], "auth": os.environ.get("RAY_AUTH_MODE"), "cwd": os.getcwd()}, f)
"""


def _submitted(launcher: Path, tmp_path: Path, **env_vars) -> dict:
    """What ``launcher`` hands to ``ray``, through a stand-in ``ray`` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ray").write_text(FAKE_RAY.replace("PYTHON", sys.executable, 1))
    (bin_dir / "ray").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "RAY_", "RLHF_")) and k != "DRY_RUN"}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        RAY_ADDRESS=ADDRESSES[0],
        FAKE_RAY_OUT=str(tmp_path / "submitted.json"),
        **env_vars,
    )
    done = subprocess.run(
        [str(launcher), "train.seed=7"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads((tmp_path / "submitted.json").read_text())


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda p: p.stem)
def test_a_launcher_submits_the_one_command(launcher, tmp_path):
    text = launcher.read_text()
    module, config = (re.search(rf"^{key}=(\S+)", text, re.M).group(1) for key in ("MODULE", "CONFIG"))
    got = _submitted(launcher, tmp_path)
    assert got["auth"] == "token" and Path(got["cwd"]) == ROOT  # --working-dir . is the repository root
    assert got["argv"] == [
        "job",
        "submit",
        "--address",
        ADDRESSES[0],
        "--working-dir",
        ".",
        "--runtime-env-json",
        NCCL_ENV,
        "--",
        "python",
        "-m",
        module,
        "--config",
        config,
        "train.seed=7",
    ]


def test_the_launchers_readme_shows_what_a_launcher_submits(tmp_path):
    shown = [c for source, c in DOCUMENTED if source == "examples/launchers/README.md"]
    assert len(shown) == 1
    got = _submitted(LAUNCHER_DIR / "grpo_qwen7b_2node_hybrid.sh", tmp_path)
    assert shlex.split(shown[0]) == [AUTH, "ray"] + got["argv"][:-1]  # less the override given above


def test_nccl_settings_from_the_shell_reach_the_runtime_env(tmp_path):
    got = _submitted(LAUNCHERS[0], tmp_path, NCCL_SOCKET_IFNAME="eth0", NCCL_DEBUG="INFO", DEEPSPEED_TIMEOUT="30")
    runtime_env = json.loads(got["argv"][got["argv"].index("--runtime-env-json") + 1])
    assert runtime_env == {"env_vars": {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "DEEPSPEED_TIMEOUT": "30"}}


# ----------------------------------------------------------------------------------------- the local commands


def _local_commands(path: Path) -> List[List[str]]:
    """``python -m rlhf.cli.*`` commands in the bash blocks of a page (or lines of a script), as argv after ``-m``,
    in order; ``$WORK`` / ``$PY`` of a script stay as written."""
    text = re.sub(r"\\\n\s*", " ", path.read_text(encoding="utf-8"))
    if path.suffix == ".md":
        text = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))
    commands = []
    for line in text.splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line.startswith("#") or "ray job submit" in line or not re.search(r"-m rlhf\.cli\.", line):
            continue
        words = shlex.split(line)
        commands.append(words[words.index("-m") + 1 :])
    return commands


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md", "examples/sft_then_dpo.sh"])
def test_the_local_commands_run_at_tiny_sizes(page, tmp_path, capsys, monkeypatch):
    """In a fresh directory, as on a fresh clone: the asset command for real, then every trainer's ``--dry-run``
    (model and data paths that the asset command wrote must be found and pass their checks)."""
    commands = [[w.replace("$WORK", "work") for w in c] for c in _local_commands(ROOT / page)]
    ran = [c[0] for c in commands]
    assert any(m.startswith("rlhf.cli.train_") for m in ran), f"{page}: no training command found"
    for module, *argv in commands:
        if "--help" in argv:
            continue
        if module == "rlhf.cli.make_assets":
            rc, _, err = _main(
                module,
                argv + ["--num-sft", "64", "--num-pref", "64", "--num-prompts", "16", "--num-eval-prompts", "8"],
                tmp_path,
                capsys,
                monkeypatch,
            )
            assert rc == 0, err
            continue
        if not module.startswith("rlhf.cli.train_"):
            continue
        rc, out, err = _main(module, argv + ["--dry-run"], tmp_path, capsys, monkeypatch)
        assert rc == 0, f"{page}: {module} {' '.join(argv)}\n{err}"
        for key in ("model.path", "data.train_path"):
            value = next(a.split("=", 1)[1] for a in argv if a.startswith(key + "="))
            if (tmp_path / value).exists():
                assert re.search(rf"{re.escape(key)} +{re.escape(value)} +found", out), out


# ------------------------------------------------------------------------------------ the algorithm pages' commands


ALGORITHM_PAGES = ("docs/algorithms/agents.md", "docs/algorithms/multi_turn.md", "docs/algorithms/async.md")
ALGORITHM_COMMANDS = [
    (page, argv)
    for page in ALGORITHM_PAGES
    for argv in _local_commands(ROOT / page)
    if argv[0].startswith("rlhf.cli.train_")
]


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory) -> Path:
    """``make_assets`` once for every page's commands, at tiny sizes."""
    from rlhf.cli.make_assets import make_assets

    out = tmp_path_factory.mktemp("assets")
    make_assets(str(out), num_sft=32, num_pref=8, num_prompts=16, num_eval_prompts=8)
    return out


def _page_files(page: str) -> dict:
    """The files a page shows: its Python blocks that open with ``# NAME.py``."""
    blocks = re.findall(r"```python\n# (\S+\.py)\n(.*?)```", (ROOT / page).read_text(encoding="utf-8"), re.S)
    return {name: code for name, code in blocks}


def _asset_dirs(page: str) -> List[str]:
    """Where the page's ``make_assets`` commands write."""
    return [argv[argv.index("--out") + 1] for argv in _local_commands(ROOT / page) if argv[0] == "rlhf.cli.make_assets"]


def test_every_algorithm_page_shows_a_training_command():
    assert {page for page, _ in ALGORITHM_COMMANDS} == set(ALGORITHM_PAGES)


@pytest.mark.parametrize(
    "page,argv", ALGORITHM_COMMANDS, ids=[f"{p.split('/')[-1]}:{' '.join(a)[:60]}" for p, a in ALGORITHM_COMMANDS]
)
def test_an_algorithm_pages_command_passes_its_dry_run(page, argv, tiny_assets, tmp_path, capsys, monkeypatch):
    """As written, in a directory holding the page's own files (``my_agent.py``, ``my_envs.py``) and make_assets'
    files (also under the ``--out`` of the page's own make_assets command), on the tiny model: only ``model.path``
    is a stand-in where it names no model here (``DIR``, or the output of the page's SFT command, which a dry run
    does not write). Each length the engines would see is checked against the tiny model's 512 positions, and the
    page's environment file loads."""
    module, *argv = argv
    for name, code in _page_files(page).items():
        (tmp_path / name).write_text(code)
    for item in tiny_assets.iterdir():
        (tmp_path / item.name).symlink_to(item)
    for out in _asset_dirs(page):  # the page's own make_assets command: built once for the module
        (tmp_path / out).symlink_to(tiny_assets)
    model = next(a.split("=", 1)[1] for a in argv if a.startswith("model.path="))
    if not (tmp_path / model).is_dir():
        argv = [f"model.path={tiny_assets / 'model'}" if a.startswith("model.path=") else a for a in argv]
    rc, out, err = _main(module, argv + ["--dry-run"], tmp_path, capsys, monkeypatch)
    assert rc == 0, f"{page}: {module} {' '.join(argv)}\n{err}"
    assert re.search(r"data.train_path +\S+ +found; ", out), out
    if module == "rlhf.cli.train_ppo":
        assert "within the model's 512 positions (max_position_embeddings 512 in its config.json)" in out, out
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("env.spec=")), "")
    if spec.split(":")[0] in _page_files(page):
        assert re.search(rf"env.spec +{re.escape(spec)} +found, loads", out), out
