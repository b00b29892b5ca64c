"""bf16 on every ZeRO stage, on real Ray actors + real DeepSpeed engines (CPU, gloo), tiny model.

Per ZeRO stage two worker groups train in bf16 from the same weights: "whole" (1 rank, the global batch as one
micro-batch) and "split" (2 ranks x 2 micro-batches of accumulation). Both take the same three optimizer steps --
SFT, DPO (reference log-probs in the batch), one RL policy update (PPO's old log-probs and advantages in the
batch) -- and must log the same loss and grad norm at every step, to within the rounding of bf16 itself, which a
third group ("fp32", the whole batch in fp32) measures on the machine running the test. They stay in lockstep, so
later steps stay comparable. The batches are cut and the normalizer counted exactly as the trainers do
(``StepPlan.shards``, one count over every micro-batch of every rank).

The groups' actors are started once for the file and rebuilt for each stage (``build`` loads the model and a new
engine): actor start-up is most of the cost. The bound: see ``BF16_NOISE_CAP``.
"""

from __future__ import annotations

import pytest
import torch
from precision_helpers import in_parallel as _in_parallel
from precision_helpers import started_groups
from precision_helpers import step as _step
from shared_helpers import uneven_pair_batch, uneven_sft_batch

from rlhf.batch import Batch
from rlhf.config.schema import ConfigError
from rlhf.distributed.engine import EngineSpec, OptimSpec, build_ds_config

pytestmark = pytest.mark.usefixtures("ray_session")

GLOBAL_BATCH = 8
# name: (ranks, micro-batch size); accumulation 1 and 2. "fp32" takes the whole batch's steps in fp32: its distance
# from the bf16 "whole" run is bf16's own rounding noise on this machine, the scale split-vs-whole is held to.
LAYOUTS = {"whole": (1, 8), "split": (2, 2), "fp32": (1, 8)}
BF16 = ("whole", "split")
STEPS = 3  # SFT, DPO, RL

# Split vs whole in bf16: every step's loss and grad norm of the split run within the bf16 run's own distance from
# fp32 on this machine, the largest relative |whole - fp32| over the stage's steps and metrics. Why that scale: two
# bf16 runs of the same batch differ only where some rounding to bf16 came out differently (a matmul over another
# padded width, a sum in another order, a gradient crossing ranks), while the fp32 run differs at every rounding to
# bf16 (weights, activations, gradients). Measured on an AMD EPYC (avx512_bf16; ZeRO 0-3, 3 steps each, deterministic
# on CPU): split-vs-whole at most 1.3e-3 relative (the RL loss at ZeRO 3), the stage's bf16 noise 4.1e-3 (the RL
# grad norm), a ratio of 0.11 to 0.32 by stage; in fp32 the same comparison agrees to <= 2.6e-7. A CPU with other
# bf16 kernels moves both together, where a fixed tolerance would not.
BF16_NOISE_CAP = 2**-5  # 8 units of bf16's rounding: a bf16 run further from fp32 than this is not rounding
MIN_LOSS = 1e-2  # nor a relative comparison between two vanishing losses (the RL loss here is ~ -0.21)
MIN_GRAD_NORM = 1e-3  # the comparison must not be between two vanishing gradients


# ------------------------------------------------------------------------------------------------ pure config
@pytest.mark.parametrize("stage, accum", [(0, "bf16"), (1, "fp32"), (2, "fp32"), (3, "fp32")])
def test_bf16_accumulates_in_fp32_where_deepspeed_allows_it(stage, accum):
    spec = EngineSpec(
        zero_stage=stage,
        precision="bf16",
        micro_batch_size=2,
        grad_accum_steps=2,
        user_config={"data_types": {"grad_accum_dtype": "fp32"}},
    )
    cfg = build_ds_config(spec, world_size=2, max_grad_norm=1.0)
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"]["enabled"] is False
    assert cfg["data_types"]["grad_accum_dtype"] == accum  # the run's value, never the user's


# ------------------------------------------------------------------------------------------------ data
def _plain_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def batches(tiny_model):
    """The three global batches, whole: SFT ``(8, T)``; DPO ``(8, 2, T)`` with the reference log-probs of the
    initial weights (fp32, this process); RL ``(8, T)`` with one random advantage per sequence on its response
    tokens (its old log-probs come from the policy right before the RL step)."""
    from transformers import AutoTokenizer

    from rlhf.objectives.dpo import ReferenceLogps

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    sft = uneven_sft_batch(tokenizer, GLOBAL_BATCH, seed=11)
    pairs = uneven_pair_batch(tokenizer, GLOBAL_BATCH, seed=12)
    with torch.no_grad():
        pairs = pairs.replace(ref_logps=ReferenceLogps()(_plain_model(tiny_model), pairs))
    advantage = torch.randn(GLOBAL_BATCH, 1, generator=torch.Generator().manual_seed(13))
    rl = Batch(
        input_ids=sft.input_ids,
        attention_mask=sft.attention_mask,
        loss_mask=sft.loss_mask,
        advantages=advantage * sft.loss_mask.float(),
    )
    return {"sft": sft, "dpo": pairs, "rl": rl}


# ------------------------------------------------------------------------------------------------ groups
@pytest.fixture(scope="module")
def groups():
    """name -> (WorkerGroup, ranks, micro): the whole and the split group, started once for the file."""
    with started_groups(LAYOUTS) as started:
        yield started


def _build(group, ranks: int, micro: int, tiny_model: str, zero_stage: int, precision: str) -> None:
    from rlhf.models.loading import ModelSpec

    group.build(
        ModelSpec(path=tiny_model, precision=precision, seed=7),
        EngineSpec(
            zero_stage=zero_stage,
            precision=precision,
            micro_batch_size=micro,
            grad_accum_steps=GLOBAL_BATCH // (ranks * micro),
        ),
        OptimSpec(lr=1e-3, total_steps=STEPS),
    )


