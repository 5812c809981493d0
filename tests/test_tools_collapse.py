"""tools/collapse.py: the collapse experiment's pre-registered outcomes, its bootstrap, its table
and figure, --why."""
import json

import pytest


def test_collapse_outcomes_by_hand():
    """tools/collapse.py's pre-registered outcomes on hand-made curves."""
    from tools import collapse
    # 0.2 and 0.1 below 0.6 / 2, steps 5 and 6
    assert collapse.collapse_step([.2, .6, .5, .4, .2, .1, .3]) == 5
    assert collapse.collapse_step([.2, .6, .5, .25, .2, .4]) == 4
    # one step below half the peak is not one
    assert collapse.collapse_step([.2, .6, .5, .25, .4, .2]) is None
    assert collapse.collapse_step([.6, .1, .1, .5, .5]) is None  # before step 4 does not count
    assert collapse.entropy_rise([.6, .4, .3, .4, .38]) == pytest.approx(0.1)
    assert collapse.entropy_rise([.6, .5, .4]) == pytest.approx(-0.1)  # only falls
    assert collapse.sign_test([1, 2, 1, 1, 3, 1]) == (6, 0, 2 / 64)
    assert collapse.sign_test([1, 1, 1, 1, 1, -1]) == (5, 1, pytest.approx(14 / 64))
    assert collapse.sign_test([0, 0, 1]) == (1, 0, 1.0)  # ties dropped


def test_collapse_bootstrap_resamples_seeds_and_problems():
    """A constant difference has a zero-width interval; a difference carried by one problem of four
    shows the problem clustering: resampling problems widens the interval beyond resampling seeds
    alone."""
    from tools import collapse
    assert collapse.bootstrap_mean_diff([[1.0, 1.0]] * 3, [[0.5, 0.5]] * 3, n=500) == \
        pytest.approx((0.5, 0.5, 0.5))
    a, b = [[1.0, 0.0, 0.0, 0.0]] * 6, [[0.0] * 4] * 6
    mean, lo, hi = collapse.bootstrap_mean_diff(a, b, n=2000)
    assert mean == 0.25 and lo == 0.0 and hi >= 0.5  # every seed agrees; the problems do not
    seeds_only = collapse.bootstrap_mean_diff([[x] for x in (0.25,) * 6], [[0.0]] * 6, n=2000)
    assert seeds_only[1] == seeds_only[2] == 0.25


