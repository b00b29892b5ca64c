"""``model.compile`` is refused by key next to what no test covers yet, and a model without decoder-layer classes is
named (rlhf.models.compiled); the compiled numbers are tested in tests/integration/test_compiled_layers.py."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import ConfigError, load_config
from rlhf.config.schema import SFTRunConfig
from rlhf.models.compiled import decoder_layers


def test_a_model_without_layer_classes_is_named():
    with pytest.raises(ValueError, match="names no layer class"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize(
    "other",
    [
        "strategy.zero_stage=3",
        "strategy.sequence_parallel_size=2",
        "model.tiled_mlp=true",
        "model.gradient_checkpointing=true",
        "model.lora.r=8",
    ],
)
def test_compile_is_refused_by_key_next_to_what_no_test_covers(other):
    overrides = ["model.path=/m", "data.train_path=/d.jsonl", "model.compile=true", other]
    if other.startswith("strategy.sequence"):
        overrides += ["train.num_workers=2", "train.packing=true"]
    with pytest.raises(ConfigError, match=r"model\.compile"):
        load_config(SFTRunConfig, "sft_tiny", overrides=overrides)
