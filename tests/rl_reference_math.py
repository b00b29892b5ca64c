"""One RL step written out by hand in plain PyTorch, for tests/integration/test_rl_reference.py (its clipped AdamW
step and weight comparison also serve tests/integration/test_multinode.py), the sweep of every algorithm
combination in tests/unit/test_rl_combinations.py, the off-policy, asynchronous, per-turn and overlong paths in
tests/unit/test_rl_paths_reference.py, and failed samples, dynamic sampling and the pairwise judge in
tests/unit/test_rl_failures_reference.py.

Nothing here imports ``rlhf``: the maths is transcribed from the papers and docs/algorithms/*.md, one sample at a
time, so it shares no code (and no padding, alignment, masking or micro-batching convention) with the project it
checks. A sample is ``(prompt ids, response ids)``; per-token quantities are 1-D tensors over the response tokens
of one sample, ``(R_i,)``, kept in a list over samples (ragged, never padded).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

Tensor = torch.Tensor
Ragged = List[Tensor]  # one (R_i,) tensor per sample


# ------------------------------------------------------------------------------------------------ forwards
def response_logits(model, prompt: Sequence[int], response: Sequence[int], temperature: float) -> Tensor:
    """``(R, V)`` logits / temperature of the distributions that response token ``j`` was drawn from (predicted at
    position ``len(prompt) + j - 1``), from one unpadded forward of the whole sequence."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(input_ids=ids).logits[0]
    p = len(prompt)
    return logits[p - 1 : p - 1 + len(response)] / temperature


def logps_and_entropy(model, samples, temperature: float) -> Tuple[Ragged, Ragged]:
    """Per response token: ``log pi(y_j)`` and the entropy of the distribution it was drawn from."""
    logps, entropies = [], []
    for prompt, response in samples:
        z = response_logits(model, prompt, response, temperature)
        log_p = z - torch.logsumexp(z, dim=-1, keepdim=True)
        logps.append(log_p[torch.arange(len(response)), torch.tensor(list(response))])
        entropies.append(-(log_p.exp() * log_p).sum(-1))
    return logps, entropies


