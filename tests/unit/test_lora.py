"""LoRA (rlhf.models.lora): the targets PEFT would wrap, the wrapped model starting at its base, the base as the
reference with adapters off, and the merge / adapter export over named tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from rlhf.models import lora as L
from rlhf.models.loading import CAUSAL_LM, SCALAR_HEAD, ModelSpec, load_model, scalar_head_values

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 512, (2, 11), generator=torch.Generator().manual_seed(seed))


def _wrapped_modules(peft_model) -> list:
    """Module paths (relative to the HF model) that PEFT gave a LoRA adapter."""
    return [
        L._strip_prefix(n)[: -len(".lora_A.default.weight")]
        for n in peft_model.state_dict()
        if n.endswith(".lora_A.default.weight")
    ]


def _perturb(peft_model, seed: int = 1) -> None:
    """Give every adapter a non-zero B (and a scalar head's trained copy new values): the model now differs from
    its base."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def _forward(model, kind: str, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if kind == CAUSAL_LM:
            return model(input_ids=ids).logits
        return scalar_head_values(model, ids, torch.ones_like(ids))


@pytest.fixture(scope="module")
def models(tiny_model):
    """Loads through the trainers' own loader; a fresh one per call."""
    return lambda kind=CAUSAL_LM: load_model(ModelSpec(tiny_model, kind=kind))


# ---------------------------------------------------------------------------------------------------- spec
@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(r=-1), "model.lora.r"),
        (dict(r=2.0), "model.lora.r"),
        (dict(r=True), "model.lora.r"),
        (dict(r=4, alpha=0), "model.lora.alpha"),
        (dict(r=4, alpha=float("nan")), "model.lora.alpha"),
        (dict(r=4, dropout=1.0), "model.lora.dropout"),
        (dict(r=4, dropout=-0.1), "model.lora.dropout"),
        (dict(r=4, target_modules=()), "model.lora.target_modules"),
        (dict(r=4, target_modules=("q_proj", "")), "model.lora.target_modules"),
        (dict(r=4, target_modules="q_proj(["), "model.lora.target_modules"),
        (dict(r=4, target_modules=("all-linear", "q_proj")), "model.lora.target_modules"),
    ],
)
def test_spec_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        L.LoraSpec(**kwargs)


def test_spec_normalizes_targets():
    assert not L.LoraSpec().enabled and L.LoraSpec(r=1).enabled
    assert L.LoraSpec(r=8, target_modules=["q_proj", "v_proj"]).target_modules == ("q_proj", "v_proj")
    assert L.LoraSpec(r=8, target_modules=["All-Linear"]).target_modules == L.ALL_LINEAR
    assert L.LoraSpec(r=8, alpha=4).scaling == 0.5


# ---------------------------------------------------------------------------------------------------- targets
@pytest.mark.parametrize("kind", [CAUSAL_LM, SCALAR_HEAD])
@pytest.mark.parametrize("targets", [ATTN, ("v_proj", "down_proj"), "all-linear", r".*\.1\.self_attn\.(q|k)_proj"])
def test_meta_check_predicts_exactly_what_peft_wraps(tiny_model, models, kind, targets):
    from peft import LoraConfig, get_peft_model

    predicted = L.check_targets(tiny_model, kind, targets)  # meta device: no weights read
    task = "CAUSAL_LM" if kind == CAUSAL_LM else "SEQ_CLS"
    by_peft = get_peft_model(
        models(kind),
        LoraConfig(r=2, target_modules=targets if isinstance(targets, str) else list(targets), task_type=task),
    )
    assert predicted == _wrapped_modules(by_peft)  # PEFT's own rule, "all-linear" included
    assert not any(n.endswith(("lm_head", "score")) for n in predicted)
    assert predicted == _wrapped_modules(L.apply_lora(models(kind), L.LoraSpec(r=2, target_modules=targets), kind))


