"""RL objectives: the PPO-family actor loss, the clipped critic loss, and the forward-only score functions that
build an RL train batch (old / reference log-probs, old values, sequence rewards).

Alignment (see :mod:`rlhf.batch`): every per-token ``(B, T)`` tensor is indexed by ``input_ids`` columns, and
column ``t`` belongs to token ``t``:

* log-probs and entropies at column ``t`` are those of the distribution predicted at position ``t - 1``
  (:func:`rlhf.ops.logprobs.token_logprobs`); column 0 is 0;
* values at column ``t`` are ``V`` of the state *before* token ``t`` is emitted, i.e. the critic head applied to
  the hidden state at position ``t - 1`` (:func:`token_values`); column 0 is 0. This is the state in which the
  action ``input_ids[:, t]`` is taken, the convention of :mod:`rlhf.ops.advantages`;
* ``loss_mask[b, t] == 1`` marks response token ``t`` (an action); column 0 is never one (nothing predicts it)
  and is ignored even if set.

Normalization follows the objective contract (:mod:`rlhf.objectives`): ``count`` is the micro-batch's share of the
denominator of the aggregation mode (:mod:`rlhf.ops.aggregation`), ``loss`` returns the un-normalized numerator,
and every metric is returned as a numerator of the *same* aggregation, so ``finalize`` divides each one once by
the global count and a metric is the same whatever the micro-batch / rank split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple, cast

import torch

from rlhf.batch import Batch
from rlhf.models.forward import lm_logits
from rlhf.models.head import token_logprobs_and_entropy, token_outputs
from rlhf.models.loading import last_token_values, scalar_head_values
from rlhf.objectives.base import MicroSums, host_sums
from rlhf.ops.aggregation import LOSS_AGGREGATIONS, aggregate_count, aggregate_sum
from rlhf.ops.distill import (
    DIVERGENCES,
    SAMPLED,
    check_divergence,
    resolve_estimator,
    teacher_divergence,
    topk_divergence,
)
from rlhf.ops.kl import KL_ESTIMATORS, kl_estimate
from rlhf.ops.logprobs import SamplingFilter, at_least_float32, check_temperature, topk_logprobs
from rlhf.ops.policy_loss import POLICY_LOSSES, PolicyLossConfig, policy_loss, value_loss

Tensor = torch.Tensor


# ------------------------------------------------------------------------------------------------ helpers
def response_mask(batch: Batch) -> Tensor:
    """``(B, T)`` bool mask of the response tokens: ``batch.loss_mask`` with column 0 forced off."""
    if batch.loss_mask is None:
        raise ValueError("RL micro-batch has no loss_mask (the response-token mask)")
    if batch.is_pairwise:
        raise ValueError("RL objectives take (B, T) batches, got a pairwise (B, 2, T) batch")
    mask = batch.loss_mask != 0
    mask[:, 0] = False  # `!=` made a new tensor: the batch's own mask is untouched
    return mask


def _require(batch: Batch, *names: str, why: str) -> None:
    missing = [name for name in names if getattr(batch, name) is None]
    if missing:
        raise ValueError(f"RL micro-batch has no {', '.join(missing)}: {why}")


def _check_agg_mode(agg_mode: str, length: Optional[int]) -> None:
    # fail on the driver, with the valid names, not inside a worker
    if LOSS_AGGREGATIONS.get(agg_mode).per_length and not (length is not None and length >= 1):
        raise ValueError(
            f"agg_mode {agg_mode!r} divides each sequence's token sum by a constant length: set "
            f"agg_length >= 1 (the generation budget), got {length}"
        )


def _check_sampling_filter(sampling_filter) -> None:
    if not isinstance(sampling_filter, SamplingFilter):
        raise TypeError(f"sampling_filter must be a rlhf.ops.logprobs.SamplingFilter, got {sampling_filter!r}")


def token_values(model: torch.nn.Module, batch: Batch, packing: Optional[bool] = None) -> Tensor:
    """Per-token critic values ``(B, T)`` float32 (float64 for a float64 critic) aligned with the tokens (the one
    definition used both when the old values are computed for the experience batch and inside
    :class:`ValueObjective`).

    ``out[:, t]`` is the value of the state before token ``t`` is emitted: the scalar head applied to the final
    hidden state at position ``t - 1`` (which has seen tokens ``0 .. t-1``). ``out[:, 0] = 0`` (no state precedes
    the first token; it is never a response token). The head output at the last position (the state after the
    whole sequence) is never used. ``packing``: see :func:`rlhf.models.packing.runs_packed`.
    """
    raw = scalar_head_values(model, batch.input_ids, batch.attention_mask, packing)
    return torch.nn.functional.pad(raw[:, :-1], (1, 0))


def _agg(mode: str, per_token: Tensor, mask: Tensor, length: Optional[int]) -> Tensor:
    """A metric numerator, detached and 0-dim on the batch's device (read back once a step, with the others)."""
    with torch.no_grad():
        return aggregate_sum(mode, per_token.detach(), mask, length)


