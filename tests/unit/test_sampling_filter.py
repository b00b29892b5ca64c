"""The sampler's top-k / top-p replayed on the trainer's logits (rlhf.ops.logprobs.SamplingFilter).

The reference below is vLLM v1's rule written out here from its sampler (``apply_top_k_top_p_pytorch``: float32
logits after the temperature; top-k drops every logit below the k-th largest; top-p sorts ascending, takes the
cumulative softmax and drops every token whose cumulative sum is ``<= 1 - p``, never the last), not from the
project's functions. The trainer's log-probs must be those of the renormalised kept set, always holding the
sampled token, with no gradient into the dropped logits; without a filter nothing may change by a single bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from shared_helpers import tiny_float64_policy

import rlhf.ops.logprobs as lp_mod
from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.objectives.actor_critic import PolicyObjective, TokenLogps, response_mask
from rlhf.ops.logprobs import SamplingFilter, sampling_mask, tempered_entropy, token_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEG_INF = float("-inf")


def vllm_keep(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's keep mask for ``(N, V)`` tempered logits (its ``apply_top_k_top_p_pytorch``, written out)."""
    vocab = z.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab  # vLLM's input batch: off (<= 0) or >= V becomes k = V
    values, order = z.sort(dim=-1, descending=False)
    kth = values[:, vocab - k].unsqueeze(1)
    values = values.masked_fill(values < kth, NEG_INF)
    if top_p < 1:
        cumulative = values.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - torch.tensor([top_p], dtype=z.dtype).unsqueeze(1)
        drop[:, -1] = False
        values = values.masked_fill(drop, NEG_INF)
    filtered = z.clone().scatter_(-1, order, values)
    return filtered > NEG_INF


def logits_with_scales(seed: int, rows: int = 300, vocab: int = 37, dtype=torch.float32) -> torch.Tensor:
    """Rows from nearly flat to peaked, so top-p keeps anything from one token to most of the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, rows, dtype=torch.float64)[:, None]
    return (torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)


FILTERS = [(5, 1.0), (1, 1.0), (-1, 0.8), (0, 0.5), (5, 0.8), (3, 0.95), (-1, 1e-6), (37, 0.9), (99, 1.0), (36, 0.99)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("top_k, top_p", FILTERS)
def test_replayed_mask_is_vllms(top_k, top_p, dtype):
    z = logits_with_scales(top_k * 100 + int(top_p * 1000), dtype=dtype)
    want = vllm_keep(z, top_k, top_p)
    got = sampling_mask(z, SamplingFilter(top_k=top_k, top_p=top_p))
    assert got.dtype == torch.bool and got.shape == z.shape
    assert torch.equal(got, want)
    kept = want.sum(-1)
    if 1e-6 < top_p < 1 and top_k in (-1, 0):  # not vacuous: the kept set's size varies with the rows' scale
        assert kept.min() <= 2 and kept.max() >= 10
    if 0 < top_k < 37:
        assert kept.max() <= top_k


def test_tiny_top_p_keeps_the_most_likely_token_only_and_large_top_k_keeps_all():
    z = logits_with_scales(3)
    one = sampling_mask(z, SamplingFilter(top_p=1e-6))
    assert torch.equal(one.sum(-1), torch.ones(len(z), dtype=torch.long))
    assert torch.equal(one.float().argmax(-1), z.argmax(-1))
    assert sampling_mask(z, SamplingFilter(top_k=37)).all() and sampling_mask(z, SamplingFilter(top_k=500)).all()
    assert not SamplingFilter(top_k=37).active(37) and SamplingFilter(top_k=36).active(37)
    assert not SamplingFilter(top_k=0).active(37) and SamplingFilter(top_p=0.999).active(37)


def test_ties():
    """Top-k keeps every logit tied with the k-th (vLLM's rule too). At the top-p edge vLLM splits a tie group by
    its sort order; the replay keeps the whole group (a superset by the tied tokens only)."""
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    for top_k in (2, 3, 4):
        want = vllm_keep(z, top_k, 1.0)
        assert want.tolist() == [[True, True, True, True, False, False]]
        assert torch.equal(sampling_mask(z, SamplingFilter(top_k=top_k)), want)
    # ties away from the top-p edge: the same set
    z = torch.tensor([[2.0, 2.0, 0.0, -3.0, -3.0]])
    assert torch.equal(sampling_mask(z, SamplingFilter(top_p=0.9)), vllm_keep(z, -1, 0.9))
    assert sampling_mask(z, SamplingFilter(top_p=0.9)).tolist() == [[True, True, False, False, False]]
    assert sampling_mask(z, SamplingFilter(top_p=0.99)).tolist() == [[True, True, True, False, False]]
    assert torch.equal(sampling_mask(z, SamplingFilter(top_p=0.99)), vllm_keep(z, -1, 0.99))
    # four equal tokens, p = 0.5: vLLM drops the first two of its sort order (cumulative 0.25, 0.5 <= 0.5)
    z = torch.zeros(1, 4)
    assert int(vllm_keep(z, -1, 0.5).sum()) == 2
    assert sampling_mask(z, SamplingFilter(top_p=0.5)).all()


def test_filter_is_validated():
    for bad in (dict(top_k=-2), dict(top_k=2.5), dict(top_k=True), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match="top_k" if "top_k" in bad else "top_p"):
            SamplingFilter(**bad)
    with pytest.raises(TypeError, match="sampling_filter"):
        PolicyObjective(sampling_filter=0.9)
    with pytest.raises(TypeError, match="sampling_filter"):
        TokenLogps(sampling_filter=(5, 0.9))


# ------------------------------------------------------------------------------------------------ log-probs
def _kept_for_next(z: torch.Tensor, ids: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(B, T, V) the set the trainer must normalise over at each position: vLLM's kept set plus every token at
    least as likely as the next (sampled) token (the set it drew from held that token, and all above it)."""
    b, t, v = z.shape
    keep = vllm_keep(z.reshape(-1, v), top_k, top_p).view(b, t, v)
    nxt = ids.roll(-1, dims=1)
    return keep | (z >= z.gather(-1, nxt[..., None]))


def _direct_logps(z: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(z.masked_fill(~keep, NEG_INF), dim=-1)
    out = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(out, (1, 0))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.8), (5, 0.8)])
