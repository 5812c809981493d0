"""Group advantages and the policy losses of STAPO and its baselines (paper Sec. 3 and 5, PAPER.md Sec. 2, 3, 5).

    A_i  = (R_i - mean_j R_j) / (std_j R_j + eps)                       (unbiased std over the G rewards)
    J    = 1/N sum_i sum_t I_it min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i),   N = sum_i sum_t I_it

Every algorithm is the same clipped surrogate, `loss = sum(weights * per_token_loss) / denominator`, and differs
only in the token weights and the denominator:

    algo        weights w_it (on response tokens)          denominator                 clip (low, high)
    stapo       1 if not S2T-silenced else 0               number of kept tokens       0.2, 0.28
    justrl      1                                          number of response tokens   0.2, 0.28
    grpo        1 / |y_i| (per-sequence mean)              number of sequences         0.2, 0.2   (+ beta k3 KL)
    20-entropy  1 if H_it >= 0.8-quantile of all H else 0  number of response tokens   0.2, 0.28
    fullmask    0 if A_i > 0 and p_it < tau_p else 1       number of kept tokens       0.2, 0.28

Two-phase API, so that micro-batches (gradient accumulation) and data-parallel ranks do not change the update; the
caller (train.py) owns the concatenation and the all-reduce:
    1. `threshold_inputs` per micro-batch -> concatenate over micro-batches, all-gather over ranks
    2. `entropy_threshold` on the gathered values -> one threshold for the mini-batch
    3. `loss_weights` and `denominator_part` per micro-batch -> sum the parts over micro-batches and ranks
    4. `policy_loss(..., weights, denominator=global)` per micro-batch; the sum of the micro-batch losses (over
       ranks: the sum of the gradients, i.e. all-reduce SUM, or AVG times world size) is the mini-batch loss.

Deliberate differences / choices:
1. The token mean runs over the whole mini-batch (all micro-batches and ranks), not per micro-batch.
2. The log-ratio is clamped to [-20, 20] before exp() so that r never overflows (r <= 4.9e8); inside that range
   (always, in practice) the loss is exact.
3. Optional dual clip for A < 0 (verl's clip_ratio_c): per-token loss bounded by -dual_clip * A; off here by
   default, on with c = 10 in train.py's presets, as in the paper's veRL runs.
4. 20-Entropy keeps the top 20% by `H >= tau` (ties at the threshold kept) and divides by all response tokens
   (the formula of Wang et al. and TRL's `top_entropy_quantile`), not by the kept tokens.
5. GRPO's KL is not inside `policy_loss`: the caller adds `beta * sum(weights * kl_k3) / denominator`.
6. A denominator below 1 (only possible when nothing is kept anywhere) is raised to 1, so the loss is 0, not NaN.
"""
import torch

import s2t

ALGORITHMS = ("stapo", "justrl", "grpo", "20-entropy", "fullmask")
ALGO_CLIP = {"stapo": (0.2, 0.28), "justrl": (0.2, 0.28), "grpo": (0.2, 0.2), "20-entropy": (0.2, 0.28),
             "fullmask": (0.2, 0.28)}
ENTROPY_TOP_FRACTION = 0.2  # 20-Entropy keeps the top 20% highest-entropy response tokens of the mini-batch
LOG_RATIO_CLAMP = 20.0


