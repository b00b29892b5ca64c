"""Padding-free packing (rlhf/models/packing.py): packed forwards give every objective the loss, gradient and
metrics of the padded forward (fp32 rounding), for SFT, DPO, the reward model, the RL actor and critic, and the
score functions; the layout maths and the errors.

The models here run in-process; that Ray workers pack the same way is test_packing_training's business.
"""

from __future__ import annotations

import pytest
import torch
from shared_helpers import host_reads_outside_modules
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.batch import Batch
from rlhf.models.packing import VARLEN_TORCH, PackedRows, packed_attention, packed_forward
from rlhf.objectives.actor_critic import PolicyObjective, SequenceScores, TokenLogps, TokenValues, ValueObjective
from rlhf.objectives.base import host_sums
from rlhf.objectives.dpo import DPOObjective, ReferenceLogps
from rlhf.objectives.reward import RewardObjective
from rlhf.objectives.sft import SFTObjective
from rlhf.utils.host_reads import HostReads

LENGTHS = (7, 1, 13, 4, 10, 2)  # uneven, with a one-token row


@pytest.fixture(scope="module")
def causal(tiny_model):
    """The tiny model under the CPU varlen attention (it also runs unpacked forwards, as sdpa) and under sdpa."""
    torch.manual_seed(0)
    packed_attention("sdpa")  # registers the implementation in this process
    varlen = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=VARLEN_TORCH)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa")
    for m in (varlen, plain):
        m.config.use_cache = False
    return varlen, plain


@pytest.fixture(scope="module")
def scalar(tiny_reward_model):
    packed_attention("sdpa")
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_reward_model, num_labels=1, attn_implementation=VARLEN_TORCH
    )
    model.config.use_cache = False
    return model


def _rows(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths) + 2  # padding beyond the longest row as well
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(4, vocab, (n,), generator=gen)
        mask[i, :n] = 1
    loss_mask = mask.clone()
    loss_mask[:, :2] = 0  # a prompt of two tokens (none to train on in the short rows)
    return ids, mask, loss_mask


