"""The RL step's logged numbers are global quantities (docs/concepts.md, "RL steps"): sums over all the step's
optimizer steps divided once by the summed normalizer, whatever the shuffle into optimizer steps and the split
into ranks and micro-batches; and each optimizer step's LR position is the run's planned step.

The driver's bookkeeping is unit-tested here with an in-process stand-in for the policy's worker group
(``group_helpers.LocalGroup``) that runs the real objective on the real tiny model without updating it (so every
optimizer step sees the same weights and the global value is known: the objective over the whole rollout batch at once).
That Ray workers keep the same contract per optimizer step is test_rl_e2e.py's and test_rl_reference.py's business.
"""

from __future__ import annotations

import copy

import pytest
import torch
from group_helpers import LocalGroup
from shared_helpers import float64_model

from rlhf.batch import Batch
from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.data.plan import StepPlan
from rlhf.distributed.engine import EngineSpec
from rlhf.objectives.actor_critic import PolicyObjective, TokenLogps
from rlhf.trainers.online.report import _largest
from rlhf.trainers.online.steps import RLActors, RLTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # this module's maths on one thread

ROWS = 16  # the rollout batch; optimizer steps of 4 -> 4 of them per RL step


@pytest.fixture(scope="module")
def model(tiny_model):
    """In float64: the split-vs-whole checks compare sums of mixed-sign terms, which float32 rounding moves by up to
    6.6e-7 relative between splits (too close to any bound that still catches a bug)."""
    return float64_model(tiny_model)


@pytest.fixture(scope="module")
def rollout(model):
    """16 rows of uneven prompt and response lengths, right-padded; old log-probs from a perturbed copy of the model
    (ratios != 1, so clipping binds on some tokens) and per-row advantages of both signs."""
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    rows, masks = [], []
    for i in range(ROWS):
        prompt, response = 2 + i % 3, 1 + (5 * i) % 7  # response lengths 1..7: token weighting matters
        rows.append(torch.randint(4, vocab, (prompt + response,), generator=gen).tolist())
        masks.append([0] * prompt + [1] * response)
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    batch = Batch(
        input_ids=ids,
        attention_mask=torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        loss_mask=torch.tensor([m + [0] * (width - len(m)) for m in masks]),
    )
    logps = TokenLogps()(model, batch)
    assert logps.dtype == torch.float64
    old = logps + 0.3 * torch.randn(logps.shape, generator=gen, dtype=torch.float64)
    advantages = torch.randn(ROWS, 1, generator=gen, dtype=torch.float64).expand(-1, width) * batch.loss_mask
    return batch.replace(old_logps=old, advantages=advantages.contiguous())


def _config(micro: int, ranks: int, ppo_epochs: int = 1, *extra: str) -> RLRunConfig:
    return load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            "model.path=unused",
            "data.train_path=unused",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "train.global_batch_size=4",
            f"train.micro_batch_size={micro}",
            f"train.num_workers={ranks}",
            f"algo.ppo_epochs={ppo_epochs}",
            "logging.console=line",
            *extra,
        ],
    )


def _update(cfg, objective, model, batch, rl_step):
    # each rank reports the LR position it was asked for: grad norm 1 + k, lr 0.01 (k + 1)
    group = LocalGroup(
        model,
        EngineSpec.for_global_batch(4, cfg.train.micro_batch_size, cfg.train.num_workers),
        cfg.train.num_workers,
        report=lambda rank, k: (1.0 + k, 0.01 * (k + 1)),
    )
    trainer = RLTrainer(cfg, None, None, None, RLActors(policy=group, engines=None), None, objective, None)
    return trainer.update(batch, rl_step), group.schedule_steps


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_rl_metrics_are_the_whole_rollouts_whatever_the_shuffle_and_split(model, rollout, agg_mode):
    objective = PolicyObjective(agg_mode=agg_mode)
    with torch.no_grad():
        whole = objective.finalize(objective.loss(model, rollout)[1], objective.count(rollout))
    logged = {}
    for micro, ranks in ((4, 1), (1, 2)):
        for rl_step in (1, 2):  # the update plan's shuffle is seeded by the RL step
            logged[micro, ranks, rl_step], calls = _update(_config(micro, ranks), objective, model, rollout, rl_step)
            assert calls == [4 * (rl_step - 1) + k for k in range(4)]  # the run's planned steps
    for row in logged.values():
        for key, value in whole.items():  # float64 rounding in other orders: ~1e-15; a wrong normalizer: > 1e-3
            assert row[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
        assert row["num_tokens"] == int(rollout.loss_mask[:, 1:].sum())
        assert row["optimizer_steps"] == 4
    # the per-optimizer-step values the old mean-of-means averaged really differ, so the check above can fail
    per_step = [objective.finalize(*_step_sums(objective, model, rollout, rows)) for rows in _shuffled_steps()]
    assert max(s["policy_loss"] for s in per_step) - min(s["policy_loss"] for s in per_step) > 0.05
    mean_of_means = sum(s["policy_loss"] for s in per_step) / len(per_step)
    if agg_mode == "token-mean":  # uneven token counts per step: the mean of means is not the global mean
        assert abs(mean_of_means - whole["policy_loss"]) > 1e-3


def _shuffled_steps():
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(11)).tolist()
    return [order[i : i + 4] for i in range(0, ROWS, 4)]


