"""GKD's full-distribution divergences as the run trains them (``algo.teacher.divergence`` forward_kl / jsd, loss
mode): the teacher's top-k scored by :class:`TeacherTopK`, carried as ``(B, T, K)`` batch fields, the student's
log-probs at those ids from its own forward, the divergence added to each response token's loss and aggregated
once. Float64, through the run's own path (the config, ``build_objectives``, ``RLTrainer.advantages``,
``PolicyObjective``), against a plain-PyTorch reference written from the paper here, one sample at a time:

* K = V: Agarwal et al. 2024 (GKD), section 3 and eq. 1, on the whole vocabulary (``KL(p || q)``; ``beta KL(p || m) +
  (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``; ``p`` the teacher's, ``q`` the student's distribution at
  the run's temperature);
* K < V: the same on the teacher's K most likely tokens plus one bucket for the rest (both distributions alike).

And the normaliser: every cut of the batch into micro-batches (each trimmed to its own rows; padded and packed)
gives the whole batch's loss and gradient to float64 rounding. Also the pieces: the (B, T, K) fields through
trim / concat / select, ``Layout.place`` as ``restore``'s inverse, ``logprobs_at``'s gradient, and the refusals.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import rl_reference_math as ref
import torch
import transformers
from shared_helpers import padded_rows, tiny_float64_policy, tiny_qwen_config

from rlhf.batch import Batch
from rlhf.config.rl_schema import AlgorithmConfig, RewardConfig, RLRunConfig, RolloutConfig, TeacherConfig
from rlhf.config.schema import ConfigError, DataConfig, ModelConfig, StrategyConfig, TrainConfig
from rlhf.models.forward import Layout
from rlhf.models.packing import PackedRows, packed_attention
from rlhf.objectives.actor_critic import TeacherTopK, split_teacher_topk
from rlhf.ops import logprobs as logprobs_module
from rlhf.ops.logprobs import logprobs_at
from rlhf.trainers.online.runner import build_objectives
from rlhf.trainers.online.steps import RLTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, TEMPERATURE, COEF, BETA = 64, 0.7, 0.4, 0.3
LENGTHS = [(3, 5), (2, 2), (4, 6), (1, 3), (3, 4), (2, 7)]  # (prompt, response) per row
GROUPS = [1, 0, 1, 0, 0, 1]
SCORES = [0.875, -0.375, 0.125, 1.25, 0.25, -1.125]
CUTS = {  # micro-batches of the rows (a GA / rank split trains each on its own, normalised over the whole)
    "whole": [[0, 1, 2, 3, 4, 5]],
    "pairs": [[0, 1], [2, 3], [4, 5]],
    "ragged": [[3], [0, 5, 1], [2, 4]],
}


def _config(divergence: str, top_k: int, agg: str = "auto", **teacher) -> RLRunConfig:
    return RLRunConfig(
        model=ModelConfig(path="model"),
        data=DataConfig(train_path="prompts.jsonl"),
        train=TrainConfig(global_batch_size=len(LENGTHS), micro_batch_size=len(LENGTHS)),
        rollout=RolloutConfig(prompts_per_step=2, n_samples_per_prompt=3, max_new_tokens=8, temperature=TEMPERATURE),
        reward=RewardConfig(functions=("r.py:f",)),
        algo=AlgorithmConfig(
            advantage_estimator="grpo",
            loss_agg_mode=agg,
            teacher=TeacherConfig(
                path="teacher", mode="loss", coef=COEF, divergence=divergence, beta=BETA, top_k=top_k, **teacher
            ),
        ),
    )


@pytest.fixture(scope="module")
def models():
    policy = tiny_float64_policy(VOCAB)
    torch.manual_seed(1)
    teacher = transformers.Qwen2ForCausalLM(tiny_qwen_config(VOCAB)).double()
    return policy, teacher


def _samples(ids):
    return [(ids[i, :p].tolist(), ids[i, p : p + r].tolist()) for i, (p, r) in enumerate(LENGTHS)]


def _ragged(x):
    return [x[i, p : p + r] for i, (p, r) in enumerate(LENGTHS)]


def _batch(cfg, models, top_k):
    """The rollout batch: pi_old near the policy, advantages by the run's path, the teacher's top-k scored by
    :class:`TeacherTopK` (padding and prompt positions hold whatever it gives: the mask drops them)."""
    policy, teacher = models
    gen = torch.Generator().manual_seed(11)
    ids, attn, loss_mask = padded_rows(LENGTHS, VOCAB, gen)
    now = ref.padded_logps(policy, ids, LENGTHS, TEMPERATURE)
    old = (now + 0.3 * torch.randn(ids.shape, generator=gen)) * loss_mask
    batch = Batch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logps=old.double())
    batch, _ = RLTrainer.advantages(SimpleNamespace(cfg=cfg), batch, torch.tensor(SCORES), GROUPS)
    with torch.no_grad():
        topk_logps, topk_ids = split_teacher_topk(TeacherTopK(top_k, TEMPERATURE)(teacher, batch))
    return batch.replace(teacher_topk_logps=topk_logps, teacher_topk_ids=topk_ids)


def _kl(p_log, q_log):
    """``KL(p || q)`` over the last dim from log-probs, ``0 log 0 = 0``."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(-1)


