"""The LM head in token tiles (rlhf.ops.logprobs.head_token_logprobs, rlhf.models.head, ``model.tiled_head``): the
log-probs, entropies and every gradient of the whole-logits path, to float64 rounding, with the temperature, the
sampler's kept-set replay and packing; within float32 rounding in float32; refused where it cannot run."""

from __future__ import annotations

import functools

import pytest
import torch
from shared_helpers import host_reads_outside_modules, tiny_float64_policy

import rlhf.ops.logprobs as logprobs
from rlhf.batch import Batch
from rlhf.config.schema import ConfigError
from rlhf.models.head import enable_tiled_head, token_logprobs_and_entropy
from rlhf.objectives.actor_critic import PolicyObjective, TokenLogps
from rlhf.objectives.sft import SFTObjective
from rlhf.ops.logprobs import SamplingFilter, head_token_logprobs, tempered_entropy, token_logprobs

VOCAB, WIDTH = 97, 16
FILTERS = {
    "none": None,
    "top_k": SamplingFilter(top_k=7),
    "top_p": SamplingFilter(top_p=0.8),
    "both": SamplingFilter(top_k=20, top_p=0.9),
}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of a few rows (the default holds 2**26 floats): every case crosses tile boundaries."""
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 3 * VOCAB)


def _inputs(dtype, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(3, 9, WIDTH, generator=gen, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, WIDTH, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(VOCAB, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    ids = torch.randint(0, VOCAB, (3, 9), generator=gen)
    return hidden, weight, b, ids, torch.randn(3, 9, generator=gen, dtype=torch.float64)


def _whole(hidden, weight, bias, ids, temperature, sampling_filter):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return (
        token_logprobs(logits, ids, temperature, sampling_filter),
        tempered_entropy(logits, temperature, sampling_filter, ids),
    )


def _values_and_grads(fn, hidden, weight, bias, ids, coefs, temperature, sampling_filter):
    logps, entropy = fn(hidden, weight, bias, ids, temperature, sampling_filter)
    # a loss of both outputs, one weight per token (column 0 and the last position included)
    ((logps * coefs).sum() + (entropy * coefs.flip(-1)).sum()).backward()
    grads = [t.grad.clone() for t in (hidden, weight, bias) if t is not None]
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    return [logps.detach(), entropy.detach(), *grads]


@pytest.mark.parametrize("name", list(FILTERS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tiles_equal_the_whole_logits_in_float64(name, temperature):
    hidden, weight, bias, ids, coefs = _inputs(torch.float64)
    args = (hidden, weight, bias, ids, coefs, temperature, FILTERS[name])
    want = _values_and_grads(_whole, *args)
    got = _values_and_grads(head_token_logprobs, *args)
    for label, a, b in zip(("logps", "entropy", "d hidden", "d weight", "d bias"), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=label)
    assert bool(torch.isfinite(want[0]).all())


def test_float32_within_float32_rounding_and_no_bias():
    hidden, weight, _, ids, coefs = _inputs(torch.float32, seed=1, bias=False)
    args = (hidden, weight, None, ids, coefs.float(), 0.9, FILTERS["top_p"])
    want = _values_and_grads(_whole, *args)
    got = _values_and_grads(head_token_logprobs, *args)
    # The tiles' logits come from differently blocked matmuls: ~1 float32 ulp apart at the largest |z| (~50 here,
    # 5.7e-6 measured). The entropy (logsumexp - E[z], two ~50s) and the gradients carry a few such roundings: each
    # output within 2^-14 of its own largest value (~100 of its ulps); a wrong temperature, kept set or gradient
    # formula moves values by O(1) of it.
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=2**-14 * float(b.abs().max()))


@pytest.fixture(scope="module")
def policies():
    whole = tiny_float64_policy(64)
    tiled = tiny_float64_policy(64)
    enable_tiled_head(tiled)
    return whole, tiled


def _rl_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 4, 12, 7])
    mask = (torch.arange(12) < lengths[:, None]).long()
    ids = torch.randint(1, 64, (4, 12), generator=gen) * mask
    loss_mask = mask * (torch.arange(12) >= 3).long()
    noise = lambda: torch.randn(4, 12, generator=gen, dtype=torch.float64) * loss_mask  # noqa: E731
    return Batch(
        input_ids=ids, attention_mask=mask, loss_mask=loss_mask, old_logps=noise() - 4.0, advantages=noise()
    )  # fmt: skip


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_objectives_on_a_tiled_model_equal_the_whole_one(policies, packing):
    """A float64 policy loaded with the tiled head: the PPO loss with an entropy bonus at a temperature with top-p
    replay, the reference log-probs and the SFT loss, and every parameter's gradient (the tied-or-not head's
    included), equal the whole-logits model's to 1e-12; padded and packed."""
    from rlhf.models.packing import packed_attention

    whole, tiled = policies
    if packing:
        for model in policies:
            model.config._attn_implementation = packed_attention("sdpa")
    try:
        batch = _rl_batch()
        policy = PolicyObjective(temperature=0.8, sampling_filter=SamplingFilter(top_p=0.9), entropy_coef=0.05)
        objectives = [(policy, "loss"), (SFTObjective(), "loss")]
        for objective, _ in objectives:
            loss_w, sums_w = objective.loss(whole, batch)
            (loss_t, sums_t), reads = host_reads_outside_modules(tiled, functools.partial(objective.loss, tiled, batch))
            assert reads == int(packing)  # the tiles, the replay and the metrics wait for nothing (packed: lengths)
            loss_w.backward(), loss_t.backward()
            assert float(loss_t.detach()) == pytest.approx(float(loss_w.detach()), rel=1e-12, abs=1e-13)
            for key, value in sums_w.items():
                assert float(sums_t[key]) == pytest.approx(float(value), rel=1e-10, abs=1e-12), key
            grads_w, grads_t = _grads(whole), _grads(tiled)
            assert grads_w.keys() == grads_t.keys() and "lm_head.weight" in grads_t
            for name, grad in grads_w.items():
                torch.testing.assert_close(grads_t[name], grad, rtol=0, atol=1e-12, msg=name)
        with torch.no_grad():
            score = TokenLogps(temperature=0.8, sampling_filter=SamplingFilter(top_k=9))
            torch.testing.assert_close(score(tiled, batch), score(whole, batch), rtol=0, atol=1e-12)
    finally:
        for model in policies:
            model.config._attn_implementation = "sdpa"
    assert tiled.get_output_embeddings() is tiled.lm_head  # the head is back after every forward


