"""Group advantages and the policy losses of STAPO and its baselines (docs/paper.md §2, §3, §5).

    A_i = (R_i - mean_j R_j) / (std_j R_j + eps)                (unbiased std over the G rewards)
    J   = 1/N sum_i sum_t I_it min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)

Every algorithm is this clipped surrogate, `loss = sum(weights * per_token_loss) / denominator`, and
differs only in the token weights and the denominator (`ALGORITHMS`, the table as data):

    algo        weights w_it (on response tokens)          denominator      clip (low, high)
    stapo       1 if not S2T-silenced else 0               kept tokens      0.2, 0.28
    justrl      1                                          response tokens  0.2, 0.28
    grpo        1 / |y_i| (per-sequence mean)              sequences        0.2, 0.2 (+ k3 KL)
    20-entropy  1 if H_it >= 0.8-quantile of all H else 0  response tokens  0.2, 0.28
    fullmask    0 if A_i > 0 and p_it < tau_p else 1       kept tokens      0.2, 0.28
    randmask    0 on a random subset of the candidates of  kept tokens      0.2, 0.28
                S2T's size, else 1 (control)
    highmask    0 on the candidates S2T keeps, else 1      kept tokens      0.2, 0.28
`token_weights` makes one mini-batch's weights and this rank's share of N (thresholds over the whole
mini-batch through a `gather` over ranks). Deliberate differences D31-D37: docs/paper.md.
"""
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

import s2t



@dataclass(frozen=True)
class Algorithm:
    """One row of the table above."""
    clip: tuple[float, float]  # (eps_low, eps_high) of the ratio clip
    # weight 0 for: "s2t" (the S2T mask), "candidates" (FullMask: every A > 0, p < tau_p token),
    # "low_entropy" (20-Entropy: H below the 0.8-quantile of the mini-batch), "random" (as many
    # candidates as S2T silences, at random), "high_entropy" (the candidates S2T keeps), None
    silence: str | None
    denominator: str  # N = "kept" tokens, "response" tokens, or "sequences" (GRPO: weights 1/|y_i|)


ALGORITHMS = {
    "stapo": Algorithm((0.2, 0.28), "s2t", "kept"),
    "justrl": Algorithm((0.2, 0.28), None, "kept"),  # nothing silenced: kept = response tokens
    "grpo": Algorithm((0.2, 0.2), None, "sequences"),
    "20-entropy": Algorithm((0.2, 0.28), "low_entropy", "response"),
    "fullmask": Algorithm((0.2, 0.28), "candidates", "kept"),
    "randmask": Algorithm((0.2, 0.28), "random", "kept"),  # the paper's random-masking control
    "highmask": Algorithm((0.2, 0.28), "high_entropy", "kept"),  # the high-entropy-masking control
}
ENTROPY_TOP_FRACTION = 0.2  # 20-Entropy keeps the mini-batch's 20% highest-entropy response tokens
LOG_RATIO_CLAMP = 20.0