def padded_logps(model, ids: Tensor, lengths: Sequence[Tuple[int, int]], temperature: float) -> Tensor:
    """``(B, T)`` float64 log-probs of each row's response tokens (0 elsewhere), rows ``(prompt, response)`` long,
    right-padded in ``ids``: the policy's own log-probs, from which a test problem draws ``pi_old``."""
    samples = [(ids[i, :p].tolist(), ids[i, p : p + r].tolist()) for i, (p, r) in enumerate(lengths)]
    out = torch.zeros(ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for i, (lp, (p, r)) in enumerate(zip(logps_and_entropy(model, samples, temperature)[0], lengths)):
            out[i, p : p + r] = lp
    return out


def values(critic, samples) -> Ragged:
    """``V_j``: the scalar head on the final hidden state at position ``len(prompt) + j - 1``, the state in which
    response token ``j`` is emitted (docs/algorithms/ppo.md, "the value of the state before response token t is
    read at position t - 1")."""
    out = []
    for prompt, response in samples:
        ids = torch.tensor([list(prompt) + list(response)])
        hidden = critic.model(input_ids=ids).last_hidden_state[0]
        v = critic.score(hidden)[:, 0]
        p = len(prompt)
        out.append(v[p - 1 : p - 1 + len(response)])
    return out


# ------------------------------------------------------------------------------------------------ KL
KL_BOUND = 10.0  # each token's KL value is kept within +-10 (docs/algorithms/rl.md; OpenRLHF's and verl's clamp)


def kl(estimator: str, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's estimators of KL(pi || ref) from ``log r = log pi - log ref``
    (http://joschu.net/blog/kl-approx.html), each value clamped to ``[-KL_BOUND, KL_BOUND]``."""
    x = logp - ref_logp
    if estimator == "k1":
        value = x
    elif estimator == "k2":
        value = 0.5 * x * x
    elif estimator == "k3":
        value = torch.exp(-x) - 1 + x
    else:
        raise ValueError(estimator)
    return value.clamp(-KL_BOUND, KL_BOUND)


# ------------------------------------------------------------------------------------------------ advantages
def group_advantages(
    estimator: str, scores: Sequence[float], groups: Sequence[int], lengths: Sequence[int], eps: float = 1e-6
) -> Ragged:
    """One value per sample on every token of it, from its group (the samples of its prompt); a group whose scores
    are all equal gets 0:

    * ``grpo`` (DeepSeekMath sec. 4.1.2): ``(s_i - mean_g) / (std_g + eps)``, unbiased (n - 1) std;
    * ``dr_grpo`` (Liu et al. 2025): ``s_i - mean_g``;
    * ``rloo`` (Ahmadian et al. 2024, eq. 6): ``s_i`` minus the mean of the other samples.
    """
    out = []
    for i, n in enumerate(lengths):
        group = [s for s, g in zip(scores, groups) if g == groups[i]]
        mean = sum(group) / len(group)
        if max(group) == min(group):
            a = 0.0
        elif estimator == "grpo":
            std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
            a = (scores[i] - mean) / (std + eps)
        elif estimator == "dr_grpo":
            a = scores[i] - mean
        elif estimator == "rloo":
            a = scores[i] - (sum(group) - scores[i]) / (len(group) - 1)
        else:
            raise ValueError(estimator)
        out.append(torch.full((n,), a, dtype=torch.float64))
    return out


def token_rewards(scores: Sequence[float], kl_penalty: Ragged, kl_coef: float) -> Ragged:
    """``-kl_coef * KL_j`` on every response token plus the sequence score on the last one."""
    out = []
    for s, k in zip(scores, kl_penalty):
        r = -kl_coef * k.detach().clone()
        r[-1] = r[-1] + s
        out.append(r)
    return out


def discounted_returns(rewards: Ragged, gamma: float) -> Ragged:
    """``G_j = r_j + gamma G_{j+1}``, ``G_R = 0``."""
    out = []
    for r in rewards:
        g = torch.zeros_like(r)
        acc: Union[float, Tensor] = 0.0  # G_R; a tensor from G_{R-1} on
        for j in reversed(range(len(r))):
            acc = r[j] + gamma * acc
            g[j] = acc
        out.append(g)
    return out


def whiten_all(x: Ragged, eps: float = 1e-8) -> Ragged:
    """Over every token of every sample at once: ``(x - mean) / sqrt(var + eps)``, population variance
    (docs/algorithms/reinforce_pp.md)."""
    flat = torch.cat(x)
    mean = flat.mean()
    var = ((flat - mean) ** 2).mean()
    return [(v - mean) / torch.sqrt(var + eps) for v in x]


def gae(rewards: Ragged, vals: Ragged, gamma: float, lam: float) -> Tuple[Ragged, Ragged]:
    """GAE (Schulman et al. 2016, eq. 16): ``delta_j = r_j + gamma V_{j+1} - V_j`` with ``V_R = 0``,
    ``A_j = delta_j + gamma lam A_{j+1}``; returns ``R_j = A_j + V_j``."""
    advs, rets = [], []
    for r, v in zip(rewards, vals):
        v = v.detach()
        a = torch.zeros_like(r)
        nxt_a: Union[float, Tensor] = 0.0  # A_R and V_R; tensors from j = R - 1 on
        nxt_v: Union[float, Tensor] = 0.0
        for j in reversed(range(len(r))):
            delta = r[j] + gamma * nxt_v - v[j]
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = v[j]
            a[j] = nxt_a
        advs.append(a)
        rets.append(a + v)
    return advs, rets


# ------------------------------------------------------------------------------------------------ losses
def ppo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float = 0.0,
    tis_weight: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7) as a loss,
    ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; dual clip (Ye et al. 2020) bounds it by ``-c A`` for
    ``A < 0``; TIS multiplies it by the detached weight. Returns the loss and 0/1 indicators of what bound."""
    ratio = torch.exp(logp - old_logp)
    plain = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    is_clipped = clipped > plain
    loss = torch.where(is_clipped, clipped, plain)
    dual = torch.zeros_like(is_clipped)
    if dual_clip:
        dual = (adv < 0) & (loss > -dual_clip * adv)
        loss = torch.where(dual, -dual_clip * adv, loss)
    if tis_weight is not None:
        loss = loss * tis_weight
    return loss, {"clipped": is_clipped.double(), "dual_clipped": dual.double()}


def gspo_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """GSPO-token (Zheng et al. 2025, eq. 13-14) for one sample: the ratio ``sg[s] pi_j / sg[pi_j]`` with
    ``s = exp(mean_j log(pi_j / pi_old_j))``, whose value is ``s`` on every token and whose gradient is
    ``s grad log pi_j``, in PPO's clipped surrogate."""
    seq = torch.exp((logp - old_logp).mean())
    ratio = seq.detach() * torch.exp(logp - logp.detach())
    plain, clipped = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.where(clipped > plain, clipped, plain)


def cispo_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """CISPO (Chen et al. 2025, MiniMax-M1, sec. 3.1) for one sample: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) A
    log pi``, the importance weight clipped and detached, every token keeping its gradient."""
    weight = torch.clamp(torch.exp(logp - old_logp), 1 - clip_low, 1 + clip_high).detach()
    return -weight * adv * logp


def sapo_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO (Gao et al. 2025) for one sample: ``-(4 / tau) sigmoid(tau (r - 1)) A``, ``tau`` the positive
    advantages' temperature where ``A > 0`` and the negative ones' elsewhere, computed token by token."""
    out = []
    for j in range(len(logp)):
        tau = tau_pos if float(adv[j]) > 0 else tau_neg
        ratio = torch.exp(logp[j] - old_logp[j])
        out.append(-(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv[j])
    return torch.stack(out)


def policy_token_loss(name: str, logp: Tensor, old_logp: Tensor, adv: Tensor, params: Tuple[float, float]) -> Tensor:
    """Policy loss ``name`` per token of one sample; ``params`` its clip range ``(clip_low, clip_high)``, or SAPO's
    gate temperatures ``(tau_pos, tau_neg)``."""
    if name == "ppo":
        return ppo_token_loss(logp, old_logp, adv, *params)[0]
    losses = {"gspo": gspo_token_loss, "cispo": cispo_token_loss, "sapo": sapo_token_loss}
    return losses[name](logp, old_logp, adv, *params)


def value_token_loss(v: Tensor, v_old: Tensor, ret: Tensor, clip: float) -> Tensor:
    """``0.5 max((V - R)^2, (V_old + clamp(V - V_old, -clip, clip) - R)^2)`` (PPO's value clipping)."""
    plain = (v - ret) ** 2
    if not clip:
        return 0.5 * plain
    v_clip = v_old + torch.clamp(v - v_old, -clip, clip)
    return 0.5 * torch.maximum(plain, (v_clip - ret) ** 2)


def aggregate(mode: str, per_token: Ragged, length: int = 0) -> Tensor:
    """The whole train batch's loss from per-token values (verl's ``loss_agg_mode`` names; ``-norm``: each sample's
    token sum over the constant generation budget ``length``, Dr. GRPO's)."""
    if mode == "token-mean":
        return torch.cat(per_token).sum() / sum(len(x) for x in per_token)
    if mode == "seq-mean-token-mean":
        return torch.stack([x.mean() for x in per_token]).mean()
    if mode == "seq-mean-token-sum":
        return torch.stack([x.sum() for x in per_token]).mean()
    if mode == "seq-mean-token-sum-norm":
        return torch.stack([x.sum() / length for x in per_token]).mean()
    raise ValueError(mode)


# ------------------------------------------------------------------------------------------------ optimizer
def grad_norm(model) -> float:
    return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))


def clip_scale(norm: float, max_grad_norm: float) -> float:
    """DeepSpeed's clipping factor: the gradient is divided by ``max(1, (norm + 1e-6) / max_grad_norm)``."""
    return 1.0 / max(1.0, (norm + 1e-6) / max_grad_norm) if max_grad_norm > 0 else 1.0


@torch.no_grad()
def clipped_adamw_first_step(
    model, *, lr: float, betas: Tuple[float, float], eps: float, weight_decay: float, max_grad_norm: float
) -> float:
    """Clip the gradient to ``max_grad_norm`` (:func:`clip_scale`), then the first AdamW step (Loshchilov & Hutter
    2019) from zero moments: ``m = (1 - b1) g``, ``v = (1 - b2) g^2``, bias-corrected,
    ``w <- w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)``, no weight decay on 1-D parameters (biases, norms).
    ``.grad`` keeps the pre-clip gradient. Returns the pre-clip norm."""
    norm = grad_norm(model)
    scale = clip_scale(norm, max_grad_norm)
    b1, b2 = betas
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad * scale
        m_hat = (1 - b1) * g / (1 - b1)
        v_hat = (1 - b2) * g * g / (1 - b2)
        decay = weight_decay if p.ndim >= 2 else 0.0
        p.mul_(1 - lr * decay)
        p.sub_(lr * m_hat / (torch.sqrt(v_hat) + eps))
    return norm


def weight_agreement(
    got: Dict[str, Tensor],
    model,
    *,
    lr: float,
    eps: float,
    norm: float,
    max_grad_norm: float,
    update_rtol: float,
    grad_rtol: float,
) -> Tuple[float, float, str]:
    """How far the weights ``got`` (name -> tensor) are from ``model``'s after :func:`clipped_adamw_first_step`.

    The first Adam step moves a weight by ``lr g / (|g| + eps')`` (``eps' = eps / clip scale``, the clipped
    gradient's eps seen on the unclipped one), ~``lr`` wherever ``|g| >> eps'``. An error ``dg`` in a gradient
    element moves that by up to ``lr dg / (|g| + eps')``: nothing where the gradient is large, up to
    ``lr dg / eps'`` where it vanishes (the attention key biases' gradient is identically 0: softmax ignores a
    constant added to every score of a row). So each element is allowed
    ``lr (update_rtol + grad_rtol * norm / (|g| + eps'))``: ``update_rtol`` of the step for the weights' own
    rounding, plus a gradient error of ``grad_rtol`` times the gradient norm.

    Returns the largest ``|got - want| / lr``, the largest ratio of the error to its allowance (<= 1 passes) and
    the parameter where that ratio is reached. ``model``'s ``.grad`` must hold the pre-clip gradient.
    """
    eps_seen = eps / clip_scale(norm, max_grad_norm)
    worst_lr, worst_ratio, where = 0.0, 0.0, ""
    for name, param in model.named_parameters():
        err = (got[name].double() - param.detach()).abs()
        allowed = lr * (update_rtol + grad_rtol * norm / (param.grad.abs() + eps_seen))
        ratio = float((err / allowed).max())
        worst_lr = max(worst_lr, float(err.max()) / lr)
        if ratio > worst_ratio:
            worst_ratio, where = ratio, name
    return worst_lr, worst_ratio, where


# ------------------------------------------------------------------------------------------------ off-policy RL
# The tokens were sampled by a behaviour policy pi_behav (the rollout engine: other numerics, and in asynchronous RL
# older weights); the PPO ratio is taken against the proximal policy pi_prox (the trainer's log-probs when the step
# starts). Each token's clipped surrogate is then weighted by a detached function of
#     rho_t = pi_prox(y_t) / pi_behav(y_t).
# Default bounds, each from its source (docs/algorithms/async.md and rlhf/ops/off_policy.py cite the same):
BEHAVIOUR_DEFAULT_BOUNDS: Dict[str, Tuple[Optional[float], float]] = {
    "tis": (None, 2.0),  # Yao et al. 2025 (TIS), cap C = 2 (verl's rollout_is_threshold default)
    "mis": (None, 2.0),  # Liu et al. 2025 ("When speed kills stability", MIS), threshold 2, token level
    "icepop": (0.5, 5.0),  # Ling Team 2025 (Ring-1T), IcePop's [alpha, beta] = [0.5, 5]
    "seq_mask": (0.999, 1.001),  # verl's rollout correction, geometric rejection (geo_rs preset)
}


def behaviour_weights(
    correction: str,
    proximal_logp: Tensor,
    behaviour_logp: Tensor,
    low: Optional[float] = None,
    high: Optional[float] = None,
) -> Tensor:
    """One sample's detached per-token weights, token by token from ``rho_t = exp(log pi_prox - log pi_behav)``
    (a bound left ``None`` takes :data:`BEHAVIOUR_DEFAULT_BOUNDS`):

    * ``tis`` (Yao et al. 2025): ``w_t = min(rho_t, high)``;
    * ``mis`` (Liu et al. 2025, masked importance sampling): ``w_t = rho_t`` if ``rho_t <= high``, else 0;
    * ``icepop`` (Ling Team 2025, Ring-1T: ``M(k; alpha, beta) = k`` if ``alpha <= k <= beta``, else 0):
      ``w_t = rho_t`` if ``low <= rho_t <= high``, else 0;
    * ``seq_mask`` (verl's geometric rejection): the whole sample is kept, ``w_t = 1``, iff its geometric-mean ratio
      ``exp(mean_t log rho_t)`` is in ``[low, high]``; else ``w_t = 0`` on all its tokens (no reweighting).

    A weight of 0 removes the token's loss, never the token: it stays in the aggregation's denominator (the IcePop
    objective's ``1 / sum_i |y_i|``), so callers keep such tokens in the ragged per-token lists."""
    default_low, default_high = BEHAVIOUR_DEFAULT_BOUNDS[correction]
    low = default_low if low is None else low
    high = default_high if high is None else high
    log_rho = [p - b for p, b in zip(proximal_logp.detach().tolist(), behaviour_logp.detach().tolist())]
    rho = [math.exp(x) for x in log_rho]
    if correction == "tis":
        w = [min(r, high) for r in rho]
    elif correction == "mis":
        w = [r if r <= high else 0.0 for r in rho]
    elif correction == "icepop":
        assert low is not None, "icepop has a lower bound (BEHAVIOUR_DEFAULT_BOUNDS)"
        w = [r if low <= r <= high else 0.0 for r in rho]
    elif correction == "seq_mask":
        assert low is not None, "seq_mask has a lower bound (BEHAVIOUR_DEFAULT_BOUNDS)"
        geometric_mean = math.exp(sum(log_rho) / len(log_rho))
        w = [1.0 if low <= geometric_mean <= high else 0.0] * len(rho)
    else:
        raise ValueError(correction)
    return torch.tensor(w, dtype=torch.float64)


def decoupled_ppo_token_loss(
    logp: Tensor,
    proximal_logp: Tensor,
    behaviour_logp: Tensor,
    adv: Tensor,
    clip_low: float,
    clip_high: float,
    correction: Optional[str] = None,
    low: Optional[float] = None,
    high: Optional[float] = None,
) -> Tensor:
    """Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"), one sample, as a loss:
    PPO's clipped surrogate of ``r_t = pi(y_t) / pi_prox(y_t)`` (the trust region is around the proximal policy),
    times the detached behaviour weight ``w_t`` of :func:`behaviour_weights`:
    ``w_t max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))``. Hilton et al.'s own weight is the untruncated
    ``rho_t = pi_prox / pi_behav`` (``tis`` with an unreachable cap); ``w_t`` being positive, this equals their
    ``min(pi / pi_behav A, rho clip(r) A)``. ``correction=None``: no behaviour weight, plain PPO against
    ``pi_prox``. Only the surrogate is weighted: regularisers added next to it (a KL loss, the entropy bonus) are
    not."""
    loss, _ = ppo_token_loss(logp, proximal_logp, adv, clip_low, clip_high)
    if correction is None:
        return loss
    return loss * behaviour_weights(correction, proximal_logp, behaviour_logp, low, high)


def partial_behaviour_logps(older: Tensor, newer: Tensor, first_tokens: int) -> Tensor:
    """Partial rollouts (docs/algorithms/async.md): one response's first ``first_tokens`` tokens were sampled by
    version ``v``, the rest, continued after the weight sync, by ``v + 1``; each token's behaviour log-prob is its
    own version's (``older`` / ``newer``: the same response scored by each)."""
    return torch.cat([older[:first_tokens], newer[first_tokens:]])


# ------------------------------------------------------------------------------------------------ reward shaping
def overlong_reward(length: int, max_length: int, cache: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) for a response of ``|y| = length`` tokens, with
    ``L_max = max_length`` and the punishment interval ``L_cache = cache``, scaled by ``penalty`` (1 in the paper)::

        R_length(y) = 0                                   if |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                      -1                                  if L_max < |y|
    """
    if length <= max_length - cache:
        value = 0.0
    elif length <= max_length:
        value = ((max_length - cache) - length) / cache
    else:
        value = -1.0
    return penalty * value


# ------------------------------------------------------------------------------------------------ multi-turn
def token_logps_and_entropy(
    model, ids: Sequence[int], positions: Sequence[int], temperature: float
) -> Tuple[Tensor, Tensor]:
    """One unpadded forward of a whole sequence (an episode: prompt, responses and observations): for each column
    in ``positions`` (the policy's tokens, in order), ``log pi(ids[c])`` under the distribution predicted at
    ``c - 1``, and that distribution's entropy. Observation tokens are context only: not in ``positions``."""
    logits = model(input_ids=torch.tensor([list(ids)])).logits[0] / temperature
    log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    rows = torch.tensor([c - 1 for c in positions])
    chosen = log_p[rows, torch.tensor([ids[c] for c in positions])]
    return chosen, -(log_p[rows].exp() * log_p[rows]).sum(-1)


def turn_token_rewards(
    score: float, turn_lengths: Sequence[int], turn_rewards: Sequence[float], kl_penalty: Tensor, kl_coef: float
) -> Tensor:
    """One episode's rewards over its policy tokens in order (observation tokens are not time steps), with per-turn
    credit (docs/algorithms/multi_turn.md): ``-kl_coef KL_j`` on every token; each turn's environment reward
    (already weighted) at that turn's last policy token, a turn without tokens giving it to the latest policy token
    before it (none before it: it stays in the score); the rest of the score (``score`` minus the rewards placed)
    at the last policy token. The rewards still sum to ``score`` minus the KL penalty."""
    r = -kl_coef * kl_penalty.detach().clone()
    end, placed = -1, 0.0
    for n, reward in zip(turn_lengths, turn_rewards):
        end += n
        if end >= 0:
            r[end] = r[end] + reward
            placed += reward
    r[-1] = r[-1] + (score - placed)
    return r


# ------------------------------------------------------------------------------------------------ checking
def objective_metrics_matching(policy, objective, batch, expected: Tensor) -> Dict[str, float]:
    """Check ``objective``'s loss over ``batch`` (its sum over its count) against ``expected``, a reference loss of
    the same ``policy`` parameters: the value to 1e-11 and the gradient to 1e-10 relative (float64; the gradient
    must not vanish). Returns the objective's finalized metrics, for the caller's own checks."""
    total, sums = objective.loss(policy, batch)
    ours = total / objective.count(batch)
    value, reference = float(ours.detach()), float(expected.detach())
    assert abs(value - reference) <= 1e-11 * abs(reference), (value, reference)
    grads = []
    for loss in (ours, expected):
        policy.zero_grad(set_to_none=True)
        loss.backward()
        grads.append(torch.cat([q.grad.reshape(-1) for q in policy.parameters() if q.grad is not None]))
    policy.zero_grad(set_to_none=True)
    ours_grad, expected_grad = grads
    assert float(expected_grad.norm()) > 1e-6
    assert float((ours_grad - expected_grad).norm()) <= 1e-10 * float(expected_grad.norm())
    return objective.finalize(sums, objective.count(batch))