def _check(algo: str) -> None:
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algo!r}; valid: {', '.join(ALGORITHMS)}")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(N,) rewards ordered group by group (rows i*G .. i*G+G-1) -> (N,) advantages (R - mean) / (std + eps).

    std is the unbiased sample std of each group; a group whose rewards are all equal gets exactly 0.
    """
    n = rewards.numel()
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (the std of one reward is undefined), got {group_size}")
    if n % group_size != 0:
        raise ValueError(f"{n} rewards is not a multiple of group_size={group_size}")
    r = rewards.detach().float().reshape(-1, group_size)  # (N/G, G)
    centered = r - r.mean(dim=1, keepdim=True)  # (N/G, G)
    adv = centered / (r.std(dim=1, unbiased=True, keepdim=True) + eps)
    adv = torch.where((r == r[:, :1]).all(dim=1, keepdim=True), torch.zeros_like(adv), adv)  # equal rewards -> 0
    return adv.reshape(-1)  # (N,)


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    # log r = log p - log p_old, clamped so that exp() cannot overflow (zero gradient beyond +-20, never reached)
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)


def _clip_active(ratio, advantages, clip_low, clip_high, dual_clip):
    """bool (B, T) masks of tokens whose gradient the clip zeroes: (low, high, dual)."""
    low = (advantages < 0) & (ratio < 1 - clip_low)  # min() picks (1 - eps_low) A, a constant
    high = (advantages > 0) & (ratio > 1 + clip_high)  # min() picks (1 + eps_high) A, a constant
    dual = (advantages < 0) & (ratio > dual_clip) if dual_clip is not None else torch.zeros_like(low)
    return low, high, dual


def surrogate_weight(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = None) -> torch.Tensor:
    """w (B, T), detached: d(objective)/d(log p) per token = r A, or 0 where a clip is active (for s2t diagnostics)."""
    ratio = _log_ratio(logprobs.detach(), old_logprobs).exp()  # (B, T)
    low, high, dual = _clip_active(ratio, advantages, clip_low, clip_high, dual_clip)
    return torch.where(low | high | dual, torch.zeros_like(ratio), ratio * advantages)  # (B, T)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                dual_clip: float | None = None, denominator=None) -> tuple[torch.Tensor, dict]:
    """Negated clipped surrogate, aggregated as sum(loss_mask * per_token_loss) / denominator.

    logprobs (B, T) differentiable, old_logprobs (B, T) of the rollout policy, advantages (B, T) (or (B, 1)),
    loss_mask (B, T) float weights (0/1, or 1/|y_i| for GRPO). denominator: float or 0-d tensor, the global number
    from `denominator_part` summed over micro-batches and ranks; default loss_mask.sum() (one-batch use).
        per_token_loss = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
        dual clip (A < 0): per_token_loss = min(per_token_loss, -dual_clip A)      (dual_clip > 1)
    stats: 0-d detached tensors on the input's device (no host sync; call .item() when logging), computed over
    the tokens with loss_mask > 0 of this call (unweighted token fractions):
        clip/frac_low   fraction with A < 0 and r < 1 - clip_low: the lower clip is active (zero gradient)
        clip/frac_high  fraction with A > 0 and r > 1 + clip_high: the upper clip is active (zero gradient)
        clip/frac_dual  (only with dual_clip) fraction with A < 0 and r > dual_clip: dual clip active
        ratio/mean      mean r
        kl/approx       mean k3 estimate of KL(pi_old || pi_theta): r - 1 - log r
        loss/tokens     number of tokens with loss_mask > 0 (to weight these means across micro-batches)
    """
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    log_ratio = _log_ratio(logprobs, old_logprobs)  # (B, T)
    ratio = log_ratio.exp()
    # min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)
    per_token_loss = -surrogate  # (B, T)
    if dual_clip is not None:
        per_token_loss = torch.where(advantages < 0, torch.minimum(per_token_loss, -dual_clip * advantages),
                                     per_token_loss)
    if denominator is None:
        denominator = loss_mask.sum()
    denominator = torch.as_tensor(denominator, device=per_token_loss.device).float()  # never a bf16 count
    loss = (loss_mask * per_token_loss).sum() / denominator.clamp(min=1)  # -1/N sum_it I_it min(...)

    with torch.no_grad():
        sel = loss_mask > 0  # (B, T)
        count = sel.sum()
        n = count.clamp(min=1).float()
        r = ratio.detach()
        low, high, dual = _clip_active(r, advantages, clip_low, clip_high, dual_clip)
        stats = {
            "clip/frac_low": (low & sel).sum() / n,
            "clip/frac_high": (high & sel).sum() / n,
            "ratio/mean": (r * sel).sum() / n,
            "kl/approx": ((r - 1 - log_ratio.detach()) * sel).sum() / n,
            "loss/tokens": count.float(),
        }
        if dual_clip is not None:
            stats["clip/frac_dual"] = (dual & sel).sum() / n
    return loss, stats


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) k3 estimate of KL(pi_theta || pi_ref) (DeepSeekMath): exp(ref - logp) - (ref - logp) - 1 >= 0.

    Differentiable in logprobs. GRPO adds `beta * (weights * kl_k3(...)).sum() / denominator` to the policy loss.
    """
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    return d.exp() - d - 1


