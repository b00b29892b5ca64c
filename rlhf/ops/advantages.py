"""Advantage estimators for policy-gradient RLHF: GAE, GRPO, Dr. GRPO, RLOO, REINFORCE++ (and its baseline form).

Every estimator is a function ``fn(inputs: AdvantageInputs) -> (advantages (B, T), returns (B, T))`` in
:data:`ADVANTAGE_ESTIMATORS`. They run on the driver over the WHOLE rollout batch: the statistics they normalize
with (group means and standard deviations, batch whitening) are properties of the rollout batch and must never be
recomputed per micro-batch, or the same sample would get a different advantage depending on its neighbours.

Conventions (see :mod:`rlhf.batch`): rows are samples, columns are ``input_ids`` columns, padding is on the
right, and ``response_mask[b, t] == 1`` marks the response tokens (the actions). Only those tokens are time steps
of the MDP: prompt tokens, padding and any hole in the mask (e.g. tool output in a multi-turn rollout) are skipped,
carrying no reward, value or discount; the step after the last response token is terminal (value 0). Outputs are
exactly 0 at every position outside ``response_mask`` whatever the inputs hold there (even inf/NaN), and are
detached (advantages are constants of the policy-gradient loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from rlhf.registry import Registry

Tensor = torch.Tensor


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an advantage estimator may read; each estimator documents which fields it uses.

    Attributes:
        token_rewards: ``(B, T)`` per-token rewards: the per-token KL penalty plus the sequence score at the last
            response token, as built by :func:`token_level_rewards`. Used by ``gae`` and the REINFORCE++ family.
        scores: ``(B,)`` sequence rewards (reward model or verifier), without any KL term. Used by the group
            estimators.
        response_mask: ``(B, T)`` 0/1 (or bool), 1 on response tokens.
        values: ``(B, T)`` critic values, ``values[b, t]`` being ``V`` of the state in which response token ``t``
            is generated (aligned with the token like the log-probs). Required by ``gae`` only.
        group_ids: ``(B,)`` integer id of each sample's prompt; the ``n_samples_per_prompt`` samples of a prompt
            share an id (ids need not be contiguous or sorted). Every group must be complete in the batch.
            Required by ``grpo``, ``dr_grpo``, ``rloo`` and ``reinforce_pp_baseline``.
        gamma: discount factor in ``[0, 1]`` (per response token).
        lam: GAE ``lambda`` in ``[0, 1]``.
        eps: added to the group standard deviation in ``grpo`` (verl's default, 1e-6).
    """

    token_rewards: Tensor
    scores: Tensor
    response_mask: Tensor
    values: Optional[Tensor] = None
    group_ids: Optional[Tensor] = None
    gamma: float = 1.0
    lam: float = 1.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        shape = tuple(self.response_mask.shape)
        if len(shape) != 2:
            raise ValueError(f"response_mask must be (B, T), got shape {shape}")
        if tuple(self.token_rewards.shape) != shape:
            raise ValueError(f"token_rewards shape {tuple(self.token_rewards.shape)} != response_mask {shape}")
        if self.values is not None and tuple(self.values.shape) != shape:
            raise ValueError(f"values shape {tuple(self.values.shape)} != response_mask {shape}")
        if tuple(self.scores.shape) != shape[:1]:
            raise ValueError(f"scores must be (B,) = {shape[:1]}, got {tuple(self.scores.shape)}")
        if self.group_ids is not None:
            if tuple(self.group_ids.shape) != shape[:1]:
                raise ValueError(f"group_ids must be (B,) = {shape[:1]}, got {tuple(self.group_ids.shape)}")
            if self.group_ids.is_floating_point() or self.group_ids.is_complex():
                raise ValueError(f"group_ids must be integers, got dtype {self.group_ids.dtype}")
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")


AdvantageFn = Callable[[AdvantageInputs], Tuple[Tensor, Tensor]]

