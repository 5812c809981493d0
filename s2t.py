"""S2T, Silencing Spurious Tokens: the token mask of STAPO and its diagnostics (docs/paper.md §4).

A response token is spurious (silenced, I_it = 0) iff all three hold:
    1. A_i > 0                 it sits in a better-than-average (correct) response,
    2. p_it < tau_p            low probability under the current policy (tau_p = 0.002),
    3. H_it < tau_h            low entropy, tau_h = q-quantile (q = 0.75) of the entropies of the *candidates*
                               (tokens meeting 1 and 2) of the whole mini-batch.
The gradient of a token's objective w.r.t. its logits has norm |w| sqrt(1 - 2p + sum_v p_v^2), w = r A
(`grad_norm_logits`): low p and low H (large sum p^2) give the largest, spurious updates.
A low-probability token with A > 0 also raises its position's entropy when it is reinforced; `entropy_change`
measures what one update did to the entropy at silenced, kept-candidate and other positions. `token_sample` draws
the tokens of the (p, H) picture of what S2T saw, `token_record` makes them a line of tokens.jsonl.

Deliberate differences / choices the paper leaves open:
1. Condition 3 is strict (H < tau_h) and tau_h uses torch.quantile's linear interpolation, so a lone candidate is
   kept and with q = 0.75 "about 75%" of candidates are silenced (exactly 3 of 4, 3 of 5, 6 of 8, ...).
2. Condition 2 is tested as log p < log tau_p, which avoids rounding in exp() for tokens at the boundary.
3. `quantile_of` does not call torch.quantile (limited to 2^24 elements) but sorts and interpolates the same way,
   so it also serves 20-Entropy thresholds over millions of tokens (kthvalue was rejected: quadratic on sorted
   input on CPU).
4. `spurious_mask` takes the mini-batch's p and H at once (train.py computes them for all of a rank's rows before
   splitting them into micro-batches) and a `gather` over ranks, so tau_h never depends on how rows are split.
5. No candidates in the mini-batch: nothing is silenced (threshold None).
6. The paper's controls (stapo.ALGORITHMS `randmask`, `highmask`): `random_subset` silences as many candidates as
   S2T would, chosen by random keys that depend only on (the run's seed, step, mini-batch, the token's row in the
   whole mini-batch, its column), never on how rows are split over ranks or micro-batches; `highmask` silences the
   candidates S2T keeps (H >= tau_h).
7. --quantile-window N (default 0, the paper's rule): tau_h is the quantile over the mini-batch's candidates and
   the N candidates before them (`spurious_mask`'s `earlier`, `window_after`): the paper's mini-batches hold hundreds
   of candidates, ours a handful, and a lone candidate sets tau_h to its own entropy (docs/paper.md).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model import TokenStats


def quantile_of(values: torch.Tensor, q: float) -> float | None:
    """torch.quantile(values, q) (linear interpolation) for a tensor of any size; None if it is empty."""
    values = values.detach().reshape(-1)  # (n,)
    n = values.numel()
    if n == 0:
        return None
    pos = q * (n - 1)  # fractional rank (0-based) of the quantile in the sorted values
    lo, hi = math.floor(pos), math.ceil(pos)
    v_lo, v_hi = values.sort().values[[lo, hi]].double().tolist()
    return v_lo + (pos - lo) * (v_hi - v_lo)


def candidates(logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
               tau_p: float = 0.002) -> torch.Tensor:
    """bool (B, T): response tokens with A > 0 and p < tau_p (conditions 1 and 2).

    logprobs (B, T) of the current policy; advantages (B, T) (or (B, 1)); response_mask (B, T) 0/1.
    """
    # p_it < tau_p  <=>  log p_it < log tau_p
    return (advantages > 0) & (logprobs.detach() < math.log(tau_p)) & (response_mask > 0)  # (B, T)


def spurious_mask(logprobs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, tau_p: float = 0.002, quantile: float = 0.75,
                  gather=None, earlier: torch.Tensor | None = None) -> tuple[torch.Tensor, float | None]:
    """The whole S2T rule on one mini-batch -> (silenced bool (B, T), tau_h or None if there are no candidates).

    logprobs, entropy (B, T) of the current policy; advantages (B, T) (or (B, 1)); response_mask (B, T) 0/1.
    gather: a function that concatenates a 1-D tensor over the data-parallel ranks (all_gather_cat), so that
    tau_h is the quantile over the whole mini-batch when each rank holds a share of its rows; None: one process.
    earlier (n',): entropies of candidates before this mini-batch pooled into the quantile (--quantile-window,
    choice 7); None: the paper's rule.
    """
    cand = candidates(logprobs, advantages, response_mask, tau_p)  # (B, T): conditions 1 and 2
    values = entropy.detach()[cand]  # (n,) entropies of this rank's candidates
    values = values if gather is None else gather(values)  # (n_all,) the whole mini-batch's
    if earlier is not None and values.numel():  # choice 7: and the window's (no candidate here: none silenced)
        values = torch.cat([earlier.to(values), values])  # (n' + n_all,)
    tau_h = quantile_of(values, quantile)  # q-quantile over the mini-batch's candidates
    if tau_h is None:  # no candidates anywhere: nothing is silenced (choice 5)
        return torch.zeros_like(cand), None
    return cand & (entropy.detach() < tau_h), tau_h  # condition 3, strict (choice 1)


def window_after(window: torch.Tensor, entropies: torch.Tensor, size: int) -> torch.Tensor:
    """--quantile-window (choice 7): the entropies of the last `size` candidates once a mini-batch's candidates
    (entropies (n,), all ranks' in the mini-batch's row order, `spurious_mask`'s `gather`) follow the window's
    (n',), oldest first, on the CPU. The same on any number of ranks; train.py keeps it in checkpoints."""
    return torch.cat([window, entropies.detach().float().cpu()])[-size:] if size else window  # (<= size,)


def random_keys(seed: int, rows: range, length: int) -> torch.Tensor:
    """(len(rows), length) uniform keys in [0, 1) for `random_subset`: row r's keys come from a generator seeded by
    (seed, r) alone, r the row's index in the whole mini-batch, so a token's key does not depend on which rank or
    micro-batch holds it. length: the run's longest response (a fixed value, so that rows padded to different
    lengths on different ranks read the same keys; cut the result to the rows' T)."""
    keys = torch.empty(len(rows), length)
    for i, r in enumerate(rows):
        keys[i] = torch.rand(length, generator=torch.Generator().manual_seed(hash((seed, r)) % 2**62))
    return keys  # (b, length)


def random_subset(cand: torch.Tensor, n: int, keys: torch.Tensor, gather=None) -> torch.Tensor:
    """bool (B, T): the n candidates of the whole mini-batch with the smallest keys (RandMask: S2T's count, random
    positions). cand (B, T) bool; keys (B, T) from `random_keys`; gather as in `spurious_mask`."""
    values = keys.to(cand.device)[cand]  # (n_local,) keys of this rank's candidates
    every = values if gather is None else gather(values)  # (n_all,) every candidate's key, any order
    if n == 0 or every.numel() == 0:
        return torch.zeros_like(cand)
    kth = every.sort().values[min(n, every.numel()) - 1]  # the n-th smallest key (keys are distinct almost surely)
    return cand & (keys.to(cand.device) <= kth)  # (B, T)


def grad_norm_logits(w: torch.Tensor, logprobs: torch.Tensor, collision: torch.Tensor) -> torch.Tensor:
    """||d(w log p_k)/dz|| = |w| sqrt(1 - 2 p_k + sum_v p_v^2), elementwise (B, T).

    z are the logits at the position, k the sampled token, w = r A the weight of d log p_k (0 where the clip is
    active, see stapo.surrogate_weight), collision = sum_v p_v^2 from the same pass as the entropy.
    """
    p = logprobs.detach().exp()
    # d log p_k / dz = e_k - p  ->  ||e_k - p||^2 = 1 - 2 p_k + sum_v p_v^2 (clamped at 0 against rounding)
    return w.detach().abs() * (1 - 2 * p + collision.detach()).clamp(min=0).sqrt()  # (B, T)


def diagnostics(stats: TokenStats, advantages: torch.Tensor, response_mask: torch.Tensor, silenced: torch.Tensor,
                tau_p: float = 0.002, grad_norm: torch.Tensor | None = None) -> dict[str, float]:
    """Sums and counts (python floats) of one mask on one mini-batch, to be added over mini-batches and ranks and
    divided once (train.StepLog): call it once on the whole mini-batch. stats: p, H and collision of the current
    policy (model.TokenStats, each (B, T)).

    candidates       number of candidates (A > 0, p < tau_p)
    silenced, kept   number of silenced and of kept response tokens
    silenced_p       sum of p over silenced tokens                  (the metric s2t/silenced_p_mean = / silenced)
    silenced_h       sum of the entropy over silenced tokens
    gn_silenced      sum of |w| sqrt(1 - 2p + sum p^2) over silenced tokens
    gn_kept          the same over kept response tokens             (s2t/grad_norm_kept = / kept)
    grad_norm (B, T): `grad_norm_logits` of each token, by default with w = the advantages, i.e. ratio r = 1
    (pi_theta = pi_old, the first mini-batch of a rollout).
    """
    logprobs, entropy, collision = stats
    mask = response_mask > 0  # (B, T)
    silenced = silenced & mask
    kept = mask & ~silenced
    g = grad_norm_logits(advantages.expand_as(logprobs), logprobs, collision) if grad_norm is None else grad_norm

    def total(x, sel):  # sum over the selected tokens, in float64
        return x.detach()[sel].double().sum().item()

    return {
        "candidates": float(candidates(logprobs, advantages, response_mask, tau_p).sum().item()),
        "silenced": float(silenced.sum().item()),
        "kept": float(kept.sum().item()),
        "silenced_p": total(logprobs.exp(), silenced),
        "silenced_h": total(entropy, silenced),
        "gn_silenced": total(g, silenced),
        "gn_kept": total(g, kept),
    }


def entropy_change(entropy_before: torch.Tensor, entropy_after: torch.Tensor, response_mask: torch.Tensor,
                   silenced: torch.Tensor, candidates: torch.Tensor) -> dict[str, float]:
    """What one update did to the entropy of the positions of one mini-batch, per kind of token (the paper's "Entropy
    Update Mechanism": reinforcing a low-probability token with A > 0 raises its position's entropy).

    entropy_before, entropy_after (B, T): H_it of the same rows before and after the optimizer step; response_mask
    (B, T) 0/1; silenced (B, T) bool: the algorithm's mask; candidates (B, T) bool: A > 0 and p < tau_p. Returns sums
    of dH = H_after - H_before and token counts (python floats; sum them over mini-batches and ranks, then divide):
        entropy_change/silenced_sum, _n     silenced response tokens
        entropy_change/candidate_sum, _n    candidates the algorithm kept
        entropy_change/other_sum, _n        every other response token
    """
    mask = response_mask > 0  # (B, T)
    delta = (entropy_after.detach() - entropy_before.detach()).float()  # (B, T) dH
    silenced = silenced & mask
    kinds = {"silenced": silenced, "candidate": candidates & mask & ~silenced,
             "other": mask & ~candidates & ~silenced}
    out = {}
    for kind, sel in kinds.items():
        out[f"entropy_change/{kind}_sum"] = delta[sel].sum().item()
        out[f"entropy_change/{kind}_n"] = float(sel.sum().item())
    return out


TOKEN_KINDS = ("candidate", "low_p", "high_p_pos", "high_p_rest")  # by p < tau_p and the sign of A
PARTS = ("graded", "after")  # up to and including the answer the reward reads, and the text after it


def token_cells(logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                graded: torch.Tensor, tau_p: float = 0.002) -> dict[str, torch.Tensor]:
    """bool (B, T) masks that split the response tokens into kind x part, e.g. "candidate_after":
        candidate      A > 0, p < tau_p (what S2T can silence)
        low_p          p < tau_p, A <= 0 (other low-probability tokens)
        high_p_pos     p >= tau_p, A > 0 (reinforced tokens S2T never sees)
        high_p_rest    p >= tau_p, A <= 0
    graded (B, T) bool: the tokens up to and including the answer the reward reads (train.graded_tokens)."""
    mask = response_mask > 0  # (B, T)
    low = logprobs.detach() < math.log(tau_p)  # (B, T)
    pos = (advantages > 0).expand_as(mask)  # (B, T)
    kinds = {"candidate": mask & low & pos, "low_p": mask & low & ~pos, "high_p_pos": mask & ~low & pos,
             "high_p_rest": mask & ~low & ~pos}
    return {f"{kind}_{part}": sel & (graded if part == "graded" else ~graded)
            for kind, sel in kinds.items() for part in PARTS}


def token_sample(stats: TokenStats, advantages: torch.Tensor, response_mask: torch.Tensor, silenced: torch.Tensor,
                 n_random: int, generator: torch.Generator, tau_p: float = 0.002,
                 w: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A small sample of one mini-batch's response tokens for the (p, H) picture of what S2T saw.

    Every token that is a candidate (A > 0, p < tau_p) or silenced is drawn, at most `n_random` of them (a uniform
    random subset beyond that), plus `n_random` of the other response tokens uniformly at random (`generator`).
    Returns 1-D tensors over the drawn tokens, in (row, col) order: `row`, `col` (long), `p`, `H`, `A`, `grad_norm`
    (`grad_norm_logits` with w, default A), `candidate`, `silenced` (bool) and `weight`, the number of the
    mini-batch's tokens of the same kind (special or other) each drawn token stands for (1 when all were drawn).
    Inputs are (B, T) tensors on any device (advantages may be (B, 1)); the outputs are on the CPU.
    """
    logprobs, entropy, collision = stats
    shape, w = logprobs.shape, advantages if w is None else w
    logprobs, entropy, collision, advantages, response_mask, silenced, w = [  # (B, T) each, on the CPU
        x.detach().cpu().expand(shape) for x in (logprobs, entropy, collision, advantages, response_mask, silenced, w)]
    mask = response_mask > 0  # (B, T)
    special = (candidates(logprobs, advantages, mask, tau_p) | silenced) & mask  # (B, T)
    picked, weight = torch.zeros_like(mask), torch.zeros(mask.shape)  # (B, T)
    for kind in (special, mask & ~special):
        where = kind.flatten().nonzero().squeeze(1)  # (n,)
        take = where[torch.randperm(where.numel(), generator=generator)[:n_random]]  # (k,)
        picked.view(-1)[take] = True
        weight.view(-1)[take] = where.numel() / max(take.numel(), 1)
    row, col = picked.nonzero(as_tuple=True)  # (k,) each
    return {"row": row, "col": col, "p": logprobs[row, col].exp().float(),
            "H": entropy[row, col].float(), "A": advantages[row, col].float(),
            "grad_norm": grad_norm_logits(w, logprobs, collision)[row, col].float(),
            "candidate": candidates(logprobs, advantages, mask, tau_p)[row, col], "silenced": silenced[row, col],
            "weight": weight[row, col]}


def token_record(step: int, k: int, threshold: float | None, sampled: dict, correct: torch.Tensor) -> dict:
    """One line of tokens.jsonl: the tokens `token_sample` drew from mini-batch k of step `step`, as columns
    (floats to 4 significant digits); `correct` (b,) bool per response of the mini-batch."""
    rows = sampled["row"]
    return {"step": step, "mini_batch": k, "tau_h": threshold,
            **{key: [float(f"{v:.4g}") for v in sampled[key].tolist()] for key in ("p", "H", "A", "grad_norm",
                                                                                 "weight")},
            "correct": correct.cpu()[rows].int().tolist(), "candidate": sampled["candidate"].int().tolist(),
            "silenced": sampled["silenced"].int().tolist()}


def ranks_joined(parts: list[list[dict]]) -> list[dict]:
    """tokens.jsonl: one line per mini-batch, the columns of every rank's record of it concatenated."""
    return [{key: sum((r[key] for r in same), []) if isinstance(same[0][key], list) else value
             for key, value in same[0].items()} for same in zip(*parts)]
