"""Hand-checked values for rlhf.ops: log-probs, entropies, masked sums, SFT/DPO/BT losses, normalization.

Expected numbers are written from first principles with ``math`` on tiny inputs (mostly a 2-token vocabulary,
where ``softmax([log 3, 0]) = [3/4, 1/4]``), never by calling the function under test a second way.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.ops import logprobs as lp_mod
from rlhf.ops.logprobs import (
    SamplingFilter,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    sequence_logprobs,
    tempered_entropy,
    token_logprobs,
    token_logprobs_with_entropy,
)
from rlhf.ops.losses import normalize, sft_nll_sum
from rlhf.ops.preference import (
    DPO_LOSSES,
    bradley_terry_losses,
    dpo_pair_losses,
    pair_accuracy_count,
)
from rlhf.registry import UnknownNameError

LN3 = math.log(3.0)


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def softplus(x: float) -> float:
    """-logsigmoid(-x) = log(1 + e^x), by hand."""
    return math.log1p(math.exp(x))


# --------------------------------------------------------------------------------------------- token_logprobs
def _two_token_logits() -> torch.Tensor:
    # position 0 predicts token 1 with softmax([0, 0]) = [1/2, 1/2]; position 1 predicts token 2 with
    # softmax([log 3, 0]) = [3/4, 1/4]; position 2 predicts nothing inside the sequence (garbage on purpose).
    return t([[[0.0, 0.0], [LN3, 0.0], [100.0, -100.0]]])


def test_token_logprobs_alignment_and_column_zero():
    ids = torch.tensor([[1, 1, 0]])
    out = token_logprobs(_two_token_logits(), ids)
    assert out.shape == (1, 3)
    expected = [0.0, math.log(0.5), math.log(0.75)]
    assert out[0].tolist() == pytest.approx(expected, abs=1e-6)
    # the other target at the same positions: log(1/2) and log(1/4)
    out = token_logprobs(_two_token_logits(), torch.tensor([[0, 0, 1]]))
    assert out[0].tolist() == pytest.approx([0.0, math.log(0.5), math.log(0.25)], abs=1e-6)


def test_token_logprobs_last_position_has_no_effect_and_no_gradient():
    logits = _two_token_logits().requires_grad_(True)
    ids = torch.tensor([[1, 1, 0]])
    out = token_logprobs(logits, ids)
    other = _two_token_logits()
    other[0, 2] = torch.tensor([-7.0, 9.0])
    assert torch.equal(out.detach(), token_logprobs(other, ids))
    out.sum().backward()
    # d log p_y / d z = onehot(y) - softmax(z): position 0 target 1 -> [-1/2, 1/2]; position 1 target 0 ->
    # [1 - 3/4, -1/4]; position 2 -> 0.
    assert logits.grad[0].tolist() == [
        pytest.approx([-0.5, 0.5], abs=1e-6),
        pytest.approx([0.25, -0.25], abs=1e-6),
        [0.0, 0.0],
    ]


def test_token_logprobs_temperature():
    # logits [2 log 3, 0] at temperature 2 are softmax([log 3, 0]) = [3/4, 1/4].
    logits = t([[[2 * LN3, 0.0], [0.0, 0.0]]]).requires_grad_(True)
    out = token_logprobs(logits, torch.tensor([[0, 0]]), temperature=2.0)
    assert out[0].tolist() == pytest.approx([0.0, math.log(0.75)], abs=1e-6)
    # at temperature 1 the same logits give 9/10
    assert token_logprobs(logits, torch.tensor([[0, 0]]))[0, 1].item() == pytest.approx(math.log(0.9), abs=1e-6)
    out[0, 1].backward()
    # d/dz of log softmax(z / T)[0] = (onehot - p) / T = [1/4, -1/4] / 2
    assert logits.grad[0, 0].tolist() == pytest.approx([0.125, -0.125], abs=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, torch.tensor([[0, 0]]), temperature=0.0)


def test_token_logprobs_bf16_logits_computed_in_fp32():
    # 1.0 and 0.0 are exact in bf16; log softmax([1, 0])[0] = -log(1 + e^-1) = -0.313261687...
    logits = t([[[1.0, 0.0], [0.0, 0.0]]], dtype=torch.bfloat16).requires_grad_(True)
    out = token_logprobs(logits, torch.tensor([[0, 0]]))
    assert out.dtype == torch.float32
    expected = -math.log1p(math.exp(-1.0))
    # bf16 arithmetic would be off by ~1e-3 here (8 mantissa bits); float32 is within 1e-6.
    assert abs(out[0, 1].item() - expected) < 1e-6
    bf16_result = torch.log_softmax(logits.detach(), -1)[0, 0, 0].item()
    assert abs(bf16_result - expected) > 1e-4  # the test would catch a bf16 computation
    out[0, 1].backward()
    assert logits.grad.dtype == torch.bfloat16
    p0 = 1 / (1 + math.exp(-1.0))
    assert logits.grad[0, 0].float().tolist() == pytest.approx([1 - p0, -(1 - p0)], rel=1e-2)


def test_token_logprobs_chunking_and_gradcheck(monkeypatch):
    # 3 elements per chunk with V = 3 -> one row per chunk; result and gradient must not depend on it.
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 3, dtype=torch.float64)
    ids = torch.randint(0, 3, (2, 4))
    whole = token_logprobs(logits, ids, temperature=0.7)
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMENTS", 3)
    assert torch.equal(token_logprobs(logits, ids, temperature=0.7), whole)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, ids, temperature=0.7), (x,))


def test_token_logprobs_gradient_at_temperature_one(monkeypatch):
    """At temperature 1 the backward skips its division (x / 1.0 is x): the gradient is still exact, chunked or not."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 3, dtype=torch.float64)
    ids = torch.randint(0, 3, (2, 4))
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMENTS", 3)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, ids), (x,))


