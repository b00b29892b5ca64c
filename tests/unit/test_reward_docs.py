"""The examples of docs/rewards.md run as the page says, through the run's own scorer: names by position, columns by
name (``answers`` takes ``answer``), an optional column's default, a tensor result, weights summed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlhf.rewards.functions import RewardFunctionScorer

PAGE = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


@pytest.fixture
def examples(tmp_path) -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    path = tmp_path / "rewards.py"
    path.write_text("\n\n".join(blocks))
    return str(path)


def test_the_pages_examples_score_as_it_says(examples):
    prompts, responses = ["2+3=", "1+1="], ["5", " 3 "]
    columns = {"answer": ["5", "2"]}
    specs = (
        f"{examples}:correct",
        f"{examples}:concise@0.1",
        f"{examples}:weighted_correct",
        f"{examples}:length_in_range",
    )
    total, by_function = RewardFunctionScorer(specs)(prompts, responses, columns)
    assert by_function[f"{examples}:correct"].tolist() == [1.0, 0.0]
    assert by_function[f"{examples}:concise"].tolist() == pytest.approx([-0.01, -0.03])  # logged unweighted
    assert by_function[f"{examples}:weighted_correct"].tolist() == [1.0, 0.0]  # difficulty: its default
    assert by_function[f"{examples}:length_in_range"].tolist() == [0.0, 1.0]
    assert total.tolist() == pytest.approx([1.0 - 0.001 + 1.0 + 0.0, 0.0 - 0.003 + 0.0 + 1.0])
    with_difficulty = {**columns, "difficulty": [2.0, 1.0]}
    _, by_function = RewardFunctionScorer((f"{examples}:weighted_correct",))(prompts, responses, with_difficulty)
    assert by_function[f"{examples}:weighted_correct"].tolist() == [2.0, 0.0]
