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


def _bf16_grads(fn, hidden, weight, bias, ids, coefs):
    leaves = [t.detach().to(torch.bfloat16).requires_grad_() for t in (hidden, weight, bias)]
    logps, _ = fn(*leaves, ids)
    (logps * coefs).sum().backward()
    return [t.grad.double() for t in leaves]


def test_bf16_tiles_of_the_vocabulary_give_the_whole_logits_gradients_to_one_rounding(monkeypatch):
    """bf16 weights, several tiles of the vocabulary: the weight's and bias's gradient slices are each one product
    over all the tokens, as the whole-logits path forms them, and the hidden states' gradient sums the tiles'
    products in float32 and rounds once. Each element within one bf16 rounding (2^-8 relative) of the whole path's,
    where a sum that rounded each tile's product to bf16 is several roundings off (fails this)."""
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 27 * 40)  # 27 tokens: tiles of 40 of the 400 ids
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 9, 64, generator=gen, dtype=torch.float64)
    weight, bias = torch.randn(400, 64, generator=gen, dtype=torch.float64) * 0.2, torch.randn(400, generator=gen)
    ids, coefs = torch.randint(0, 400, (3, 9), generator=gen), torch.randn(3, 9, generator=gen)

    def whole(h, w, b, i):
        return token_logprobs(torch.nn.functional.linear(h, w, b), i), None

    want = _bf16_grads(whole, hidden, weight, bias, ids, coefs)
    got = _bf16_grads(functools.partial(head_token_logprobs, entropy=False), hidden, weight, bias, ids, coefs)
    for label, a, b in zip(("d hidden", "d weight", "d bias"), got, want):
        assert bool((b != 0).any()), label
        torch.testing.assert_close(a, b, rtol=2**-8, atol=1e-30, msg=label)


def test_add_product_sums_exact_products_in_float32():
    """``total += a @ b`` for bf16 factors: the float64 product of the same values within float32's rounding of
    the k-term sums (k u sum |a b|, u = 2^-24), widened into the scratch buffer or not; float32 factors go straight
    in. A product rounded to bf16 first is ~2^-9 of it off."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(64, 7, generator=gen).to(torch.bfloat16)
    start = torch.randn(5, 7, generator=gen)
    want = start.double() + a.double() @ b.double()
    bound = 64 * 2**-24 * (start.double().abs() + a.double().abs() @ b.double().abs())
    for scratch in (None, torch.empty(5, 64)):
        total = start.clone()
        logprobs._add_product(total, a, b, scratch=scratch)
        assert bool(((total.double() - want).abs() <= bound).all())
    total = start.clone()
    logprobs._add_product(total, a.float(), b.float())
    assert bool(((total.double() - want).abs() <= bound).all())


def test_head_backward_makes_no_pass_for_an_unused_entropy_and_no_head_sized_buffer(monkeypatch):
    """The backward through tiles of the vocabulary: three matrix products a tile (the logits again, the weight's
    slice, the hidden states' share) and no float32 buffer of the head's size; an entropy computed but used by no
    loss (a metric) dispatches exactly what no entropy does."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701 (torch exports it nowhere else)

    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 8 * 25)  # 8 positions: two tiles of 25 of the 50 ids
    hidden, weight, ids = torch.randn(1, 8, 4).bfloat16(), torch.randn(50, 4).bfloat16(), torch.randint(0, 50, (1, 8))

    class Ops(TorchDispatchMode):
        """Records each tensor-making op the backward dispatches: ``(name, shape, dtype)``."""

        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and not func.is_view:
                self.seen.append((func.overloadpacket.__name__, tuple(result.shape), result.dtype))
            return result

    dispatched = {}
    for entropy in (False, True):
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        logps, _ = head_token_logprobs(*leaves, None, ids, entropy=entropy)
        logprobs._widening_product("cpu", torch.bfloat16, torch.float32)  # its probe is no pass
        with Ops() as ops:
            logps.sum().backward()
        dispatched[entropy] = ops.seen
    assert dispatched[True] == dispatched[False]
    products = [name for name, _, _ in dispatched[False] if name in ("mm", "addmm", "addmm_")]
    assert len(products) == 3 * 2
    assert not [op for op in dispatched[False] if op[1] == (50, 4) and op[2] != torch.bfloat16]


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