# ------------------------------------------------------------------------------------------------ actor
@dataclass(frozen=True)
class PolicyObjective:
    """PPO-family actor loss for one micro-batch of an RL train batch.

    Per response token ``t``: ``pg_t - entropy_coef * H_t + kl_loss_coef * KL_t`` with ``pg_t`` the policy loss
    ``loss_type`` of :data:`rlhf.ops.policy_loss.POLICY_LOSSES` (ratio against ``batch.old_logps``, advantage
    ``batch.advantages``, each token weighted by the clip's behaviour correction (TIS, MIS, IcePop, sequence masking,
    :mod:`rlhf.ops.off_policy`) of ``batch.rollout_logps`` when ``correct_off_policy``), ``H_t`` the entropy of the
    tempered next-token distribution and ``KL_t`` the ``kl_estimator`` estimate of KL(policy || reference) from
    ``batch.ref_logps`` (GRPO-style KL loss; each token's value kept within ``+-KL_VALUE_BOUND``, as OpenRLHF and verl
    bound it), plus ``distill_coef * D_t`` with ``D_t`` the ``distill_estimator`` reverse KL of the policy from a
    distillation teacher on the sampled tokens (``batch.teacher_logps``, :mod:`rlhf.ops.distill`). The per-token
    total is reduced with ``agg_mode``, once: every term is normalised over the whole global batch.

    Attributes:
        loss_type: a name in ``POLICY_LOSSES`` (``ppo``, ``gspo``, ``cispo``, ``sapo``).
        clip: clip ranges, dual clip and the behaviour correction (``tis_cap`` or ``off_policy``).
        agg_mode: a name in :data:`rlhf.ops.aggregation.LOSS_AGGREGATIONS`.
        temperature: the sampling temperature of the rollout (log-probs and entropy are of ``logits / T``).
        sampling_filter: the rollout's top-k / top-p (:class:`rlhf.ops.logprobs.SamplingFilter`): log-probs and
            entropy are of the renormalised kept set the tokens were drawn from, as ``batch.old_logps`` must be
            (:class:`TokenLogps` with the same filter); the default drops nothing.
        entropy_coef: weight of the entropy bonus (0: entropy is only reported, computed without autograd).
        kl_loss_coef: weight of the KL-to-reference loss (needs ``batch.ref_logps``).
        kl_estimator: ``k1`` / ``k2`` / ``k3`` (:mod:`rlhf.ops.kl`); also used for the reported ``kl``.
        correct_off_policy: apply the clip's behaviour correction (``clip.correction``) with
            ``batch.rollout_logps``, the behaviour policy's log-probs; requires ``clip.tis_cap`` or
            ``clip.off_policy`` (and either requires it). A token the correction drops keeps its place in the
            denominator: ``count`` depends on the response mask only.
        packing: run the forward padding-free (None: as the model was built, ``train.packing``); every per-token
            quantity is the same either way.
        distill_coef: weight of the distillation loss (``algo.teacher.mode=loss``; needs ``batch.teacher_logps``,
            or for the full-distribution divergences ``batch.teacher_topk_logps`` and ``batch.teacher_topk_ids``).
        distill_estimator: ``k2`` (its expected gradient is the reverse KL's) or ``k3``; ``k1`` is refused.
        distill_divergence: ``reverse_kl`` (on the sampled tokens, ``distill_estimator``), or ``forward_kl`` /
            ``jsd`` (GKD: the whole next-token distributions on the teacher's top-k plus a tail,
            :func:`rlhf.ops.distill.topk_divergence`; no sampling filter).
        distill_beta: the generalised JSD's ``beta`` in ``(0, 1)``.
    """

    loss_type: str = "ppo"
    clip: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    agg_mode: str = "token-mean"
    agg_length: Optional[int] = None  # the constant L of a per-length aggregation (seq-mean-token-sum-norm)
    temperature: float = 1.0
    sampling_filter: SamplingFilter = SamplingFilter()
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    correct_off_policy: bool = False
    packing: Optional[bool] = None
    distill_coef: float = 0.0  # > 0: on-policy distillation as a loss (rlhf.ops.distill), reads batch.teacher_logps
    distill_estimator: str = "k2"
    distill_divergence: str = SAMPLED
    distill_beta: float = 0.5

    def __post_init__(self) -> None:
        POLICY_LOSSES.get(self.loss_type)
        sampled = check_divergence(self.distill_divergence, self.distill_beta).sampled
        if not (self.distill_coef >= 0 and math.isfinite(self.distill_coef)):
            raise ValueError(f"distill_coef must be a finite number >= 0, got {self.distill_coef}")
        if self.distill_coef and sampled:
            resolve_estimator(self.distill_estimator, "loss")  # k1 refused: no gradient in expectation
        _check_agg_mode(self.agg_mode, self.agg_length)
        KL_ESTIMATORS.get(self.kl_estimator)
        check_temperature(self.temperature)
        _check_sampling_filter(self.sampling_filter)
        if not math.isfinite(self.entropy_coef):
            raise ValueError(f"entropy_coef must be finite, got {self.entropy_coef}")
        if not (self.kl_loss_coef >= 0 and math.isfinite(self.kl_loss_coef)):
            raise ValueError(f"kl_loss_coef must be a finite number >= 0, got {self.kl_loss_coef}")
        correction = self.clip.correction
        if self.correct_off_policy and correction is None:
            raise ValueError(
                "correct_off_policy=True needs a behaviour correction: clip.tis_cap or clip.off_policy (e.g. "
                "rlhf.ops.off_policy.BehaviourCorrection('icepop'))"
            )
        if not self.correct_off_policy and correction is not None:
            raise ValueError(
                f"clip sets behaviour correction {correction.name!r} but correct_off_policy=False; enable it or "
                "unset clip.tis_cap / clip.off_policy"
            )
        # Probe the loss on one token so a combination the loss rejects (e.g. gspo with dual_clip) fails here, on
        # the driver, rather than in every worker at the first step.
        one = torch.zeros(1, 1)
        policy_loss(
            self.loss_type,
            one,
            one,
            one,
            torch.ones(1, 1, dtype=torch.bool),
            self.clip,
            rollout_logps=one if self.correct_off_policy else None,
        )

    def count(self, batch: Batch) -> int:
        return aggregate_count(self.agg_mode, response_mask(batch))

    def loss(self, model: torch.nn.Module, batch: Batch) -> Tuple[Tensor, MicroSums]:
        _require(batch, "old_logps", "advantages", why="the experience batch must be built before the update")
        if self.correct_off_policy:
            _require(batch, "rollout_logps", why="correct_off_policy needs the behaviour (rollout engine) log-probs")
        if self.kl_loss_coef:
            _require(batch, "ref_logps", why="kl_loss_coef > 0 needs reference log-probs")
        topk = bool(self.distill_coef) and not DIVERGENCES.get(self.distill_divergence).sampled
        if self.distill_coef and not topk:
            _require(batch, "teacher_logps", why="distill_coef > 0 needs the teacher's log-probs")
        if topk:
            why = f"{self.distill_divergence} needs the teacher's top-k (TeacherTopK)"
            _require(batch, "teacher_topk_logps", "teacher_topk_ids", why=why)
        if batch.ref_logps is not None and batch.ref_logps.shape != batch.input_ids.shape:
            raise ValueError(
                f"RL ref_logps must be per-token {tuple(batch.input_ids.shape)}, got {tuple(batch.ref_logps.shape)}"
            )
        mask = response_mask(batch)
        mode, length = self.agg_mode, self.agg_length

        outputs = token_outputs(
            model,
            batch.input_ids,
            batch.attention_mask,
            self.packing,
            self.temperature,
            self.sampling_filter,
            entropy="grad" if self.entropy_coef else "value",  # only reported without a bonus: no gradient
            at_ids=batch.teacher_topk_ids if topk else None,
        )
        logps, entropy = outputs.logps, outputs.entropy
        assert entropy is not None, "asked for"
        # cast: _require above raised unless both are set
        pg, stats = policy_loss(
            self.loss_type,
            logps,
            cast(Tensor, batch.old_logps),
            cast(Tensor, batch.advantages),
            mask,
            self.clip,
            rollout_logps=batch.rollout_logps if self.correct_off_policy else None,
        )
        per_token = pg

        if self.entropy_coef:
            per_token = per_token - self.entropy_coef * entropy

        kl = None
        if batch.ref_logps is not None:
            # Outside the mask the reference is replaced by the policy itself (log-ratio 0), so whatever the
            # padding holds cannot reach the value or the gradient.
            ref = torch.where(mask, batch.ref_logps.detach().to(logps.dtype), logps.detach())
            if self.kl_loss_coef:
                kl = kl_estimate(self.kl_estimator, logps, ref, bounded=True)
                per_token = per_token + self.kl_loss_coef * kl
            else:
                kl = kl_estimate(self.kl_estimator, logps.detach(), ref, bounded=True)

        distill = None
        if topk:  # the student's log-probs at the teacher's top-k tokens, from the same forward
            teacher = cast(Tensor, batch.teacher_topk_logps)
            distill = topk_divergence(
                self.distill_divergence, cast(Tensor, outputs.at_ids), teacher, mask, self.distill_beta
            )
        elif self.distill_coef:
            distill = teacher_divergence(self.distill_estimator, logps, cast(Tensor, batch.teacher_logps), mask)
        if distill is not None:  # before the one aggregation: normalised with the rest over the global batch
            per_token = per_token + self.distill_coef * distill

        total = aggregate_sum(mode, per_token, mask, length)
        sums: Dict[str, Tensor] = {
            "loss_sum": total.detach(),
            "policy_loss_sum": _agg(mode, pg, mask, length),
            "entropy_sum": _agg(mode, entropy, mask, length),
            "clipfrac_sum": _agg(mode, stats["clipped"], mask, length),
            "approx_kl_sum": _agg(mode, stats["approx_kl"], mask, length),
            "num_tokens": mask.sum(),
        }
        if kl is not None:
            sums["kl_sum"] = _agg(mode, kl, mask, length)
        if distill is not None:
            sums["distill_sum"] = _agg(mode, distill, mask, length)
        if self.clip.dual_clip is not None and "dual_clipped" in stats:
            sums["dual_clipfrac_sum"] = _agg(mode, stats["dual_clipped"], mask, length)
        if "tis_weight" in stats:
            sums["tis_weight_sum"] = _agg(mode, stats["tis_weight"], mask, length)
            sums["tis_capped_sum"] = _agg(mode, stats["tis_capped"], mask, length)
        if "is_weight" in stats:
            sums["is_weight_sum"] = _agg(mode, stats["is_weight"], mask, length)
            sums["is_masked_sum"] = _agg(mode, stats["is_masked"], mask, length)
        if "gate_grad" in stats:  # the factor a soft gate (SAPO's) puts on each token's gradient
            sums["gate_grad_sum"] = _agg(mode, stats["gate_grad"], mask, length)
        if batch.rollout_logps is not None:
            zero = torch.zeros((), dtype=torch.float64, device=mask.device)
            old_logps = cast(Tensor, batch.old_logps)  # _require at the top raised unless it is set
            gap = torch.where(mask, (old_logps.double() - batch.rollout_logps.double()).abs(), zero)
            sums["logp_mismatch_sum"] = _agg(mode, gap, mask, length)
        return total, sums

    def finalize(self, sums: MicroSums, normalizer: int) -> Dict[str, float]:
        """Metrics of the global batch. ``kl`` only when reference log-probs were present, ``logp_mismatch``
        (mean |old_logps - rollout_logps|) only when rollout log-probs were, ``dual_clip_frac`` / ``tis_weight`` /
        ``tis_capped_frac`` (TIS) / ``is_weight`` / ``is_masked_frac`` (a masking behaviour correction) only when
        those corrections are on, ``gate_grad`` (the mean factor a soft gate puts on each token's gradient, 1
        on-policy) only for a policy loss with one (SAPO)."""
        sums = host_sums(sums)
        n = normalizer
        out = {
            "loss": sums["loss_sum"] / n,
            "policy_loss": sums["policy_loss_sum"] / n,
            "entropy": sums["entropy_sum"] / n,
            "clip_frac": sums["clipfrac_sum"] / n,
            "approx_kl": sums["approx_kl_sum"] / n,
            "num_tokens": int(sums["num_tokens"]),
        }
        optional = {
            "kl_sum": "kl",
            "distill_sum": "distill",  # not "kl": health.max_kl watches the KL to the reference
            "logp_mismatch_sum": "logp_mismatch",
            "dual_clipfrac_sum": "dual_clip_frac",
            "tis_weight_sum": "tis_weight",
            "tis_capped_sum": "tis_capped_frac",
            "is_weight_sum": "is_weight",
            "is_masked_sum": "is_masked_frac",
            "gate_grad_sum": "gate_grad",
        }
        for key, name in optional.items():
            if key in sums:
                out[name] = sums[key] / n
        return out


