"""The GKD divergences of rlhf.ops.distill (Agarwal et al. 2024, eq. 1) against a float64 reference written from the
paper over whole vocabularies: the top-k + tail form is exact when k covers the vocabulary, a coarse-graining below
it (>= 0, <= the full value), 0 with its gradient off the mask; and its gradient is the softmax's ``q - p``."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.ops.distill import generalized_jsd, topk_divergence, with_tail

V = 12


def _paper_jsd(p: torch.Tensor, q: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD eq. 1 over probabilities ``(..., V)``: ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p +
    (1 - beta) q``; ``p`` the teacher's, ``q`` the student's."""
    m = beta * p + (1 - beta) * q
    return beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)


def _paper_forward_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p * (p / q).log()).sum(-1)


def _logits(seed: int, shape=(3, 5, V)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def _topk(student_logits, teacher_logits, k):
    """The teacher's top-k ids and both sides' log-probs of them, ``(B, T, k)``."""
    teacher_logps, ids = teacher_logits.log_softmax(-1).topk(k, dim=-1)
    return student_logits.log_softmax(-1).gather(-1, ids), teacher_logps, ids


@pytest.mark.parametrize("name,beta", [("forward_kl", 0.5), ("jsd", 0.1), ("jsd", 0.5), ("jsd", 0.9)])
def test_with_k_covering_the_vocabulary_it_is_the_papers_divergence(name, beta):
    student, teacher = _logits(0), _logits(1)
    mask = torch.ones(3, 5, dtype=torch.bool)
    got = topk_divergence(name, *_topk(student, teacher, V)[:2], mask, beta)
    p, q = teacher.softmax(-1), student.softmax(-1)
    want = _paper_forward_kl(p, q) if name == "forward_kl" else _paper_jsd(p, q, beta)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["forward_kl", "jsd"])
def test_below_the_vocabulary_it_is_the_divergence_of_the_coarse_grained_distributions(name):
    student, teacher = _logits(2), _logits(3)
    mask = torch.ones(3, 5, dtype=torch.bool)
    s, t, _ = _topk(student, teacher, 4)
    got = topk_divergence(name, s, t, mask, 0.3)
    coarse_p = torch.cat([t.exp(), 1 - t.exp().sum(-1, keepdim=True)], -1)
    coarse_q = torch.cat([s.exp(), 1 - s.exp().sum(-1, keepdim=True)], -1)
    p, q = teacher.softmax(-1), student.softmax(-1)
    full, coarse = (
        (_paper_forward_kl(p, q), _paper_forward_kl(coarse_p, coarse_q))
        if name == "forward_kl"
        else (_paper_jsd(p, q, 0.3), _paper_jsd(coarse_p, coarse_q, 0.3))
    )
    torch.testing.assert_close(got, coarse, rtol=1e-12, atol=1e-14)
    assert (got >= 0).all() and (got <= full + 1e-12).all() and (got < full - 1e-6).any()  # data processing


def test_the_jsd_is_symmetric_in_beta_and_tends_to_beta_times_the_forward_kl():
    p, q = _logits(4).log_softmax(-1), _logits(5).log_softmax(-1)
    torch.testing.assert_close(generalized_jsd(q, p, 0.3), generalized_jsd(p, q, 0.7), rtol=1e-12, atol=0)
    beta = 1e-7
    kl = _paper_forward_kl(p.exp(), q.exp())
    torch.testing.assert_close(generalized_jsd(q, p, beta) / beta, kl, rtol=1e-5, atol=0)
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="beta must be in \\(0, 1\\)"):
            generalized_jsd(q, p, bad)


def test_the_forward_kl_gradient_is_the_softmax_difference():
    """d KL(p || softmax(z)) / dz = softmax(z) - p: the full-vocabulary gradient, through the top-k gather."""
    student, teacher = _logits(6).requires_grad_(), _logits(7)
    mask = torch.ones(3, 5, dtype=torch.bool)
    s, t, _ = _topk(student, teacher, V)
    topk_divergence("forward_kl", s, t, mask).sum().backward()
    torch.testing.assert_close(student.grad, student.softmax(-1) - teacher.softmax(-1), rtol=1e-10, atol=1e-12)


def test_off_the_mask_nothing_reaches_value_or_gradient():
    student, teacher = _logits(8).requires_grad_(), _logits(9)
    s, t, _ = _topk(student, teacher, 4)
    t = t.clone()
    t[:, -2:] = float("nan")  # padding holds anything
    s = torch.where(torch.arange(5)[None, :, None] >= 3, torch.full_like(s, float("-inf")), s)
    mask = torch.arange(5)[None].expand(3, 5) < 3
    for name in ("forward_kl", "jsd"):
        student.grad = None
        got = topk_divergence(name, s, t, mask, 0.5)
        assert torch.isfinite(got).all() and (got[:, 3:] == 0).all() and (got[:, :3] > 0).all()
        got.sum().backward(retain_graph=True)
        assert torch.isfinite(student.grad).all() and (student.grad[:, 3:] == 0).all()


def test_the_tail_holds_the_rest_of_the_mass():
    logps = _logits(10).log_softmax(-1)
    top = logps.topk(5, dim=-1).values
    torch.testing.assert_close(with_tail(top).exp().sum(-1), torch.ones(3, 5, dtype=torch.float64), rtol=0, atol=1e-14)
    assert math.isclose(float(with_tail(logps)[..., -1].exp().max()), 0.0, abs_tol=1e-13)  # k = V: an empty tail