def _bf16_probe():
    """A score function for the workers (nested, so Ray ships it by value) -> ``[DeepSpeed's bf16 flag, every
    module weight is bf16, Adam's state is fp32 and keyed by fp32 master weights, fewest and most Adam steps]``."""

    def probe(model, batch):
        engine = model.engine
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch AdamW inside the wrapper
        states = list(inner.state.items())
        fp32 = bool(states) and all(
            master.dtype == torch.float32 and state["exp_avg"].dtype == torch.float32 for master, state in states
        )
        steps = [float(state["step"]) for _, state in states] or [-1.0]
        return torch.tensor(
            [
                float(engine.bfloat16_enabled()),
                float(all(p.dtype == torch.bfloat16 for p in model.module.parameters())),
                float(fp32),
                min(steps),
                max(steps),
            ]
        )

    return probe


def _train_in_lockstep(groups: dict, batches: dict) -> dict:
    """Every group takes the SFT, the DPO and the RL step in turn; the RL batch gets PPO's pi_old from the whole
    group (the policy's log-probs after the DPO step), one tensor for all. Returns name -> the steps'
    ``{"loss", "grad_norm"}``."""
    from rlhf.objectives.actor_critic import PolicyObjective, TokenLogps
    from rlhf.objectives.dpo import DPOObjective
    from rlhf.objectives.sft import SFTObjective

    rows = {name: [] for name in groups}

    def step_all(objective, batch):
        done = _in_parallel({name: (lambda g=g: _step(*g, objective, batch)) for name, g in groups.items()})
        for name, row in done.items():
            rows[name].append(row)

    step_all(SFTObjective(), batches["sft"])
    step_all(DPOObjective(beta=0.1), batches["dpo"])
    old_logps = groups["whole"][0].score([batches["rl"]], TokenLogps())[0]
    step_all(PolicyObjective(), batches["rl"].replace(old_logps=old_logps))
    return rows


def _plain_fp32_sft_loss(tiny_model: str, batch: Batch) -> float:
    from rlhf.objectives.sft import SFTObjective

    with torch.no_grad():
        loss_sum, _ = SFTObjective().loss(_plain_model(tiny_model), batch)
    return float(loss_sum) / SFTObjective().count(batch)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])  # 3 last: a ZeRO-3 engine is never followed by a rebuild
def test_bf16_split_equals_whole_on_every_zero_stage(zero_stage, groups, tiny_model, batches):
    precision = {name: "bf16" if name in BF16 else "fp32" for name in groups}
    _in_parallel(
        {name: (lambda g=g, n=name: _build(*g, tiny_model, zero_stage, precision[n])) for name, g in groups.items()}
    )
    rows = _train_in_lockstep(groups, batches)

    # Trained in bf16: DeepSpeed's bf16 mode, bf16 module weights, fp32 masters and Adam state, and exactly one
    # Adam step per optimizer step (DeepSpeed's ZeRO-0 wrapper would count one more; see _undo_construction_step).
    for name in BF16:
        group, ranks, _ = groups[name]
        probes = group.score([batches["sft"]] * ranks, _bf16_probe())
        assert all(p.tolist() == [1.0, 1.0, 1.0, STEPS, STEPS] for p in probes), (name, probes)
    # ... so the forward is bf16's: near the fp32 loss of the same weights, but not equal to it (6.5e-5 relative
    # seen on every stage; ZeRO 3 keeps the rotary buffers float32 too, tests/unit/test_zero3_buffers.py).
    fp32_loss = _plain_fp32_sft_loss(tiny_model, batches["sft"])
    assert 1e-5 < abs(rows["whole"][0]["loss"] - fp32_loss) / fp32_loss < 1e-2, (rows["whole"][0], fp32_loss)

    steps = list(zip(rows["whole"], rows["split"], rows["fp32"]))
    for whole, split, _ in steps:
        assert abs(whole["loss"]) > MIN_LOSS and min(whole["grad_norm"], split["grad_norm"]) > MIN_GRAD_NORM

    def relative(a: dict, b: dict, key: str) -> float:
        return abs(a[key] - b[key]) / abs(b[key])

    keys = ("loss", "grad_norm")
    noise = max(relative(whole, fp32, key) for whole, _, fp32 in steps for key in keys)
    assert 0 < noise <= BF16_NOISE_CAP, noise
    for step, (whole, split, fp32) in enumerate(steps, start=1):
        for key in keys:
            off = relative(split, whole, key)
            print(
                f"[bf16 zero={zero_stage} step={step}] {key}: whole {whole[key]:.7g} split {split[key]:.7g} "
                f"fp32 {fp32[key]:.7g}; split vs whole {off:.2e}, bf16 noise {noise:.2e}"
            )
            assert off <= noise, (zero_stage, step, key, whole, split, fp32)


# ------------------------------------------------------------------------------------------------ fp16
def test_fp16_is_refused_by_name_when_the_config_is_built(tiny_model, sft_data, tmp_path):
    from rlhf.config.loader import load_config
    from rlhf.config.schema import SFTRunConfig

    with pytest.raises(ConfigError, match=r"^strategy\.precision is fp16, which is not supported: .* use bf16"):
        load_config(
            SFTRunConfig,
            overrides=[
                f"model.path={tiny_model}",
                f"data.train_path={sft_data}",
                f"train.output_dir={tmp_path / 'out'}",
                "strategy.precision=fp16",
            ],
        )
