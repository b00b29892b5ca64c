"""One descriptor per trainer (``rlhf.trainers.kinds``): what the command lines, ``--dry-run``, the audit, LoRA and
the output directory read, and no code left that guesses a config's trainer from the sections it has."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rlhf.config import DPORunConfig, RewardModelRunConfig, SFTRunConfig, load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.models.loading import CAUSAL_LM, SCALAR_HEAD
from rlhf.registry import UnknownNameError
from rlhf.trainers.kinds import TRAINER_KINDS, kind_of, kinds

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["model.path=/m", "data.train_path=/d.jsonl"]


def _cfg(cls, preset, *extra):
    return load_config(cls, preset, [*OVERRIDES, *extra])


def test_every_run_config_has_one_descriptor_found_by_its_class():
    pairs = {SFTRunConfig: "sft", RewardModelRunConfig: "rm", DPORunConfig: "dpo", RLRunConfig: "ppo"}
    assert [k.name for k in kinds()] == ["sft", "rm", "dpo", "ppo"]
    for cls, name in pairs.items():
        assert kind_of(object.__new__(cls)) is TRAINER_KINDS.get(name)
        assert TRAINER_KINDS.get(name).config_cls is cls
    with pytest.raises(
        TypeError,
        match=r"^dict is no trainer's run config; the trainers' are SFTRunConfig, "
        r"RewardModelRunConfig, DPORunConfig, RLRunConfig$",
    ):
        kind_of({})
    with pytest.raises(UnknownNameError, match=r"unknown trainer 'kto'\..*Valid names: dpo, ppo, rm, sft"):
        TRAINER_KINDS.get("kto")


def test_the_descriptors_facts():
    sft, rm, dpo, ppo = kinds()
    assert [(k.policy_role, k.policy_kind, k.run_name) for k in kinds()] == [
        ("policy", CAUSAL_LM, "sft"),
        ("reward_model", SCALAR_HEAD, "rm"),
        ("policy", CAUSAL_LM, "dpo"),
        ("policy", CAUSAL_LM, "rl"),
    ]
    assert "vllm" not in sft.packages and "vllm" in ppo.packages and ppo.online and not dpo.online
    assert ppo.model_keys == ("model.path", "model.ref_path", "critic.path", "reward.model_path", "algo.teacher.path")
    assert sft.model_keys == rm.model_keys == dpo.model_keys == ("model.path", "model.ref_path")


def test_a_plan_comes_from_the_descriptor():
    """DPO's reference group, or none with LoRA (the policy's workers score the base); the reward model's role."""
    dpo = _cfg(DPORunConfig, "dpo_tiny", "dpo.ref_num_workers=3", "dpo.ref_mode=online")
    assert [(a.role, a.count) for a in kind_of(dpo).plan(dpo, 0.0).actors] == [("policy", 1), ("reference", 3)]
    lora = _cfg(DPORunConfig, "dpo_tiny", "model.lora.r=8")
    assert [a.role for a in kind_of(lora).plan(lora, 0.0).actors] == ["policy"]
    rm = _cfg(RewardModelRunConfig, "rm_tiny")
    assert [a.role for a in kind_of(rm).plan(rm, 0.0).actors] == ["reward_model"]
    gae = _cfg(RLRunConfig, "grpo_tiny", "algo.advantage_estimator=gae", "reward.functions=[m:f]")
    assert "critic" in [a.role for a in kind_of(gae).plan(gae, 0.0).actors]
    assert kind_of(gae).trained_models(gae) == [("/m", CAUSAL_LM), ("/m", SCALAR_HEAD)]


