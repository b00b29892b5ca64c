"""Rollouts a step assembles from more than one generation: dynamic sampling's draws and a partial rollout's two
halves (rlhf.trainers.online.steps calls them; the stages that stay one generation live there).

* :func:`draw_until_varied`: DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2).
* :func:`partial_single_turn`: partial rollouts (``rollout.partial_rollout_tokens``), a response's first tokens with
  one version of the weights and the rest with the next.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Tuple

import torch

from rlhf.config.rl_schema import RolloutConfig
from rlhf.data.plan import StepPlan
from rlhf.ops.dapo import failed_groups, filter_values, pick_groups, varied_groups
from rlhf.ops.failures import counted
from rlhf.rollout.prompts import PromptSet
from rlhf.rollout.sources import Rollout, continued, single_turn_of, spanned_versions
from rlhf.rollout.types import SamplingSpec
from rlhf.trainers.online.schedule import Pause

CONTINUATION_SEED_BASE = 1 << 43  # partial rollouts: the rest of a response, after the weights changed


def draw_until_varied(
    first: Rollout,
    step: StepPlan,
    r: RolloutConfig,
    num_prompts: int,
    sample: Callable[[List[int], int], Rollout],
    score: Callable[[Rollout], Tuple],
    seed_base: Callable[[int], int],
    pad_id: int,
) -> Rollout:
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2, eq. 11): draws of ``rollout.prompts_per_step`` more
    prompts until the step holds that many varied groups (``rollout.dynamic_sampling_draws`` draws at most), then
    the first such groups in draw order, filled with tied ones if the draws ran out
    (:func:`rlhf.ops.dapo.pick_groups`): the batch keeps its size. A group is varied when its samples differ in
    ``rollout.dynamic_sampling_metric`` (:func:`rlhf.ops.dapo.filter_values`; accuracy by default, as the paper:
    ``0 < #correct < G``) and none of them failed (a failed sample's placeholder is no reward).

    Draw ``d`` takes prompts the step has not drawn yet, in the order of a permutation seeded by ``seed_base(d)``
    (the run's seed, the step and ``d``), and samples them with seeds of their own (``sample(prompt_index,
    seed_base(d))``): a step's samples depend on its number and its weights alone, as without dynamic sampling
    (rollout.max_staleness and resume stay exact). Each draw is scored here, once (``Rollout.scored``).

    Args:
        first: the step's own samples (draw 0: the plan's prompts, ``n_samples_per_prompt`` each, in groups).
        num_prompts: how many prompts the data has (draws take from all of them).
        score: ``(scores (B,), per-source scores)`` of a rollout.
    """
    n = r.n_samples_per_prompt
    draws, varied, failed, found = [first], [], [], 0
    drawn = set(step.indices)
    while True:
        draws[-1].scored = score(draws[-1])
        real = counted(draws[-1].failures(), len(draws[-1].prompt_index))  # placeholders are no rewards
        failed.append(failed_groups(~real, n))  # never varied (rlhf.ops.failures)
        values = filter_values(r.dynamic_sampling_metric, *draws[-1].scored, real)
        varied.append(varied_groups(values, n) & ~failed[-1])  # this draw's; the earlier ones' are kept
        found += int(varied[-1].sum())
        if found >= r.prompts_per_step or len(draws) > r.dynamic_sampling_draws:
            break
        indices = fresh_prompts(num_prompts, r.prompts_per_step, drawn, seed_base(len(draws)))
        if not indices:  # every prompt of the data is in this step already
            break
        drawn.update(indices)
        draws.append(sample([i for i in indices for _ in range(n)], seed_base(len(draws))))
    picked, tied = pick_groups(varied, r.prompts_per_step, failed)
    starts = [sum(len(d.prompt_index) for d in draws[:k]) for k in range(len(draws))]
    rows = [starts[d] + g * n + j for d, g in picked for j in range(n)]
    rollout = Rollout.concat(draws, pad_id).select(rows)
    for key in {k for d in draws for k in d.metrics if k.startswith("reward/")}:  # every draw's scoring counts
        rollout.metrics[key] = sum(d.metrics.get(key, 0.0) for d in draws)
    rollout.metrics.update(
        {
            "dynamic/draws": float(len(draws) - 1),
            "dynamic/varied_groups": float(found),
            "dynamic/tied_groups_in_batch": float(tied),
            "dynamic/samples_generated": float(starts[-1] + len(draws[-1].prompt_index)),
        }
    )
    return rollout


def fresh_prompts(num_prompts: int, wanted: int, drawn: set, seed: int) -> List[int]:
    """Up to ``wanted`` prompt indices not in ``drawn``, in the order of a permutation seeded by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_prompts, generator=generator).tolist()
    return [i for i in order if i not in drawn][:wanted]


def partial_single_turn(
    engines,
    tokenizer,
    prompts: PromptSet,
    prompt_index: List[int],
    sampling: SamplingSpec,
    r: RolloutConfig,
    pause: Pause,
    version: int,
) -> Rollout:
    """Partial rollouts (``rollout.partial_rollout_tokens = c``): every response's first ``c`` tokens with the
    engines' weights (``version``), then ``pause()`` until the next version's weights land, then the rest of each
    response not yet ended, continued from its prompt and first tokens with the new weights and seeds of their own
    (``sampling.seed + CONTINUATION_SEED_BASE``). A response thus spans versions ``version`` and ``version + 1``,
    recorded per token (``Rollout.token_versions``); its sampling log-probs are each token's own version's."""
    first = engines.generate(
        [prompts.prompt_ids[i] for i in prompt_index],
        dataclasses.replace(sampling, max_new_tokens=r.partial_rollout_tokens),
    )
    pause()  # the weight sync of the step training now waits for this point only
    going = [j for j, g in enumerate(first) if g.finish_reason == "length"]
    rest = (
        engines.generate(
            [tuple(first[j].prompt_ids) + tuple(first[j].response_ids) for j in going],
            dataclasses.replace(
                sampling,
                max_new_tokens=r.max_new_tokens - r.partial_rollout_tokens,
                seed=None if sampling.seed is None else sampling.seed + CONTINUATION_SEED_BASE,
            ),
        )
        if going
        else []
    )
    whole = continued(first, going, rest)
    rollout = single_turn_of(whole, tokenizer, prompt_index)
    rollout.token_versions = spanned_versions(first, whole, rollout.batch.input_ids.shape, version)
    return rollout