def test_logprobs_are_of_the_renormalised_kept_set(top_k, top_p, temperature):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 9, 12, generator=gen, dtype=torch.float64) * 2
    ids = torch.randint(0, 12, (3, 9), generator=gen)
    f = SamplingFilter(top_k=top_k, top_p=top_p)
    z = logits / temperature
    keep = _kept_for_next(z, ids, top_k, top_p)
    got = token_logprobs(logits, ids, temperature, f)
    torch.testing.assert_close(got, _direct_logps(z, ids, keep), rtol=0, atol=1e-12)
    assert torch.isfinite(got).all()  # the sampled token is always kept, even where it lies outside the set
    outside = ~vllm_keep(z.reshape(-1, 12), top_k, top_p).view(3, 9, 12)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(
        -1
    )
    assert outside.any()  # ... which random ids do here
    # Every token of a position's kept set, scored as that position's token: the probabilities sum to 1.
    vllm_sets = vllm_keep(z.reshape(-1, 12), top_k, top_p).view(3, 9, 12)
    total = torch.zeros(3, 8, dtype=torch.float64)
    for token in range(12):
        logps = token_logprobs(logits, torch.full_like(ids, token), temperature, f)[:, 1:]
        total += torch.where(vllm_sets[:, :-1, token], logps.exp(), 0.0)
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-12)
    # ... and the full-vocabulary log-probs are smaller by the log of the kept mass: the replay matters.
    full = token_logprobs(logits, ids, temperature)
    assert bool((got[:, 1:] - full[:, 1:] > 1e-3).any())


def test_gradient_flows_through_the_kept_logits_only():
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(2, 7, 16, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    ids = torch.randint(0, 16, (2, 7), generator=gen)
    f = SamplingFilter(top_k=6, top_p=0.85)
    weights = torch.randn(2, 7, generator=gen, dtype=torch.float64)
    (token_logprobs(logits, ids, 0.9, f) * weights).sum().backward()
    keep = _kept_for_next(logits.detach() / 0.9, ids, 6, 0.85)
    grad = logits.grad
    assert torch.equal(grad[:, :-1][~keep[:, :-1]], torch.zeros_like(grad[:, :-1][~keep[:, :-1]]))
    assert (grad[:, :-1][keep[:, :-1]] != 0).all()
    assert (~keep[:, :-1]).sum() > 20 and torch.equal(grad[:, -1], torch.zeros_like(grad[:, -1]))
    # the kept set's own gradient is exact (the set does not move under gradcheck's 1e-6 steps here)
    x = logits.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: token_logprobs(v, ids, 0.9, f), (x,))


