"""Weighted rank statistics and RQ1's gradient analysis (docs/paper.md §4 and §8, RQ1): is a
token's policy-gradient magnitude larger the less likely the token is? Spearman's rank correlation
with weights (tokens.jsonl's `weight`: how many tokens of its kind a drawn token stands for), its
partial form at equal z, weighted quantiles and binned medians; `gradient_analysis` applies them to
the closed-form logit-gradient norm |w| sqrt(1 - 2p + sum_v p_v^2) of tokens.jsonl's tokens.
Pure functions of lists of numbers: no files, no matplotlib.
"""
import math

# below this p the factor sqrt(1 - 2p + sum p^2) is ~1: the norm is ~|w| whatever p (gradient.png)
P_FLAT = 0.1


def _ranks(values: list[float], weights: list[float]) -> list[float]:
    """Weighted mid-ranks in [0, 1]: the share of the total weight below each value plus half of its
    own tie group."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    total, below, ranks, i = sum(weights), 0.0, [0.0] * len(values), 0
    while i < len(order):
        j = i
        while j < len(order) and values[order[j]] == values[order[i]]:
            j += 1
        tie = sum(weights[k] for k in order[i:j])
        for k in order[i:j]:
            ranks[k] = (below + tie / 2) / total
        below, i = below + tie, j
    return ranks


def rank_correlation(x: list[float], y: list[float], w: list[float] | None = None) -> float | None:
    """Spearman's rank correlation of x and y, each token weighted by w (tokens.jsonl's `weight`:
    how many tokens of its kind a drawn token stands for), ties at mid-rank; None for fewer than 3
    tokens or a constant column."""
    w = w or [1.0] * len(x)
    if len(x) < 3:
        return None
    rx, ry, total = _ranks(x, w), _ranks(y, w), sum(w)
    mx, my = sum(a * b for a, b in zip(rx, w)) / total, sum(a * b for a, b in zip(ry, w)) / total
    cov = sum(c * (a - mx) * (b - my) for a, b, c in zip(rx, ry, w))
    vx, vy = (sum(c * (a - mx) ** 2 for a, c in zip(rx, w)),
              sum(c * (b - my) ** 2 for b, c in zip(ry, w)))
    return cov / (vx * vy) ** 0.5 if vx > 0 and vy > 0 else None


def partial_rank_correlation(x: list[float], y: list[float], z: list[float],
                             w: list[float] | None = None):
    """Spearman's correlation of x and y at equal z:
    (r_xy - r_xz r_yz) / sqrt((1 - r_xz^2)(1 - r_yz^2)) from the weighted rank correlations; None
    where one is undefined or z determines x or y."""
    r_xy, r_xz, r_yz = (rank_correlation(x, y, w), rank_correlation(x, z, w),
                        rank_correlation(y, z, w))
    if None in (r_xy, r_xz, r_yz) or max(abs(r_xz), abs(r_yz)) >= 1:
        return None
    return (r_xy - r_xz * r_yz) / ((1 - r_xz ** 2) * (1 - r_yz ** 2)) ** 0.5


def _weighted_quantile(values: list[float], weights: list[float], q: float) -> float:
    """The value at which the weight below reaches q of the total (values sorted by value)."""
    pairs = sorted(zip(values, weights))
    target, seen = q * sum(weights), 0.0
    for value, weight in pairs:
        seen += weight
        if seen >= target:
            return value
    return pairs[-1][0]


def binned(x: list[float], y: list[float], w: list[float], edges: list[float]) -> list[tuple]:
    """(bin centre, weighted median, 25% and 75% quantiles of y, tokens) for each bin
    [edges[i], edges[i + 1]) of x that holds at least 3 drawn tokens; the last bin includes its
    upper edge."""
    out = []
    for lo, hi in zip(edges, edges[1:]):
        sel = [i for i, v in enumerate(x) if lo <= v < hi or (hi == edges[-1] and v == hi)]
        if len(sel) >= 3:
            ys, ws = [y[i] for i in sel], [w[i] for i in sel]
            out.append(((lo + hi) / 2, _weighted_quantile(ys, ws, 0.5),
                        _weighted_quantile(ys, ws, 0.25), _weighted_quantile(ys, ws, 0.75),
                        len(sel)))
    return out


def gradient_analysis(records: list[dict]) -> dict:
    """The paper's RQ1 on the tokens of tokens.jsonl `records` that carry a gradient (|w| > 0:
    nonzero advantage, ratio not clipped): Spearman correlations of the closed-form logit-gradient
    norm with p and with H (weighted, so the oversampled candidates count as the tokens they are),
    and its binned medians against log10 p and H, for correct and incorrect responses. Below
    p = P_FLAT the factor sqrt(1 - 2p + sum p^2) is ~1, so rho_p_low, the correlation with p among
    those tokens, says whether the rarest tokens carry more than the merely unlikely ones. Low-p
    tokens are mostly high-entropy ones, so the plain correlation with H mixes in p's; rho_h_at_p is
    the partial rank correlation of the norm per unit advantage, sqrt(1 - 2p + sum p^2) (the factor
    S2T's rule is about), with H at equal p. Keys: n, rho_p, rho_p_low, rho_h, rho_h_at_p, and per
    response kind bins_p, bins_h."""
    tok = {k: [v for r in records for v in r[k]]
           for k in ("p", "H", "A", "grad_norm", "weight", "correct")}
    keep = [i for i, (g, a) in enumerate(zip(tok["grad_norm"], tok["A"])) if g > 0 and a != 0]
    col = {k: [v[i] for i in keep] for k, v in tok.items()}
    logp = [math.log10(max(p, 1e-12)) for p in col["p"]]
    # one bin per decade of p up to P_FLAT, then finer ones up to 1, where the norm falls to 0
    p_edges = (list(range(math.floor(min(logp, default=-1)), -1))
               + [math.log10(p) for p in (0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 0.999)] + [0])
    low = [i for i, p in enumerate(col["p"]) if p < P_FLAT]
    h_top = max(col["H"], default=1.0)
    h_edges = [h_top * i / 8 for i in range(9)]
    result = {"n": len(keep), "rho_p": rank_correlation(col["p"], col["grad_norm"], col["weight"]),
              "rho_p_low": rank_correlation(*([col[k][i] for i in low]
                                              for k in ("p", "grad_norm", "weight"))),
              "rho_h": rank_correlation(col["H"], col["grad_norm"], col["weight"]),
              "rho_h_at_p": partial_rank_correlation(
                  col["H"], [g / abs(a) for g, a in zip(col["grad_norm"], col["A"])], col["p"],
                  col["weight"])}
    for kind, flag in (("correct", 1), ("incorrect", 0)):
        sel = [i for i, c in enumerate(col["correct"]) if c == flag]
        pick = lambda values: [values[i] for i in sel]  # noqa: E731
        result[kind] = {
            "bins_p": binned(pick(logp), pick(col["grad_norm"]), pick(col["weight"]), p_edges),
            "bins_h": binned(pick(col["H"]), pick(col["grad_norm"]), pick(col["weight"]), h_edges),
            "n": len(sel)}
    return result