IN_PLACE = ["sub", "exp_", "mul_", "scatter_add_"]  # exp(z - lse) * -g built where it is kept, the targets added


@pytest.mark.parametrize("dtype, passes", [(torch.float32, IN_PLACE), (torch.bfloat16, [*IN_PLACE, "copy_"])])
def test_token_logprobs_backward_makes_no_pass_it_does_not_need(dtype, passes):
    """The backward's passes over the ``(rows, V)`` logits, at temperature 1: the softmax built where it is kept (in
    the gradient itself for float32 logits; bf16 logits widened as the subtraction reads them, the result cast once
    into the gradient), no division by 1, no upcast or temporary copy. Each such pass is one over the step's largest
    tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701 (torch exports it nowhere else)

    rows, vocab = 6, 50
    logits = torch.randn(1, rows + 1, vocab).to(dtype).requires_grad_(True)
    ids = torch.randint(0, vocab, (1, rows + 1))
    out = token_logprobs(logits, ids)
    seen = []

    class Passes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if isinstance(result, torch.Tensor) and result.numel() >= rows * vocab and not func.is_view:
                if not name.startswith("empty"):  # an allocation is no pass
                    seen.append(name)
            return result

    with Passes():
        out.sum().backward()
    assert seen == passes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk", [None, 40])
@pytest.mark.parametrize("shifted", [True, False])
def test_log_probs_with_the_entropy_metric_are_the_two_calls_bit_for_bit(dtype, chunk, shifted, monkeypatch):
    """One pass for the log-probs and the entropy metric (the RL update's): the values of :func:`token_logprobs`
    and :func:`entropy_from_logits`, and the log-probs' gradient, bit for bit; the entropy carries no gradient."""
    if chunk is not None:  # several chunks of rows (40 elements: 4 rows of V = 10)
        monkeypatch.setattr(lp_mod, "_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 10) * 4).to(dtype)
    ids = torch.randint(0, 10, (3, 5))
    next_ids = None if shifted else torch.randint(0, 10, (3, 5))
    weights = torch.randn(3, 5, dtype=torch.float64)
    results = []
    for fused in (True, False):
        x = logits.clone().requires_grad_(True)
        if fused:
            logps, entropy = token_logprobs_with_entropy(x, ids, next_ids=next_ids)
            assert not entropy.requires_grad
        else:
            logps = token_logprobs(x, ids, next_ids=next_ids)
            with torch.no_grad():
                entropy = entropy_from_logits(x.detach(), aligned=shifted)
        (logps * weights.to(logps.dtype)).sum().backward()
        results.append((logps.detach(), entropy, x.grad))
    for mine, theirs in zip(*results):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "temperature, sampling_filter",
    [(0.7, None), (0.7, SamplingFilter(top_p=0.8)), (1.0, SamplingFilter(top_k=3)), (1.3, SamplingFilter(4, 0.9))],
    ids=["tempered", "tempered-top-p", "top-k", "tempered-both"],
)
def test_the_entropy_metric_of_a_tempered_or_filtered_distribution_comes_from_the_log_probs_pass(
    dtype, temperature, sampling_filter, monkeypatch
):
    """Away from temperature 1 or with a sampling filter, one pass (and one replay of the kept sets, a sort of every
    row, where the two calls make one each) still gives :func:`token_logprobs`' values and gradient bit for bit, and
    :func:`tempered_entropy`'s entropy of the same distribution, which that function takes one batch row at a time:
    the same arithmetic on each row, summed in chunks of other shapes, so equal within the rounding of a sum of V
    terms (V = 10 logits of up to ~20 after the division: 10 x 20 x 2^-23 < 1e-4 in float32, 1e-12 in float64)."""
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMENTS", 40)  # several chunks of rows (40 elements: 4 rows of V = 10)
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 10) * 4).to(dtype)
    ids = torch.randint(0, 10, (3, 5))
    weights = torch.randn(3, 5, dtype=torch.float64)
    sorts = []
    monkeypatch.setattr(lp_mod, "_sampler_edges", _counted(lp_mod._sampler_edges, sorts))
    results = []
    for fused in (True, False):
        sorts.clear()
        x = logits.clone().requires_grad_(True)
        if fused:
            logps, entropy = token_logprobs_with_entropy(x, ids, temperature, sampling_filter)
            assert not entropy.requires_grad
        else:
            logps = token_logprobs(x, ids, temperature, sampling_filter)
            with torch.no_grad():
                entropy = tempered_entropy(x.detach(), temperature, sampling_filter, ids)
        (logps * weights.to(logps.dtype)).sum().backward()
        results.append((logps.detach(), x.grad, entropy, len(sorts)))
    (logps, grad, entropy, replays), (two_logps, two_grad, two_entropy, two_replays) = results
    assert torch.equal(logps, two_logps) and torch.equal(grad, two_grad)
    atol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(entropy, two_entropy, rtol=0, atol=atol)
    assert entropy.dtype == two_entropy.dtype and entropy[:, 0].eq(0).all()
    if sampling_filter is not None:  # each chunk's kept sets replayed once, not twice
        assert 2 * replays == two_replays > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "temperature, sampling_filter",
    [(1.0, None), (0.7, None), (0.7, SamplingFilter(top_p=0.8)), (1.3, SamplingFilter(4, 0.9))],
    ids=["plain", "tempered", "tempered-top-p", "tempered-both"],
)
def test_an_entropy_bonus_takes_one_pass_and_the_gradient_of_the_two_calls(
    dtype, temperature, sampling_filter, monkeypatch
):
    """With a differentiable entropy (an entropy bonus) the one pass gives :func:`token_logprobs`' log-probs bit for
    bit and the gradient of log-probs + bonus that :func:`token_logprobs` + :func:`tempered_entropy` give, from one
    backward pass (and one replay of the kept sets where they make two). Both are held to the float64 gradient of the
    same bf16 / fp32 logits, within a bound from the arithmetic: the entropy's gradient centres each logit on the
    distribution's mean (``x - (logsumexp - H)``), whose float32 rounding is that of a V-term sum of logits up to
    ``max|x|``, so 4 V max|x| 2^-24 times the largest upstream weights; in bf16 the one pass sums its two terms in
    float32 and casts once (one more rounding, at most half a bf16 step: 2^-8 relative), the two calls round each
    term into bf16 and add in bf16 (2^-8 of each term and of their sum, held to twice that). In float64 the two agree
    to 1e-12."""
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMENTS", 40)  # several chunks of rows (40 elements: 4 rows of V = 10)
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 10) * 4).to(dtype)
    ids = torch.randint(0, 10, (3, 5))
    weights, bonus = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    sorts = []
    monkeypatch.setattr(lp_mod, "_sampler_edges", _counted(lp_mod._sampler_edges, sorts))

    def gradient(x, fused, on_logps=1.0, on_entropy=1.0):
        x = x.clone().requires_grad_(True)
        if fused:
            logps, entropy = token_logprobs_with_entropy(x, ids, temperature, sampling_filter, entropy_grad=True)
        else:
            logps = token_logprobs(x, ids, temperature, sampling_filter)
            entropy = tempered_entropy(x, temperature, sampling_filter, ids)
        loss = (
            on_logps * (logps * weights.to(logps.dtype)).sum() + on_entropy * (entropy * bonus.to(entropy.dtype)).sum()
        )
        loss.backward()
        return logps.detach(), entropy.detach(), x.grad

    (logps, entropy, grad), replays = gradient(logits, True), len(sorts)
    (two_logps, two_entropy, two_grad), two_replays = gradient(logits, False), len(sorts) - replays
    _, _, exact = gradient(logits.double(), True)
    terms = gradient(logits.double(), True, on_entropy=0.0)[2], gradient(logits.double(), True, on_logps=0.0)[2]
    bound_of_terms = (terms[0].abs() + terms[1].abs() + exact.abs()) * 2.0**-8
    assert torch.equal(logps, two_logps) and grad.dtype == two_grad.dtype == dtype
    if dtype == torch.float64:
        torch.testing.assert_close(entropy, two_entropy, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad, two_grad, rtol=0, atol=1e-12)
    else:
        torch.testing.assert_close(entropy, two_entropy, rtol=0, atol=1e-4)
        largest = logits.double().abs().max() / temperature
        float32 = 4 * 10 * largest * 2.0**-24 * (weights.abs().max() + bonus.abs().max())
        step = 0.0 if dtype == torch.float32 else 2.0**-8  # bf16 rounds to 8 significant bits
        assert ((grad.double() - exact).abs() <= exact.abs() * step + float32).all()
        assert ((two_grad.double() - exact).abs() <= 2 * bound_of_terms + float32).all()
    if sampling_filter is not None:  # the kept sets replayed once, not twice
        assert 2 * replays == two_replays > 0