def test_collapse_table_and_figure_from_run_folders(tmp_path):
    """tools/collapse.py RUNS: the table pairs arms by seed (JustRL collapsing where STAPO does
    not), and draws the figure."""
    from tools import collapse
    curves = {"justrl": [.2, .6, .5, .2, .1, .1, .1, .1, .1, .1, .1, .1],
              "stapo": [.2, .6, .6, .7, .7, .7, .8, .8, .8, .8, .8, .8]}
    for algo, acc in curves.items():
        for seed in range(3):
            folder = tmp_path / f"{algo}-{seed}"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps({"algo": algo, "seed": seed}))
            (folder / "metrics.jsonl").write_text("".join(
                json.dumps({"step": t + 1, "reward/acc": a, "entropy/mean": 0.5 + (1 - a),
                            "s2t/silenced": (algo == "stapo") * t % 2, "s2t/candidates": 3}) + "\n"
                for t, a in enumerate(acc)))
            evals = [{"step": t, "eval/acc": acc[max(t - 1, 0)], "eval/n": 8,
                      "eval/correct": [round(acc[max(t - 1, 0)] * 4)] * 2} for t in (0, 4, 8, 12)]
            (folder / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    arms = collapse.read_runs(tmp_path)
    assert [r["collapse"] for r in arms["justrl"].values()] == [4, 4, 4]
    assert all(r["collapse"] is None for r in arms["stapo"].values())
    rows = {r["outcome"]: r for r in collapse.compare(arms, "stapo", "justrl")}
    # 3 of 3: 2 / 8
    assert rows["collapsed"]["diffs"] == [-1.0] * 3 and rows["collapsed"]["p"] == 0.25
    assert rows["held-out acc @12"]["mean_diff"] == pytest.approx(0.75)
    # the same prompts, step by step
    matched = rows["training acc, mean of all steps (not pre-registered)"]
    assert matched["mean_diff"] == \
        pytest.approx((sum(curves["stapo"]) - sum(curves["justrl"])) / 12)
    text = collapse.table(arms)
    assert "| stapo - justrl | collapsed | 3 |" in text
    # silenced / candidates a step, per arm
    assert "| 0.5 / 3.0 |" in text and "| 0.0 / 3.0 |" in text
    assert collapse.main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0 and \
        (tmp_path / "c.png").stat().st_size
    assert collapse.main([str(tmp_path / "stapo-0")]) == 2  # no complete run below it


def test_collapse_why_reads_the_shares_of_the_steps_before_the_collapse(tmp_path):
    """tools/collapse.py --why: per kind x part, the gradient share and tokens averaged over the
    steps before the collapse only (step 4 on are left out), the entropy change per token pooled
    over those steps' tokens, summed per step."""
    from tools import collapse
    folder = tmp_path / "justrl-0"
    folder.mkdir()
    cells = [f"{k}_{p}" for k in collapse.KINDS for p in collapse.PARTS]
    lines = []
    for step in range(1, 7):
        m = {"step": step}
        for cell in cells:
            m |= {f"shares/grad_{cell}": 0.0, f"shares/n_{cell}": 0.0, f"shares/dH_{cell}": 0.0}
        # shares/n_candidate_after in steps 1-3: 1, 2, 3
        m |= {"shares/grad_candidate_after": 0.1 * step, "shares/n_candidate_after": float(step),
              "shares/dH_candidate_after": 0.01 * step,
              "shares/grad_high_p_pos_after": 1 - 0.1 * step, "shares/n_high_p_pos_after": 10.0,
              "shares/dH_high_p_pos_after": -0.02}
        lines.append(json.dumps(m) + "\n")
    (folder / "metrics.jsonl").write_text("".join(lines))
    got = collapse.shares_before_collapse(folder, collapse=4)
    assert got["candidate_after"] == pytest.approx([0.2, 2.0, (0.01 + 0.04 + 0.09) / 6,
                                                    (0.01 + 0.04 + 0.09) / 3])
    assert got["high_p_pos_after"] == pytest.approx([0.8, 10.0, -0.02, -0.2])
    assert got["low_p_graded"] == [0.0, 0.0, 0.0, 0.0]  # no tokens: 0, not a division by zero
    # all 6 steps
    assert collapse.shares_before_collapse(folder, None)["candidate_after"][1] == pytest.approx(3.5)
    arms = {"justrl": {0: {"collapse": 4, "folder": folder}}}
    text = collapse.why_table(arms)
    assert "seeds 0 (steps 1-3)" in text and \
        "| candidates (A > 0, p < tau_p) | after | 20.0% [20.0%, 20.0%] |" in text


def test_collapse_reading_follows_the_plans_rules():
    """collapse.reading: the pre-registered sentence from made-up outcomes of six seeds per arm, one
    case per rule."""
    from tools import collapse

    # collapse steps per seed (None: none); rise per arm
    def arms(justrl, stapo, randmask, rises=(0.3, 0.3)):
        def arm(steps, rise):
            return {s: {"collapse": c, "rise": rise + 0.01 * s, "acc": [0.5], "eval": {},
                        "eval_correct": {}} for s, c in enumerate(steps)}
        return {"justrl": arm(justrl, rises[1]), "stapo": arm(stapo, rises[0]),
                "randmask": arm(randmask, rises[1])}

    six, none = [5] * 6, [None] * 6
    assert collapse.reading(arms(six, none, six)).startswith("supports the claim")
    assert collapse.reading(arms(six, none, none)).startswith("supports, but not S2T's choice")
    # prevents 1 of 6
    assert collapse.reading(arms(six, [None] + [5] * 5, six)).startswith("refutes")
    # rise lower
    assert collapse.reading(arms(six, [None] + [5] * 5, six, rises=(0.1, 0.3))).startswith(
        "cannot tell")
    # 5 of 6: p = 0.22
    assert collapse.reading(arms(six, [None] * 5 + [5], six)).startswith("cannot tell")
    assert "fewer than 4" in collapse.reading(arms([5] * 3 + [None] * 3, none, six))
    assert collapse.reading({"justrl": arms(six, none, six)["justrl"]}).startswith(
        "not yet read: stapo, randmask")
