"""tools/confirm.py: the confirmatory experiment's statistics against tabulated values, its power
calculation, its reading rules one case each, the gate's report and the tables from hand-built run
folders."""
import json
import math
import re

import numpy as np
import pytest

from tools import confirm


def test_chi_square_against_tables():
    """Chi-square's CDF and quantiles: 2 df in closed form (1 - exp(-x/2)), the rest against the
    printed tables (lower 5% of 9 df 3.325, upper 5% of 1 df 3.841 = 1.95996^2, lower 5% of 4 df
    0.711, upper 2.5% of 40 df 59.342)."""
    assert confirm.chi2_cdf(3.0, 2) == pytest.approx(1 - math.exp(-1.5), abs=1e-12)
    assert confirm.chi2_quantile(0.05, 2) == pytest.approx(-2 * math.log(0.95), abs=1e-9)
    assert confirm.chi2_quantile(0.05, 9) == pytest.approx(3.325113, abs=1e-5)
    assert confirm.chi2_quantile(0.95, 1) == pytest.approx(1.959964 ** 2, abs=1e-5)
    assert confirm.chi2_quantile(0.05, 4) == pytest.approx(0.710723, abs=1e-5)
    assert confirm.chi2_cdf(59.342, 40) == pytest.approx(0.975, abs=1e-4)  # continued fraction


def test_confirm_t_distribution_matches_tables():
    """Student's t from the incomplete beta function: two-sided p and quantiles as printed in
    statistics tables."""
    assert confirm.t_two_sided_p(2.0, 10) == pytest.approx(0.07339, abs=1e-5)
    assert confirm.t_two_sided_p(0.0, 5) == pytest.approx(1.0)
    assert confirm.t_two_sided_p(12.706, 1) == pytest.approx(0.05, abs=1e-4)
    for p, df, table in ((0.975, 5, 2.5706), (0.975, 29, 2.0452), (0.95, 29, 1.6991),
                         (0.975, 1, 12.7062), (0.995, 10, 3.1693)):
        assert confirm.t_quantile(p, df) == pytest.approx(table, abs=1e-4)
    t = confirm.paired_t([0.1, 0.2, 0.3, 0.4])  # mean 0.25, sd 0.1291, se 0.0645, t 3.873 on 3 df
    assert t["t"] == pytest.approx(3.873, abs=1e-3) and t["p"] == pytest.approx(0.0305, abs=1e-3)
    assert t["ci"] == pytest.approx((0.25 - 3.1824 * 0.06455, 0.25 + 3.1824 * 0.06455), abs=1e-4)
    assert t["ci90"] == pytest.approx((0.25 - 2.3534 * 0.06455, 0.25 + 2.3534 * 0.06455), abs=1e-4)


def test_confirm_wilcoxon_exact_and_holm():
    """Wilcoxon's exact signed-rank p by counting sign assignments (n = 6: 2^6 of them), zeros
    dropped, ties at their mean rank; Holm's step-down adjustment."""
    assert confirm.wilcoxon([1, 2, 3, 4, 5, 6]) == (21.0, pytest.approx(2 / 64))
    # W- = 2: {2}, {1, 2}... 3 ways
    assert confirm.wilcoxon([1, -2, 3, 4, 5, 6]) == (19.0, pytest.approx(6 / 64))
    assert confirm.wilcoxon([0, 0, 1, -1]) == (1.5, pytest.approx(1.0))  # ties: ranks 1.5 and 1.5
    w, p = confirm.wilcoxon([0.5, 1.0, 1.0, -0.5, 2.0])  # ranks 1.5, 3.5, 3.5, 1.5, 5
    brute = [sum(r for r, s in zip((1.5, 3.5, 3.5, 1.5, 5), signs) if s)
             for signs in np.ndindex(*[2] * 5)]
    assert w == 13.5 and p == pytest.approx(2 * sum(x <= 1.5 for x in brute) / 32)
    assert confirm.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_confirm_power_and_seeds():
    """Power by simulation against the normal approximation's closed form at large n, and the
    plan's seed count."""
    sd, n = 0.074, 60
    normal = 1 - 0.5 * (1 + math.erf((1.96 - 0.04 / (sd / math.sqrt(n))) / math.sqrt(2)))
    assert confirm.power(n, sd, draws=50_000) == pytest.approx(normal, abs=0.02)
    # the test's level
    assert confirm.power(10, sd, delta=0.0, draws=50_000) == pytest.approx(0.05, abs=0.005)
    sd, df = confirm.pooled_sd(confirm.FIRST_EXPERIMENT)
    assert df == 25 and sd == pytest.approx(0.0741, abs=1e-4)
    assert confirm.seeds_needed(sd) == 29


