"""Long-tailed synthetic SFT rows and preference pairs, for packing and token-budget benchmarks.

Real instruction data is long-tailed: most rows are short, a few are ten times the median. Padding every
micro-batch to its longest row then wastes most of the compute, which is what sequence packing and a per-micro-batch
token budget recover. The arithmetic task (:mod:`rlhf.synthetic.arithmetic`) has rows of 5-10 tokens; this module
makes rows whose *token* lengths follow a clipped log-normal distribution (default: median 80, p99 ~ 8x the median,
clipped to 16..1024 tokens), deterministic in a seed.

Lengths are exact for the project's tiny tokenizer (:func:`rlhf.models.tiny.build_tokenizer`): every text here is
made only of digits, ``+``, ``=`` and single spaces between them, and that tokenizer's pre-tokenizer (Qwen's regex)
splits each digit, each single space and each operator into its own token, with no merge across them. So a text
costs exactly ``len(text)`` tokens, and a row ``prompt + response + EOS`` costs ``len(prompt) + len(response) + 1``
(the data pipeline appends EOS and adds no BOS). :func:`token_length` states this in one place.

Pure Python (no torch, no transformers): importable anywhere, and cheap enough for unit tests.

    python -m rlhf.synthetic.long_tail OUT_DIR [--rows 2048] [--seed 0] [--median 80] [--sigma 1.0]

writes ``OUT_DIR/sft.jsonl`` and ``OUT_DIR/pairs.jsonl`` and prints their length reports.
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import random
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from rlhf.synthetic.arithmetic import write_jsonl

# Tokens the data pipeline adds to a row besides its text: the EOS after the response (add_eos=True).
EOS_TOKENS = 1
# Shortest prompt this module writes: "a+b=" with one-digit operands.
MIN_PROMPT_TOKENS = 4
# Shortest response: the answer (at least one digit).
MIN_RESPONSE_TOKENS = 1


@dataclass(frozen=True)
class LengthSpec:
    """A clipped log-normal distribution of row lengths, in tokens (prompt + response + EOS).

    Args:
        median: The log-normal's median (``exp(mu)``); clipping at ``min_tokens`` / ``max_tokens`` barely moves it.
        sigma: Shape (std of ``log(length)``). 1.0 gives p99 / p50 ~ 10 before clipping, 0.0 gives constant rows.
        min_tokens, max_tokens: Every length is clipped into ``[min_tokens, max_tokens]``.
        prompt_share: ``(low, high)``: a row's prompt takes a uniform share of it in this range (at least the
            4-token ``a+b=``); the response (answer first) and EOS take the rest.
    """

    median: float = 80.0
    sigma: float = 1.0
    min_tokens: int = 16
    max_tokens: int = 1024
    prompt_share: tuple = (0.1, 0.5)

    def __post_init__(self) -> None:
        if self.min_tokens < MIN_PROMPT_TOKENS + MIN_RESPONSE_TOKENS + EOS_TOKENS + 2:
            raise ValueError(
                f"min_tokens must be >= {MIN_PROMPT_TOKENS + MIN_RESPONSE_TOKENS + EOS_TOKENS + 2} "
                f"(a prompt, an answer and EOS), got {self.min_tokens}"
            )
        if self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens {self.max_tokens} < min_tokens {self.min_tokens}")
        if not (self.median > 0 and self.sigma >= 0):
            raise ValueError(f"median must be > 0 and sigma >= 0, got median={self.median} sigma={self.sigma}")
        low, high = self.prompt_share
        if not 0.0 <= low <= high < 1.0:
            raise ValueError(f"prompt_share must be (low, high) with 0 <= low <= high < 1, got {self.prompt_share}")


UNIFORM_72 = LengthSpec(median=72, sigma=0.0, min_tokens=72, max_tokens=72, prompt_share=(0.08, 0.08))


def sample_lengths(n: int, seed: int, spec: LengthSpec = LengthSpec()) -> List[int]:
    """``n`` row lengths (tokens) drawn from ``spec``, deterministic in ``seed``."""
    rng = random.Random(seed)
    mu = math.log(spec.median)
    return [
        min(spec.max_tokens, max(spec.min_tokens, int(round(rng.lognormvariate(mu, spec.sigma))))) for _ in range(n)
    ]


def token_length(text: str) -> int:
    """Tokens the tiny tokenizer spends on a text written by this module: one per character (module docstring)."""
    return len(text)


def row_tokens(row: Mapping[str, str], response_key: str = "response") -> int:
    """Tokens of a row as the SFT pipeline tokenizes it: prompt + response + EOS. For a pair, pass
    ``response_key="chosen"`` or ``"rejected"``."""
    return token_length(row["prompt"]) + token_length(row[response_key]) + EOS_TOKENS


def _digits(rng: random.Random, tokens: int) -> str:
    """Exactly ``tokens`` characters of single digits separated by single spaces (``"3 1 4"``), starting and
    ending with a digit; ``tokens`` even ends with a two-digit group (``"3 1 41"``) so no space is doubled."""
    if tokens <= 0:
        return ""
    out: List[str] = []
    while tokens > 0:
        if out:
            out.append(" ")
            tokens -= 1
        take = 2 if tokens == 2 else 1
        out.append("".join(str(rng.randrange(10)) for _ in range(take)))
        tokens -= take
    return "".join(out)


def _split(rng: random.Random, total: int, spec: LengthSpec) -> tuple:
    """(prompt tokens, response tokens) for a row of ``total`` tokens including EOS."""
    text = total - EOS_TOKENS
    share = rng.uniform(*spec.prompt_share)
    prompt = max(MIN_PROMPT_TOKENS, int(round(text * share)))
    prompt = min(prompt, text - MIN_RESPONSE_TOKENS)
    return prompt, text - prompt


def _prompt(rng: random.Random, tokens: int) -> tuple:
    """A prompt of exactly ``tokens`` tokens ending with ``a+b=`` (one-digit operands); returns (text, a + b).
    Longer prompts put digit "context" first: ``"7 0 2 5+3="``."""
    a, b = rng.randrange(10), rng.randrange(10)
    question = f"{a}+{b}="
    context = tokens - len(question)
    if context <= 0:
        return question, a + b
    if context == 1:  # a single extra token cannot be "<digit> ": widen an operand instead ("12+3=")
        a = rng.randrange(10, 100)
        return f"{a}+{b}=", a + b
    return _digits(rng, context - 1) + " " + question, a + b


def _response(rng: random.Random, tokens: int, answer: int) -> str:
    """``tokens`` tokens: the answer, then digit filler (``"8 4 0 9"``)."""
    head = str(answer)
    if tokens <= len(head):
        return head[:tokens] if tokens > 0 else ""
    rest = tokens - len(head)
    if rest == 1:  # no room for " d": append a digit to the answer instead
        return head + str(rng.randrange(10))
    return head + " " + _digits(rng, rest - 1)


def make_sft_rows(n: int, seed: int, spec: LengthSpec = LengthSpec()) -> List[Dict[str, str]]:
    """``n`` rows ``{"prompt", "response"}`` whose token lengths (prompt + response + EOS) follow ``spec``.

    The lengths are exactly :func:`sample_lengths` ``(n, seed, spec)``, in order.
    """
    rng = random.Random(f"long-tail-sft-{seed}")
    rows = []
    for total in sample_lengths(n, seed, spec):
        prompt_tokens, response_tokens = _split(rng, total, spec)
        prompt, answer = _prompt(rng, prompt_tokens)
        rows.append({"prompt": prompt, "response": _response(rng, response_tokens, answer)})
    return rows


def make_preference_rows(n: int, seed: int, spec: LengthSpec = LengthSpec()) -> List[Dict[str, str]]:
    """``n`` pairs ``{"prompt", "chosen", "rejected"}``: a shared prompt; chosen starts with the right answer,
    rejected with a wrong one. Each side's length (prompt + side + EOS) is its own draw from ``spec``: the chosen
    sides' lengths are :func:`sample_lengths` ``(n, seed, spec)``, the rejected ones ``(n, seed + 1, spec)``,
    except that a side shorter than the shared prompt needs is lengthened to it (rare: prompts take a share of the
    shorter side)."""
    rng = random.Random(f"long-tail-pairs-{seed}")
    rows = []
    for chosen_total, rejected_total in zip(sample_lengths(n, seed, spec), sample_lengths(n, seed + 1, spec)):
        prompt_tokens, _ = _split(rng, min(chosen_total, rejected_total), spec)
        prompt, answer = _prompt(rng, prompt_tokens)
        wrong = answer + rng.choice((-2, -1, 1, 2)) if answer >= 2 else answer + rng.choice((1, 2))
        rows.append(
            {
                "prompt": prompt,
                "chosen": _response(rng, max(MIN_RESPONSE_TOKENS, chosen_total - EOS_TOKENS - len(prompt)), answer),
                "rejected": _response(rng, max(MIN_RESPONSE_TOKENS, rejected_total - EOS_TOKENS - len(prompt)), wrong),
            }
        )
    return rows


def sft_lengths(rows: Sequence[Mapping[str, str]]) -> List[int]:
    """Token lengths (prompt + response + EOS) of SFT rows."""
    return [row_tokens(r) for r in rows]


def pair_lengths(rows: Sequence[Mapping[str, str]]) -> List[int]:
    """Token lengths of every side of every pair: chosen then rejected, row by row."""
    return [row_tokens(r, side) for r in rows for side in ("chosen", "rejected")]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, by linear interpolation (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def length_report(lengths: Sequence[int], edges: Optional[Sequence[int]] = None) -> dict:
    """Summary of token lengths: count, mean, min/max, percentiles p10..p99, the tail ratio p99/p50, the share
    of all tokens held by the longest 10% of rows, and a histogram over ``edges`` (default powers of two:
    ``[16, 32), [32, 64), ...``) as ``{"lo-hi": count}``."""
    values = sorted(lengths)
    if not values:
        raise ValueError("length_report of no lengths")
    edges = list(edges) if edges is not None else [2**k for k in range(0, 21)]
    hist: Dict[str, int] = {}
    for v in values:
        i = bisect.bisect_right(edges, v) - 1
        key = (
            f"{edges[i]}-{edges[i + 1] - 1}"
            if 0 <= i < len(edges) - 1
            else (f">={edges[-1]}" if i >= 0 else f"<{edges[0]}")
        )
        hist[key] = hist.get(key, 0) + 1
    total = sum(values)
    top = values[len(values) - max(1, len(values) // 10) :]
    p = {f"p{q}": percentile(values, q) for q in (10, 25, 50, 75, 90, 95, 99)}
    return {
        "count": len(values),
        "tokens": total,
        "mean": total / len(values),
        "min": values[0],
        "max": values[-1],
        **p,
        "p99_over_p50": p["p99"] / p["p50"],
        "top10pct_token_share": sum(top) / total,
        "histogram": hist,
    }


def format_report(report: dict, title: str = "lengths") -> str:
    """A few printable lines of :func:`length_report`, with a text bar per histogram bin."""
    r = report
    lines = [
        f"{title}: {r['count']} rows, {r['tokens']} tokens, mean {r['mean']:.1f}, min {r['min']}, "
        f"p10 {r['p10']:.0f}, p50 {r['p50']:.0f}, p90 {r['p90']:.0f}, p99 {r['p99']:.0f}, max {r['max']}; "
        f"p99/p50 {r['p99_over_p50']:.1f}; longest 10% of rows hold {100 * r['top10pct_token_share']:.0f}% "
        f"of the tokens"
    ]
    peak = max(r["histogram"].values())
    for key, count in r["histogram"].items():
        lines.append(f"  {key:>10} {count:6d} {'#' * max(1, round(40 * count / peak))}")
    return "\n".join(lines)


def write_datasets(out_dir: str, n: int, seed: int, spec: LengthSpec = LengthSpec()) -> Dict[str, str]:
    """``out_dir/sft.jsonl`` and ``out_dir/pairs.jsonl`` (``n`` rows each); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    return {
        "sft": write_jsonl(os.path.join(out_dir, "sft.jsonl"), make_sft_rows(n, seed, spec)),
        "pairs": write_jsonl(os.path.join(out_dir, "pairs.jsonl"), make_preference_rows(n, seed, spec)),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Write long-tailed synthetic SFT rows and preference pairs (JSONL).")
    ap.add_argument("out_dir")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--median", type=float, default=LengthSpec.median)
    ap.add_argument("--sigma", type=float, default=LengthSpec.sigma)
    ap.add_argument("--min-tokens", type=int, default=LengthSpec.min_tokens)
    ap.add_argument("--max-tokens", type=int, default=LengthSpec.max_tokens)
    args = ap.parse_args(argv)
    spec = LengthSpec(median=args.median, sigma=args.sigma, min_tokens=args.min_tokens, max_tokens=args.max_tokens)
    paths = write_datasets(args.out_dir, args.rows, args.seed, spec)
    print(format_report(length_report(sft_lengths(make_sft_rows(args.rows, args.seed, spec))), paths["sft"]))
    print(format_report(length_report(pair_lengths(make_preference_rows(args.rows, args.seed, spec))), paths["pairs"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