def test_the_one_pass_entropy_gradient_is_the_derivative_of_its_values():
    """The one pass's backward (both gradients formed together) against finite differences of its own forward, in
    float64, tempered and over a top-p kept set (piecewise constant: the steps stay inside one set)."""
    torch.manual_seed(1)
    logits = (torch.randn(2, 4, 7, dtype=torch.float64) * 2).requires_grad_(True)
    ids = torch.randint(0, 7, (2, 4))

    def both(x):
        return token_logprobs_with_entropy(x, ids, 0.7, SamplingFilter(top_p=0.8), entropy_grad=True)

    assert torch.autograd.gradcheck(both, (logits,))


def _counted(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted


def test_token_logprobs_does_not_modify_float32_logits():
    logits = _two_token_logits().requires_grad_(True)
    before = logits.detach().clone()
    token_logprobs(logits, torch.tensor([[1, 1, 0]])).sum().backward()
    assert torch.equal(logits.detach(), before)


def test_token_logprobs_shape_errors():
    with pytest.raises(ValueError, match="input_ids"):
        token_logprobs(torch.zeros(1, 3, 2), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        token_logprobs(torch.zeros(3, 2), torch.zeros(1, 3, dtype=torch.long))


# ----------------------------------------------------------------------------------------------------- entropy
def test_entropy_of_uniform_is_log_v_and_column_zero():
    logits = torch.full((2, 3, 5), 1.7)
    logits[1] = -4.0
    out = entropy_from_logits(logits)
    assert out.shape == (2, 3)
    assert out[:, 0].tolist() == [0.0, 0.0]
    assert out[:, 1:].flatten().tolist() == pytest.approx([math.log(5)] * 4, abs=1e-6)


def test_entropy_alignment_hand_value_and_masked_vocab():
    # column 1 <- softmax([log 3, 0]) = [3/4, 1/4]; column 2 <- [0, -inf] is a point mass (entropy 0, not NaN).
    logits = t([[[LN3, 0.0], [0.0, float("-inf")], [0.0, 0.0]]]).requires_grad_(True)
    out = entropy_from_logits(logits)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert out[0].tolist() == pytest.approx([0.0, h, 0.0], abs=1e-6)
    out.sum().backward()
    # dH/dz_i = -p_i (z_i - E_p[z]): z = [log 3, 0], E = 3/4 log 3 -> [-3/4 * 1/4 log 3, +1/4 * 3/4 log 3]
    g = 3 / 16 * LN3
    assert logits.grad[0, 0].tolist() == pytest.approx([-g, g], abs=1e-6)
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 2].tolist() == [0.0, 0.0]  # the last position predicts nothing


def test_a_nan_logit_makes_its_entropy_nan_where_a_minus_inf_one_adds_nothing():
    """The entropy's sum leaves out the NaN of ``0 * -inf`` (a masked logit); a NaN logit is not left out with it:
    its row's entropy is NaN, in the metric and the bonus alike, the other rows as they were."""
    logits = t([[[LN3, 0.0], [0.0, float("nan")], [0.0, float("-inf")], [0.0, 0.0]]])
    ids = torch.zeros(1, 4, dtype=torch.long)
    for entropy in (entropy_from_logits(logits), token_logprobs_with_entropy(logits, ids, 0.7)[1]):
        assert entropy[0, 2].isnan() and entropy[0, 3] == 0 and entropy[0, 1].isfinite()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_logsumexp_is_torchs_bit_for_bit_and_its_entropy_within_rounding(dtype):
    """The log-probs' logsumexp (:func:`rlhf.ops.logprobs._logsumexp`) is ``torch.logsumexp``'s value bit for bit,
    masked (-inf) logits and rows of one kept logit included, built in a scratch copy or not, so every log-prob is
    what it was; the entropy it takes from the same exponentials is the float64 entropy within the rounding of its
    sums: torch sums V terms in a cascade (error about log2(V) eps max|x|: V = 4096 logits up to ~25, 12 x 2^-24 x
    25 = 2e-5 in float32), and the logsumexp's own rounding (~35 x 2^-24) adds less: 1e-4 in float32, 1e-12 in
    float64."""
    torch.manual_seed(0)
    x = (torch.randn(64, 4096, dtype=torch.float64) * 5).to(dtype)
    x[0, :100] = -math.inf
    x[1, 1:] = -math.inf  # one kept logit: entropy 0
    entropy = torch.empty(64, dtype=dtype)
    lse = lp_mod._logsumexp(x, entropy)
    assert torch.equal(lse, torch.logsumexp(x, -1)) and torch.equal(lp_mod._logsumexp(x), lse)
    scratch = x.clone()  # a copy the caller no longer needs: the exponentials are built in it, the same values
    assert torch.equal(lp_mod._logsumexp(scratch, scratch=True), lse) and not torch.equal(scratch, x)
    wide = x.double()
    p = torch.softmax(wide, -1)
    exact = -(p * torch.where(p > 0, p.log(), 0.0)).sum(-1)
    torch.testing.assert_close(entropy.double(), exact, rtol=0, atol=1e-4 if dtype == torch.float32 else 1e-12)
    assert entropy[1] == 0


def test_entropy_gradcheck_with_chunking(monkeypatch):
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMENTS", 4)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(entropy_from_logits, (x,))


# ------------------------------------------------------------------------------------------- masked reductions
VALUES = [[1.0, 2.0, 3.0], [4.0, 5.0, float("-inf")]]
MASK = [[0, 1, 1], [1, 0, 0]]


def test_masked_sum_ignores_masked_inf():
    assert masked_sum(t(VALUES), torch.tensor(MASK)).item() == 9.0  # 2 + 3 + 4
    x = t(VALUES).requires_grad_(True)
    masked_sum(x, torch.tensor(MASK)).backward()
    assert x.grad.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]


