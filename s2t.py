"""S2T, Silencing Spurious Tokens: the token mask of STAPO (docs/paper.md §4).

A response token is spurious (silenced, I_it = 0) iff all three hold:
    1. A_i > 0         it sits in a better-than-average (correct) response,
    2. p_it < tau_p    low probability under the current policy (tau_p = 0.002),
    3. H_it < tau_h    low entropy, tau_h = q-quantile (q = 0.75) of the entropies of the
                       *candidates* (tokens meeting 1 and 2) of the whole mini-batch.
The gradient of a token's objective w.r.t. its logits has norm |w| sqrt(1 - 2p + sum_v p_v^2),
w = r A (`grad_norm_logits`): low p and low H (large sum p^2) give the largest, spurious updates.
What S2T saw and did, for the metrics, is step_metrics/s2t_diagnostics.py. Deliberate differences
D24-D30: docs/paper.md, "Deliberate differences".
"""
from __future__ import annotations

import math

import torch


def quantile_of(values: torch.Tensor, q: float) -> float | None:
    """torch.quantile(values, q) (linear interpolation) for a tensor of any size; None if it is
    empty."""
    values = values.detach().reshape(-1)  # (n,)
    n = values.numel()
    if n == 0:
        return None
    pos = q * (n - 1)  # fractional rank (0-based) of the quantile in the sorted values
    lo, hi = math.floor(pos), math.ceil(pos)
    v_lo, v_hi = values.sort().values[[lo, hi]].double().tolist()  # not torch.quantile (D26)
    return v_lo + (pos - lo) * (v_hi - v_lo)


def candidates(logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
               tau_p: float = 0.002) -> torch.Tensor:
    """bool (B, T): response tokens with A > 0 and p < tau_p (conditions 1 and 2).

    logprobs (B, T) of the current policy; advantages (B, T) (or (B, 1)); response_mask (B, T) 0/1.
    """
    # p_it < tau_p  <=>  log p_it < log tau_p (D25)
    return (advantages > 0) & (logprobs.detach() < math.log(tau_p)) & (response_mask > 0)  # (B, T)


def spurious_mask(logprobs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, tau_p: float = 0.002, quantile: float = 0.75,
                  gather=None,
                  earlier: torch.Tensor | None = None) -> tuple[torch.Tensor, float | None]:
    """The whole S2T rule on one mini-batch -> (silenced bool (B, T), tau_h or None if there are no
    candidates).

    logprobs, entropy (B, T) of the current policy; advantages (B, T) (or (B, 1)); response_mask
    (B, T) 0/1.
    gather: a function that concatenates a 1-D tensor over the data-parallel ranks (all_gather_cat),
    so that tau_h is the quantile over the whole mini-batch when each rank holds a share of its
    rows; None: one process.
    earlier (n',): entropies of candidates before this mini-batch pooled into the quantile
    (--quantile-window, D30); None: the paper's rule."""
    cand = candidates(logprobs, advantages, response_mask, tau_p)  # (B, T): conditions 1 and 2
    values = entropy.detach()[cand]  # (n,) entropies of this rank's candidates
    values = values if gather is None else gather(values)  # (n_all,) the whole mini-batch's (D27)
    if earlier is not None and values.numel():  # D30 (no candidate here: none silenced)
        values = torch.cat([earlier.to(values), values])  # (n' + n_all,): and the window's
    tau_h = quantile_of(values, quantile)  # q-quantile over the mini-batch's candidates
    if tau_h is None:  # no candidates anywhere: nothing is silenced (D28)
        return torch.zeros_like(cand), None
    return cand & (entropy.detach() < tau_h), tau_h  # condition 3, strict (D24)


class QuantileWindow:
    """--quantile-window (D30): tau_h also pools the entropies of the last `size` candidates
    before this mini-batch (all ranks' in the mini-batch's row order, oldest first, on the CPU), so
    a mini-batch with few candidates gets a steadier threshold. The same on any number of ranks;
    train.py keeps `values` in checkpoints."""

    def __init__(self, size: int, values: torch.Tensor | None = None):
        self.size = size
        self.values = torch.zeros(0) if values is None else values  # (<= size,)

    def add(self, entropies: torch.Tensor) -> None:
        """A mini-batch's candidates (n,) join the window; the oldest beyond `size` leave it."""
        self.values = torch.cat([self.values, entropies.detach().float().cpu()])[-self.size:]


def random_keys(seed: int, rows: range, length: int) -> torch.Tensor:
    """(len(rows), length) uniform keys in [0, 1) for `random_subset`: row r's keys come from a
    generator seeded by (seed, r) alone, r the row's index in the whole mini-batch, so a token's key
    does not depend on which rank or micro-batch holds it. length: the run's longest response (a
    fixed value, so that rows padded to different lengths on different ranks read the same keys;
    cut the result to the rows' T)."""
    keys = torch.empty(len(rows), length)
    for i, r in enumerate(rows):
        keys[i] = torch.rand(length,
                             generator=torch.Generator().manual_seed(hash((seed, r)) % 2**62))
    return keys  # (b, length)


def random_subset(cand: torch.Tensor, n: int, keys: torch.Tensor, gather=None) -> torch.Tensor:
    """bool (B, T): the n candidates of the whole mini-batch with the smallest keys (RandMask: S2T's
    count, random positions). cand (B, T) bool; keys (B, T) from `random_keys`; gather as in
    `spurious_mask`."""
    values = keys.to(cand.device)[cand]  # (n_local,) keys of this rank's candidates
    every = values if gather is None else gather(values)  # (n_all,) all candidates' keys, any order
    if n == 0 or every.numel() == 0:
        return torch.zeros_like(cand)
    kth = every.sort().values[min(n, every.numel()) - 1]  # the n-th smallest key (D29)
    return cand & (keys.to(cand.device) <= kth)  # (B, T); keys are distinct almost surely


def grad_norm_logits(w: torch.Tensor, logprobs: torch.Tensor,
                     collision: torch.Tensor) -> torch.Tensor:
    """||d(w log p_k)/dz|| = |w| sqrt(1 - 2 p_k + sum_v p_v^2), elementwise (B, T).

    z are the logits at the position, k the sampled token, w = r A the weight of d log p_k (0 where
    the clip is active, see stapo.surrogate_weight), collision = sum_v p_v^2 from the same pass as
    the entropy."""
    p = logprobs.detach().exp()
    # d log p_k / dz = e_k - p  ->  ||e_k - p||^2 = 1 - 2 p_k + sum_v p_v^2 (clamped at 0: rounding)
    return w.detach().abs() * (1 - 2 * p + collision.detach()).clamp(min=0).sqrt()  # (B, T)