def _paper_divergence(name, teacher_log, student_log, k):
    """GKD's divergence per response token from the two ``(R, V)`` log-softmaxes, on the teacher's top-k plus a
    tail bucket when ``k < V``."""
    if k < VOCAB:
        top = teacher_log.topk(k, dim=-1).indices
        p, q = teacher_log.gather(-1, top).exp(), student_log.gather(-1, top).exp()
        p = torch.cat([p, (1 - p.sum(-1, keepdim=True))], -1)
        q = torch.cat([q, (1 - q.sum(-1, keepdim=True))], -1)
        teacher_log, student_log = p.log(), q.log()
    if name == "forward_kl":
        return _kl(teacher_log, student_log)
    m = (BETA * teacher_log.exp() + (1 - BETA) * student_log.exp()).log()
    return BETA * _kl(teacher_log, m) + (1 - BETA) * _kl(student_log, m)


def _grads(model):
    return torch.cat([q.grad.reshape(-1) for q in model.parameters() if q.grad is not None])


@pytest.mark.parametrize("agg", ["auto", "token-mean"])
@pytest.mark.parametrize("top_k", [8, VOCAB], ids=["k8", "kV"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_loss_is_the_papers_divergence_added_to_each_tokens_loss(models, divergence, top_k, agg):
    policy, teacher = models
    cfg = _config(divergence, top_k, agg)
    batch = _batch(cfg, models, top_k)
    objective, _ = build_objectives(cfg)
    per_row, reported = [], []
    samples = _samples(batch.input_ids)
    for (prompt, response), old, adv in zip(samples, _ragged(batch.old_logps), _ragged(batch.advantages)):
        z_s = ref.response_logits(policy, prompt, response, TEMPERATURE)
        with torch.no_grad():
            z_t = ref.response_logits(teacher, prompt, response, TEMPERATURE)
        student_log, teacher_log = z_s.log_softmax(-1), z_t.log_softmax(-1)
        lp = student_log[torch.arange(len(response)), torch.tensor(response)]
        loss, _ = ref.ppo_token_loss(lp, old, adv, 0.2, 0.2)
        d = _paper_divergence(divergence, teacher_log, student_log, top_k)
        per_row.append(loss + COEF * d)
        reported.append(d.detach())
    expected = ref.aggregate(cfg.algo.aggregation, per_row, cfg.max_response_tokens)
    metrics = ref.objective_metrics_matching(policy, objective, batch, expected)
    assert metrics["distill"] > 0
    assert metrics["distill"] == pytest.approx(float(ref.aggregate(cfg.algo.aggregation, reported)), rel=1e-11)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_every_cut_of_the_batch_trains_the_whole_batchs_step(models, divergence, packing):
    """Micro-batches (each trimmed to its rows, as WorkerGroup cuts), normalised over the whole batch: the summed
    loss and gradient of every cut equal the whole batch's to float64 rounding (verl#7200: the OPD loss depended
    on the micro-batch partition)."""
    policy, _ = models
    cfg = _config(divergence, 8, "token-mean")
    batch = _batch(cfg, models, 8)
    objective, _ = build_objectives(cfg)
    normaliser = objective.count(batch)
    policy.config._attn_implementation = packed_attention("sdpa") if packing else "sdpa"
    try:
        results = {}
        for name, cut in CUTS.items():
            policy.zero_grad(set_to_none=True)
            total = 0.0
            for rows in cut:
                loss, _ = objective.loss(policy, batch.select(rows).trim().contiguous())
                (loss / normaliser).backward()
                total += float(loss.detach()) / normaliser
            results[name] = (total, _grads(policy).clone())
    finally:
        policy.config._attn_implementation = "sdpa"
        policy.zero_grad(set_to_none=True)
    whole_loss, whole_grad = results["whole"]
    for name, (loss, grad) in results.items():
        assert loss == pytest.approx(whole_loss, rel=1e-12), name
        assert float((grad - whole_grad).norm()) <= 1e-12 * float(whole_grad.norm()), name


def test_teacher_topk_is_the_same_padded_and_packed(models):
    _, teacher = models
    cfg = _config("jsd", 8)
    batch = _batch(cfg, models, 8)
    score = TeacherTopK(8, TEMPERATURE)
    with torch.no_grad():
        padded = score(teacher, batch)
        teacher.config._attn_implementation = packed_attention("sdpa")
        try:
            packed = score(teacher, batch)
        finally:
            teacher.config._attn_implementation = "sdpa"
    keep = batch.loss_mask.bool()
    assert padded.shape == (len(LENGTHS), batch.input_ids.shape[1], 8, 2)
    torch.testing.assert_close(packed[keep], padded[keep], rtol=0, atol=1e-12)
    logps, ids = split_teacher_topk(padded)
    assert ids.dtype == torch.long and bool((logps[keep][:, :-1] >= logps[keep][:, 1:]).all())  # most likely first


def test_topk_fields_are_cut_and_stacked_along_time():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = (ids > 0).long()
    topk = torch.arange(2 * 4 * 3, dtype=torch.float64).view(2, 4, 3)
    batch = Batch(input_ids=ids, attention_mask=mask, teacher_topk_logps=topk, teacher_topk_ids=topk.long())
    short = batch.select([1]).trim()
    assert short.input_ids.shape == (1, 2) and short.teacher_topk_logps.shape == (1, 2, 3)
    both = Batch.concat([short, batch.select([0]).trim()])
    assert both.teacher_topk_ids.shape == (2, 3, 3) and both.teacher_topk_ids[0, 2].tolist() == [0, 0, 0]
    torch.testing.assert_close(both.teacher_topk_logps[1], topk[0, :3])
    with pytest.raises(ValueError, match=r"teacher_topk_logps must be \(B, T, K\)"):
        Batch(input_ids=ids, attention_mask=mask, teacher_topk_logps=topk[:, :3])


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_place_is_the_inverse_of_restore(packing):
    gen = torch.Generator().manual_seed(3)
    ids, attn, loss_mask = padded_rows(LENGTHS, VOCAB, gen)
    layout = Layout(PackedRows.from_padded(ids, attn) if packing else None)
    values = torch.randn(*ids.shape, 5, generator=gen, dtype=torch.float64)
    back = layout.restore(layout.place(values), token_aligned=True)
    keep = loss_mask.bool()  # column 0 and padding are not predicted by any position
    torch.testing.assert_close(back[keep], values[keep], rtol=0, atol=0)


def test_logprobs_at_and_its_gradient_equal_autograds(monkeypatch):
    """Chunked (a few rows per chunk) against log_softmax + gather with plain autograd, float64; ids repeated and
    including the target of a duplicate."""
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 3 * VOCAB)
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, VOCAB, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, VOCAB, (2, 5, 6), generator=gen)
    ids[0, 0, 1] = ids[0, 0, 0]
    weights = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64)
    ours = logprobs_at(logits, ids, TEMPERATURE)
    expected = (logits / TEMPERATURE).log_softmax(-1).gather(-1, ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-13)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    (grad_expected,) = torch.autograd.grad((expected * weights).sum(), logits)
    torch.testing.assert_close(grad_ours, grad_expected, rtol=0, atol=1e-13)


