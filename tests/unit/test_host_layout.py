"""Row lengths known on the host (rlhf.models.host_layout): a trainer rank records them for the masks it copies to
its device, and a forward then lays out its rows without reading the device: padded rows get the boolean mask
transformers would have built, a packed forward is sized from them and hands transformers a mask it never reads,
unpadded rows hand every layer no mask (transformers' causal kernel) where the decoder takes its masks ready-made,
and keep the 2-D mask and transformers' one read where it does not. The logits are those of the forward that reads
the mask, bit for bit; the reads are gone."""

from __future__ import annotations

import gc

import pytest
import torch
from shared_helpers import host_reads_outside_modules, tiny_qwen_config

from rlhf.models import host_layout
from rlhf.models.forward import _mask_argument, _unmasked_layers, lm_logits
from rlhf.models.host_layout import remember_row_lengths, row_lengths
from rlhf.models.packing import PackedRows, packed_attention
from rlhf.utils.host_reads import HostReads

VOCAB = 50


def _mask(lengths, width):
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


def _recorded(mask):
    copy = mask.clone()  # the "device" copy; the host original stays unrecorded
    remember_row_lengths(copy, mask)
    return copy


def test_the_lengths_follow_the_mask_and_its_same_element_views():
    pairs = _recorded(_mask([3, 5, 5, 1], 5).view(2, 2, 5))
    assert row_lengths(pairs) == [3, 5, 5, 1]
    assert row_lengths(pairs.reshape(4, 5)) == [3, 5, 5, 1]  # a (B, 2, T) pair mask flattened to (2B, T)
    assert row_lengths(pairs.reshape(4, 5)[:, :4]) is None  # a slice: other elements
    assert row_lengths(pairs[1:]) is None
    assert row_lengths(pairs.clone()) is None  # another tensor, never recorded
    assert row_lengths(pairs.reshape(4, 5).t().contiguous()) is None


def test_a_mask_that_is_not_right_padded_is_not_recorded():
    holes = torch.tensor([[1, 0, 1], [1, 1, 0]])
    copy = holes.clone()
    remember_row_lengths(copy, holes)
    assert row_lengths(copy) is None


def test_a_record_ends_with_its_mask():
    before = len(host_layout._RECORDED)
    mask = _recorded(_mask([2, 3], 4))
    assert len(host_layout._RECORDED) == before + 1
    del mask
    gc.collect()
    assert len(host_layout._RECORDED) == before


def test_recording_reads_nothing_from_the_device():
    mask = _mask([2, 3], 4)
    with HostReads() as reads:
        _recorded(mask)  # the host original's sums and checks are host reads: no device waits for them
    assert reads.total == 0


@pytest.fixture(scope="module")
def models():
    import transformers

    torch.manual_seed(0)
    sdpa = transformers.Qwen2ForCausalLM(tiny_qwen_config(VOCAB)).eval()
    varlen = transformers.Qwen2ForCausalLM(tiny_qwen_config(VOCAB)).eval()
    varlen.load_state_dict(sdpa.state_dict())
    varlen.config._attn_implementation = packed_attention("sdpa")
    for model in (sdpa, varlen):
        model.config.use_cache = False  # as rlhf.models.loading loads every model
    return {"sdpa": sdpa, "varlen": varlen}