def test_matching_from_names_alone():
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "lm_head"]
    assert L.matching_modules(names, "all-linear") == names[:2]
    assert L.matching_modules(names, ("q_proj",)) == names[:1]
    assert L.matching_modules(names, "q_proj") == []  # a string is a full-path regex, as in PEFT


@pytest.mark.parametrize(
    "kind, targets, says",
    [
        (
            CAUSAL_LM,
            ("qproj",),
            r"matches no Linear layer .* end in: down_proj, gate_proj, k_proj, o_proj, q_proj, "
            r"up_proj, v_proj$",
        ),
        (CAUSAL_LM, ("q_proj", "vproj"), r"\['vproj'\] match no Linear layer"),
        (CAUSAL_LM, ("q_proj", "lm_head"), r"would wrap the output head 'lm_head'.*output layer"),
        (CAUSAL_LM, r"lm_.*", r"would wrap the output head 'lm_head'"),
        (SCALAR_HEAD, ("score",), r"would wrap the output head 'score'.*trained fully"),
        (CAUSAL_LM, ("mlp",), r"not Linear layers: model\.layers\.0\.mlp \(Qwen2MLP\)"),
        (CAUSAL_LM, ("embed_tokens",), r"not Linear layers: model\.embed_tokens \(Embedding\)"),
    ],
)
def test_target_errors(tiny_model, kind, targets, says):
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules=") as err:
        L.check_targets(tiny_model, kind, targets)
    assert err.match(says)


# ---------------------------------------------------------------------------------------------------- wrapping
def test_apply_lora_starts_at_the_base_with_only_adapters_trainable(models):
    base = models()
    spec = L.LoraSpec(r=4, alpha=8, target_modules=ATTN)
    torch.manual_seed(0)
    a = L.apply_lora(models(), spec, CAUSAL_LM)
    torch.manual_seed(0)
    b = L.apply_lora(models(), spec, CAUSAL_LM)
    c = L.apply_lora(models(), spec, CAUSAL_LM, seed=0)
    d = L.apply_lora(models(), spec, CAUSAL_LM, seed=1)
    assert torch.equal(_forward(a, CAUSAL_LM, _ids()), _forward(base, CAUSAL_LM, _ids()))  # B = 0: bit for bit

    trainable = {n: p for n, p in a.named_parameters() if p.requires_grad}
    assert list(trainable) == list(L.trainable_parameter_names(types.SimpleNamespace(module=a)))
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(_wrapped_modules(a)) == 2 * 2 * len(ATTN)
    assert all(not p.requires_grad for n, p in a.named_parameters() if "lora_" not in n)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    for name, param in trainable.items():
        if ".lora_B." in name:
            assert not param.any()
        else:  # A: drawn from the seeded RNG, the same for the same seed, different for another
            params = dict(b.named_parameters()), dict(c.named_parameters()), dict(d.named_parameters())
            assert param.abs().sum() > 0 and torch.equal(param, params[0][name])
            assert torch.equal(param, params[1][name]) and not torch.equal(param, params[2][name])