def test_masked_sum_accumulates_bf16_in_fp32():
    # 300 + 256 * 1 = 556; bf16 cannot represent 556 (spacing 4 above 512), so a bf16 sum would be off.
    values = torch.ones(257, dtype=torch.bfloat16)
    values[0] = 300.0
    out = masked_sum(values, torch.ones(257))
    assert out.dtype == torch.float32 and out.item() == 556.0


def test_masked_mean_metric():
    values, mask = t(VALUES), torch.tensor(MASK)
    assert masked_mean(values, mask).item() == 3.0  # (2 + 3 + 4) / 3
    assert masked_mean(values, mask, dim=-1).tolist() == [2.5, 4.0]
    empty = masked_mean(values, torch.tensor([[0, 0, 0], [1, 1, 0]]), dim=-1)
    assert empty.tolist() == [0.0, 4.5]


def test_sequence_logprobs():
    logps = t([[0.0, -1.0, -2.0, -0.5], [0.0, -3.0, float("nan"), float("nan")]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])
    assert sequence_logprobs(logps, mask).tolist() == [-3.0, -3.0]


# ------------------------------------------------------------------------------------------------- SFT, normalize
def test_sft_nll_sum():
    logps = t([[0.0, -1.0, -2.0], [0.0, -0.5, float("-inf")]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    assert sft_nll_sum(logps, mask).item() == 3.5


def test_sft_nll_sum_from_logits_by_hand():
    # two targets: log(3/4) and log(1/2) -> NLL = -log(3/8)
    logits = t([[[LN3, 0.0], [0.0, 0.0], [5.0, 5.0]]])
    ids = torch.tensor([[1, 0, 1]])
    mask = torch.tensor([[0, 1, 1]])
    assert sft_nll_sum(token_logprobs(logits, ids), mask).item() == pytest.approx(-math.log(3 / 8), abs=1e-6)


def test_normalize_world_size_factor_and_errors():
    assert normalize(t(6.0), 3, world_size=1).item() == 2.0
    assert normalize(t(6.0), 3, world_size=4).item() == 8.0
    for bad in (0, 0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="normalizer"):
            normalize(t(6.0), bad, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        normalize(t(6.0), 3, world_size=0)


def test_normalize_with_averaged_allreduce_gives_global_mean_gradient():
    # loss = w * c for each micro-batch; 2 ranks with 2 and 1 micro-batches. Global normalizer N = 5 tokens.
    # Target gradient d/dw [sum c / N] = (1 + 2 + 4) / 5 = 1.4.
    per_rank = [[1.0, 2.0], [4.0]]
    world_size, n_tokens = 2, 5
    rank_grads = []
    for contribs in per_rank:
        w = torch.tensor(0.3, requires_grad=True)
        for c in contribs:  # gradient accumulation: backward per micro-batch, grads add up
            normalize(w * c, n_tokens, world_size).backward()
        rank_grads.append(w.grad.item())
    allreduced = sum(rank_grads) / world_size  # what DDP / DeepSpeed do
    assert allreduced == pytest.approx(1.4, abs=1e-6)


def test_split_vs_whole_batch_normalization():
    # Three sequences: A has 4 target tokens of NLL 1, B and C have one target of NLL 3 each.
    # Global token mean = (4 * 1 + 3 + 3) / 6 = 10 / 6.
    # Micro-batch 1 = [A] (width 5), micro-batch 2 = [B, C] (width 2): different padding widths.
    mb1_logps = t([[0.0, -1.0, -1.0, -1.0, -1.0]])
    mb1_mask = torch.tensor([[0, 1, 1, 1, 1]])
    mb2_logps = t([[0.0, -3.0], [0.0, -3.0]])
    mb2_mask = torch.tensor([[0, 1], [0, 1]])
    pieces = [(mb1_logps, mb1_mask), (mb2_logps, mb2_mask)]

    global_tokens = sum(int(m.sum()) for _, m in pieces)
    assert global_tokens == 6
    split_total = sum(normalize(sft_nll_sum(lp, m), global_tokens, world_size=1) for lp, m in pieces)
    assert split_total.item() == pytest.approx(10 / 6, abs=1e-6)

    # the same batch in one piece, right-padded to width 5 (padding filled with -inf: must be ignored)
    whole_logps = t([[0.0, -1.0, -1.0, -1.0, -1.0], [0.0, -3.0] + [float("-inf")] * 3, [0.0, -3.0] + [0.0] * 3])
    whole_mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 0, 0, 0], [0, 1, 0, 0, 0]])
    whole_mean = sft_nll_sum(whole_logps, whole_mask) / whole_mask.sum()
    assert split_total.item() == pytest.approx(whole_mean.item(), abs=1e-6)

    # The classic bug: averaging per-micro-batch means gives (4/4 + 6/2) / 2 = 2, not 10/6.
    mean_of_means = sum(sft_nll_sum(lp, m) / m.sum() for lp, m in pieces) / len(pieces)
    assert mean_of_means.item() == pytest.approx(2.0, abs=1e-6)
    assert abs(mean_of_means.item() - whole_mean.item()) > 0.3