def _step_sums(objective, model, batch, rows):
    part = batch.select(rows).trim()
    with torch.no_grad():
        return objective.loss(model, part)[1], objective.count(part)


def test_rl_row_lr_is_the_last_optimizer_steps_and_ppo_epochs_count_every_pass(model, rollout):
    row, calls = _update(_config(4, 1, ppo_epochs=2), PolicyObjective(), model, rollout, rl_step=3)
    assert calls == list(range(16, 24))  # 8 optimizer steps per RL step; RL step 3 starts at 16
    assert row["lr"] == pytest.approx(0.01 * 24) and row["grad_norm"] == 24.0  # the last step's LR, the largest norm
    assert row["optimizer_steps"] == 8
    assert row["num_tokens"] == 2 * int(rollout.loss_mask[:, 1:].sum())  # both passes' tokens


def test_the_largest_grad_norm_keeps_a_non_finite_one():
    assert _largest([1.0, 3.0, 2.0]) == 3.0
    assert _largest([1.0, float("nan"), 2.0]) != _largest([1.0, float("nan"), 2.0])  # NaN, not 2.0
    assert _largest([float("inf"), 1.0]) == float("inf")
    assert _largest([None, None]) is None


@pytest.mark.parametrize(
    "estimator, policy_loss, expected",
    [
        ("grpo", "ppo", "seq-mean-token-mean"),
        ("grpo", "gspo", "seq-mean-token-mean"),
        ("gae", "gspo", "seq-mean-token-mean"),
        ("grpo", "cispo", "token-mean"),
        ("dr_grpo", "cispo", "token-mean"),
        ("dr_grpo", "ppo", "seq-mean-token-sum-norm"),
        ("rloo", "ppo", "seq-mean-token-sum-norm"),
        ("gae", "ppo", "token-mean"),
        ("reinforce_pp", "ppo", "token-mean"),
    ],
)
def test_auto_aggregation_is_the_papers(estimator, policy_loss, expected):
    from rlhf.config.rl_schema import AlgorithmConfig

    algo = AlgorithmConfig(advantage_estimator=estimator, policy_loss=policy_loss)
    assert algo.loss_agg_mode == "auto" and algo.aggregation == expected
    assert (
        AlgorithmConfig(advantage_estimator=estimator, policy_loss=policy_loss, loss_agg_mode="token-mean").aggregation
        == "token-mean"
    )  # a chosen mode wins


def test_an_unknown_aggregation_lists_auto_too():
    from rlhf.config.rl_schema import AlgorithmConfig
    from rlhf.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"algo\.loss_agg_mode: .*token-mean.*or auto"):
        AlgorithmConfig(loss_agg_mode="tokens")


def test_the_run_says_when_the_aggregation_is_not_the_papers():
    from rlhf.config.rl_schema import AlgorithmConfig

    assert AlgorithmConfig().describe_aggregation() == "seq-mean-token-mean (the paper's; algo.loss_agg_mode=auto)"
    assert (
        AlgorithmConfig(loss_agg_mode="token-mean").describe_aggregation()
        == "token-mean (the paper's is seq-mean-token-mean)"
    )
    assert AlgorithmConfig(advantage_estimator="gae", loss_agg_mode="token-mean").describe_aggregation() == "token-mean"


# ------------------------------------------------------------------------------------------ trainer / engine gaps
def _gapped(old, rollout, mask):
    """A one-row batch of 6 tokens with the given ``(6,)`` trainer and engine log-probs and loss mask."""
    return Batch(
        input_ids=torch.arange(4, 10)[None],
        attention_mask=torch.ones(1, 6, dtype=torch.long),
        loss_mask=torch.tensor([mask]),
        old_logps=torch.tensor([old], dtype=torch.float64),
        rollout_logps=torch.tensor([rollout], dtype=torch.float32),
    )


def test_logp_mismatch_max_is_the_largest_gap_on_a_response_token_beside_the_mean():
    from rlhf.rl import logp_mismatch, logp_mismatch_max

    #             prompt: a huge gap there is no sampled token's | response: gaps 0.125, 0.5, 0, 0.25 | padding
    old = [-9.0, -1.0, -1.125, -2.5, -0.75, -7.0]
    rollout = [0.0, -1.0, -1.0, -2.0, -0.75, -0.5]
    batch = _gapped(old, rollout, [0, 0, 1, 1, 1, 0])
    assert logp_mismatch_max(batch) == 0.5  # not 9 (a prompt token) nor 6.5 (padding)
    assert logp_mismatch(batch) == pytest.approx((0.125 + 0.5) / 3)  # the mean keeps its meaning
    assert logp_mismatch_max(_gapped(old, rollout, [0] * 6)) == 0.0  # no response token: no gap
    assert logp_mismatch_max(batch.replace(rollout_logps=None)) is None  # nothing to compare: not logged
    nan = _gapped([-1.0, float("nan"), -1.0, -1.0, -1.0, -1.0], [-1.0] * 6, [0, 1, 1, 0, 0, 0])
    assert logp_mismatch_max(nan) != logp_mismatch_max(nan)  # a NaN log-prob is NaN here, not dropped


