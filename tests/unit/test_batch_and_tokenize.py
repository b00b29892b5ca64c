"""The typed batch and the tokenization that feeds it (pure, fast; real tokenizer)."""

from __future__ import annotations

import pytest
import torch

from rlhf.batch import Batch, pad_sequences
from rlhf.data.tokenize import collate_pairs, collate_sft, tokenize_pairs, tokenize_sft


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_sft_mask_covers_exactly_the_response_and_eos(tokenizer):
    rows = [{"prompt": "12+7=", "response": "19"}]
    ex = tokenize_sft(rows, tokenizer, max_length=64, prompt_key="prompt", response_key="response").examples[0]
    prompt_len = len(tokenizer("12+7=")["input_ids"])
    response = tokenizer("19", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert list(ex.input_ids[prompt_len:]) == response
    assert list(ex.loss_mask) == [0] * prompt_len + [1] * len(response)
    assert ex.num_targets == len(response)


def test_truncation_keeps_prompt_and_skips_rows_that_cannot_fit(tokenizer):
    rows = [{"prompt": "1+1=", "response": "2 " * 40}, {"prompt": "9" * 80 + "+1=", "response": "x"}]
    out = tokenize_sft(rows, tokenizer, max_length=16, prompt_key="prompt", response_key="response")
    assert out.skipped_rows == [1]
    (ex,) = out.examples
    assert len(ex.input_ids) == 16 and ex.input_ids[-1] != tokenizer.eos_token_id  # truncated: no EOS
    assert ex.loss_mask[0] == 0 and sum(ex.loss_mask) == 16 - len(tokenizer("1+1=")["input_ids"])


def test_collate_pads_right_to_the_longest_row(tokenizer):
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "10+10=", "response": "20 1 2 3"}]
    exs = tokenize_sft(rows, tokenizer, max_length=64, prompt_key="prompt", response_key="response").examples
    b = collate_sft(exs, tokenizer.pad_token_id, [5, 9])
    width = max(len(e.input_ids) for e in exs)
    assert b.input_ids.shape == (2, width)
    n0 = len(exs[0].input_ids)
    assert b.attention_mask[0].tolist() == [1] * n0 + [0] * (width - n0)
    assert (b.input_ids[0, n0:] == tokenizer.pad_token_id).all() and b.loss_mask[0, n0:].sum() == 0
    assert b.sample_index.tolist() == [5, 9]


def test_pairs_stay_together_when_a_batch_is_cut(tokenizer):
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": f"{i + 2} 7 7 7"} for i in range(4)]
    exs = tokenize_pairs(
        rows, tokenizer, max_length=64, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected"
    ).examples
    b = collate_pairs(exs, tokenizer.pad_token_id, list(range(4)), ref_logps=torch.arange(8.0).view(4, 2))
    assert b.is_pairwise and b.input_ids.shape[:2] == (4, 2)
    halves = b.split(2)
    assert [h.ref_logps.tolist() for h in halves] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert torch.equal(Batch.concat(halves, tokenizer.pad_token_id).input_ids, b.input_ids)
    chosen_len = len(exs[1].chosen.input_ids)
    assert b.attention_mask[1, 0].sum() == chosen_len and b.attention_mask[1, 1].sum() == len(exs[1].rejected.input_ids)


def test_batch_rejects_inconsistent_fields_and_bad_splits():
    ids = pad_sequences([[1, 2, 3], [4]], 0)
    with pytest.raises(ValueError, match="attention_mask shape"):
        Batch(input_ids=ids, attention_mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="ref_logps has 3 rows"):
        Batch(input_ids=ids, attention_mask=torch.ones_like(ids), ref_logps=torch.zeros(3))
    b = Batch(input_ids=ids, attention_mask=(ids != 0).long())
    with pytest.raises(ValueError, match="cannot split 2 rows into pieces of 3"):
        b.split(3)


def test_concat_pads_to_widest_and_trim_drops_all_padding_columns():
    a = Batch(
        input_ids=pad_sequences([[1, 2]], 0), attention_mask=torch.tensor([[1, 1]]), loss_mask=torch.tensor([[0, 1]])
    )
    b = Batch(
        input_ids=pad_sequences([[3, 4, 5, 6]], 0),
        attention_mask=torch.tensor([[1, 1, 1, 0]]),
        loss_mask=torch.tensor([[0, 1, 1, 0]]),
    )
    c = Batch.concat([a, b], pad_id=0)
    assert c.input_ids.tolist() == [[1, 2, 0, 0], [3, 4, 5, 6]]
    assert c.attention_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert c.trim().input_ids.shape == (2, 3)