def test_refusals_name_their_keys():
    with pytest.raises(ConfigError, match=r"^algo\.teacher\.divergence is forward_kl, .* set algo\.teacher\.mode"):
        TeacherConfig(path="t", mode="reward", divergence="forward_kl")
    with pytest.raises(ConfigError, match=r"^algo\.teacher\.divergence: unknown distillation divergence 'kl'.*jsd"):
        TeacherConfig(path="t", mode="loss", divergence="kl")
    with pytest.raises(ConfigError, match=r"^algo\.teacher\.beta: beta must be in \(0, 1\)"):
        TeacherConfig(path="t", mode="loss", divergence="jsd", beta=1.0)
    with pytest.raises(ConfigError, match=r"^algo\.teacher\.top_k must be >= 1"):
        TeacherConfig(path="t", mode="loss", divergence="jsd", top_k=0)
    TeacherConfig(path="t", mode="reward", beta=7.0)  # beta is read by jsd only
    base = _config("jsd", 8)
    for key, change in (
        ("rollout.top_p", dict(rollout=RolloutConfig(prompts_per_step=2, n_samples_per_prompt=3, top_p=0.9))),
        ("rollout.top_k", dict(rollout=RolloutConfig(prompts_per_step=2, n_samples_per_prompt=3, top_k=20))),
        ("model.tiled_head", dict(model=ModelConfig(path="model", tiled_head=True))),
        ("strategy.sequence_parallel_size", dict(strategy=StrategyConfig(sequence_parallel_size=2))),
    ):
        fields = {f: getattr(base, f) for f in ("model", "data", "train", "rollout", "reward", "algo", "strategy")}
        fields.update(change)
        if key.startswith("strategy"):
            fields["train"] = TrainConfig(global_batch_size=6, micro_batch_size=3, num_workers=2, packing=True)
        with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}"):
            RLRunConfig(**fields)


def test_the_dry_run_line_names_the_divergence():
    from rlhf.trainers.online.checks import describe_distillation

    line = describe_distillation(_config("jsd", 8, "token-mean"))
    assert line.startswith("distillation: generalised JSD (beta 0.3) of the policy's next-token distributions")
    assert "top 8 tokens and a tail, +0.4 x it in each response token's policy loss" in line
    assert "forward KL of the policy's" in describe_distillation(_config("forward_kl", 8))