# ----------------------------------------------------------------------------------------------------------- DPO
# beta = 0.5; pairs with h = chosen - rejected logratio of 2, 0.5 and 3 -> beta h = 1, 0.25, 1.5.
CHOSEN = [1.0, 0.25, 2.0]
REJECTED = [-1.0, -0.25, -1.0]
BETA = 0.5
BH = [1.0, 0.25, 1.5]


def _fn(name):
    return DPO_LOSSES.get(name).fn


def test_registered_dpo_losses():
    assert set(DPO_LOSSES.names()) >= {"sigmoid", "ipo", "hinge", "robust", "apo_zero", "apo_down"}
    assert DPO_LOSSES.get("ipo").average_logps is True
    assert DPO_LOSSES.get("sigmoid").average_logps is False
    assert "Rafailov" in DPO_LOSSES.get("sigmoid").paper


def test_sigmoid_loss_hand_values():
    out = _fn("sigmoid")(t(CHOSEN), t(REJECTED), BETA, 0.0)
    assert out.tolist() == pytest.approx([softplus(-z) for z in BH], abs=1e-6)  # log(1 + e^{-beta h})


def test_sigmoid_loss_label_smoothing():
    eps = 0.1
    out = _fn("sigmoid")(t(CHOSEN), t(REJECTED), BETA, eps)
    expected = [(1 - eps) * softplus(-z) + eps * softplus(z) for z in BH]
    assert out.tolist() == pytest.approx(expected, abs=1e-6)
    assert out[0].item() == pytest.approx(0.9 * 0.3132616875 + 0.1 * 1.3132616875, abs=1e-6)
    with pytest.raises(ValueError, match="sigmoid"):
        _fn("sigmoid")(t(CHOSEN), t(REJECTED), BETA, 0.5)