@pytest.mark.parametrize("workers", [2, 0])
@pytest.mark.parametrize("lora", [False, True])
def test_dpo_scores_the_starting_policy_on_the_policys_ranks_and_any_other_reference_on_its_own(lora, workers):
    """Precomputed, the reference the run starts from needs no group: the policy's ranks score it before the first
    step (with LoRA: its base, at every step too). Another ``model.ref_path``, or an online reference without
    LoRA, is a frozen group of ``dpo.ref_num_workers`` ranks, or with 0 a frozen copy each policy rank holds; the dry
    run says which."""
    extra = ("model.lora.r=8",) if lora else ()
    for overrides, needs_copy in (
        ((), False),
        (("model.ref_path=/m",), False),  # the policy's own path: the same model
        (("dpo.ref_mode=online",), not lora),
        (("model.ref_path=/other",), True),
        (("model.ref_path=/other", "dpo.ref_mode=online"), True),
    ):
        cfg = _cfg(DPORunConfig, "dpo_tiny", "model.path=/m", f"dpo.ref_num_workers={workers}", *extra, *overrides)
        kind = kind_of(cfg)
        group, held = needs_copy and workers > 0, needs_copy and workers == 0
        assert kind.reference_group(cfg) is group and kind.reference_on_policy(cfg) is not group, overrides
        assert kind.reference_held(cfg) is held, overrides
        assert kind.reference_on_base(cfg) is (lora and "model.ref_path=/other" not in overrides), overrides
        roles = [(a.role, a.count) for a in kind.plan(cfg, 0.0).actors]
        assert roles == [("policy", 1)] + ([("reference", 2)] if group else []), overrides
        said = [line for line in kind.batch_lines(cfg, []) if line.startswith("  reference: ")]
        online = "dpo.ref_mode=online" in overrides
        if group:
            assert said and said[0].startswith("  reference: 2 ranks"), overrides
        elif held:
            path = "/other" if "model.ref_path=/other" in overrides else "/m"
            assert said == [
                f"  reference: {path}, a frozen copy in each policy rank's own process (dpo.ref_num_workers=0), "
                + ("dpo.ref_mode=online" if online else "dpo.ref_mode=precompute: scores every pair once, then dropped")
            ], overrides
        elif not lora:
            assert said == [
                "  reference: the starting policy, dpo.ref_mode=precompute: the policy's ranks score every pair "
                "once before the first step (no reference workers; dpo.ref_num_workers unused)"
            ]
        else:  # the LoRA line of the dry run says the base is the reference
            assert said == []


def test_dpo_ref_offload_moves_the_held_copy_and_is_refused_where_there_is_none():
    """``dpo.ref_offload``: the copy the policy's ranks hold and score at every step (online, 0 reference ranks)
    waits in host memory between its passes, as the dry run says; refused, naming the key and why, where nothing
    would move."""
    from rlhf.config.schema import ConfigError

    held = ("dpo.ref_mode=online", "dpo.ref_num_workers=0", "dpo.ref_offload=true")
    cfg = _cfg(DPORunConfig, "dpo_tiny", "model.path=/m", *held)
    assert [line for line in kind_of(cfg).batch_lines(cfg, []) if line.startswith("  reference: ")] == [
        "  reference: /m, a frozen copy in each policy rank's own process (dpo.ref_num_workers=0), "
        "dpo.ref_mode=online; in host memory between its passes (dpo.ref_offload)"
    ]
    for extra, why in (
        (("dpo.loss_type=simpo",), "dpo.loss_type=simpo reads no reference model"),
        (("model.lora.r=4",), "with model.lora.r > 0 the reference is the policy's own frozen base"),
        (("dpo.ref_mode=precompute",), "dpo.ref_mode=precompute scores the reference once, then drops it"),
        (("dpo.ref_num_workers=1",), r"a reference group \(dpo.ref_num_workers > 0\) has devices of its own"),
    ):
        with pytest.raises(ConfigError, match=rf"^dpo.ref_offload has nothing to offload: {why}"):
            _cfg(DPORunConfig, "dpo_tiny", "model.path=/m", *held, *extra)
    # LoRA with another reference: a copy to hold, and to offload
    _cfg(DPORunConfig, "dpo_tiny", "model.path=/m", *held, "model.lora.r=4", "model.ref_path=/other")


def test_rl_policy_ranks_hold_the_reference_when_asked_and_nothing_else_does():
    """``colocate.reference_in_policy``: no reference group, the policy's ranks hold and score it (the dry run says
    so); refused without a KL term, with LoRA on its own base (the base is the reference already) and beside
    ``colocate.policy_reference`` (two places for one reference), each naming the key."""
    from rlhf.config.schema import ConfigError
    from rlhf.distributed.resource_plan import Devices

    rl = ("reward.functions=[m:f]", "model.ref_path=/ref")
    for overrides, held in (((), False), (("colocate.reference_in_policy=true",), True)):
        cfg = _cfg(RLRunConfig, "grpo_tiny", *rl, *overrides)
        kind = kind_of(cfg)
        assert kind.reference_held(cfg) is held and kind.reference_group(cfg) is not held
        assert kind.reference_on_policy(cfg) is held and not kind.reference_on_base(cfg)
        plan = kind.plan(cfg, 0.0)
        assert ("reference" in [a.role for a in plan.actors]) is not held
        said = [
            line for line in kind.describe(cfg, plan, Devices(0.0, "fp32", "gloo")) if line.startswith("reference: ")
        ]
        assert said == (
            [
                "reference: /ref, a frozen copy in each policy rank's own process (colocate.reference_in_policy): no "
                "reference workers"
            ]
            if held
            else []
        )
    for extra, why in (
        (("algo.kl_coef=0",), "needs a reference model"),
        (("model.lora.r=4",), "has nothing to hold"),
        (("colocate.policy_reference=true",), "and colocate.policy_reference both place the reference"),
    ):
        with pytest.raises(ConfigError, match=rf"^colocate.reference_in_policy {why}"):
            _cfg(RLRunConfig, "grpo_tiny", rl[0], "colocate.reference_in_policy=true", *extra)
    # LoRA with another model.ref_path: that model is the reference, held as any other
    lora = _cfg(RLRunConfig, "grpo_tiny", *rl, "model.lora.r=4", "colocate.reference_in_policy=true")
    assert kind_of(lora).reference_held(lora) and not kind_of(lora).reference_on_base(lora)


