"""KTO on unpaired rows without Ray: the loss against hand-computed values, the KL reference point, the rows'
layouts and their errors (file and line), the mismatched pairing, the config refusals, and the objective's
split invariance in float64 (whole batch vs micro-batches: the same loss sum and gradient)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from shared_helpers import host_reads_outside_modules, uneven_unpaired_rows

from rlhf.batch import Batch
from rlhf.config.loader import load_config
from rlhf.config.schema import ConfigError, DPORunConfig
from rlhf.data.formats import chat_formatter, unpaired_fields
from rlhf.data.io import DataError, read_rows
from rlhf.data.tokenize import RowError, collate_unpaired, tokenize_unpaired
from rlhf.objectives.base import add_sums, host_sums
from rlhf.objectives.kto import KTOObjective, MismatchedLogps, with_kl_baseline
from rlhf.ops.preference import kto_kl_baseline, preference_rows, unpaired_losses
from rlhf.registry import UnknownNameError


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_loss_matches_the_paper_by_hand():
    # r = policy - ref; z0 = 0.3; beta = 0.5; lambda_D = 1, lambda_U = 1.5
    policy = torch.tensor([-3.0, -5.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-4.0, -4.5, -2.0], dtype=torch.float64)
    desirable = torch.tensor([True, False, False])
    z0 = torch.full((3,), 0.3, dtype=torch.float64)
    losses, rewards = unpaired_losses("kto", policy, ref, z0, desirable, 0.5, 1.0, 1.5)
    expected = [
        1.0 - 1.0 * _sigmoid(0.5 * (1.0 - 0.3)),  # desirable: lambda_D - lambda_D sigma(beta (r - z0))
        1.5 - 1.5 * _sigmoid(0.5 * (0.3 - (-0.5))),  # undesirable: lambda_U - lambda_U sigma(beta (z0 - r))
        1.5 - 1.5 * _sigmoid(0.5 * 0.3),
    ]
    assert losses.tolist() == pytest.approx(expected, rel=1e-15)
    assert rewards.tolist() == pytest.approx([0.5, -0.25, 0.0], rel=1e-15)
    # raising the desirable row's log-prob lowers its loss; raising the undesirable one's raises it
    grad_policy = policy.clone().requires_grad_()
    unpaired_losses("kto", grad_policy, ref, z0, desirable, 0.5, 1.0, 1.5)[0].sum().backward()
    assert grad_policy.grad[0] < 0 < grad_policy.grad[1]


def test_kl_baseline_is_the_clamped_mean_and_carries_no_gradient():
    policy = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    assert float(kto_kl_baseline(policy, torch.tensor([-2.0, -2.5, -3.0]))) == pytest.approx(0.5)
    assert not kto_kl_baseline(policy, torch.tensor([-2.0, -2.5, -3.0])).requires_grad
    assert float(kto_kl_baseline(policy, torch.tensor([0.0, 0.0, 0.0]))) == 0.0  # a negative mean is clamped
    with pytest.raises(ValueError, match="two equal"):
        kto_kl_baseline(policy, torch.zeros(2))


def test_loss_type_names_and_refusals():
    assert preference_rows("sigmoid") == "pairs" and preference_rows("kto") == "unpaired"
    with pytest.raises(
        UnknownNameError, match="Valid names: apo_down, apo_zero, cpo, hinge, ipo, kto, orpo, robust, sigmoid, simpo"
    ):
        preference_rows("kt0")
    base = ["model.path=m", "data.train_path=d.jsonl", "train.output_dir=o", "dpo.loss_type=kto"]
    assert load_config(DPORunConfig, overrides=base).dpo.unpaired
    with pytest.raises(ConfigError, match="dpo.label_smoothing .*not used by dpo.loss_type=kto"):
        load_config(DPORunConfig, overrides=base + ["dpo.label_smoothing=0.1"])
    for key in ("nll_coef", "simpo_gamma"):
        with pytest.raises(ConfigError, match=f"dpo.{key} is not used by dpo.loss_type=kto .*remove it"):
            load_config(DPORunConfig, overrides=base + [f"dpo.{key}=0.5"])
    with pytest.raises(ConfigError, match="dpo.undesirable_weight must be > 0"):
        load_config(DPORunConfig, overrides=base + ["dpo.undesirable_weight=0"])
    with pytest.raises(ConfigError, match="dpo.loss_type: unknown DPO loss type 'kt0'"):
        load_config(DPORunConfig, overrides=base[:-1] + ["dpo.loss_type=kt0"])


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "1+2=", "completion": "3"}, "missing field 'label' .*Set data.label_key"),
        ({"prompt": "1+2=", "label": True}, "missing field 'completion' .*Set data.completion_key"),
        (
            {"prompt": "1+2=", "completion": "3", "label": "yes"},
            "'label' must be true or false \\(desirable or not\\), got 'yes'",
        ),
        ({"prompt": "1+2=", "completion": "3", "label": 2}, "field 'label' must be true or false .*got 2"),
        (
            {"prompt": [{"role": "user", "content": "1+2="}], "completion": "3", "label": True},
            "field 'prompt' is messages but 'completion' is text",
        ),
        (
            {"prompt": "1+2=", "completion": [{"role": "user", "content": "3"}], "label": False},
            "'completion': message 0 has role 'user'; completions hold assistant messages",
        ),
    ],
)
def test_bad_unpaired_rows_name_file_and_line(tmp_path, row, message):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "1+2=", "completion": "3", "label": True}, row])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{message}"):
        read_rows(path, **unpaired_fields("prompt", "completion", "label"))


def _tokenize(tokenizer, rows, max_length=64):
    chat = chat_formatter(tokenizer, "auto", rows, keys=("completion",))
    return tokenize_unpaired(
        rows,
        tokenizer,
        max_length=max_length,
        prompt_key="prompt",
        completion_key="completion",
        label_key="label",
        chat=chat,
    )


def test_rows_are_mismatched_half_the_kept_rows_away_within_their_kind(tokenizer, tmp_path):
    user = [{"role": "user", "content": "2+2="}]
    rows = [
        {"prompt": "1+1=", "completion": "2", "label": True},
        {"prompt": "1+2=", "completion": "4", "label": False},
        {"prompt": user, "completion": [{"role": "assistant", "content": "4"}], "label": 1},
        {"prompt": "1+3=", "completion": "4", "label": True},
        {"prompt": "9+9=" * 40, "completion": "18", "label": True},  # the prompt fills max_length: skipped
        {"prompt": "3+3=", "completion": [{"role": "assistant", "content": "7"}], "label": 0},  # one user turn
        {"prompt": "1+4=", "completion": "5", "label": False},
    ]
    path = _write(tmp_path / "rows.jsonl", rows)
    read = read_rows(path, **unpaired_fields("prompt", "completion", "label"))
    out = _tokenize(tokenizer, read)
    assert out.skipped_rows == [4]
    text = lambda e: tokenizer.decode(e.input_ids)  # noqa: E731
    target = lambda e: tokenizer.decode([t for t, m in zip(e.input_ids, e.loss_mask) if m])  # noqa: E731
    # plain rows 0, 1, 3, 6 (n = 4): row k takes the completion of row (k + 2) mod 4; conversations 2, 5 swap
    plain, chats = [out.examples[i] for i in (0, 1, 3, 5)], [out.examples[i] for i in (2, 4)]
    assert [target(e.completion) for e in plain] == ["2</s>", "4</s>", "4</s>", "5</s>"]
    assert [target(e.mismatched) for e in plain] == ["4</s>", "5</s>", "2</s>", "4</s>"]
    assert [text(e.mismatched).split("=")[0][-3:] for e in plain] == ["1+1", "1+2", "1+3", "1+4"]
    assert [target(e.mismatched) for e in chats] == ["7<|im_end|>", "4<|im_end|>"]
    assert "3+3=" in text(chats[1].mismatched) and "2+2=" in text(chats[0].mismatched)
    assert [e.desirable for e in out.examples] == [True, False, True, True, False, False]
    batch = collate_unpaired(out.examples, tokenizer.pad_token_id, range(6))
    assert batch.input_ids.shape[:2] == (6, 2) and batch.desirable.tolist() == [True, False, True, True, False, False]
    with pytest.raises(RowError, match="row 2 \\(0-based\\): the only conversational row: KTO's KL estimate"):
        _tokenize(tokenizer, read[:3])


def _fp64_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").train()


def test_objective_whole_batch_equals_its_micro_batches_in_float64(tiny_model, tokenizer, tmp_path):
    """The loss is a per-row sum with z_0 fixed over the whole batch, so the micro-batches' losses add up to the
    whole batch's and so do their gradients (float64: to rounding)."""
    out = _tokenize(tokenizer, uneven_unpaired_rows(7, seed=3))
    batch = collate_unpaired(out.examples, tokenizer.pad_token_id, range(7))
    policy, reference = _fp64_model(tiny_model), _fp64_model(tiny_model)
    with torch.no_grad():  # a reference that is not the policy: non-zero rewards and z_0
        for p in reference.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
    from rlhf.objectives.dpo import ReferenceLogps

    with torch.no_grad():
        batch = batch.replace(ref_logps=ReferenceLogps(packing=False)(reference, batch))
        batch = with_kl_baseline(batch, MismatchedLogps(packing=False)(policy, batch))
    assert float(batch.kl_baseline[0]) > 0  # the unclamped branch
    objective = KTOObjective(beta=0.5, undesirable_weight=1.5, packing=False)

    def loss_and_grad(parts):
        policy.zero_grad()
        total = sum(objective.loss(policy, p)[0] for p in parts) / len(batch)
        total.backward()
        return float(total.detach()), torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])

    whole_loss, whole_grad = loss_and_grad([batch])
    split_loss, split_grad = loss_and_grad([batch.slice(0, 3), batch.slice(3, 4), batch.slice(4, 7).trim()])
    assert abs(split_loss - whole_loss) <= 1e-13 * abs(whole_loss)
    assert float((split_grad - whole_grad).abs().max()) <= 1e-12 * float(whole_grad.abs().max())
    assert float(whole_grad.abs().max()) > 1e-3
    (_, sums), reads = host_reads_outside_modules(policy, lambda: objective.loss(policy, batch))
    assert reads == 0  # the per-label sums are masked sums on the device, not x[label] (sized by the data)
    split = {}
    for part in (batch.slice(0, 3), batch.slice(3, 4), batch.slice(4, 7).trim()):
        split = add_sums(split, objective.loss(policy, part)[1])
    whole = host_sums(sums)
    assert split.keys() == whole.keys()
    for key, value in whole.items():  # float64 sums of float64 terms, in another order
        assert split[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    metrics = objective.finalize(sums, len(batch))
    assert metrics["kl"] == pytest.approx(float(batch.kl_baseline[0]), rel=1e-15)
    assert metrics["loss"] == pytest.approx(whole_loss, rel=1e-13)
    assert set(metrics) >= {"rewards/desirable", "rewards/undesirable", "rewards/margin", "num_tokens"}


def test_a_batch_without_a_reference_point_is_refused(tiny_model, tokenizer):
    out = _tokenize(tokenizer, uneven_unpaired_rows(3, seed=1))
    batch: Batch = collate_unpaired(out.examples, tokenizer.pad_token_id, range(3))
    with pytest.raises(ValueError, match="needs ref_logps, kl_baseline and desirable"):
        KTOObjective().loss(_fp64_model(tiny_model), batch)
