"""``model.tiled_mlp``: each gated MLP in tiles of positions (DeepSpeed's TiledMLP) gives the whole MLP's loss and
gradients; it runs whole on short rows; ZeRO 3 is refused by key."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import ConfigError, load_config
from rlhf.config.schema import SFTRunConfig
from rlhf.models.tiled_mlp import enable_tiled_mlp


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from rlhf.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiled_mlp") / "tiny"), seed=2, max_position_embeddings=1024)


def _loss_and_grads(model, ids, mask):
    from rlhf.models.head import token_logprobs_and_entropy

    logps, _ = token_logprobs_and_entropy(model, ids, mask)
    loss = -(logps * mask).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("length", [600, 100])  # 600 positions: 5 tiles of the 128-wide model; 100: whole
def test_tiled_mlp_gives_the_whole_mlps_loss_and_gradients(model_path, length):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(4, 512, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, length // 2 :] = 0  # a padded row too
    whole = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    tiled = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    assert enable_tiled_mlp(tiled) == 2  # one per layer
    calls = []
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    original = ulysses_sp.TiledMLP.forward
    ulysses_sp.TiledMLP.forward = staticmethod(lambda ctx, *a: calls.append(a[3]) or original(ctx, *a))
    try:
        ref_loss, ref_grads = _loss_and_grads(whole, ids, mask)
        loss, grads = _loss_and_grads(tiled, ids, mask)
    finally:
        ulysses_sp.TiledMLP.forward = original
    assert calls == ([5, 5] if length == 600 else [])  # tiles per layer's MLP; none below 2 x hidden
    assert abs(float(loss - ref_loss)) <= 1e-12 * abs(float(ref_loss))
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).norm() <= 1e-10 * max(grad.norm().item(), 1e-30), name


def test_a_model_without_gated_mlps_is_refused():
    with pytest.raises(ValueError, match="model.tiled_mlp needs gated MLPs"):
        enable_tiled_mlp(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_zero_3_is_refused_by_key():
    with pytest.raises(ConfigError, match="model.tiled_mlp runs each MLP in a number of tiles"):
        load_config(
            SFTRunConfig,
            None,
            ["model.path=/m", "data.train_path=/d.jsonl", "model.tiled_mlp=true", "strategy.zero_stage=3"],
        )
