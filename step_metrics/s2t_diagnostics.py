"""What S2T saw and did, for the metrics (docs/outputs.md, Metrics glossary; docs/paper.md §4): per
mini-batch sums of p, H and the closed-form logit-gradient norm of silenced and kept tokens
(`diagnostics`), what one update did to the entropy at silenced, kept-candidate and other positions
(`entropy_change`), tokens by kind and part of the response (`token_cells`), and the seeded sample
of tokens.jsonl (`token_sample`, `token_record`)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from s2t import candidates, grad_norm_logits

if TYPE_CHECKING:
    from model import TokenStats


def diagnostics(stats: TokenStats, advantages: torch.Tensor, response_mask: torch.Tensor,
                silenced: torch.Tensor, tau_p: float = 0.002,
                grad_norm: torch.Tensor | None = None) -> dict[str, float]:
    """Sums and counts (python floats) of one mask on one mini-batch, to be added over mini-batches
    and ranks and divided once (step_log.StepLog): call it once on the whole mini-batch. stats: p, H
    and collision of the current policy (model.TokenStats, each (B, T)).

    candidates       number of candidates (A > 0, p < tau_p)
    silenced, kept   number of silenced and of kept response tokens
    silenced_p       sum of p over silenced tokens  (the metric s2t/silenced_p_mean = / silenced)
    silenced_h       sum of the entropy over silenced tokens
    gn_silenced      sum of |w| sqrt(1 - 2p + sum p^2) over silenced tokens
    gn_kept          the same over kept response tokens  (s2t/grad_norm_kept = / kept)
    grad_norm (B, T): `grad_norm_logits` of each token, by default with w = the advantages, i.e.
    ratio r = 1 (pi_theta = pi_old, the first mini-batch of a rollout).
    """
    logprobs, entropy, collision = stats
    mask = response_mask > 0  # (B, T)
    silenced = silenced & mask
    kept = mask & ~silenced
    g = grad_norm_logits(advantages.expand_as(logprobs), logprobs, collision) \
        if grad_norm is None else grad_norm

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


def entropy_change(entropy_before: torch.Tensor, entropy_after: torch.Tensor,
                   response_mask: torch.Tensor, silenced: torch.Tensor,
                   candidates: torch.Tensor) -> dict[str, float]:
    """What one update did to the entropy of the positions of one mini-batch, per kind of token (the
    paper's "Entropy Update Mechanism": reinforcing a low-probability token with A > 0 raises its
    position's entropy).

    entropy_before, entropy_after (B, T): H_it of the same rows before and after the optimizer step;
    response_mask (B, T) 0/1; silenced (B, T) bool: the algorithm's mask; candidates (B, T) bool:
    A > 0 and p < tau_p. Returns sums of dH = H_after - H_before and token counts (python floats;
    sum them over mini-batches and ranks, then divide):
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


PARTS = ("graded", "after")  # up to and including the answer the reward reads; the text after it


def token_cells(logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                graded: torch.Tensor, tau_p: float = 0.002) -> dict[str, torch.Tensor]:
    """bool (B, T) masks that split the response tokens into kind x part, e.g. "candidate_after":
        candidate      A > 0, p < tau_p (what S2T can silence)
        low_p          p < tau_p, A <= 0 (other low-probability tokens)
        high_p_pos     p >= tau_p, A > 0 (reinforced tokens S2T never sees)
        high_p_rest    p >= tau_p, A <= 0
    graded (B, T) bool: the tokens up to and including the answer the reward reads
    (train.graded_tokens)."""
    mask = response_mask > 0  # (B, T)
    low = logprobs.detach() < math.log(tau_p)  # (B, T)
    pos = (advantages > 0).expand_as(mask)  # (B, T)
    kinds = {"candidate": mask & low & pos, "low_p": mask & low & ~pos,
             "high_p_pos": mask & ~low & pos, "high_p_rest": mask & ~low & ~pos}
    return {f"{kind}_{part}": sel & (graded if part == "graded" else ~graded)
            for kind, sel in kinds.items() for part in PARTS}


def token_sample(stats: TokenStats, advantages: torch.Tensor, response_mask: torch.Tensor,
                 silenced: torch.Tensor, n_random: int, generator: torch.Generator,
                 tau_p: float = 0.002, w: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A small sample of one mini-batch's response tokens for the (p, H) picture of what S2T saw.

    Every token that is a candidate (A > 0, p < tau_p) or silenced is drawn, at most `n_random` of
    them (a uniform random subset beyond that), plus `n_random` of the other response tokens
    uniformly at random (`generator`). Returns 1-D tensors over the drawn tokens, in (row, col)
    order: `row`, `col` (long), `p`, `H`, `A`, `grad_norm` (`grad_norm_logits` with w, default A),
    `candidate`, `silenced` (bool) and `weight`, the number of the mini-batch's tokens of the same
    kind (special or other) each drawn token stands for (1 when all were drawn). Inputs are (B, T)
    tensors on any device (advantages may be (B, 1)); the outputs are on the CPU.
    """
    logprobs, entropy, collision = stats
    shape, w = logprobs.shape, advantages if w is None else w
    # (B, T) each, on the CPU
    logprobs, entropy, collision, advantages, response_mask, silenced, w = [
        x.detach().cpu().expand(shape)
        for x in (logprobs, entropy, collision, advantages, response_mask, silenced, w)]
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
            "candidate": candidates(logprobs, advantages, mask, tau_p)[row, col],
            "silenced": silenced[row, col], "weight": weight[row, col]}


def token_record(step: int, k: int, threshold: float | None, sampled: dict,
                 correct: torch.Tensor) -> dict:
    """One line of tokens.jsonl: the tokens `token_sample` drew from mini-batch k of step `step`, as
    columns (floats to 4 significant digits); `correct` (b,) bool per response of the mini-batch."""
    rows = sampled["row"]
    return {"step": step, "mini_batch": k, "tau_h": threshold,
            **{key: [float(f"{v:.4g}") for v in sampled[key].tolist()]
               for key in ("p", "H", "A", "grad_norm", "weight")},
            "correct": correct.cpu()[rows].int().tolist(),
            "candidate": sampled["candidate"].int().tolist(),
            "silenced": sampled["silenced"].int().tolist()}


def ranks_joined(parts: list[list[dict]]) -> list[dict]:
    """tokens.jsonl: one line per mini-batch, the columns of every rank's record of it
    concatenated."""
    return [{key: sum((r[key] for r in same), []) if isinstance(same[0][key], list) else value
             for key, value in same[0].items()} for same in zip(*parts)]