class SyncedEngines:
    """Stand-in engines after a weight sync: each request samples fixed tokens, reported with their log-probs under
    the weights the engines hold (``model``: the policy's when the sync landed, an older copy when it did not)."""

    def __init__(self, model, logps):
        self.model, self.logps, self.asked = model, logps, []

    def generate(self, prompt_ids, sampling):
        from rlhf.rl import rollout_batch
        from rlhf.rollout.types import Generation

        self.asked.append(([tuple(p) for p in prompt_ids], sampling))
        out = []
        for j, prompt in enumerate(prompt_ids):
            response = tuple(5 + (3 * j + i) % 11 for i in range(sampling.max_new_tokens))
            batch = rollout_batch([Generation(tuple(prompt), response, (0.0,) * len(response), "length")], 0)
            with torch.no_grad():
                logps = self.logps(self.model, batch)[0][batch.loss_mask[0] != 0]
            out.append(Generation(tuple(prompt), response, tuple(logps.tolist()), "length"))
        return out


def _prober(model, engines_model, staleness: int):
    from types import SimpleNamespace

    from rlhf.rollout.prompts import PromptSet

    cfg = _config(4, 1, 1, f"rollout.max_staleness={staleness}")
    logps = TokenLogps(temperature=cfg.rollout.temperature, sampling_filter=cfg.rollout.sampling_filter)
    engines = SyncedEngines(engines_model, logps)
    policy = LocalGroup(model, EngineSpec.for_global_batch(4, 4, 1), 1)
    prompts = PromptSet([[7, 8, 9], [10, 11]], ["a", "b"], {}, 0, 0, stop_token_ids=(3,))
    plan = SimpleNamespace(total_steps=4)
    tokenizer = SimpleNamespace(pad_token_id=0)
    trainer = RLTrainer(cfg, tokenizer, prompts, plan, RLActors(policy=policy, engines=engines), None, None, None)
    return trainer, engines


def test_the_sync_probe_shows_whether_the_pushed_weights_reached_the_engines(model):
    """k >= 1: the probe's gap is ~0 when the engines hold the policy's weights and large when they kept older
    ones, whatever the step's stale samples say (rlhf/trainers/online/steps.py RLTrainer.probe_sync)."""
    from rlhf.trainers.online.report import StageTimer
    from rlhf.trainers.online.steps import PROBE_SAMPLES, PROBE_SEED, PROBE_TOKENS

    stale = copy.deepcopy(model)
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5), dtype=p.dtype))
    trainer, engines = _prober(model, model, staleness=1)
    timer = StageTimer()
    landed = trainer._probe_after_push(timer)
    assert landed is not None and landed < 1e-6  # float32 engine log-probs against float64 scores: rounding only
    assert "probe" in timer.seconds  # time/probe
    ((prompts, sampling),) = engines.asked
    assert prompts == [(7, 8, 9)] * PROBE_SAMPLES and sampling.seed == PROBE_SEED  # fixed: the first prompt
    assert sampling.max_new_tokens == min(PROBE_TOKENS, trainer.cfg.rollout.max_new_tokens)
    assert sampling.stop_token_ids == (3,) and sampling.temperature == trainer.cfg.rollout.temperature
    missed = _prober(model, stale, staleness=1)[0]._probe_after_push(StageTimer())
    assert missed > 1e-2  # a sync that did not land
    synchronous, engines = _prober(model, stale, staleness=0)
    assert synchronous._probe_after_push(StageTimer()) is None and not engines.asked  # k = 0: no extra call


def test_the_row_logs_the_gaps_and_k0s_sync_mismatch_is_logp_mismatch(model):
    from rlhf.trainers.online.report import StageTimer, step_row

    trainer, _ = _prober(model, model, staleness=0)
    batch = _gapped([-1.0, -1.0, -1.125, -2.5, -0.75, -1.0], [-1.0, -1.0, -1.0, -2.0, -0.75, -1.0], [0, 0, 1, 1, 1, 0])
    step = StepPlan(step=3, epoch=1, indices=[0])
    args = (step, torch.tensor([1.0]), {}, batch, {}, {}, StageTimer())
    row = step_row(trainer.prompts, *args)
    assert row["logp_mismatch"] == pytest.approx(0.625 / 3) and row["logp_mismatch_max"] == 0.5
    assert row["sync_mismatch"] == row["logp_mismatch"]  # k = 0: the step's own samples are the freshest weights'
    stale_row = step_row(
        trainer.prompts, *args, sync_mismatch=2e-7
    )  # k >= 1: the probe's, not the behaviour / proximal gap
    assert stale_row["sync_mismatch"] == 2e-7 and stale_row["logp_mismatch"] == row["logp_mismatch"]
