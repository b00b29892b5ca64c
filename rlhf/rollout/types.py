"""What every rollout backend takes and returns (the engine behind them is vLLM today, ``rollout.backend``): a
request's sampling (:class:`SamplingSpec`) and one sampled completion with its per-token log-probs
(:class:`Generation`). Nothing here imports an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class SamplingSpec:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0  # 1: off. The trainer must score with SamplingFilter(top_k, top_p) (TokenLogps, PolicyObjective)
    top_k: int = -1  # -1 or 0: off
    seed: Optional[int] = None  # per-request seed base: request i uses seed + i (reproducible rollouts)
    stop_token_ids: Tuple[int, ...] = ()


@dataclass(frozen=True)
class Generation:
    """One sampled completion. ``response_logps[i]`` is the sampling log-prob of ``response_ids[i]``."""

    prompt_ids: Tuple[int, ...]
    response_ids: Tuple[int, ...]
    response_logps: Tuple[float, ...]
    finish_reason: str  # "stop" (EOS / stop token) or "length" (hit max_new_tokens)
