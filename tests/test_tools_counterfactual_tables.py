"""tools/counterfactual_tables.py: the counterfactual's intervals against published values, its
tables of pooled runs, and differences that resample whole responses."""
import math

import pytest

from reports import figures
from tools import counterfactual_tables


def test_counterfactual_wilson_interval_and_pooled_groups(tmp_path, monkeypatch):
    """The Wilson interval against published values (Newcombe 1998: 81/263 -> 0.2553-0.3662;
    0/10 -> 0-0.2775); pooled groups per algorithm: its kinds, then its candidates split by the S2T
    rule, whatever mask it trained with."""
    assert counterfactual_tables.wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert counterfactual_tables.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)

    def line(algo, seed, step, kind, candidate, rule, effect=0.0, part="graded"):
        return {"algo": algo, "seed": seed, "step": step, "row": step, "kind": kind, "part": part,
                "candidate": candidate, "s2t_rule": rule, "effect": effect, "stderr": 0.1,
                "keep": 0.5, "resample": 0.5 - effect, "exclude": 0.5 - effect, "contrast": effect,
                "negligible": effect == 0, "delta": 0.2}

    lines = [line("justrl", 0, 1, "candidate", True, True),
             line("justrl", 0, 2, "candidate", True, False, 0.5),
             line("justrl", 1, 3, "other", False, False, part="after"),
             line("fullmask", 0, 1, "silenced", True, False, 0.5),
             line("fullmask", 0, 1, "silenced", True, True)]
    groups = counterfactual_tables.pooled_groups(lines)
    assert list(groups) == ["justrl (2 seeds, steps 1-3)", "fullmask (1 seeds, steps 1)"]
    justrl, fullmask = groups.values()
    assert [len(justrl[f"{k}, {p}"])
            for k in counterfactual_tables.KINDS
            for p in counterfactual_tables.PARTS] == [0, 0, 2, 0, 0, 1]
    assert [x["step"] for x in justrl["candidates the S2T rule silences"]] == [1]
    assert [x["step"] for x in justrl["candidates the S2T rule keeps"]] == [2]
    assert [x["effect"] for x in fullmask["candidates the S2T rule keeps"]] == [0.5]
    table = counterfactual_tables.pooled_summary(lines).splitlines()
    # 8 groups and 3 differences (graded, after, both) per algorithm
    assert len(table) == 2 + 2 * (8 + 3)
    assert table[2].startswith("| justrl (2 seeds, steps 1-3) | silenced, graded | 0 |")
    assert table[9].startswith("|  | candidates the S2T rule keeps | 1 (1) | "
                               "+0.500 (+0.500, +0.500) | +0.500 (+0.500, +0.500) | 0% (0%, 0%)")
    # the figure: each group's size and share under its tick label, nothing written inside the axes
    # over the points
    import matplotlib.pyplot as plt
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    assert figures.plot_counterfactual_groups(groups, str(tmp_path / "groups.png"),
                                              counterfactual_tables.cluster_interval)
    monkeypatch.undo()
    axes = closed[0].axes
    assert [t.get_text() for t in axes[1].get_xticklabels()] == [
        "silenced\ngraded\nn = 2\n50% negl.", "cand., S2T\nsilences\nn = 1\n100% negl.",
        "cand., S2T\nkeeps\nn = 1\n0% negl."]
    assert all(not ax.texts for ax in axes)
    plt.close(closed[0])


def test_counterfactual_differences_resample_responses():
    """The difference between two groups of tokens (the candidates the S2T rule silences minus those
    it keeps) resamples responses, not tokens: 20 agreeing tokens of one response widen the interval
    well beyond the one that counts them as 20 responses, and tokens of one response in both groups
    move together (the same values: a difference of exactly 0 in every replicate); `--table` prints
    it per part and for both."""
    a, b = [1.0] * 20 + [0.0] * 10, [1.0] * 5 + [0.0] * 5
    a_responses, b_responses = (["r0"] * 20 + [f"r{i}" for i in range(1, 11)],
                                [f"s{i}" for i in range(10)])
    d, lo, hi = counterfactual_tables.cluster_difference(a, a_responses, b, b_responses)
    d_tokens, lo_tokens, hi_tokens = counterfactual_tables.cluster_difference(a, list(range(30)), b,
                                                                       b_responses)
    assert d == d_tokens == pytest.approx(20 / 30 - 0.5) and lo < lo_tokens < d < hi
    assert hi - lo > 1.5 * (hi_tokens - lo_tokens)  # 1.30 against 0.73
    v, shared = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0], list("abcdef")
    assert counterfactual_tables.cluster_difference(v, shared, v, shared) == (0.0, 0.0, 0.0)
    # apart: they vary apart
    assert counterfactual_tables.cluster_difference(v, shared, v, list("ghijkl"))[1] < -0.3
    assert all(math.isnan(x) for x in counterfactual_tables.cluster_difference(v, shared, [], []))

    def line(row, rule, negligible, part):
        contrast = 0.0 if negligible else 0.5
        return {"algo": "stapo", "seed": 0, "step": 1, "row": row,
                "kind": "silenced" if rule else "candidate", "part": part, "candidate": True,
                "s2t_rule": rule, "effect": contrast, "stderr": 0.1, "keep": 1.0,
                "resample": 1.0 - contrast, "exclude": 1.0 - contrast, "contrast": contrast,
                "negligible": negligible, "delta": 0.2}

    lines = [line(0, True, True, "after")] * 20 \
        + [line(r, True, False, "after") for r in range(1, 11)] \
        + [line(r, False, r % 2 == 0, "after") for r in range(11, 21)] \
        + [line(21, True, False, "graded")]
    rows = counterfactual_tables.pooled_summary(lines).splitlines()[-3:]
    assert rows[0] == "|  | S2T rule, silences - keeps, graded | 1 - 0 | - | - | - | - | - | - |"
    assert rows[1].startswith("|  | S2T rule, silences - keeps, after | 30 - 10 (21) | -0.083 (")
    assert rows[2].startswith("|  | S2T rule, silences - keeps, both | 31 - 10 (22) | ")
    negligible = rows[1].split(" | ")[5]  # the share negligible, silenced minus kept: 20/30 - 5/10
    assert negligible.startswith("+0.17 (") and float(negligible.split("(")[1].split(",")[0]) < -0.5