def test_gradients_are_the_same_with_gradient_checkpointing(tiny_model):
    """load_model turns checkpointing on before the wrap (non-reentrant): the frozen base must not cut the
    adapters' gradient path."""
    spec, ids = L.LoraSpec(r=4, alpha=8, target_modules=("q_proj", "down_proj")), _ids(2)
    grads = []
    for checkpointing in (False, True):
        model = L.apply_lora(
            load_model(ModelSpec(tiny_model, gradient_checkpointing=checkpointing)), spec, CAUSAL_LM, seed=0
        )
        _perturb(model)
        model.train()
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(grads[0][n].abs().sum() > 0 for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_apply_lora_refuses_a_disabled_spec(models):
    with pytest.raises(ValueError, match=r"model\.lora\.r is 0"):
        L.apply_lora(models(), L.LoraSpec(r=0), CAUSAL_LM)


@pytest.mark.parametrize("kind", [CAUSAL_LM, SCALAR_HEAD])
def test_adapters_disabled_is_the_base_model_bit_for_bit(models, kind):
    base = models(kind)
    peft_model = L.apply_lora(models(kind), L.LoraSpec(r=4, alpha=8, target_modules="all-linear"), kind, seed=0)
    _perturb(peft_model)
    engine = types.SimpleNamespace(module=peft_model)  # how a DeepSpeed engine / TrainEngine exposes it
    expected, ids = _forward(base, kind, _ids()), _ids()
    tuned = _forward(peft_model, kind, ids)
    assert not torch.allclose(tuned, expected, atol=1e-3)
    with L.adapters_disabled(engine):
        assert torch.equal(_forward(peft_model, kind, ids), expected)
    assert torch.equal(_forward(peft_model, kind, ids), tuned)  # back on after the block
    with pytest.raises(TypeError, match="not a PEFT model"):
        with L.adapters_disabled(base):
            pass


def test_scalar_head_trains_a_full_copy_of_score_through_scalar_head_values(models):
    base = models(SCALAR_HEAD)
    model = L.apply_lora(models(SCALAR_HEAD), L.LoraSpec(r=4, target_modules=ATTN), SCALAR_HEAD, seed=0)
    ids = _ids()
    assert torch.equal(_forward(model, SCALAR_HEAD, ids), _forward(base, SCALAR_HEAD, ids))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "base_model.model.score.modules_to_save.default.weight" in trainable
    assert "base_model.model.score.original_module.weight" not in trainable

    values = scalar_head_values(model, ids, torch.ones_like(ids))  # reads model.score: the trained copy
    values.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == trainable  # nothing frozen receives a gradient (lora_A's is zero while B is zero)
    assert grads["base_model.model.score.modules_to_save.default.weight"].abs().sum() > 0
    assert all(grads[n].abs().sum() > 0 for n in grads if "lora_B" in n)


# ---------------------------------------------------------------------------------------------------- merging
def _tuned(models, kind, targets="all-linear", r=4, alpha=8):
    spec = L.LoraSpec(r=r, alpha=alpha, target_modules=targets)
    model = L.apply_lora(models(kind), spec, kind, seed=0)
    _perturb(model)
    return model, spec


@pytest.mark.parametrize("kind", [CAUSAL_LM, SCALAR_HEAD])
def test_merged_tensors_are_the_base_state_dict_and_compute_the_peft_model(models, kind):
    model, spec = _tuned(models, kind, targets=("q_proj", "v_proj", "down_proj"))
    merged = list(L.merged_named_tensors(model.state_dict().items(), spec))
    fresh = models(kind)
    reference = fresh.state_dict()
    assert [n for n, _ in merged] == list(reference)  # names and their order
    assert all(t.shape == reference[n].shape and t.dtype == reference[n].dtype for n, t in merged)
    fresh.load_state_dict(dict(merged), strict=True)
    ids = _ids(3)
    torch.testing.assert_close(_forward(fresh, kind, ids), _forward(model, kind, ids), rtol=1e-5, atol=1e-5)

    # PEFT's own merge gives the same weights
    peft_merged = model.merge_and_unload().state_dict()
    for name, tensor in merged:
        torch.testing.assert_close(tensor, peft_merged[name], rtol=1e-6, atol=1e-6)


def test_merge_streams_one_module_at_a_time(models):
    model, spec = _tuned(models, CAUSAL_LM, targets=ATTN)
    names = list(model.state_dict())
    consumed = []

    def source():
        for name, tensor in model.state_dict().items():
            consumed.append(name)
            yield name, tensor

    q = "base_model.model.model.layers.0.self_attn.q_proj"
    for name, _ in L.merged_named_tensors(source(), spec):
        if name == "model.layers.0.self_attn.q_proj.weight":
            # the module's pieces are adjacent and it is released as soon as the next name shows up
            assert consumed[-5:-1] == [
                f"{q}.base_layer.weight",
                f"{q}.base_layer.bias",
                f"{q}.lora_A.default.weight",
                f"{q}.lora_B.default.weight",
            ]
            assert len(consumed) == names.index(f"{q}.lora_B.default.weight") + 2
            break
    else:
        pytest.fail("the merged q_proj weight never came")

    scrambled = sorted(model.state_dict().items())  # q_proj.base_layer.* and q_proj.lora_* far apart
    moved = [(n, t) for n, t in scrambled if "layers.0.self_attn.q_proj.lora_B" not in n] + [
        (n, t) for n, t in scrambled if "layers.0.self_attn.q_proj.lora_B" in n
    ]
    with pytest.raises(ValueError, match="incomplete|arrived after"):
        list(L.merged_named_tensors(moved, spec))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_merge_weight_is_computed_wide_and_rounded_once(dtype):
    gen = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((6, 5), (3, 5), (6, 3)))
    out = L.merge_weight(w.to(dtype), a.to(dtype), b.to(dtype), scaling=0.75)
    assert out.dtype == dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    exact = w.to(dtype).to(acc) + 0.75 * (b.to(dtype).to(acc) @ a.to(dtype).to(acc))
    assert torch.equal(out, exact.to(dtype))
    assert torch.equal(
        L.merge_weight(torch.zeros(2, 2), torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [4.0]]), scaling=2.0),
        torch.tensor([[6.0, 12.0], [8.0, 16.0]]),
    )