def threshold_inputs(algo: str, logprobs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor,
                     response_mask: torch.Tensor, tau_p: float = 0.002) -> torch.Tensor:
    """1-D detached tensor of the entropies the mini-batch threshold is taken over (phase 1).

    stapo: entropies of the S2T candidates; 20-entropy: of all response tokens; others: empty.
    """
    _check(algo)
    if algo == "stapo":
        sel = s2t.candidates(logprobs, advantages, response_mask, tau_p)  # (B, T)
    elif algo == "20-entropy":
        sel = response_mask > 0
    else:
        sel = torch.zeros_like(response_mask, dtype=torch.bool)
    return entropy.detach()[sel]  # (n,)


def entropy_threshold(algo: str, values: torch.Tensor, quantile: float = 0.75) -> float | None:
    """The mini-batch entropy threshold from the gathered `threshold_inputs` (phase 2).

    stapo: tau_h = `quantile`-quantile of the candidate entropies (None if there are none: silence nothing);
    20-entropy: the (1 - ENTROPY_TOP_FRACTION) = 0.8-quantile of all response entropies (`quantile` unused);
    others: None.
    """
    _check(algo)
    if algo == "stapo":
        return s2t.quantile_of(values, quantile)
    if algo == "20-entropy":
        return s2t.quantile_of(values, 1 - ENTROPY_TOP_FRACTION)
    return None


def loss_weights(algo: str, logprobs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, tau_p: float = 0.002,
                 threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (B, T) float, silenced (B, T) bool) of one micro-batch (phase 3); see the table above.

    silenced marks response tokens the algorithm removes (S2T mask, FullMask mask, 20-Entropy's low-entropy 80%).
    """
    _check(algo)
    mask = (response_mask > 0).float()  # (B, T)
    if algo == "stapo":
        silenced = s2t.spurious_mask_at(logprobs, entropy, advantages, response_mask, tau_p, threshold)
    elif algo == "fullmask":
        silenced = s2t.candidates(logprobs, advantages, response_mask, tau_p)  # every candidate, no entropy test
    elif algo == "20-entropy" and threshold is not None:  # None only if the mini-batch has no response tokens
        silenced = (mask > 0) & (entropy.detach() < threshold)  # keep H >= tau: the top 20%
    else:  # justrl, grpo (and 20-entropy on a mini-batch without response tokens)
        silenced = torch.zeros_like(mask, dtype=torch.bool)
    weights = mask * (~silenced).float()  # (B, T)
    if algo == "grpo":
        weights = weights / mask.sum(dim=1, keepdim=True).clamp(min=1)  # 1/|y_i|: per-sequence mean
    return weights, silenced


def denominator_part(algo: str, weights: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the global denominator (phase 3), a 0-d float tensor; sum over micro-batches
    and ranks. stapo/justrl/fullmask: kept tokens; 20-entropy: all response tokens; grpo: sequences with at
    least one response token."""
    _check(algo)
    mask = response_mask > 0  # (B, T)
    if algo == "grpo":
        return mask.any(dim=1).sum().float()
    if algo == "20-entropy":
        return mask.sum().float()
    return weights.sum()