def _rl_batch(vocab, seed=0):
    ids, mask, loss_mask = _rows(LENGTHS, vocab, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    noise = lambda: torch.randn(ids.shape, generator=gen) * loss_mask  # noqa: E731
    return Batch(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=loss_mask,
        old_logps=noise() - 3.0,
        rollout_logps=noise() - 3.0,
        ref_logps=noise() - 3.0,
        advantages=noise(),
        values=noise(),
        returns=noise(),
    )


def _pair_batch(vocab, seed=0):
    lengths = tuple(max(3, n) for n in LENGTHS)  # a completion needs a target token (two prompt tokens)
    ids_a, mask_a, lm_a = _rows(lengths, vocab, seed)
    ids_b, mask_b, lm_b = _rows(lengths[::-1], vocab, seed + 7)
    stack = lambda a, b: torch.stack([a, b], dim=1)  # noqa: E731
    gen = torch.Generator().manual_seed(seed)
    return Batch(
        input_ids=stack(ids_a, ids_b),
        attention_mask=stack(mask_a, mask_b),
        loss_mask=stack(lm_a, lm_b),
        ref_logps=torch.randn(len(lengths), 2, generator=gen) - 20.0,
        margin=torch.rand(len(lengths)),
    )


def _loss_and_grad(model, objective, batch):
    model.zero_grad(set_to_none=True)
    (loss, sums), reads = host_reads_outside_modules(model, lambda: objective.loss(model, batch))
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return loss.detach(), host_sums(sums), grad, reads


def _assert_same(model, unpacked, packed, batch):
    loss_u, sums_u, grad_u, reads_u = _loss_and_grad(model, unpacked, batch)
    loss_p, sums_p, grad_p, reads_p = _loss_and_grad(model, packed, batch)
    # Around the model's forward the loss reads nothing back to the host (its metrics stay tensors), packed once:
    # the row lengths that size the packed layout.
    assert (reads_u, reads_p) == (0, 1)
    torch.testing.assert_close(loss_p, loss_u, rtol=2e-6, atol=1e-6)
    # the whole gradient vector, relative to its size (single elements near 0 carry cancellation noise)
    assert (grad_p - grad_u).norm() <= 1e-5 * grad_u.norm(), float((grad_p - grad_u).norm() / grad_u.norm())
    assert sums_p.keys() == sums_u.keys()
    for key in sums_u:
        assert sums_p[key] == pytest.approx(sums_u[key], rel=2e-5, abs=1e-6), key
    assert grad_u.abs().max() > 0  # something was trained on


def test_pack_and_unpack_place_every_token_and_zero_the_rest():
    ids, mask, _ = _rows(LENGTHS, 50)
    with HostReads() as reads:
        rows = PackedRows.from_padded(ids, mask)
    assert reads.by_op == {"tolist": 1}  # the row lengths, with the layout check: one wait for a GPU, not four
    assert rows.input_ids.shape == (1, sum(LENGTHS)) and rows.max_length == max(LENGTHS)
    assert rows.cu_seqlens.tolist() == [0, 7, 8, 21, 25, 35, 37] and rows.cu_seqlens.dtype == torch.int32
    assert rows.position_ids[0].tolist() == [t for n in LENGTHS for t in range(n)]
    flat = mask.reshape(-1).nonzero().squeeze(-1)  # the layout written the plain way
    assert torch.equal(rows.index, flat) and torch.equal(rows.input_ids[0], ids.reshape(-1)[flat])
    assert rows.row_start.tolist() == [t == 0 for n in LENGTHS for t in range(n)]
    back = rows.unpack(rows.input_ids[..., None].float(), token_aligned=False)[..., 0]
    assert torch.equal(back.long(), ids * mask)
    aligned = rows.unpack(torch.ones(1, rows.num_tokens), token_aligned=True)
    expected = mask.float().clone()
    expected[:, 0] = 0  # each row's first token has no prediction
    assert torch.equal(aligned, expected)


def test_empty_rows_take_no_place_in_the_packed_run():
    ids, mask, _ = _rows((3, 0, 2, 0), 50)
    rows = PackedRows.from_padded(ids, mask)
    assert rows.cu_seqlens.tolist() == [0, 3, 5] and rows.max_length == 3
    assert rows.index.tolist() == [0, 1, 2, 2 * ids.shape[1], 2 * ids.shape[1] + 1]
    assert rows.position_ids[0].tolist() == [0, 1, 2, 0, 1]
    none = PackedRows.from_padded(ids[:0], mask[:0])
    assert none.num_tokens == 0 and none.cu_seqlens.tolist() == [0] and none.max_length == 0


def test_rows_with_holes_or_left_padding_are_refused():
    ids, mask, _ = _rows((3, 4), 50)
    with pytest.raises(ValueError, match="right-padded"):
        PackedRows.from_padded(ids, mask.flip(-1))


def test_the_varlen_attention_equals_padded_sdpa_row_by_row(causal):
    varlen, plain = causal
    ids, mask, _ = _rows(LENGTHS, varlen.config.vocab_size)
    with torch.no_grad():
        padded = plain(input_ids=ids, attention_mask=mask).logits
        unpacked = varlen(input_ids=ids, attention_mask=mask).logits  # no cu_seqlens: sdpa with its padding mask
        out, rows = packed_forward(varlen, ids, mask)
        packed = rows.unpack(out.logits, token_aligned=False)
    real = mask.bool()
    assert torch.equal(unpacked, padded)
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=2e-5)


def test_a_model_without_a_varlen_attention_runs_padded_and_cannot_run_packed(causal):
    _, plain = causal
    ids, mask, loss_mask = _rows(LENGTHS, plain.config.vocab_size)
    batch = Batch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask)
    with torch.no_grad():  # None follows the model: padded here
        assert SFTObjective().loss(plain, batch)[0] == SFTObjective(packing=False).loss(plain, batch)[0]
    with pytest.raises(RuntimeError, match="variable-length attention"):
        packed_forward(plain, ids, mask)
    with pytest.raises(ValueError, match="train.packing"):
        packed_attention("eager")


def test_sft_packed_equals_padded(causal):
    model = causal[0]
    ids, mask, loss_mask = _rows(LENGTHS, model.config.vocab_size)
    batch = Batch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask)
    _assert_same(model, SFTObjective(packing=False), SFTObjective(), batch)  # None: as the model was built


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_packed_equals_padded_and_so_do_its_reference_logps(causal, loss_type):
    model = causal[0]
    batch = _pair_batch(model.config.vocab_size)
    _assert_same(
        model,
        DPOObjective(loss_type=loss_type, nll_coef=0.5, packing=False),
        DPOObjective(loss_type=loss_type, nll_coef=0.5, packing=True),
        batch,
    )
    with torch.no_grad():
        torch.testing.assert_close(
            ReferenceLogps(packing=True)(model, batch),
            ReferenceLogps(packing=False)(model, batch),
            rtol=1e-5,
            atol=1e-5,
        )