def test_rl_policy_ranks_hold_the_distillation_teacher_when_asked():
    """``colocate.teacher_in_policy``: no teacher group, the held roles say both models, the dry run says so;
    refused without a teacher, for a teacher of another rank count, and beside ``colocate.policy_teacher``."""
    from rlhf.config.schema import ConfigError
    from rlhf.distributed.resource_plan import Devices
    from rlhf.trainers.online.roles import held_models

    rl = ("reward.functions=[m:f]", "algo.teacher.path=/t", "algo.teacher.mode=loss", "train.num_workers=2")
    for overrides, held in (
        ((), []),
        (("colocate.teacher_in_policy=true",), [("teacher", "/t")]),
        (
            ("colocate.teacher_in_policy=true", "colocate.reference_in_policy=true"),
            [("reference", "/m"), ("teacher", "/t")],
        ),
    ):
        cfg = _cfg(RLRunConfig, "grpo_tiny", *rl, *overrides)
        kind = kind_of(cfg)
        assert held_models(cfg, kind.reference_held(cfg)) == held, overrides
        plan = kind.plan(cfg, 0.0)
        assert [a.role for a in plan.actors if a.role in ("teacher", "reference")] == [
            role for role in ("reference", "teacher") if role not in dict(held)
        ], overrides
        said = [line for line in kind.describe(cfg, plan, Devices(0.0, "fp32", "gloo")) if line.startswith("teacher")]
        assert said == (
            [
                "teacher: /t, a frozen copy in each policy rank's own process (colocate.teacher_in_policy): "
                "no teacher workers"
            ]
            if "colocate.teacher_in_policy=true" in overrides
            else []
        )
    for extra, why in (
        (("algo.teacher.path=",), "needs a teacher"),
        (("algo.teacher.num_workers=1",), r"needs algo.teacher.num_workers \(1\) == train.num_workers \(2\), or 0"),
        (("colocate.policy_teacher=true",), "and colocate.policy_teacher both place the teacher"),
    ):
        with pytest.raises(ConfigError, match=rf"^colocate.teacher_in_policy {why}"):
            _cfg(RLRunConfig, "grpo_tiny", *rl, "colocate.teacher_in_policy=true", *extra)


def test_the_command_lines_parse_the_descriptors_config_class(capsys):
    """Each ``train_*`` CLI is its descriptor: ``--help`` lists a key only that trainer's config has."""
    import importlib

    for module, key in (
        ("train_sft", "data.assistant_turns"),
        ("train_rm", "rm.use_margin"),
        ("train_dpo", "dpo.beta"),
        ("train_ppo", "rollout.num_engines"),
    ):
        with pytest.raises(SystemExit):
            importlib.import_module(f"rlhf.cli.{module}").main(["--help"])
        assert key in capsys.readouterr().out, module


def _attribute_probes(path: Path, root: Path = ROOT):
    """``hasattr(cfg, ...)`` / ``getattr(cfg, "literal", ...)`` calls on a config in ``path``: a trainer guessed from
    its sections."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in ("cfg", "config")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
        ):
            yield f"{path.relative_to(root)}:{node.lineno}"


def test_no_code_asks_a_config_which_sections_it_has():
    found = [hit for path in sorted((ROOT / "rlhf").rglob("*.py")) for hit in _attribute_probes(path)]
    assert found == [], "read the trainer's descriptor (rlhf.trainers.kinds.kind_of) instead: " + ", ".join(found)


def test_the_probe_finder_finds_a_probe(tmp_path):
    sample = tmp_path / "probe.py"
    sample.write_text("def f(cfg):\n    return hasattr(cfg, 'rollout')\n", encoding="utf-8")
    assert list(_attribute_probes(sample, tmp_path)) == ["probe.py:2"]


#: The rooms every trainer passes through: they reach a trainer's own checks, lines and splits through its
#: descriptor's hooks, and never name a trainer's run config (an ``isinstance`` on one is a branch on the run's type).
GENERIC_ROOMS = (
    "rlhf/trainers/run.py",
    "rlhf/trainers/preflight.py",
    "rlhf/trainers/output_dir.py",
    "rlhf/trainers/actors.py",
    "rlhf/trainers/checkpoint.py",
    "rlhf/trainers/descriptor.py",
    "rlhf/trainers/findings.py",
    "rlhf/cli/dry_run.py",
    "rlhf/audit/lint.py",
    "rlhf/audit/runner.py",
    "rlhf/audit/factorizations.py",
)
TRAINER_CONFIGS = ("SFTRunConfig", "RewardModelRunConfig", "DPORunConfig", "RLRunConfig")


def _trainer_config_names(path: Path, root: Path = ROOT):
    """Where ``path`` names a trainer's run config class (an import or a use)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        for name in names:
            if name in TRAINER_CONFIGS:
                yield f"{path.relative_to(root)}:{node.lineno}: {name}"