def _primary(mean, p, ci90=(-1, 1)):
    return {"mean": mean, "p": p, "ci90": ci90}


def test_confirm_reading_one_case_per_rule():
    """Each of the plan's readings from the comparisons that make it."""
    assert confirm.reading(_primary(0.05, 0.01), _primary(0.03, 0.02), False).startswith(
        "not a test")
    assert confirm.reading(_primary(-0.05, 0.01), None, True) == "harms at this scale"
    assert confirm.reading(_primary(0.05, 0.01), _primary(0.03, 0.02), True) == \
        "supports the claim at this scale"
    assert confirm.reading(_primary(0.05, 0.01), _primary(0.03, 0.2), True).startswith(
        "supports, but not")
    assert confirm.reading(_primary(0.05, 0.01), _primary(-0.03, 0.01), True).startswith(
        "supports, but not")
    assert confirm.reading(_primary(0.01, 0.3, (-0.03, 0.035)), None, True).startswith(
        "refutes at this scale")
    assert confirm.reading(_primary(0.01, 0.3, (-0.05, 0.035)), None, True) == \
        "cannot tell at this scale"


def _write_run(folder, algo, seed, acc, silenced, rule, heldout=0.5, before=True, extra=None):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"algo": algo, "seed": seed}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({
        "step": t + 1, "reward/acc": a, "entropy/mean": 0.5 - 0.01 * t, "s2t/silenced": silenced,
        "s2t/rule_silenced": rule, "s2t/candidates": 2.0, **(extra or {})}) + "\n"
        for t, a in enumerate(acc)))
    evals = ([{"step": 0, "eval/acc": 0.3}] if before else []) + \
        [{"step": len(acc), "eval/acc": heldout}]
    (folder / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))


def test_confirm_report_from_run_folders(tmp_path):
    """tools/confirm.py RUNS: the primary outcome skips the warm-up steps; STAPO better than JustRL
    in every seed and than RandMask reads "supports"; a RandMask run whose count differs from the
    rule's fails the manipulation check."""
    rng = np.random.default_rng(0)
    for seed in range(5):
        base = list(rng.uniform(0.2, 0.6, 16))
        _write_run(tmp_path / f"justrl-{seed}", "justrl", seed, [0.9, 0.9] + base[2:], 0, 1.0)
        _write_run(tmp_path / f"stapo-{seed}", "stapo", seed,
                   [0.0, 0.0] + [a + 0.1 for a in base[2:]], 1.0, 1.0, before=False)
        _write_run(tmp_path / f"randmask-{seed}", "randmask", seed,
                   [0.5, 0.5] + [a + 0.05 * (seed % 2) for a in base[2:]], 1.0, 1.0, before=False)
    _write_run(tmp_path / "stapo-9", "stapo", 9, [0.5] * 10, 1.0, 1.0)  # unfinished: left out
    arms = confirm.read_runs(tmp_path)
    assert sorted(arms["stapo"]) == [0, 1, 2, 3, 4]
    primary = confirm.compare(arms, "stapo", "justrl", "primary")
    # the warm-up steps left out
    assert primary["diffs"] == pytest.approx([0.1] * 5) and primary["p"] < 1e-10
    text = confirm.report(arms)
    assert "| stapo - justrl | training acc after warm-up (primary) | 5 |" in text
    assert "manipulation check: passed" in text and \
        text.endswith("supports the claim at this scale")
    (tmp_path / "randmask-0" / "metrics.jsonl").write_text(
        (tmp_path / "randmask-0" / "metrics.jsonl").read_text().replace(
            '"s2t/silenced": 1.0', '"s2t/silenced": 2.0'))
    assert confirm.report(confirm.read_runs(tmp_path)).endswith(
        "not a test: the manipulation check failed")
    confirm.figure(confirm.read_runs(tmp_path), tmp_path / "confirm.png")
    assert (tmp_path / "confirm.png").stat().st_size > 10_000