def test_chunked_equals_whole(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, 10, generator=gen)
    ids = torch.randint(0, 10, (2, 6), generator=gen)
    f = SamplingFilter(top_k=4, top_p=0.7)
    whole = token_logprobs(logits, ids, 0.8, f)
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMENTS", 3)  # one row per chunk (filter copies included)
    assert torch.equal(token_logprobs(logits, ids, 0.8, f), whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_without_a_filter_nothing_changes_by_a_bit(dtype, temperature):
    """An inactive filter (the default, k off or >= V, p = 1) runs the unfiltered code: same values, same
    gradients, same entropy, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(2, 5, 11, generator=gen).to(dtype)
    ids = torch.randint(0, 11, (2, 5), generator=gen)

    def run(*extra):
        x = base.clone().requires_grad_()
        out = token_logprobs(x, ids, temperature, *extra)
        out.sum().backward()
        return out.detach(), x.grad, tempered_entropy(base, temperature, *extra, input_ids=ids)

    plain = run()
    for f in (None, SamplingFilter(), SamplingFilter(top_k=0), SamplingFilter(top_k=11), SamplingFilter(top_k=40)):
        for a, b in zip(plain, run(f)):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ entropy
def test_entropy_is_that_of_the_kept_set():
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(2, 6, 14, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    ids = torch.randint(0, 14, (2, 6), generator=gen)
    f = SamplingFilter(top_k=7, top_p=0.9)
    z = logits.detach() / 0.8
    keep = _kept_for_next(z, ids, 7, 0.9)
    logp = torch.log_softmax(z.masked_fill(~keep, NEG_INF), dim=-1)
    want = -torch.where(keep, logp.exp() * logp, 0.0).sum(-1)
    got = tempered_entropy(logits, 0.8, f, ids)
    torch.testing.assert_close(got, torch.nn.functional.pad(want[:, :-1], (1, 0)), rtol=0, atol=1e-12)
    full = tempered_entropy(logits.detach(), 0.8)
    assert float((full - got.detach()).abs().max()) > 0.1  # not the full distribution's
    got.sum().backward()
    assert torch.equal(logits.grad[~keep], torch.zeros_like(logits.grad[~keep]))
    with pytest.raises(ValueError, match="input_ids"):
        tempered_entropy(logits, 0.8, f)


# ------------------------------------------------------------------------------------------------ objective
@pytest.fixture(scope="module")
def policy():
    model = tiny_float64_policy(48)
    with torch.no_grad():  # peaked next-token distributions, so top-p keeps a few tokens, not most of them
        model.lm_head.weight.mul_(10.0)
    return model


@torch.no_grad()
def _rollout(policy, f: SamplingFilter, temperature: float, seed: int = 0):
    """3 prompts of 3 random tokens, 6 response tokens each drawn from the filtered distribution, as vLLM does."""
    from rlhf.batch import Batch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 48, (3, 3), generator=gen)
    for _ in range(6):
        z = policy(input_ids=ids).logits[:, -1] / temperature
        probs = z.masked_fill(~vllm_keep(z, f.top_k, f.top_p), NEG_INF).softmax(-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :3] = 0
    return Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=loss_mask)


def test_policy_objective_scores_the_kept_set_and_matches_old_logps(policy):
    """With the rollout's filter on both sides the ratio is exactly 1 (approx_kl 0) and loss, entropy and
    gradient are those of the renormalised kept set written out here; scoring pi_old without the filter would
    put the kept mass into every ratio."""
    f = SamplingFilter(top_k=8, top_p=0.7)
    temperature = 0.9
    batch = _rollout(policy, f, temperature)
    mask = response_mask(batch)
    with torch.no_grad():
        old = TokenLogps(temperature, f)(policy, batch)
        old_full = TokenLogps(temperature)(policy, batch)
    adv = torch.where(mask, torch.linspace(-1, 1, mask.numel()).view(mask.shape), 0.0).double()  # float32 values

    logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    z = logits / temperature
    keep = _kept_for_next(z.detach(), batch.input_ids, 8, 0.7)
    kept = keep.sum(-1)[:, :-1][mask[:, 1:]]  # the sets the response tokens were drawn from (position t - 1)
    assert kept.max() < 8 and kept.float().mean() > 2  # top-p cuts below top-k, and leaves a choice
    logp = _direct_logps(z, batch.input_ids, keep)
    logp_all = torch.log_softmax(z.masked_fill(~keep, NEG_INF), dim=-1)
    # p log p with 0 log 0 = 0, written so that no NaN reaches the gradient through the dropped entries
    plogp = logp_all.exp() * logp_all.masked_fill(~keep, 0.0)
    entropy = torch.nn.functional.pad(-plogp.sum(-1)[:, :-1], (1, 0))
    count = int(mask.sum())
    expected = torch.where(mask, -adv * torch.exp(logp - old.double()) - 0.05 * entropy, 0.0).sum() / count
    policy.zero_grad(set_to_none=True)
    expected.backward()
    want_grad = torch.cat([p.grad.reshape(-1).clone() for p in policy.parameters() if p.grad is not None])

    obj = PolicyObjective(temperature=temperature, sampling_filter=f, entropy_coef=0.05)
    policy.zero_grad(set_to_none=True)
    loss, sums = obj.loss(policy, batch.replace(old_logps=old, advantages=adv.float()))
    (loss / obj.count(batch)).backward()
    got_grad = torch.cat([p.grad.reshape(-1).clone() for p in policy.parameters() if p.grad is not None])
    policy.zero_grad(set_to_none=True)
    metrics = obj.finalize(sums, obj.count(batch))
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-9, abs=1e-12)
    assert abs(metrics["approx_kl"]) < 1e-12
    assert metrics["entropy"] == pytest.approx(float(torch.where(mask, entropy.detach(), 0.0).sum()) / count, rel=1e-9)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-9, atol=1e-12 * float(want_grad.abs().max()))

    # pi_old from the full vocabulary: every ratio is off by the kept mass
    _, sums_full = obj.loss(policy, batch.replace(old_logps=old_full, advantages=adv.float()))
    assert obj.finalize(sums_full, count)["approx_kl"] > 1e-3


# ------------------------------------------------------------------------------------------------ plumbing
def _cfg(*extra) -> RLRunConfig:
    return load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            "model.path=unused",
            "data.train_path=unused",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            *extra,
        ],
    )


def test_rollout_top_k_is_validated_naming_the_key():
    assert _cfg().rollout.top_k == -1
    assert _cfg("rollout.top_k=0").rollout.top_k == 0 and _cfg("rollout.top_k=50").rollout.top_k == 50
    with pytest.raises(ConfigError, match=r"^rollout.top_k must be -1 or 0 \(off\)"):
        _cfg("rollout.top_k=-2")


def test_the_trainer_samples_and_scores_with_the_configs_top_k_and_top_p():
    """The engines get rollout.top_k / top_p, and pi_old, the reference and the loss score the same kept set."""
    from rlhf.rollout.prompts import PromptSet
    from rlhf.rollout.types import Generation
    from rlhf.trainers.online.runner import build_objectives
    from rlhf.trainers.online.steps import RLActors, RLTrainer

    class Recorder:
        def __init__(self):
            self.calls = []
            self.held = set()  # a stand-in group holds no frozen model of another role (WorkerGroup.hold)

        def generate(self, prompt_ids, sampling):
            self.calls.append(sampling)
            return [Generation(tuple(p), (5, 6), (-0.1, -0.2), "stop") for p in prompt_ids]

        def score_batch(self, batch, fn):
            self.calls.append(fn)
            return torch.zeros(batch.input_ids.shape)

    cfg = _cfg("rollout.top_k=5", "rollout.top_p=0.8", "rollout.temperature=0.7", "algo.kl_coef=0.1")
    tokenizer = SimpleNamespace(
        pad_token_id=0, eos_token_id=2, batch_decode=lambda ids, skip_special_tokens: ["x"] * len(ids)
    )
    engines, policy, reference = Recorder(), Recorder(), Recorder()
    policy_objective = build_objectives(cfg)[0]
    trainer = RLTrainer(
        cfg,
        tokenizer,
        PromptSet([[1, 2], [3]], ["p", "q"], {}, 0, 0),
        None,
        RLActors(policy=policy, engines=engines, reference=reference),
        None,
        policy_objective,
        None,
    )
    rollout = trainer._sample(trainer.prompts, [0, 0, 1, 1], seed_base=0, step=1)
    trainer.annotate(rollout.batch)
    (sampling,) = engines.calls
    assert (sampling.top_k, sampling.top_p, sampling.temperature) == (5, 0.8, 0.7)
    want = SamplingFilter(top_k=5, top_p=0.8)
    assert [(fn.temperature, fn.sampling_filter) for fn in policy.calls + reference.calls] == [(0.7, want)] * 2
    assert (policy_objective.temperature, policy_objective.sampling_filter) == (0.7, want)
