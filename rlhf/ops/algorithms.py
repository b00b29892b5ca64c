"""An online-RL algorithm is an advantage estimator, a policy loss, a KL estimator and a loss aggregation: what their
registry entries say, combined.

Every fact lives in one registry entry (:class:`rlhf.ops.advantages.Estimator`,
:class:`rlhf.ops.policy_loss.PolicyLoss`, :class:`rlhf.ops.kl.KLEstimator`,
:class:`rlhf.ops.aggregation.LossAggregation`); this module only reads them. Config validation
(``rlhf.config.rl_schema.AlgorithmConfig``), ``--dry-run``, the audit lint and the generated table of
docs/algorithms/rl.md call these functions, so adding an estimator is one entry plus its maths.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from rlhf.ops.advantages import ADVANTAGE_ESTIMATORS, Estimator
from rlhf.ops.aggregation import LOSS_AGGREGATIONS
from rlhf.ops.kl import KL_ESTIMATORS, KL_VALUE_BOUND
from rlhf.ops.policy_loss import POLICY_LOSSES, PolicyLoss


def estimator(name: str) -> Estimator:
    """The registry entry of advantage estimator ``name`` (an unknown name lists the valid ones)."""
    return ADVANTAGE_ESTIMATORS.get(name)


def loss(name: str) -> PolicyLoss:
    """The registry entry of policy loss ``name``."""
    return POLICY_LOSSES.get(name)


def paper_aggregation(estimator_name: str, policy_loss: str) -> str:
    """The aggregation of the papers: the policy loss's when its paper fixes one (GSPO's objective is a mean over
    sequences, CISPO's a mean over tokens, whatever the estimator), else the estimator's. What
    ``algo.loss_agg_mode=auto`` trains with."""
    return loss(policy_loss).aggregation or estimator(estimator_name).aggregation


def paper_clip(policy_loss: str) -> Optional[Tuple[float, float]]:
    """``(clip_low, clip_high)`` of the policy loss's paper: what unset ``algo.clip_low`` / ``clip_high`` take;
    ``None`` for a loss that clips nothing (SAPO)."""
    entry = loss(policy_loss)
    if entry.clip_low is None or entry.clip_high is None:
        return None
    return entry.clip_low, entry.clip_high


def paper_gate(policy_loss: str) -> Optional[Tuple[float, float]]:
    """The soft gate's temperatures of the policy loss's paper, ``(positive advantages, negative ones)``: what unset
    ``algo.gate_tau_pos`` / ``gate_tau_neg`` take; ``None`` for a loss without a gate."""
    return loss(policy_loss).gate_taus


def needs_length(aggregation: str) -> bool:
    """Whether aggregation ``aggregation`` divides by a constant length (the generation budget)."""
    return LOSS_AGGREGATIONS.get(aggregation).per_length


def combination_problems(
    *,
    estimator_name: str,
    policy_loss: str,
    kl_mode: str,
    kl_estimator: str,
    kl_coef: float,
    dual_clip: float,
    tis_cap: float,
    off_policy_correction: str = "none",
) -> List[Tuple[str, str]]:
    """Why this combination does not train what its keys say: ``[(config key, message), ...]``, empty when it does.

    What is refused, and why (each rule reads the registry entries, never a list of names):

    * a KL *loss* with an estimator whose gradient is zero in expectation (``k1``): it would add noise only;
    * dual clip with a policy loss whose entry refuses it (GSPO, CISPO), TIS or another behaviour correction
      (``off_policy_correction``, :mod:`rlhf.ops.off_policy`) with one whose entry refuses those (GSPO: they are
      token-level corrections with no sequence-level form in the paper); the message quotes the entry's reason.
    """
    problems = []
    kl = KL_ESTIMATORS.get(kl_estimator)
    if kl_coef > 0 and kl_mode == "loss" and not kl.usable_as_loss:
        problems.append(
            (
                "algo.kl_estimator",
                f"is {kl_estimator} with algo.kl_mode=loss: its gradient as a loss is zero in expectation "
                f"(log r's expected score is 0), so the KL term would add noise and no regularisation; use "
                f"k3 (DeepSeekMath's) or k2 (the reverse KL's gradient), or algo.kl_mode=reward",
            )
        )
    entry = loss(policy_loss)
    settings = (  # (key, its value as set, whether the policy loss takes it)
        ("algo.dual_clip", f"{dual_clip:g}", entry.dual_clip),
        ("algo.tis_cap", f"{tis_cap:g}", entry.behaviour_corrections),
        ("algo.off_policy_correction", off_policy_correction, entry.behaviour_corrections),
    )
    problems += [
        (key, f"is {value}, which policy loss {policy_loss!r} ({entry.paper}) refuses: {entry.refusal}")
        for key, value, takes in settings
        if not takes and value not in ("0", "none")
    ]
    return problems


def describe(estimator_name: str, policy_loss: str, kl_mode: str, kl_estimator: str, kl_coef: float) -> List[str]:
    """What a run with these settings trains, in the words of the registry entries (``--dry-run``, run start)."""
    est, pl = estimator(estimator_name), loss(policy_loss)
    needs = [
        what
        for what, needed in (
            ("group ids: n_samples_per_prompt >= 2", est.needs_group_ids),
            ("a critic", est.needs_critic),
        )
        if needed
    ]
    lines = [
        f"advantages: {estimator_name} ({est.paper}); reads {' and '.join(est.reads)}"
        + (f"; needs {', '.join(needs)}" if needs else ""),
        f"policy loss: {policy_loss} ({pl.paper})" + ("; sequence-level ratio" if pl.sequence_level else ""),
    ]
    if kl_coef > 0:
        where = "a loss term" if kl_mode == "loss" else f"a penalty in the reward, {est.kl_in_reward}"
        grad = (
            f"; its gradient follows the {KL_ESTIMATORS.get(kl_estimator).loss_gradient}" if kl_mode == "loss" else ""
        )
        lines.append(
            f"KL: {kl_coef:g} x {kl_estimator} as {where}, each token within +-{KL_VALUE_BOUND:g}{grad}; "
            f"the paper's: {est.paper_kl}"
        )
    else:
        lines.append(f"KL: none (algo.kl_coef=0); the paper's: {est.paper_kl}")
    return lines


def facts_table() -> str:
    """The Markdown table of every estimator and policy loss and their facts (docs/algorithms/rl.md embeds it; a
    test checks that the page's copy is current)."""
    rows = [
        "| estimator | paper | reads | KL in the reward | group ids | critic | paper's aggregation | paper's KL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ADVANTAGE_ESTIMATORS:
        e = estimator(name)
        rows.append(
            f"| `{name}` | {e.paper} | {', '.join(e.reads)} | {e.kl_in_reward} | "
            f"{'yes' if e.needs_group_ids else 'no'} | {'yes' if e.needs_critic else 'no'} | "
            f"`{e.aggregation}` | {e.paper_kl} |"
        )
    rows += [
        "",
        "| policy loss | paper | clip_low / clip_high | ratio | aggregation it imposes | dual clip | TIS, MIS, IcePop, "
        "seq_mask |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in POLICY_LOSSES:
        p = loss(name)
        imposes = f"`{p.aggregation}`" if p.aggregation else "the estimator's"
        trust = (
            f"{p.clip_low:g} / {p.clip_high:g}"
            if p.clip_low is not None and p.clip_high is not None
            else "none: a soft gate, tau " + " / ".join(f"{t:g}" for t in p.gate_taus or ())
        )
        rows.append(
            f"| `{name}` | {p.paper} | {trust} | "
            f"{'per sequence' if p.sequence_level else 'per token'} | {imposes} | "
            f"{'yes' if p.dual_clip else 'refused'} | {'yes' if p.behaviour_corrections else 'refused'} |"
        )
    rows += ["", "| KL estimator | as a loss, its gradient follows | with algo.kl_mode=loss |", "|---|---|---|"]
    for name in KL_ESTIMATORS:
        k = KL_ESTIMATORS.get(name)
        rows.append(
            f"| `{name}` | {k.loss_gradient if k.usable_as_loss else 'nothing (zero in expectation)'} | "
            f"{'accepted' if k.usable_as_loss else 'refused'} |"
        )
    return "\n".join(rows) + "\n"
