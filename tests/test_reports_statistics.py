"""reports/statistics.py: weighted rank correlations, binned medians and RQ1's gradient analysis on
constructed tokens."""
import math

import pytest
import torch

from reports import statistics
from tests.fake_runs import token_records


def test_plot_gradient_analysis_sign_and_bins():
    """RQ1's numbers on constructed tokens: the Spearman correlation has the sign built in (and ~0
    against an unrelated H), weights count a token as the tokens it stands for, and the bins hold
    the medians of their tokens."""
    falling = statistics.gradient_analysis(token_records())
    rising = statistics.gradient_analysis(token_records(sign=1))
    assert falling["rho_p"] < -0.9 and rising["rho_p"] > 0.9 and abs(falling["rho_h"]) < 0.15
    assert falling["n"] == 400 and falling["correct"]["n"] == falling["incorrect"]["n"] == 200
    # one bin per decade of p below 0.1 (centres -5.5 ... -1.5), finer above
    bins = falling["correct"]["bins_p"]
    assert [b[0] for b in bins][:5] == [-5.5, -4.5, -3.5, -2.5, -1.5] \
        and -1 < bins[5][0] < bins[-1][0] < 0
    assert all(a[1] > b[1] for a, b in zip(bins, bins[1:]))  # medians fall as p rises
    records = token_records()
    edges = [-6, -3, 0]
    logp = [math.log10(p) for r in records[1:] for p in r["p"]]
    norm = [v for r in records[1:] for v in r["grad_norm"]]
    low = sorted(v for v, x in zip(norm, logp) if x < -3)
    median = low[(len(low) - 1) // 2]
    assert statistics.binned(logp, norm, [1.0] * len(norm), edges)[0][1] == median
    # a weight of 3 on a token counts it three times
    assert statistics.rank_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1)
    assert statistics.rank_correlation([1, 2, 3, 4], [1, 2, 4, 3], [1, 1, 1, 3]) == pytest.approx(
        statistics.rank_correlation([1, 2, 3, 4, 4, 4], [1, 2, 4, 3, 3, 3]))
    assert statistics.rank_correlation([1, 1, 1], [1, 2, 3]) is None  # a constant column
    zero = token_records()  # tokens without a gradient (zero advantage or clipped) are left out
    zero[0]["grad_norm"] = [0.0] * 200
    assert statistics.gradient_analysis(zero)["n"] == 200
    # at equal p: H tied to p (low p = high H, as in real runs) plus a factor that falls with H at
    # fixed p, and advantages of several sizes: the plain correlation with H is positive, the
    # partial one at equal p negative
    g = torch.Generator().manual_seed(3)
    logp = torch.rand(400, generator=g) * -6
    H = -logp / 2 + torch.rand(400, generator=g)  # (400,)
    A = torch.tensor([0.8, 1.0, 1.25]).repeat(134)[:400]
    factor = 1 - logp / 6 - 0.1 * (H + logp / 2)  # falls with p and, at equal p, with H
    tied = [{"p": (10 ** logp).tolist(), "H": H.tolist(), "A": A.tolist(),
             "grad_norm": (A * factor).tolist(), "weight": [1.0] * 400, "correct": [1] * 400}]
    a = statistics.gradient_analysis(tied)
    assert a["rho_h"] > 0.3 and a["rho_h_at_p"] < -0.3, a
    assert statistics.partial_rank_correlation([1, 2, 3], [1, 2, 3], [1, 2, 3]) is None  # z gives x