def test_confirm_gate_report(tmp_path, capsys):
    """tools/confirm.py gate RUN ...: S2T's activity against the bar 0.25 a step, the
    parameter-gradient shares with cancellation (the ratio of the mean norms, 0.45 / 5.0 = 9%, with
    the per-mini-batch range 5%-25%; it printed their mean ratio, 15%) beside the per-token
    logit-gradient shares, the graded part's share of tokens."""
    cells = {f"shares/{x}_{k}_{part}": 1.0 for x in ("grad", "n")
             for k in ("candidate", "low_p", "high_p_pos", "high_p_rest")
             for part in ("graded", "after")}
    cells |= {"shares/grad_candidate_graded": 0.02, "shares/grad_candidate_after": 0.0,
              "shares/n_high_p_pos_graded": 93.0, "grad_share/n": 1.0, "grad_share/all": 2.0,
              "grad_share/candidates": 0.5, "grad_share/without": 1.8}
    norms = {100: (2.0, 0.5, 1.8), 101: (8.0, 0.4, 7.9)}  # the whole, the candidates', without
    for seed, rule in ((100, 0.0), (101, 1.0)):
        g = dict(zip(("grad_share/all", "grad_share/candidates", "grad_share/without"),
                     norms[seed]))
        _write_run(tmp_path / f"gate-{seed}", "justrl", seed, [0.3] * 16, 0.0, rule,
                   extra=cells | g)
    assert confirm.main(["gate", str(tmp_path / "gate-100"), str(tmp_path / "gate-101")]) == 0
    out = capsys.readouterr().out
    assert "would silence 0.50 tokens a step (16 in 32 steps; the gate's bar 0.25): " \
           "the gate passes" in out
    assert "whole objective 5.000, the candidates' terms alone 0.450 (9% of the whole's mean; " \
           "per mini-batch 5%-25%), without them 4.850 (97%)" in out
    assert "tokens in the graded part: 96.0%" in out  # (93 + 1 + 1 + 1) of 100
    for seed in (100, 101):
        (tmp_path / f"gate-{seed}" / "metrics.jsonl").write_text(
            (tmp_path / f"gate-{seed}" / "metrics.jsonl").read_text().replace(
                '"s2t/rule_silenced": 1.0', '"s2t/rule_silenced": 0.0'))
    confirm.main(["gate", str(tmp_path / "gate-100"), str(tmp_path / "gate-101")])
    assert "**below the bar**: the experiment ends" in capsys.readouterr().out
    assert confirm.main(["gate", str(tmp_path / "nothing")]) == 2