def algorithm(name: str) -> Algorithm:
    """ALGORITHMS[name] (--algo NAME), or a ValueError naming the valid ones."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown --algo {name!r}; valid: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def clip_range(algo: str, clip_low: float | None = None,
               clip_high: float | None = None) -> tuple[float, float]:
    """(eps_low, eps_high) of the ratio clip: clip_low / clip_high (--clip-low, --clip-high), or
    where None the algorithm's (ALGORITHMS)."""
    low, high = algorithm(algo).clip
    return low if clip_low is None else clip_low, high if clip_high is None else clip_high


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(N,) rewards ordered group by group (rows i*G .. i*G+G-1) -> (N,) advantages
    (R - mean) / (std + eps).

    std is the unbiased sample std of each group; a group whose rewards are all equal gets
    exactly 0.
    """
    n = rewards.numel()
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (the std of one reward is undefined), "
                         f"got {group_size}")
    if n % group_size != 0:
        raise ValueError(f"{n} rewards is not a multiple of group_size={group_size}")
    r = rewards.detach().float().reshape(-1, group_size)  # (N/G, G)
    centered = r - r.mean(dim=1, keepdim=True)  # (N/G, G)
    adv = centered / (r.std(dim=1, unbiased=True, keepdim=True) + eps)
    tied = (r == r[:, :1]).all(dim=1, keepdim=True)  # equal rewards -> 0
    adv = torch.where(tied, torch.zeros_like(adv), adv)
    return adv.reshape(-1)  # (N,)


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    # log r = log p - log p_old, clamped so that exp() cannot overflow (zero gradient beyond +-20,
    # never reached; D32)
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)


def _clip_active(ratio, advantages, clip_low, clip_high, dual_clip):
    """bool (B, T) masks of tokens whose gradient the clip zeroes: (low, high, dual)."""
    low = (advantages < 0) & (ratio < 1 - clip_low)  # min() picks (1 - eps_low) A, a constant
    high = (advantages > 0) & (ratio > 1 + clip_high)  # min() picks (1 + eps_high) A, a constant
    dual = (advantages < 0) & (ratio > dual_clip) if dual_clip is not None \
        else torch.zeros_like(low)
    return low, high, dual


def surrogate_weight(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     clip_low: float = 0.2, clip_high: float = 0.28,
                     dual_clip: float | None = None) -> torch.Tensor:
    """w (B, T), detached: d(objective)/d(log p) per token = r A, or 0 where a clip is active (for
    s2t diagnostics)."""
    ratio = _log_ratio(logprobs.detach(), old_logprobs).exp()  # (B, T)
    low, high, dual = _clip_active(ratio, advantages, clip_low, clip_high, dual_clip)
    return torch.where(low | high | dual, torch.zeros_like(ratio), ratio * advantages)  # (B, T)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                weights: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                dual_clip: float | None = None, denominator=None) -> tuple[torch.Tensor, dict]:
    """Negated clipped surrogate, aggregated as sum(weights * per_token_loss) / denominator.

    logprobs (B, T) differentiable, old_logprobs (B, T) of the rollout policy, advantages (B, T) (or
    (B, 1)), weights (B, T) the token weights I_it (0/1, or 1/|y_i| for GRPO). denominator: float or
    0-d tensor, the global N (`token_weights`' shares summed over ranks); default weights.sum()
    (one-batch use).
        per_token_loss = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
        dual clip (A < 0): per_token_loss = min(per_token_loss, -dual_clip A)      (dual_clip > 1)
    stats: 0-d detached tensors on the input's device (no host sync; call .item() when logging),
    computed over the tokens with weights > 0 of this call (unweighted token fractions):
        clip/frac_low   fraction with A < 0 and r < 1 - clip_low: the lower clip active (no grad)
        clip/frac_high  fraction with A > 0 and r > 1 + clip_high: the upper clip active (no grad)
        clip/frac_dual  (with dual_clip only) fraction with A < 0 and r > dual_clip: dual clip on
        ratio/mean      mean r
        kl/approx       mean k3 estimate of KL(pi_old || pi_theta): r - 1 - log r
        loss/tokens     number of tokens with weights > 0 (weighs these means over micro-batches)
    """
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    log_ratio = _log_ratio(logprobs, old_logprobs)  # (B, T)
    ratio = log_ratio.exp()
    # min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    surrogate = torch.minimum(ratio * advantages,
                              ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)
    per_token_loss = -surrogate  # (B, T)
    if dual_clip is not None:  # verl's dual clip for A < 0 (D33)
        per_token_loss = torch.where(advantages < 0,
                                     torch.minimum(per_token_loss, -dual_clip * advantages),
                                     per_token_loss)
    if denominator is None:
        denominator = weights.sum()
    # never a bf16 count
    denominator = torch.as_tensor(denominator, device=per_token_loss.device).float()
    loss = (weights * per_token_loss).sum() / denominator.clamp(min=1)  # -1/N sum I min(...) (D36)

    with torch.no_grad():
        sel = weights > 0  # (B, T)
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


# policy_loss's means
CLIP_STATS = ("clip/frac_low", "clip/frac_high", "clip/frac_dual", "ratio/mean", "kl/approx")


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) k3 estimate of KL(pi_theta || pi_ref) (DeepSeekMath):
    exp(ref - logp) - (ref - logp) - 1 >= 0.

    Differentiable in logprobs; GRPO's loss adds beta * `kl_term`.
    """
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    return d.exp() - d - 1


def kl_term(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, weights: torch.Tensor,
            denominator: float) -> torch.Tensor:
    """GRPO's KL term, 0-d, differentiable in logprobs: sum(I * k3) / N (the loss adds it times
    --kl-beta). logprobs, ref_logprobs, weights (B, T); denominator: the global N."""
    return (weights * kl_k3(logprobs, ref_logprobs)).sum() / max(denominator, 1.0)


def tis_weight(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
               cap: float) -> torch.Tensor:
    """(B, T) truncated importance-sampling weight for the mismatch between the rollout engine and
    the trainer's pi_old (verl's / TRL's TIS, Yao et al. 2025), a constant (no gradient flows
    through it):

        w_t = min(pi_old(y_t) / pi_sampler(y_t), C)

    `token_weights` multiplies the token weights by it after N is counted (the token mean stays
    over tokens)."""
    # (B, T) log pi_old / pi_sampler
    d = (old_logprobs - sampler_logprobs).detach().clamp(max=LOG_RATIO_CLAMP)
    return d.exp().clamp(max=cap)


class TokenWeights(NamedTuple):
    """One mini-batch's decision (this rank's rows of it): what the step weighs its tokens by."""
    weights: torch.Tensor  # (B, T) float: the token weights I_it (GRPO: I_it / |y_i|; TIS: * w_t)
    silenced: torch.Tensor  # (B, T) bool: response tokens the algorithm removes
    threshold: float | None  # the mini-batch's entropy threshold (S2T's tau_h, 20-Entropy's), None
    share: torch.Tensor  # 0-d float: this rank's share of N (summed over ranks: N)
    rule: torch.Tensor | None  # (B, T) bool: what S2T's rule silences, whatever the algorithm does
    # (None: not applied, on policy)


@dataclass(frozen=True)
class MiniBatchContext:
    """What this rank's rows of a mini-batch need from outside them; the default: one process
    holds the whole mini-batch, the paper's rule, no option.
    gather: concatenates a 1-D tensor over ranks (all_gather_cat), so entropy thresholds are over
    the whole mini-batch; None: this process holds the whole mini-batch.
    seed, rows, length: randmask's keys (s2t.random_keys), seeded per mini-batch, each row's by its
    place in the whole mini-batch (rows; None: 0..B-1) up to the run's longest response (length;
    None: T), so the silenced positions are the same on any number of ranks.
    window: --quantile-window's earlier candidates (s2t.QuantileWindow), which this mini-batch's
    candidates then join; None: the paper's rule.
    tis: (B, T) truncated importance-sampling weights (`tis_weight`), applied after N is counted
    (the token mean stays over tokens); None: no TIS.
    known: p and H are the current policy's before the update; False on policy (train.on_policy),
    where only the update's forward gives them: S2T's rule is then not applied here."""
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    seed: int = 0
    rows: range | None = None
    length: int | None = None
    window: s2t.QuantileWindow | None = None
    tis: torch.Tensor | None = None
    known: bool = True


def token_weights(algo: str, logprobs: torch.Tensor | None, entropy: torch.Tensor | None,
                  advantages: torch.Tensor, response_mask: torch.Tensor, tau_p: float = 0.002,
                  quantile: float = 0.75,
                  context: MiniBatchContext = MiniBatchContext()) -> TokenWeights:
    """The token weights of one mini-batch (this rank's rows of it) and its share of the denominator
    N.

    logprobs, entropy (B, T) of the current policy (unread when not `context.known`); advantages
    (B, T) (or (B, 1)); response_mask (B, T) 0/1; context: the other ranks' rows, randmask's keys,
    the window, TIS, whether p and H are known (`MiniBatchContext`).
    """
    a, gather, window = algorithm(algo), context.gather, context.window
    mask = response_mask > 0  # (B, T)
    silenced, threshold, rule, tau_h = torch.zeros_like(mask), None, None, None
    if context.known:  # S2T's rule, whatever the algorithm silences (the metrics read it)
        rule, tau_h = s2t.spurious_mask(logprobs, entropy, advantages, response_mask, tau_p,
                                        quantile, gather, None if window is None else window.values)
        if window is not None:  # the mini-batch's candidates join the window (ranks in order)
            cand = entropy.detach()[s2t.candidates(logprobs, advantages, response_mask, tau_p)]
            window.add(cand if gather is None else gather(cand))
    elif a.silence is not None:
        raise ValueError(f"--algo {algo} reads p and H before the update: it cannot run on policy")
    if a.silence in ("s2t", "random", "high_entropy"):
        silenced, threshold = rule, tau_h
    if a.silence == "random":  # S2T's count over the whole mini-batch, at random candidates
        B, T = mask.shape
        keys = s2t.random_keys(context.seed, context.rows or range(B), context.length or T)
        count = silenced.sum().float().reshape(1)  # (1,) this rank's S2T count
        n = int((count if gather is None else gather(count)).sum().item())
        silenced = s2t.random_subset(s2t.candidates(logprobs, advantages, response_mask, tau_p), n,
                                     keys[:, :T], gather)
    elif a.silence == "high_entropy":  # the candidates S2T keeps: H >= tau_h
        silenced = s2t.candidates(logprobs, advantages, response_mask, tau_p) & ~silenced
    elif a.silence == "candidates":
        # every candidate, no entropy test
        silenced = s2t.candidates(logprobs, advantages, response_mask, tau_p)
    elif a.silence == "low_entropy":
        values = entropy.detach()[mask]  # (n,) every response token's entropy
        threshold = s2t.quantile_of(values if gather is None else gather(values),
                                    1 - ENTROPY_TOP_FRACTION)
        if threshold is not None:  # None only if the mini-batch has no response tokens
            silenced = mask & (entropy.detach() < threshold)  # keep H >= tau: top 20% (D34)
    weights = (mask & ~silenced).float()  # (B, T): I_it
    if a.denominator == "sequences":  # GRPO: 1/|y_i| per token, N = sequences with a response token
        weights = weights / mask.float().sum(dim=1, keepdim=True).clamp(min=1)
        part = mask.any(dim=1).sum().float()
    elif a.denominator == "response":  # 20-Entropy: N = all response tokens (D34)
        part = mask.sum().float()
    else:  # N = sum_i sum_t I_it
        part = weights.sum()
    if context.tis is not None:  # TIS: I_it * min(pi_old / pi_sampler, C), N as counted (D37)
        weights = weights * context.tis
    return TokenWeights(weights, silenced, threshold, part, rule)