# ------------------------------------------------------------------------------------------------ critic
@dataclass(frozen=True)
class ValueObjective:
    """Critic loss ``0.5 (V - R)^2`` per response token, with PPO value clipping around ``batch.values`` when
    ``clip`` is set (:func:`rlhf.ops.policy_loss.value_loss`), reduced with ``agg_mode``. ``V`` comes from
    :func:`token_values` (column ``t`` = value of the state before token ``t``), targets from ``batch.returns``.
    """

    clip: Optional[float] = 0.2
    agg_mode: str = "token-mean"
    agg_length: Optional[int] = None  # the constant L of a per-length aggregation (seq-mean-token-sum-norm)
    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def __post_init__(self) -> None:
        _check_agg_mode(self.agg_mode, self.agg_length)
        if self.clip is not None and not (self.clip > 0 and math.isfinite(self.clip)):
            raise ValueError(f"value clip must be a positive finite number or None, got {self.clip}")

    def count(self, batch: Batch) -> int:
        return aggregate_count(self.agg_mode, response_mask(batch))

    def loss(self, model: torch.nn.Module, batch: Batch) -> Tuple[Tensor, MicroSums]:
        _require(batch, "returns", why="value targets must be computed before the critic update")
        if self.clip is not None:
            _require(batch, "values", why="value clipping needs the critic's values at rollout time")
        mask = response_mask(batch)
        mode, length = self.agg_mode, self.agg_length
        values = token_values(model, batch, self.packing)
        old = batch.values if batch.values is not None else values.detach()  # unused without clipping
        returns = cast(Tensor, batch.returns)  # _require above raised unless it is set
        per_token = value_loss(values, old, returns, self.clip, mask)
        total = aggregate_sum(mode, per_token, mask, length)
        sums = {
            "value_loss_sum": total.detach(),
            "value_clipfrac_sum": _agg(mode, self._clipped(values.detach(), old, returns, mask), mask, length),
            "values_sum": _agg(mode, values, mask, length),
            "num_tokens": mask.sum(),
        }
        return total, sums

    def _clipped(self, values: Tensor, old: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
        """1 where the clipped branch of :func:`value_loss` is the one used (its condition, strictly larger)."""
        if self.clip is None:
            return torch.zeros(values.shape, dtype=torch.float32, device=values.device)
        # value_loss's working dtype, so the indicator is computed from the very numbers it compared.
        work = torch.float64 if torch.float64 in (values.dtype, old.dtype, returns.dtype) else torch.float32
        zero = torch.zeros((), dtype=work, device=values.device)
        v, v_old, ret = (torch.where(mask, x.detach().to(work), zero) for x in (values, old, returns))
        unclipped = (v - ret).square()
        clipped = (v_old + (v - v_old).clamp(-self.clip, self.clip) - ret).square()
        return ((clipped > unclipped) & mask).to(work)

    def finalize(self, sums: MicroSums, normalizer: int) -> Dict[str, float]:
        sums = host_sums(sums)
        n = normalizer
        return {
            "value_loss": sums["value_loss_sum"] / n,
            "value_clip_frac": sums["value_clipfrac_sum"] / n,
            "values": sums["values_sum"] / n,
            "num_tokens": int(sums["num_tokens"]),
        }


# ------------------------------------------------------------------------------------------------ score fns
# Score functions return float32, or float64 from a float64 model (strategy.precision=fp64): the experience batch of
# an fp64 run is then float64 throughout, so its factorisations agree to float64 rounding at every step.
@dataclass(frozen=True)
class TokenLogps:
    """Score function: per-token log-probs ``(B, T)`` float32 at ``temperature`` (old log-probs from the policy,
    reference log-probs from the reference). Aligned like :func:`token_logprobs`: column 0 is 0, padding columns
    hold meaningless values for the response mask to drop.

    ``sampling_filter``: the rollout's top-k / top-p; the log-probs are then of each model's own renormalised kept
    set (always holding the sampled token), which is what vLLM reports and samples from. The RL trainer scores the
    reference with the same filter, so the KL is 0 where the policy equals the reference."""

    temperature: float = 1.0
    sampling_filter: SamplingFilter = SamplingFilter()
    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        _check_sampling_filter(self.sampling_filter)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> Tensor:
        logps, _ = token_logprobs_and_entropy(
            model, batch.input_ids, batch.attention_mask, self.packing, self.temperature, self.sampling_filter
        )
        return at_least_float32(logps)


@dataclass(frozen=True)
class TeacherTopK:
    """Score function of a distillation teacher for the full-distribution divergences (``algo.teacher.divergence``
    ``forward_kl`` / ``jsd``, :func:`rlhf.ops.distill.topk_divergence`): at every token, the ``k`` most likely tokens
    of the distribution that predicts it, at ``temperature``, and their log-probs.

    Returns one ``(B, T, K, 2)`` tensor (a score function returns one tensor): ``[..., 0]`` the log-probs (float32,
    float64 in an fp64 run), ``[..., 1]`` the token ids as numbers of the same dtype (exact: ids below 2**24 in
    float32, refused above). Aligned like :class:`TokenLogps` (column t: the distribution of token t; column 0 and
    padding 0). :func:`split_teacher_topk` makes it the two :class:`~rlhf.batch.Batch` fields."""

    k: int
    temperature: float = 1.0
    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        check_temperature(self.temperature)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> Tensor:
        out = lm_logits(model, batch.input_ids, batch.attention_mask, self.packing)
        values, ids = topk_logprobs(out.logits, self.k, self.temperature)
        if values.dtype == torch.float32 and out.logits.shape[-1] > 2**24:
            raise ValueError(f"a vocabulary of {out.logits.shape[-1]} ids is not exact in float32 (2**24 at most)")
        return torch.stack([out.per_token(values), out.per_token(ids.to(values.dtype))], dim=-1)


def split_teacher_topk(scored: Tensor) -> Tuple[Tensor, Tensor]:
    """:class:`TeacherTopK`'s ``(B, T, K, 2)`` -> the ``(B, T, K)`` log-probs and the ``(B, T, K)`` int64 ids."""
    return scored[..., 0].contiguous(), scored[..., 1].round().long()


@dataclass(frozen=True)
class TokenValues:
    """Score function: critic values ``(B, T)`` float32 via :func:`token_values` (column t = state before token t)."""

    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> Tensor:
        return at_least_float32(token_values(model, batch, self.packing))


@dataclass(frozen=True)
class SequenceScores:
    """Score function: reward-model scores ``(B,)`` float32 at each row's last real token (attention mask)."""

    packing: Optional[bool] = None  # padding-free forward; None: as the model was built (train.packing)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> Tensor:
        values = scalar_head_values(model, batch.input_ids, batch.attention_mask, self.packing)
        return at_least_float32(last_token_values(values, batch.attention_mask))