def test_ipo_loss_hand_values():
    # (h - 1 / (2 beta))^2 = (h - 1)^2 for h = 2, 0.5, 3
    out = _fn("ipo")(t(CHOSEN), t(REJECTED), BETA, 0.0)
    assert out.tolist() == pytest.approx([1.0, 0.25, 4.0], abs=1e-6)


def test_hinge_loss_hand_values():
    # relu(1 - beta h) for beta h = 1, 0.25, 1.5
    out = _fn("hinge")(t(CHOSEN), t(REJECTED), BETA, 0.0)
    assert out.tolist() == pytest.approx([0.0, 0.75, 0.0], abs=1e-6)


def test_robust_loss_hand_values():
    eps = 0.1
    out = _fn("robust")(t(CHOSEN), t(REJECTED), BETA, eps)
    expected = [((1 - eps) * softplus(-z) - eps * softplus(z)) / (1 - 2 * eps) for z in BH]
    assert out.tolist() == pytest.approx(expected, abs=1e-6)
    assert out[0].item() == pytest.approx((0.9 * 0.3132616875 - 0.1 * 1.3132616875) / 0.8, abs=1e-6)
    # eps = 0 is plain DPO
    plain = _fn("robust")(t(CHOSEN), t(REJECTED), BETA, 0.0)
    assert plain.tolist() == pytest.approx([softplus(-z) for z in BH], abs=1e-6)
    with pytest.raises(ValueError, match="robust"):
        _fn("robust")(t(CHOSEN), t(REJECTED), BETA, 0.5)