def test_entropy_modes(policies):
    _, tiled = policies
    batch = _rl_batch(seed=3)
    logps, none = token_logprobs_and_entropy(tiled, batch.input_ids, batch.attention_mask)
    _, value = token_logprobs_and_entropy(tiled, batch.input_ids, batch.attention_mask, entropy="value")
    _, grad = token_logprobs_and_entropy(tiled, batch.input_ids, batch.attention_mask, entropy="grad")
    assert none is None and not value.requires_grad and grad.requires_grad and logps.requires_grad
    torch.testing.assert_close(value, grad.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="entropy must be one of"):
        token_logprobs_and_entropy(tiled, batch.input_ids, batch.attention_mask, entropy="yes")


def test_refused_where_it_cannot_run(tiny_model):
    from rlhf.config.loader import load_config
    from rlhf.config.schema import SFTRunConfig

    base = [f"model.path={tiny_model}", "data.train_path=x.jsonl", "model.tiled_head=true"]
    with pytest.raises(ConfigError, match=r"^model\.tiled_head .*ZeRO 3"):
        load_config(SFTRunConfig, "sft_tiny", overrides=[*base, "strategy.zero_stage=3"])
    with pytest.raises(ConfigError, match=r"^model\.tiled_head .*LoRA"):
        load_config(SFTRunConfig, "sft_tiny", overrides=[*base, "model.lora.r=8"])
    assert load_config(SFTRunConfig, "sft_tiny", overrides=base).model.tiled_head