@pytest.mark.parametrize("lengths", [[6, 4, 1], [6, 6, 6]], ids=["padded", "unpadded"])
@pytest.mark.parametrize("name, packing", [("sdpa", False), ("varlen", False), ("varlen", True)])
def test_a_forward_with_host_lengths_computes_the_same_bits_without_the_mask_reads(models, lengths, name, packing):
    model = models[name]
    mask = _mask(lengths, 6)
    ids = torch.randint(1, VOCAB, mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    with torch.no_grad(), HostReads() as reading:
        read = lm_logits(model, ids, mask, packing).logits
    recorded = _recorded(mask)
    with torch.no_grad():
        told, outside = host_reads_outside_modules(model, lambda: lm_logits(model, ids, recorded, packing).logits)
        with HostReads() as reads:
            lm_logits(model, ids, recorded, packing)
    assert torch.equal(told, read)
    assert outside == 0
    layers = model.config.num_hidden_layers
    if packing:
        # the layout's own read is gone (and transformers' look for packed position ids, which a model handed no mask
        # makes: below); what is left is the CPU twin's per-row attention reading its row bounds, once a layer
        # (torch's varlen kernel on a GPU reads none)
        assert reading.by_op == {"tolist": 1 + layers}
        assert reads.by_op == {"tolist": layers}
        rows = PackedRows.from_padded(ids, mask, row_lengths(recorded))
        with torch.no_grad(), HostReads() as unmasked:
            model(**rows.model_inputs())
        assert unmasked.by_op == {"tolist": layers, "_local_scalar_dense": 1}
    elif lengths[-1] < 6:  # padded: transformers' two reads of the mask are gone
        assert reading.by_op == {"_local_scalar_dense": 2} and reads.total == 0
    else:  # unpadded: transformers' one read of the mask, to pick the causal kernel, is gone too
        assert reading.by_op == {"_local_scalar_dense": 1} and reads.total == 0


def _llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def test_unpadded_rows_hand_no_mask_only_to_a_decoder_that_takes_its_masks_ready_made():
    """A decoder that checks for a mapping of masks (Qwen2's) gets one with no mask in it, through a LoRA wrapper too;
    one that builds its masks from any argument (Llama's, in this transformers) keeps the 2-D mask and its read, as
    does an implementation whose layers, handed no mask, would attend to every key (eager)."""
    import peft
    import transformers

    def qwen(attention: str):
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(tiny_qwen_config(VOCAB)).eval()
        model.config._attn_implementation, model.config.use_cache = attention, False
        return model

    mask = _recorded(_mask([4, 4], 4))
    ids = torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(3))
    wrapped = peft.get_peft_model(qwen("sdpa"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    llama, eager = _llama(), qwen("eager")
    assert _mask_argument(qwen("sdpa"), mask, row_lengths(mask)) == {"full_attention": None}
    assert _mask_argument(wrapped, mask, row_lengths(mask)) == {"full_attention": None}
    assert _mask_argument(llama, mask, row_lengths(mask)) is mask
    assert _mask_argument(eager, mask, row_lengths(mask)) is mask
    for model, reads_left in ((wrapped, 0), (llama, 1), (eager, 0)):
        with torch.no_grad():
            read = lm_logits(model, ids, mask.clone()).logits
            with HostReads() as reads:
                told = lm_logits(model, ids, mask).logits
        assert torch.equal(told, read)
        assert reads.total == reads_left  # eager's mask code reads nothing: it builds the whole mask


def test_a_model_whose_decoder_transformers_cannot_find_is_handed_its_mask():
    class Exotic(torch.nn.Module):
        def get_decoder(self):
            raise NotImplementedError("no rule for this model")  # transformers' lookup may raise for one

    assert _unmasked_layers(Exotic()) is None and _unmasked_layers(torch.nn.Linear(2, 2)) is None


def test_models_with_other_than_full_causal_layers_keep_transformers_mask(models):
    import transformers

    config = tiny_qwen_config(VOCAB)
    config.layer_types = ["sliding_attention"]
    config.sliding_window = 2
    torch.manual_seed(0)
    windowed = transformers.Qwen2ForCausalLM(config).eval()
    windowed.config.use_cache = False
    mask = _recorded(_mask([5, 2], 5))
    assert _mask_argument(windowed, mask, row_lengths(mask)) is mask  # transformers builds its windowed mask
    bidirectional = transformers.Qwen2ForCausalLM(tiny_qwen_config(VOCAB))
    bidirectional.model.layers[0].self_attn.is_causal = False  # as an encoder's attention is
    assert _mask_argument(bidirectional, mask, row_lengths(mask)) is mask
    assert _mask_argument(models["sdpa"], mask, row_lengths(mask)).shape == (2, 1, 5, 5)
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2)) * mask
    with torch.no_grad():
        assert torch.equal(lm_logits(windowed, ids, mask).logits, lm_logits(windowed, ids, mask.clone()).logits)