def _logistic(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def test_apo_losses_anchor_each_log_ratio_as_the_paper():
    """D'Oosterlinck et al. 2024, eq. 7 (zero) and 8 (down), in float64 against ``math``; with the policy equal to
    the reference every log-ratio is 0 and both losses are 1."""
    chosen, rejected = t(CHOSEN, torch.float64), t(REJECTED, torch.float64)
    zero = _fn("apo_zero")(chosen, rejected, BETA, 0.0)
    down = _fn("apo_down")(chosen, rejected, BETA, 0.0)
    for i, (c, r) in enumerate(zip(CHOSEN, REJECTED)):
        assert zero[i].item() == pytest.approx(1 - _logistic(BETA * c) + _logistic(BETA * r), rel=1e-15)
        assert down[i].item() == pytest.approx(_logistic(BETA * c) + 1 - _logistic(BETA * (c - r)), rel=1e-15)
    still = torch.zeros(3, dtype=torch.float64)
    assert _fn("apo_zero")(still, still, BETA, 0.0).tolist() == [1.0] * 3
    assert _fn("apo_down")(still, still, BETA, 0.0).tolist() == [1.0] * 3


def test_apo_gradients_push_the_way_the_paper_says():
    """APO-zero raises the chosen log-ratio and lowers the rejected one; APO-down lowers both, the rejected more
    (gradient descent moves each log-ratio against its gradient). The gradients by hand: d s(x) / dx = s (1 - s)."""
    chosen = t(CHOSEN, torch.float64).requires_grad_(True)
    rejected = t(REJECTED, torch.float64).requires_grad_(True)
    _fn("apo_zero")(chosen, rejected, BETA, 0.0).sum().backward()
    for i, (c, r) in enumerate(zip(CHOSEN, REJECTED)):
        sc, sr = _logistic(BETA * c), _logistic(BETA * r)
        assert chosen.grad[i].item() == pytest.approx(-BETA * sc * (1 - sc), rel=1e-14) and chosen.grad[i] < 0
        assert rejected.grad[i].item() == pytest.approx(BETA * sr * (1 - sr), rel=1e-14) and rejected.grad[i] > 0
    chosen.grad, rejected.grad = None, None
    _fn("apo_down")(chosen, rejected, BETA, 0.0).sum().backward()
    for i, (c, r) in enumerate(zip(CHOSEN, REJECTED)):
        sc, sh = _logistic(BETA * c), _logistic(BETA * (c - r))
        assert rejected.grad[i].item() == pytest.approx(BETA * sh * (1 - sh), rel=1e-14) and rejected.grad[i] > 0
        assert chosen.grad[i].item() == pytest.approx(BETA * sc * (1 - sc) - BETA * sh * (1 - sh), rel=1e-13)


@pytest.mark.parametrize("name", ["ipo", "hinge", "apo_zero", "apo_down"])
def test_label_smoothing_rejected_where_unused(name):
    with pytest.raises(ValueError, match=name):
        _fn(name)(t(CHOSEN), t(REJECTED), BETA, 0.1)
    with pytest.raises(ValueError, match=name):
        dpo_pair_losses(name, t([[-1.0, -2.0]]), t([[-1.0, -1.0]]), BETA, 0.1, lengths=torch.tensor([[1, 1]]))


def test_unknown_loss_type_lists_valid_names():
    with pytest.raises(UnknownNameError) as info:
        dpo_pair_losses("sigmod", t([[0.0, 0.0]]), t([[0.0, 0.0]]), BETA, 0.0)
    message = str(info.value)
    assert "'sigmoid'" in message.split("Did you mean")[1]
    for name in ("sigmoid", "ipo", "hinge", "robust"):
        assert name in message.split("Valid names:")[1]
    assert isinstance(info.value, KeyError)


def test_dpo_pair_losses_sigmoid_sums_and_rewards():
    # chosen logratio = -4 - (-6) = 2, rejected = -9 - (-6) = -3 -> h = 5, beta h = 2.5
    policy = t([[-4.0, -9.0]], dtype=torch.float32).requires_grad_(True)
    ref = t([[-6.0, -6.0]])
    losses, chosen_r, rejected_r = dpo_pair_losses("sigmoid", policy, ref, BETA, 0.0)
    assert losses.tolist() == pytest.approx([softplus(-2.5)], abs=1e-6)
    assert chosen_r.tolist() == [1.0] and rejected_r.tolist() == [-1.5]
    assert not chosen_r.requires_grad and not rejected_r.requires_grad
    losses.sum().backward()
    # d/d chosen = -beta * sigmoid(-beta h); rejected gets the opposite sign
    g = BETA / (1 + math.exp(2.5))
    assert policy.grad.tolist() == [pytest.approx([-g, g], abs=1e-6)]


def test_dpo_pair_losses_ipo_averages_per_token():
    # averaged: policy [-4/2, -9/3] = [-2, -3], ref [-6/2, -6/3] = [-3, -2] -> logratios 1, -1 -> h = 2
    # (h - 1)^2 = 1. With sums it would be h = 5 -> 16.
    policy, ref, lengths = t([[-4.0, -9.0]]), t([[-6.0, -6.0]]), torch.tensor([[2, 3]])
    losses, chosen_r, rejected_r = dpo_pair_losses("ipo", policy, ref, BETA, 0.0, lengths=lengths)
    assert losses.tolist() == pytest.approx([1.0], abs=1e-6)
    assert chosen_r.tolist() == pytest.approx([0.5]) and rejected_r.tolist() == pytest.approx([-0.5])
    with pytest.raises(ValueError, match="lengths"):
        dpo_pair_losses("ipo", policy, ref, BETA, 0.0)
    with pytest.raises(ValueError, match="lengths shape"):
        dpo_pair_losses("ipo", policy, ref, BETA, 0.0, lengths=torch.tensor([2, 3]))
    # a 0 count is not read back here (DPOObjective.count refuses it on the host): the average is infinite
    losses, _, _ = dpo_pair_losses("ipo", policy, ref, BETA, 0.0, lengths=torch.tensor([[2, 0]]))
    assert not torch.isfinite(losses).all()


def test_dpo_pair_losses_shape_check():
    with pytest.raises(ValueError, match=r"\(B, 2\)"):
        dpo_pair_losses("sigmoid", t([-1.0, -2.0]), t([-1.0, -1.0]), BETA, 0.0)


# ------------------------------------------------------------------------------------------- Bradley-Terry, acc
def test_bradley_terry_without_and_with_margin():
    chosen, rejected = t([2.0, 0.0]), t([1.0, 0.0])
    assert bradley_terry_losses(chosen, rejected).tolist() == pytest.approx([softplus(-1.0), math.log(2)], abs=1e-6)
    # margin 1 on the first pair: -logsigmoid(0) = log 2; margin 2 on the second: log(1 + e^2)
    out = bradley_terry_losses(chosen, rejected, margin=t([1.0, 2.0]))
    assert out.tolist() == pytest.approx([math.log(2), softplus(2.0)], abs=1e-6)


def test_pair_accuracy_count_ties_are_wrong():
    chosen = t([1.0, 2.0, 3.0, 4.0, 0.0])
    rejected = t([0.0, 2.0, 5.0, 3.0, 0.0])
    count = pair_accuracy_count(chosen, rejected)
    assert count.item() == 2  # pairs 0 and 3; the ties at 1 and 4 do not count
    assert count.dtype == torch.int64 and count.dim() == 0


def test_chosen_nll_is_per_pair_token_average():
    from rlhf.ops.preference import chosen_nll

    out = chosen_nll(torch.tensor([-6.0, -1.5]), torch.tensor([3, 1]))
    assert out.tolist() == pytest.approx([2.0, 1.5])


@pytest.mark.parametrize("loss_type,nll_coef", [("ipo", 0.0), ("sigmoid", 0.5)])
def test_dpo_refuses_a_completion_without_targets_on_the_driver(loss_type, nll_coef):
    """A per-token average (IPO) or RPO's NLL divides by a completion's target count: DPOObjective.count, which the
    group runs on the host over every micro-batch before the first backward, names the pairs with none."""
    from rlhf.batch import Batch
    from rlhf.objectives.dpo import DPOObjective

    mask = torch.ones(3, 2, 5, dtype=torch.long)
    loss_mask = mask.clone()
    loss_mask[:, :, :2] = 0
    loss_mask[1, 1, :] = 0  # pair 1's rejected completion has no target token
    batch = Batch(input_ids=mask, attention_mask=mask, loss_mask=loss_mask, sample_index=torch.tensor([7, 8, 9]))
    objective = DPOObjective(loss_type=loss_type, nll_coef=nll_coef)
    if loss_type == "ipo":
        with pytest.raises(ValueError, match=r"DPO loss 'ipo' averages log-probs per token: data rows \[8\]"):
            objective.count(batch)
    else:  # the NLL needs the chosen completion's targets only
        assert objective.count(batch) == 3
    loss_mask[2, 0, :] = 0  # pair 2's chosen completion has none
    with pytest.raises(ValueError, match=r"\[9\]|\[8, 9\]"):
        objective.count(batch)
    assert DPOObjective().count(batch) == 3  # the sigmoid loss sums log-probs: nothing to divide by