def test_no_generic_room_branches_on_the_runs_type():
    found = [hit for room in GENERIC_ROOMS for hit in _trainer_config_names(ROOT / room)]
    assert found == [], "reach the trainer's own behaviour through a hook of its descriptor: " + ", ".join(found)


def test_the_room_finder_finds_a_branch(tmp_path):
    sample = tmp_path / "room.py"
    sample.write_text(
        "from rlhf.config.rl_schema import RLRunConfig\ndef f(cfg):\n    return isinstance(cfg, RLRunConfig)\n",
        encoding="utf-8",
    )
    assert list(_trainer_config_names(sample, tmp_path)) == ["room.py:1: RLRunConfig", "room.py:3: RLRunConfig"]


def test_the_hooks_reach_the_generic_rooms():
    """What only online RL checks, prints and splits comes from its hooks; the offline trainers' defaults add
    nothing (DPO's batch lines add its reference group)."""
    from rlhf.audit.runner import split_fits
    from rlhf.distributed.resource_plan import Devices

    sft, rm, dpo, ppo = kinds()
    gae = _cfg(RLRunConfig, "grpo_tiny", "algo.advantage_estimator=gae", "reward.functions=[m:f]")
    devices = Devices(precision="fp32", backend="gloo", gpus_per_worker=0.0)
    lines = ppo.describe(gae, ppo.plan(gae, 0.0), devices)
    assert lines[0].startswith("rollout: ") and any("weight sync" in line for line in lines)
    sft_cfg = _cfg(SFTRunConfig, "sft_tiny")
    assert sft.describe(sft_cfg, sft.plan(sft_cfg, 0.0), devices) == [] and sft.checks(sft_cfg, False) == []
    assert ppo.batch_lines(gae, ["  x"])[0].startswith("  RL step: ") and sft.batch_lines(sft_cfg, ["  x"])[0] == "  x"
    dpo_cfg = _cfg(DPORunConfig, "dpo_tiny", "dpo.ref_num_workers=2", "dpo.ref_mode=online")
    assert any(line.startswith("  reference: 2 ranks") for line in dpo.batch_lines(dpo_cfg, []))
    tied = _cfg(
        RLRunConfig,
        "grpo_tiny",
        "algo.advantage_estimator=gae",
        "reward.functions=[m:f]",
        "train.num_workers=2",
        "critic.num_workers=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
    )
    assert ppo.audit_overrides(tied, 1, 4) == ["critic.num_workers=4"] and sft.audit_overrides(sft_cfg, 1, 4) == []
    assert split_fits(tied)(2, 2) and not split_fits(tied)(3, 2)  # the critic's 2 x 3 do not divide 8
    assert [f.key for f in ppo.lint_batches(tied, 1)] == [
        "rollout.prompts_per_step=" + str(tied.rollout.prompts_per_step)
    ]


def test_the_core_never_imports_a_wing_and_no_wing_imports_the_list_of_trainers():
    """``rlhf/trainers/``'s core (its own modules) imports neither wing (``offline/``, ``online/``) nor
    ``kinds.py``; a wing imports the core, never ``kinds.py`` nor the other wing. So each trainer hands the core its
    own descriptor, and the list of every trainer sits above both wings."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    from test_architecture import all_imports

    def room(module: str) -> str:
        parts = module.split(".")
        if parts[:2] != ["rlhf", "trainers"] or len(parts) < 3:
            return "outside"
        return parts[2] if parts[2] in ("offline", "online", "kinds") else "core"

    allowed = {"core": {"core"}, "offline": {"core", "offline"}, "online": {"core", "online"}}
    imports = all_imports()
    seen = {(room(imp.importer), room(imp.target)) for imp in imports}
    assert {("online", "core"), ("offline", "core"), ("kinds", "online"), ("kinds", "offline")} <= seen  # read them
    wrong = [
        str(imp)
        for imp in imports
        if room(imp.importer) in allowed
        and room(imp.target) != "outside"
        and room(imp.target) not in allowed[room(imp.importer)]
    ]
    assert wrong == [], "\n".join(wrong)