def test_the_collapse_experiments_t_intervals_are_its_tables():
    """docs/experiments.md quotes paired t intervals beside the plan's bootstrap (six seeds'
    percentile bootstrap cannot be wider than their range); each is recomputed here from the paired
    differences of the section's own table, and the one row whose interval excludes 0 with its
    Holm p."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "experiments.md").read_text()
    rows = {}
    for cells in (line.split("|")[1:-1] for line in doc.splitlines()
                  if line.startswith("| ") and line.count("|") == 8):
        name, outcome, diffs = cells[0].strip(), cells[1].strip(), cells[4]
        if " - " in name and "," in diffs:
            rows[name, outcome] = [float(d) for d in diffs.split(",")]
    flat = " ".join(doc.split())

    def quoted(name, outcome):
        t = confirm.paired_t(rows[name, outcome])
        return f"{t['ci'][0]:+.2f} to {t['ci'][1]:+.2f}".replace("+-", "-").lstrip("+"), t["p"]

    ci, p = quoted("stapo - justrl", "entropy rise")
    assert f"paired t 95% interval {ci}, p = {p:.2f}" in flat
    ci, _ = quoted("stapo - justrl", "held-out acc @12")
    assert f"t interval {ci}, 4/2" in flat
    training = "training acc, mean of all steps (not pre-registered)"
    t = confirm.paired_t(rows["stapo - highmask", training])
    assert f"-0.043 (paired t 95% interval {t['ci'][0]:.3f} to {t['ci'][1]:.3f}, p = " \
           f"{t['p']:.3f};" in flat
    names = [n for n, o in rows if o == training]
    adjusted = dict(zip(names, confirm.holm([confirm.paired_t(rows[n, training])["p"]
                                             for n in names])))
    holm = adjusted["stapo - highmask"]
    assert len(names) == 7 and f"seven comparisons (adjusted p = {holm:.2f})" in flat
    assert [n for n in names if confirm.paired_t(rows[n, training])["ci"][1] < 0
            or confirm.paired_t(rows[n, training])["ci"][0] > 0] == ["stapo - highmask"]


def test_the_gates_table_is_its_committed_runs():
    """docs/experiments.md's gate table and sentences are `confirm.gate` (and the runs' entropies)
    on the two runs' committed outputs (docs/experiments/gate/: config.json, metrics.jsonl,
    eval.jsonl of the rerun whose config.json names its commit), and the original's values of seed
    101, which parted from the rerun at step 13, are those of its rerun at the original commit."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    folders = [root / "docs/experiments/gate" / f"gate-justrl-{seed}" for seed in (100, 101)]
    doc = (root / "docs" / "experiments.md").read_text()
    flat = " ".join(doc.split())
    for folder in folders:
        run = confirm.read_run(folder)
        assert json.loads((folder / "config.json").read_text())["code"]["commit"]
        row = next(line for line in doc.splitlines() if line.startswith(f"| {run['seed']} | 0."))
        e = run["entropy"]
        cells = [", ".join(f"{a:.2f}" for a in run["acc"]), f"{run['primary']:.3f}",
                 f"{np.mean(run['candidates']):.2f} ({sum(run['candidates']):.0f} in 16 steps)",
                 f"{np.mean(run['rule']):.2f}", f"{e[0]:.2f} / {e[2]:.2f} / {e[15]:.2f}",
                 f"{run['before']:.3f} / {run['heldout']:.3f}"]
        assert row == f"| {run['seed']} | {' | '.join(cells)} |"
    report = confirm.gate(folders)
    for quoted in ("0.00 tokens a step (0 in 32 steps", "**below the bar**"):
        assert quoted in report
    norms = re.search(r"whole objective ([\d.]+), the candidates' terms alone ([\d.]+) \((\d+)% of "
                      r"the whole's mean; per mini-batch (\d+)%-(\d+)%\), without them ([\d.]+)",
                      report).groups()
    whole, alone, share, low, high, rest = norms
    assert (f"the parameter-gradient norm of the whole objective was {whole} (mean), that of the "
            f"candidate's terms alone {alone} ({share}% of the whole's mean; per mini-batch {low}% "
            f"and {high}%") in flat
    assert f"and that of the rest {rest}:" in flat
    original = confirm.read_run(root / "docs/experiments/gate/check-f52d4aa-101")  # at f52d4aa
    assert original["acc"][:12] == confirm.read_run(folders[1])["acc"][:12]
    assert ("the original's steps 13-16 were " + ", ".join(f"{a:.2f}" for a in original["acc"][12:])
            + f" (mean after warm-up {original['primary']:.3f}), its entropy at step 16 "
            f"{original['entropy'][15]:.2f} and its held-out accuracy after 16 steps "
            f"{original['heldout']:.3f}") in flat
    per_token = re.search(r"candidates ([\d.]+)% of a step's, .*\(([\d.]+)%\): per token ([\d.]+)x",
                          report).groups()
    assert (f"gives the 2 candidates {float(per_token[0]):.1f}% of a step's total from "
            f"{per_token[1]}% of its tokens, {float(per_token[2]):.0f}x the average token") in flat