def test_reward_model_packed_equals_padded(scalar):
    batch = _pair_batch(scalar.config.vocab_size)
    _assert_same(scalar, RewardObjective(use_margin=True, packing=False), RewardObjective(use_margin=True), batch)
    single = Batch(input_ids=batch.input_ids[:, 0], attention_mask=batch.attention_mask[:, 0])
    with torch.no_grad():
        torch.testing.assert_close(
            SequenceScores(packing=True)(scalar, single),
            SequenceScores(packing=False)(scalar, single),
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("temperature,entropy_coef", [(1.0, 0.0), (0.7, 0.01)])
def test_rl_actor_packed_equals_padded(causal, temperature, entropy_coef):
    model = causal[0]
    batch = _rl_batch(model.config.vocab_size)

    def make(packing):
        return PolicyObjective(temperature=temperature, entropy_coef=entropy_coef, kl_loss_coef=0.1, packing=packing)

    _assert_same(model, make(False), make(True), batch)
    with torch.no_grad():
        real = batch.attention_mask.bool()
        torch.testing.assert_close(
            TokenLogps(temperature, packing=True)(model, batch)[real],
            TokenLogps(temperature, packing=False)(model, batch)[real],
            rtol=1e-5,
            atol=2e-5,
        )


def test_critic_packed_equals_padded(scalar):
    batch = _rl_batch(scalar.config.vocab_size)
    _assert_same(scalar, ValueObjective(packing=False), ValueObjective(packing=True), batch)
    with torch.no_grad():
        real = batch.attention_mask.bool()
        torch.testing.assert_close(
            TokenValues(packing=True)(scalar, batch)[real],
            TokenValues(packing=False)(scalar, batch)[real],
            rtol=1e-5,
            atol=1e-6,
        )


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """A CPU stand-in for ``torch.nn.attention.varlen.varlen_attn``, written from its documented contract (``(T, H,
    D)`` tensors, int32 offsets, ``window_size=(-1, 0)`` causal, ``enable_gqa`` sharing each KV head among
    ``H_q / H_kv`` query heads): explicit float64 softmax attention within each row."""
    assert q.dim() == k.dim() == v.dim() == 3 and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    assert window_size == (-1, 0), "the glue asks for causal attention"
    if k.shape[1] != q.shape[1]:
        assert enable_gqa, "grouped KV heads passed without enable_gqa"
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    assert max_q == max_k == max(lengths)
    out = torch.empty_like(q)
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[s:e].double().transpose(0, 1) for t in (q, k, v))  # (H, L, D)
        scores = qs @ ks.transpose(1, 2) * (scale if scale is not None else q.shape[-1] ** -0.5)
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        out[s:e] = (scores.masked_fill(~causal, -torch.inf).softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("gqa", [True, False], ids=["enable_gqa", "repeated_kv"])
def test_torch_varlen_glue_matches_padded(causal, tiny_model, monkeypatch, gqa):
    """The CUDA path's glue (the layout transposes, int32 offsets, the causal window, grouped KV heads shared by the
    kernel or repeated for a torch without ``enable_gqa``) gives the padded forward's log-probs, with the kernel
    replaced by a reference from its documented contract (the real kernel runs on CUDA only: bench/gpu_check.py)."""
    import rlhf.models.packing as packing

    monkeypatch.setattr(packing, "_torch_varlen", lambda: (_reference_varlen, {"window_size": (-1, 0)}, gqa))
    monkeypatch.setattr(packing, "varlen_kernel", lambda device, dtype: "torch varlen_attn")
    varlen, plain = causal
    ids, mask, _ = _rows(LENGTHS, varlen.config.vocab_size)
    with torch.no_grad():
        packed = TokenLogps(packing=True)(varlen, Batch(input_ids=ids, attention_mask=mask))
        padded = TokenLogps(packing=False)(plain, Batch(input_ids=ids, attention_mask=mask))
    assert varlen.config.num_key_value_heads < varlen.config.num_attention_heads  # the GQA branch is taken
    torch.testing.assert_close(packed * mask, padded * mask, rtol=0, atol=2e-5)


def test_varlen_kernel_choice():
    """torch's varlen kernel only on CUDA in half precision; the per-row sdpa twin everywhere else."""
    from rlhf.models.packing import varlen_kernel

    assert varlen_kernel(torch.device("cpu"), torch.bfloat16) == "sdpa per row"
    assert varlen_kernel(torch.device("cuda", 0), torch.float32) == "sdpa per row"
