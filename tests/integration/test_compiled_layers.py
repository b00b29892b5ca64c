"""``model.compile``: each decoder layer under ``torch.compile`` (rlhf.models.compiled) computes the eager model's
numbers to float32 rounding, padded and packed, over micro-batches of changing lengths (one dynamic graph). Real
inductor compiles (C++ on CPU, ~1 minute each on 2 cores): an integration test. The refusals are unit-tested
(tests/unit/test_compile_config.py)."""

from __future__ import annotations

import pytest
import torch

from rlhf.batch import Batch
from rlhf.models.compiled import decoder_layers, is_compiled
from rlhf.models.loading import ModelSpec, load_model
from rlhf.objectives.sft import SFTObjective

# float32: a fused RMSNorm or activation chain rounds once where eager rounds per kernel, and sums in another order;
# the relative error of a loss or a gradient stays a few units of float32 rounding (6e-8) times the depth. 1e-6 is
# the bound (measured below 1e-7 on the tiny model); a wrong graph (a dropped residual, a stale shape
# specialisation) is O(1).
RTOL = 1e-6


def _batch(rows: int, longest: int, seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, longest + 1, (rows,), generator=generator)
    lengths[0] = longest
    mask = (torch.arange(longest) < lengths[:, None]).long()
    ids = torch.randint(4, 500, (rows, longest), generator=generator) * mask
    return Batch(input_ids=ids, attention_mask=mask, loss_mask=mask)


def _loss_and_grads(model: torch.nn.Module, batch: Batch, packing: bool):
    model.zero_grad(set_to_none=True)
    objective = SFTObjective(packing=packing)
    loss_sum, _ = objective.loss(model, batch)
    loss = loss_sum / objective.count(batch)
    loss.backward()
    return loss.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def models(tiny_model):
    from rlhf.models.packing import packed_attention

    built = {}
    for packing in (False, True):
        attention = packed_attention("sdpa") if packing else "sdpa"
        for compiled in (False, True):
            spec = ModelSpec(path=tiny_model, attn_implementation=attention, packing=packing, compile=compiled)
            built[packing, compiled] = load_model(spec).train()
    return built


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_compiled_layers_train_as_eager_to_float32_rounding(models, packing):
    eager, compiled = models[packing, False], models[packing, True]
    assert is_compiled(compiled) and not is_compiled(eager)
    assert len(decoder_layers(compiled)) == compiled.config.num_hidden_layers
    for rows, longest, seed in ((3, 24, 0), (2, 17, 1), (4, 31, 2)):  # new lengths: the dynamic graph, no recompile
        batch = _batch(rows, longest, seed)
        loss_e, grads_e = _loss_and_grads(eager, batch, packing)
        loss_c, grads_c = _loss_and_grads(compiled, batch, packing)
        assert _rel(loss_c, loss_e) <= RTOL, (rows, longest)
        assert grads_c.keys() == grads_e.keys()
        flat = [torch.cat([g.flatten() for g in grads.values()]) for grads in (grads_c, grads_e)]
        total = _rel(*flat)
        assert total <= RTOL, (rows, longest, total)