def test_merge_rejects_a_spec_of_another_rank(models):
    model, _ = _tuned(models, CAUSAL_LM, targets=ATTN, r=4)
    with pytest.raises(ValueError, match="r=8"):
        list(L.merged_named_tensors(model.state_dict().items(), L.LoraSpec(r=8, target_modules=ATTN)))


# ---------------------------------------------------------------------------------------------------- saving
@pytest.mark.parametrize("kind", [CAUSAL_LM, SCALAR_HEAD])
def test_saved_adapter_is_peft_s_and_loads_on_the_base(models, tiny_model, tmp_path, kind):
    from peft import PeftModel
    from safetensors.torch import load_file

    model, spec = _tuned(models, kind)
    ours = L.save_adapter(
        model.state_dict().items(), spec, str(tmp_path / "ours"), kind, base_model_name_or_path=tiny_model
    )
    model.save_pretrained(str(tmp_path / "peft"))
    theirs = load_file(str(tmp_path / "peft" / L.ADAPTER_WEIGHTS))
    written = load_file(os.path.join(ours, L.ADAPTER_WEIGHTS))
    assert sorted(written) == sorted(theirs) and all(torch.equal(written[n], theirs[n]) for n in theirs)
    config = L.read_adapter_config(ours)
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, tiny_model)
    assert sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]

    loaded = PeftModel.from_pretrained(models(kind), ours)  # a fresh base: the scalar head comes from the adapter
    ids = _ids(5)
    assert torch.equal(_forward(loaded, kind, ids), _forward(model, kind, ids))


@pytest.mark.parametrize("kind", [CAUSAL_LM, SCALAR_HEAD])
def test_saved_merged_model_loads_without_peft(models, tmp_path, kind):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model, spec = _tuned(models, kind, targets=ATTN)
    L.save_merged(model, spec, str(tmp_path / "merged"))
    auto = AutoModelForCausalLM if kind == CAUSAL_LM else AutoModelForSequenceClassification
    loaded = auto.from_pretrained(str(tmp_path / "merged"))
    with open(tmp_path / "merged" / "config.json") as f:
        assert json.load(f)["architectures"] == [type(loaded).__name__]
    assert not any("lora" in n or "base_layer" in n for n in loaded.state_dict())
    ids = _ids(6)
    torch.testing.assert_close(_forward(loaded, kind, ids), _forward(model, kind, ids), rtol=1e-5, atol=1e-5)


def test_import_is_cheap():
    code = "import sys, rlhf.models.lora; print([m for m in ('peft', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