# What an estimator reads of AdvantageInputs besides the mask (Estimator.reads).
TOKEN_REWARDS, SCORES = "token_rewards", "scores"


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: its maths and every fact the rest of the project needs about it. Config validation,
    :func:`rlhf.ops.batch_advantages.advantages_for`, ``--dry-run``, the audit lint and docs/algorithms read these
    fields; no other list of estimator names exists, so a new estimator is one entry plus its maths.

    Attributes:
        fn: the maths, ``AdvantageInputs -> (advantages (B, T), returns (B, T))``.
        paper: the paper it follows (and where).
        reads: which rewards it reads: ``token_rewards`` (a KL penalty in the reward enters per token),
            ``scores`` (sequence rewards only: a KL penalty enters as its sum over the response, subtracted from the
            score before any group statistic), or both (the score is the group baseline's, the KL per token).
        needs_group_ids: compares the samples of one prompt (``rollout.n_samples_per_prompt >= 2``).
        needs_critic: reads ``values`` (a critic is trained next to the policy).
        aggregation: the loss aggregation of its paper (``algo.loss_agg_mode=auto``).
        paper_kl: how its paper regularises towards the reference (said in the docs and ``--dry-run``).
    """

    fn: AdvantageFn
    paper: str
    reads: Tuple[str, ...]
    needs_group_ids: bool
    needs_critic: bool
    aggregation: str
    paper_kl: str

    def __post_init__(self) -> None:
        if not self.reads or set(self.reads) - {TOKEN_REWARDS, SCORES}:
            raise ValueError(f"Estimator.reads must name {TOKEN_REWARDS!r} and/or {SCORES!r}, got {self.reads}")

    @property
    def kl_in_reward(self) -> str:
        """Where ``algo.kl_mode=reward`` puts the KL penalty: ``per token`` or ``per sequence`` (summed)."""
        return "per token" if TOKEN_REWARDS in self.reads else "per sequence"


ADVANTAGE_ESTIMATORS = Registry[Estimator]("advantage estimator")


def _estimator(name: str, **facts) -> Callable[[AdvantageFn], AdvantageFn]:
    """Registers the decorated function as estimator ``name`` with its :class:`Estimator` facts."""
    return ADVANTAGE_ESTIMATORS.register_entry(name, lambda fn: Estimator(fn=fn, **facts))


def compute_advantages(name: str, inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """Estimator ``name``'s maths: ``(advantages (B, T), returns (B, T))``."""
    return ADVANTAGE_ESTIMATORS.get(name).fn(inputs)


# ------------------------------------------------------------------------------------------------ helpers
def _float_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """float64 if any input is float64, else float32 (half-precision inputs are upcast)."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in tensors) else torch.float32


def _clean(x: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype`` on the mask and exactly 0 elsewhere (padding may hold inf/NaN)."""
    return torch.where(mask, x.detach().to(dtype), torch.zeros((), dtype=dtype, device=x.device))


def _last_token_index(mask: Tensor) -> Tensor:
    """``(B,)`` column of each row's last masked token; -1 for a row without any."""
    cols = torch.arange(-1, mask.shape[-1], device=mask.device)  # a leading -1 column for empty rows
    return torch.where(torch.nn.functional.pad(mask, (1, 0), value=True), cols, -1).amax(-1)


def token_level_rewards(
    scores: Tensor,
    response_mask: Tensor,
    kl: Optional[Tensor],
    kl_coef: float,
    turn_rewards: Optional[Tensor] = None,
) -> Tensor:
    """Per-token rewards ``r[b, t] = -kl_coef * kl[b, t]`` on response tokens, plus ``scores[b]`` at the row's last
    response token (Ziegler et al. 2019; Ouyang et al. 2022, eq. 2, with the KL penalty spread over tokens).

    With ``turn_rewards`` (multi-turn per-turn credit), the part of each score that an environment gave turn by turn
    sits at each turn's own last policy token instead: ``r[b, t] += turn_rewards[b, t]`` and the last token gets
    ``scores[b] - sum_t turn_rewards[b, t]``. A row's rewards still sum to its score (minus the KL penalty); only
    where they enter changes, so a discounted or bootstrapped estimator (GAE, REINFORCE++) credits each turn with
    what followed it rather than with the episode's end.

    Args:
        scores: ``(B,)`` sequence rewards.
        response_mask: ``(B, T)`` 0/1 or bool, 1 on response tokens.
        kl: ``(B, T)`` per-token KL estimates (e.g. :func:`rlhf.ops.kl.kl_estimate` ``"k1"``), or ``None`` for no
            penalty. Values outside the mask are ignored (even inf/NaN).
        kl_coef: the penalty coefficient ``beta`` (>= 0; ignored when ``kl`` is None).
        turn_rewards: ``(B, T)`` or ``None``: rewards already part of ``scores``, each at the token that earns it
            (a turn's last policy token); nonzero only on response tokens.

    Returns:
        ``(B, T)`` detached rewards in at least float32, 0 outside the mask. A row with no response token has
        nowhere to receive its score: it is all zeros (its score is dropped).
    """
    if response_mask.dim() != 2 or tuple(scores.shape) != tuple(response_mask.shape[:1]):
        raise ValueError(
            f"need scores (B,) and response_mask (B, T); got {tuple(scores.shape)} and {tuple(response_mask.shape)}"
        )
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    mask = response_mask != 0
    dtype = _float_dtype(scores, kl)
    rewards = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    if kl is not None:
        if kl.shape != mask.shape:
            raise ValueError(f"kl shape {tuple(kl.shape)} != response_mask {tuple(mask.shape)}")
        if kl_coef != 0:
            rewards = -kl_coef * _clean(kl, mask, dtype)
    scores = scores.detach().to(dtype)
    if turn_rewards is not None:
        if turn_rewards.shape != mask.shape:
            raise ValueError(f"turn_rewards shape {tuple(turn_rewards.shape)} != response_mask {tuple(mask.shape)}")
        placed = turn_rewards.detach().to(dtype)
        if bool((placed[~mask] != 0).any()):
            raise ValueError("turn_rewards must be 0 outside the response mask (a turn's reward sits on its tokens)")
        rewards = rewards + placed
        scores = scores - placed.sum(-1)
    last = _last_token_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += scores[rows]
    return rewards


def _reverse_scan(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """GAE over the masked tokens of each row, skipping unmasked columns; ``rewards``/``values`` are clean.

    ``delta_t = r_t + gamma V_next - V_t`` and ``A_t = delta_t + gamma lam A_next``, where ``next`` is the row's
    next masked token, and ``V_next = A_next = 0`` after its last one. With ``values = 0, lam = 1`` this is the
    discounted return-to-go. Loops over the columns (vectorized over rows), visiting only columns where some row
    has a masked token.
    """
    out = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_adv = rewards.new_zeros(rewards.shape[0])
    active = torch.nonzero(mask.any(0)).squeeze(-1).tolist()
    for t in reversed(active):
        m = mask[:, t]
        adv = rewards[:, t] + gamma * next_value - values[:, t] + (gamma * lam) * next_adv
        out[:, t] = torch.where(m, adv, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv, next_adv)
    return out


def whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize ``values`` by the mean and standard deviation of ALL masked entries (the whole batch at once).

    ``mu = sum(mask * x) / N``, ``var = sum(mask * (x - mu)^2) / N`` with ``N`` the number of masked entries
    (the population variance, no Bessel correction), and the output is ``(x - mu) / sqrt(var + eps)``, or
    ``x / sqrt(var + eps)`` with ``shift_mean=False`` (a pure rescaling, which keeps the sign of each value).

    Departures: verl's ``masked_whiten`` uses the Bessel-corrected variance (a factor ``sqrt(N / (N - 1))``,
    negligible over the thousands of tokens of a rollout batch), and with ``shift_mean=False`` adds the mean back
    unscaled, ``(x - mu) / sigma + mu``; here the population variance makes the whitened entries have exactly
    mean 0 and variance ``var / (var + eps)``, and is defined for ``N = 1``.

    Statistics are accumulated in float64. Call this on the whole rollout batch, never per micro-batch.

    Args:
        values: ``(B, T)`` values to normalize.
        mask: ``(B, T)`` 0/1 or bool, 1 on entries that count (entries outside are ignored even if inf/NaN).
        shift_mean: subtract the mean (True) or only divide by the standard deviation (False).
        eps: added to the variance.

    Returns:
        ``(B, T)`` detached, in at least float32, 0 outside the mask.

    Raises:
        ValueError: if the mask selects no entry (there is nothing to take statistics of).
    """
    if values.shape != mask.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(values.shape)}")
    m = mask != 0
    n = int(m.sum())
    if n == 0:
        raise ValueError("whiten: the mask selects no entries")
    x = _clean(values, m, torch.float64)
    mean = x.sum() / n
    var = torch.where(m, x - mean, 0.0).square().sum() / n
    out = (x - mean if shift_mean else x) * torch.rsqrt(var + eps)
    return torch.where(m, out, 0.0).to(_float_dtype(values))


def _group_stats(scores: Tensor, group_ids: Optional[Tensor], name: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample ``(group size, group sum, group sum of squared deviations from the group mean, constant)``,
    float64, where ``constant`` is True when all scores of the group are equal (including a group of one).

    ``constant`` is decided by comparing the group's max and min exactly: the float mean of equal scores is not
    always that score (``(0.1 + 0.1 + 0.1) / 3 != 0.1``), so ``s - mean`` and the std would be rounding noise of
    the same size, and their ratio an advantage of order 1 out of nothing."""
    if group_ids is None:
        raise ValueError(f"advantage estimator {name!r} needs group_ids (samples of one prompt share an id)")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    s = scores.detach().to(torch.float64)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    size = torch.zeros(groups, dtype=torch.float64, device=s.device).index_add_(0, inverse, torch.ones_like(s))
    total = torch.zeros_like(size).index_add_(0, inverse, s)
    mean = total / size
    sq_dev = torch.zeros_like(size).index_add_(0, inverse, (s - mean[inverse]).square())
    high = torch.full_like(size, -torch.inf).scatter_reduce_(0, inverse, s, "amax")
    low = torch.full_like(size, torch.inf).scatter_reduce_(0, inverse, s, "amin")
    return size[inverse], total[inverse], sq_dev[inverse], (high == low)[inverse]


def _broadcast(per_sample: Tensor, inputs: AdvantageInputs) -> Tensor:
    """A ``(B,)`` per-sample advantage on every response token of its row, 0 elsewhere."""
    mask = inputs.response_mask != 0
    dtype = _float_dtype(inputs.scores)
    return torch.where(mask, per_sample.to(dtype)[:, None], torch.zeros((), dtype=dtype, device=mask.device))


# ------------------------------------------------------------------------------------------------ estimators
@_estimator(
    "gae",
    paper="Schulman et al. 2016 (GAE), with PPO (Schulman et al. 2017) as in InstructGPT (Ouyang et al. 2022)",
    reads=(TOKEN_REWARDS,),
    needs_group_ids=False,
    needs_critic=True,
    aggregation="token-mean",
    paper_kl="a per-token KL penalty in the reward (InstructGPT eq. 2): algo.kl_mode=reward, k1",
)
def gae(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, "High-dimensional continuous control using
    generalized advantage estimation", eq. 16) over the response tokens.

    ``delta_t = r_t + gamma V_{t'} - V_t``, ``A_t = delta_t + gamma lam A_{t'}`` with ``t'`` the next response
    token of the row and ``V = A = 0`` after the last one (the episode ends there; a truncated response is also
    bootstrapped with 0, as in OpenRLHF and verl). Returns are ``A_t + V_t``, the ``TD(lambda)`` targets of the
    value loss.

    Uses ``token_rewards``, ``values``, ``response_mask``, ``gamma``, ``lam``.
    """
    if inputs.values is None:
        raise ValueError("advantage estimator 'gae' needs values (B, T) from the critic")
    mask = inputs.response_mask != 0
    dtype = _float_dtype(inputs.token_rewards, inputs.values)
    rewards = _clean(inputs.token_rewards, mask, dtype)
    values = _clean(inputs.values, mask, dtype)
    advantages = _reverse_scan(rewards, values, mask, inputs.gamma, inputs.lam)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


@_estimator(
    "grpo",
    paper="Shao et al. 2024 (DeepSeekMath), sec. 4.1",
    reads=(SCORES,),
    needs_group_ids=True,
    needs_critic=False,
    aggregation="seq-mean-token-mean",
    paper_kl="a k3 KL loss next to the policy loss (eq. 3-4): algo.kl_mode=loss, k3",
)
def grpo(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """GRPO outcome supervision (Shao et al. 2024, DeepSeekMath, sec. 4.1.2): ``(s_i - mean_g) / (std_g + eps)``
    over the samples of the prompt's group, the same value on every response token.

    The standard deviation is the Bessel-corrected one (``1 / (n - 1)``), which is what ``torch.std`` computes
    and verl uses; the paper does not say. A group of size 1 has no spread to normalize by and gets advantage 0,
    as does any group whose scores are all equal (exactly 0, also with ``eps = 0``). ``token_rewards`` is not
    used: the paper's KL is a loss (its ``k3`` term); a KL penalty in the reward reaches GRPO through the scores
    (:func:`rlhf.ops.batch_advantages.advantages_for` subtracts its sum over the response). Returns equal the
    advantages (there is no critic).

    Uses ``scores``, ``group_ids``, ``response_mask``, ``eps``.
    """
    size, total, sq_dev, constant = _group_stats(inputs.scores, inputs.group_ids, "grpo")
    s = inputs.scores.detach().to(torch.float64)
    std = torch.sqrt(sq_dev / (size - 1).clamp(min=1))
    adv = torch.where(constant, 0.0, (s - total / size) / (std + inputs.eps))
    out = _broadcast(adv, inputs)
    return out, out.clone()


@_estimator(
    "dr_grpo",
    paper="Liu et al. 2025 (Understanding R1-Zero-like training), sec. 3.2",
    reads=(SCORES,),
    needs_group_ids=True,
    needs_critic=False,
    aggregation="seq-mean-token-sum-norm",
    paper_kl="none (the paper drops the KL term: kl_coef 0)",
)
def dr_grpo(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training: a critical perspective", sec. 3.2):
    ``s_i - mean_g``, without GRPO's division by the group standard deviation (which up-weights prompts that are
    nearly always or never solved). The paper's other half, removing the per-sequence length normalization, is a
    loss-aggregation choice (``seq-mean-token-sum`` in :mod:`rlhf.ops.aggregation`). A group of size 1, or of
    equal scores, gets exactly 0.
    Returns equal the advantages.

    Uses ``scores``, ``group_ids``, ``response_mask``.
    """
    size, total, _, constant = _group_stats(inputs.scores, inputs.group_ids, "dr_grpo")
    adv = torch.where(constant, 0.0, inputs.scores.detach().to(torch.float64) - total / size)
    out = _broadcast(adv, inputs)
    return out, out.clone()


@_estimator(
    "rloo",
    paper="Ahmadian et al. 2024 (Back to basics), eq. 6",
    reads=(SCORES,),
    needs_group_ids=True,
    needs_critic=False,
    aggregation="seq-mean-token-sum-norm",
    paper_kl="a sequence-level KL penalty in the reward (sec. 2): algo.kl_mode=reward, k1",
)
def rloo(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to basics", eq. 6; Kool et al. 2019):
    ``s_i - (sum_g - s_i) / (n - 1)``, the score minus the mean of the *other* samples of its group, an unbiased
    baseline since it does not depend on sample ``i`` (it equals ``n / (n - 1) * (s_i - mean_g)``). A group of
    size 1 has no other sample and gets 0; a group of equal scores gets exactly 0. Returns equal the advantages.

    Uses ``scores``, ``group_ids``, ``response_mask``. (Sequence scores only: the paper's KL penalty is
    sequence-level, ``r(x, y) - beta log pi(y|x) / ref(y|x)``, which :func:`rlhf.ops.batch_advantages.advantages_for`
    folds into the scores for ``algo.kl_mode=reward``.)
    """
    size, total, _, constant = _group_stats(inputs.scores, inputs.group_ids, "rloo")
    s = inputs.scores.detach().to(torch.float64)
    adv = torch.where(constant, 0.0, s - (total - s) / (size - 1).clamp(min=1))
    out = _broadcast(adv, inputs)
    return out, out.clone()


@_estimator(
    "reinforce_pp",
    paper="Hu 2025 (REINFORCE++)",
    reads=(TOKEN_REWARDS,),
    needs_group_ids=False,
    needs_critic=False,
    aggregation="token-mean",
    paper_kl="a per-token KL penalty in the reward: algo.kl_mode=reward",
)
def reinforce_pp(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: a simple and efficient approach for aligning large language models"):
    the discounted return-to-go of the per-token rewards, ``G_t = r_t + gamma G_{t'}`` over the row's response
    tokens, whitened with :func:`whiten` over all response tokens of the whole batch.

    Returns are the un-whitened returns-to-go ``G_t`` (Monte Carlo returns; no critic uses them here).

    Uses ``token_rewards``, ``response_mask``, ``gamma``.
    """
    mask = inputs.response_mask != 0
    dtype = _float_dtype(inputs.token_rewards)
    rewards = _clean(inputs.token_rewards, mask, dtype)
    returns = _reverse_scan(rewards, torch.zeros_like(rewards), mask, inputs.gamma, 1.0)
    return whiten(returns, mask).to(dtype), returns


@_estimator(
    "reinforce_pp_baseline",
    paper="Hu 2025 (REINFORCE++, revised: REINFORCE++-baseline)",
    reads=(TOKEN_REWARDS, SCORES),
    needs_group_ids=True,
    needs_critic=False,
    aggregation="token-mean",
    paper_kl="a KL loss (the revised paper's recipe) or a per-token KL penalty in the reward",
)
def reinforce_pp_baseline(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025, REINFORCE++ revised version, "REINFORCE++-baseline"): subtract the group
    mean score, then proceed as :func:`reinforce_pp`.

    Exactly: ``r'_t = token_rewards_t - [t is the row's last response token] * mean_g(scores)``, i.e. the score
    placed at the last token is replaced by ``s_i - mean_g`` while the per-token KL part is kept; then
    ``G_t = r'_t + gamma G_{t'}``, then :func:`whiten` (mean and std) over all response tokens of the batch. The
    group mean is a baseline independent of the sample's own tokens only in the limit of large groups (it
    includes ``s_i``), the same as GRPO; the global whitening replaces GRPO's per-group std. A group of size 1
    therefore loses its score entirely (``s_i - s_i = 0``), like the other group estimators. A row with no
    response token does not contribute. Returns are the un-whitened ``G_t``.

    Uses ``token_rewards``, ``scores``, ``group_ids``, ``response_mask``, ``gamma``.
    """
    size, total, _, _ = _group_stats(inputs.scores, inputs.group_ids, "reinforce_pp_baseline")
    mask = inputs.response_mask != 0
    dtype = _float_dtype(inputs.token_rewards, inputs.scores)
    rewards = _clean(inputs.token_rewards, mask, dtype)
    last = _last_token_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] -= (total / size).to(dtype)[rows]
    returns = _reverse_scan(rewards, torch.zeros_like(rewards), mask, inputs.gamma, 1.0)
    return whiten(returns, mask).to(dtype), returns
