"""Does S2T stop a collapse? The outcomes, paired statistics and figure of the pre-registered
experiment (docs/experiments.md, "Does S2T stop a collapse?"; docs/paper.md §4 and §8 RQ3).

    python -m tools.collapse RUNS  # RUNS/ALGO-SEED run folders: the table of outcomes and tests
    python -m tools.collapse RUNS --out docs/collapse.png
    python -m tools.collapse RUNS --why  # also: what carries JustRL's updates before its collapse

The paper's central claim: JustRL's training collapses (accuracy falls, entropy rebounds) where
STAPO, JustRL with the S2T mask, stays stable. Every arm runs the same recipe with one --algo; runs
of one seed share their first rollout (the same policy, the same sampling seed), so arms are
compared seed by seed. The outcomes, fixed before the runs:
    collapse step   the first step t >= 4 with a_t < m_t / 2 and a_(t+1) < m_(t+1) / 2, where a_t
                    is the training accuracy of step t's rollout and m_t = max_(s <= t) a_s its
                    running peak (None: no collapse)
    entropy rise    max_t (H_t - min_(s < t) H_s), H_t the mean entropy of step t's rollout
                    (entropy/mean)
    held-out acc    eval/acc after 4, 8 and 12 steps (64 problems x 4 samples)
and the statistics (docs/experiments.md): paired sign tests and bootstrap intervals over seeds and
problems. Deliberate choices D66-D70: docs/paper.md, "Deliberate differences".
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

# the plan's order; any other arm after them
ARM_ORDER = ("justrl", "stapo", "randmask", "fullmask", "highmask")
COLLAPSE_AFTER = 3  # a collapse can start at step 4 at the earliest
EVAL_STEPS = (4, 8, 12)  # held-out accuracy after these many steps


def collapse_step(acc: list[float], after: int = COLLAPSE_AFTER) -> int | None:
    """acc[t - 1] = a_t, the training accuracy of step t (t from 1) -> the first step t > after with
    a_t < m_t / 2 and a_(t+1) < m_(t+1) / 2 (m: the running peak), or None."""
    peak = [max(acc[:t + 1]) for t in range(len(acc))]  # m_t, 0-based
    for t in range(after, len(acc) - 1):  # 0-based t = step t + 1
        if acc[t] < peak[t] / 2 and acc[t + 1] < peak[t + 1] / 2:  # two steps in a row (D67)
            return t + 1
    return None


def entropy_rise(entropy: list[float]) -> float:
    """max over t of H_t - min over s < t of H_s (negative when the entropy only falls); needs >= 2
    steps."""
    return max(entropy[t] - min(entropy[:t]) for t in range(1, len(entropy)))


def sign_test(diffs: list[float]) -> tuple[int, int, float]:
    """(positive, negative, exact two-sided p) of the sign test on the non-zero differences (ties
    dropped; D66)."""
    pos, neg = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    n, k = pos + neg, min(pos, neg)
    if n == 0:
        return 0, 0, 1.0
    # P(|#pos - n/2| >= observed) under p = 1/2
    p = 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return pos, neg, min(p, 1.0)


def bootstrap_mean_diff(a: list[list[float]], b: list[list[float]], n: int = 10_000, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean of a - b and its percentile bootstrap interval. a, b:
    [seed][problem] values of two arms, paired by seed and problem (one problem for a per-seed
    outcome); each replicate draws seeds and problems with replacement, independently (crossed
    clusters)."""
    diff = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)  # (seeds, problems)
    seeds, problems = diff.shape
    rng = np.random.default_rng(seed)
    s = rng.integers(seeds, size=(n, seeds))  # (n, seeds) the seeds each replicate draws
    p = rng.integers(problems, size=(n, 1, problems)).repeat(seeds, axis=1)  # (n, seeds, problems)
    # (n,) the replicates' mean differences
    stats = np.take_along_axis(diff[s], p, axis=2).mean(axis=(1, 2))
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(diff.mean()), float(lo), float(hi)


def read_run(folder: Path) -> dict:
    """A run folder's outcomes: training accuracy and entropy per step, held-out accuracy and
    per-problem correct counts per evaluation step."""
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    evals = [json.loads(line) for line in (folder / "eval.jsonl").read_text().splitlines()
             if line.strip()] \
        if (folder / "eval.jsonl").exists() else []
    config = json.loads((folder / "config.json").read_text())
    acc = [m["reward/acc"] for m in metrics]
    entropy = [m["entropy/mean"] for m in metrics]
    return {"folder": folder, "algo": config["algo"], "seed": config["seed"], "acc": acc,
            "entropy": entropy, "silenced": [m.get("s2t/silenced", 0.0) for m in metrics],
            "candidates": [m.get("s2t/candidates", 0.0) for m in metrics],
            "collapse": collapse_step(acc),
            "rise": entropy_rise(entropy) if len(entropy) > 1 else float("nan"),
            "eval": {e["step"]: e["eval/acc"] for e in evals},
            "eval_correct": {e["step"]: [c / e["eval/n"] * len(e["eval/correct"])
                                         for c in e["eval/correct"]]
                             for e in evals if "eval/correct" in e}}


def read_runs(root: Path, steps: int = 12) -> dict[str, dict[int, dict]]:
    """{algo: {seed: outcomes}} of the complete runs (`steps` steps) in root's sub-folders, arms in
    the plan's order."""
    arms: dict[str, dict[int, dict]] = {}
    for folder in sorted(p for p in root.iterdir()
                         if (p / "metrics.jsonl").exists() and (p / "config.json").exists()):
        run = read_run(folder)
        if len(run["acc"]) >= steps and steps in run["eval"]:
            arms.setdefault(run["algo"], {})[run["seed"]] = run
    return dict(sorted(arms.items(), key=lambda kv: (
        ARM_ORDER.index(kv[0]) if kv[0] in ARM_ORDER else len(ARM_ORDER), kv[0])))


def compare(arms: dict, a: str, b: str) -> list[dict]:
    """The paired comparisons of arm a against arm b over their common seeds: one dict per
    outcome."""
    seeds = sorted(set(arms.get(a, {})) & set(arms.get(b, {})))
    if not seeds:
        return []
    A, B = [arms[a][s] for s in seeds], [arms[b][s] for s in seeds]
    # a run without a collapse counts as collapsing after the last step, for the difference's sign
    never = 13
    rows = [("collapsed", [float(x["collapse"] is not None) for x in A],
             [float(x["collapse"] is not None) for x in B], None, None),
            ("collapse step", [x["collapse"] or never for x in A],
             [x["collapse"] or never for x in B], None, None),
            ("entropy rise", [x["rise"] for x in A], [x["rise"] for x in B], None, None),
            # not pre-registered: the arms of a seed train on the same prompts in the same order, so
            # this mean compares them on matched prompts, where a_t alone mostly follows the
            # prompts' difficulty (D68)
            ("training acc, mean of all steps (not pre-registered)",
             [float(np.mean(x["acc"])) for x in A], [float(np.mean(x["acc"])) for x in B],
             None, None)]
    for step in EVAL_STEPS:
        if all(step in x["eval_correct"] for x in A + B):
            rows.append((f"held-out acc @{step}", [x["eval"][step] for x in A],
                         [x["eval"][step] for x in B], [x["eval_correct"][step] for x in A],
                         [x["eval_correct"][step] for x in B]))
    out = []
    for name, xa, xb, pa, pb in rows:
        diffs = [u - v for u, v in zip(xa, xb)]
        pos, neg, p = sign_test(diffs)
        mean, lo, hi = bootstrap_mean_diff(pa or [[u] for u in xa], pb or [[v] for v in xb])
        out.append({"outcome": name, "a": a, "b": b, "seeds": len(seeds),
                    "a_mean": sum(xa) / len(xa), "b_mean": sum(xb) / len(xb), "diffs": diffs,
                    "mean_diff": mean, "ci": (lo, hi), "pos": pos, "neg": neg, "p": p})
    return out


# s2t_diagnostics.TOKEN_KINDS (no torch here)
KINDS = ("candidate", "low_p", "high_p_pos", "high_p_rest")
PARTS = ("graded", "after")  # s2t_diagnostics.PARTS
CELL_NAMES = {"candidate": "candidates (A > 0, p < tau_p)", "low_p": "other p < tau_p (A <= 0)",
              "high_p_pos": "p >= tau_p, A > 0", "high_p_rest": "p >= tau_p, A <= 0"}


def shares_before_collapse(folder: Path, collapse: int | None) -> dict[str, list[float]] | None:
    """{cell: [grad share, tokens, mean dH per token, summed dH]} averaged over a run's steps before
    its collapse (all steps without one), from its metrics.jsonl's shares/*; None for a run without
    them."""
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    steps = [m for m in metrics if collapse is None or m["step"] < collapse]
    if not steps or "shares/grad_candidate_graded" not in steps[0]:
        return None
    out = {}
    for cell in (f"{k}_{p}" for k in KINDS for p in PARTS):
        rows = [(m[f"shares/grad_{cell}"], m[f"shares/n_{cell}"], m[f"shares/dH_{cell}"])
                for m in steps]
        # dH: a mean over n tokens
        tokens, summed = sum(n for _, n, _ in rows), sum(n * d for _, n, d in rows)
        out[cell] = [sum(g for g, _, _ in rows) / len(rows), tokens / len(rows),
                     summed / tokens if tokens else 0.0, summed / len(rows)]
    return out


def why_table(arms: dict, algo: str = "justrl") -> str:  # --why (D70)
    """Markdown: what carries `algo`'s updates on its steps before the collapse, per kind x part
    (averaged over its seeds, the range over seeds in brackets)."""
    per_seed = {seed: shares_before_collapse(run["folder"], run["collapse"])
                for seed, run in sorted(arms.get(algo, {}).items())}
    per_seed = {s: v for s, v in per_seed.items() if v}
    if not per_seed:
        return f"(no {algo} run with shares/*)"
    seeds = ", ".join(f"{s} (steps 1-{(arms[algo][s]['collapse'] or 13) - 1}"
                      f"{'' if arms[algo][s]['collapse'] else ', no collapse'})" for s in per_seed)
    lines = [f"{algo}, seeds {seeds}: per step, mean over steps then seeds [range over seeds]", "",
             "| tokens | part | share of the logit-gradient norm | tokens a step | "
             "entropy change a token | entropy change summed a step |", "|---|---|---|---|---|---|"]
    for kind in KINDS:
        for part in PARTS:
            # 4 tuples over seeds
            vals = list(zip(*(v[f"{kind}_{part}"] for v in per_seed.values())))

            def cell(xs, fmt):
                return f"{fmt(sum(xs) / len(xs))} [{fmt(min(xs))}, {fmt(max(xs))}]"
            lines.append(f"| {CELL_NAMES[kind]} | {part} | {cell(vals[0], lambda x: f'{x:.1%}')} | "
                         f"{cell(vals[1], lambda x: f'{x:.1f}')} | "
                         f"{cell(vals[2], lambda x: f'{x:+.4f}')} | "
                         f"{cell(vals[3], lambda x: f'{x:+.2f}')} |")
    return "\n".join(lines)


def table(arms: dict) -> str:
    """Markdown: each arm's per-seed outcomes, then the paired tests (every arm against JustRL,
    STAPO against its controls)."""
    lines = ["| arm | seeds | collapsed | collapse steps | entropy rise (mean) | "
             "held-out acc @0 / 4 / 8 / 12 | silenced / candidates a step |",
             "|---|---|---|---|---|---|---|"]
    for algo, runs in arms.items():
        xs = list(runs.values())
        held = " / ".join(f"{sum(x['eval'].get(s, float('nan')) for x in xs) / len(xs):.3f}"
                          for s in (0, *EVAL_STEPS))
        lines.append(f"| {algo} | {len(xs)} | {sum(x['collapse'] is not None for x in xs)} | "
                     f"{', '.join(str(x['collapse'] or '-') for x in xs)} | "
                     f"{sum(x['rise'] for x in xs) / len(xs):+.3f} | {held} | "
                     f"{np.mean([np.mean(x['silenced']) for x in xs]):.1f} / "
                     f"{np.mean([np.mean(x['candidates']) for x in xs]):.1f} |")
    lines += ["", "| comparison | outcome | seeds | means | paired differences | "
                  "mean diff (95% bootstrap) | sign test (+/-, p) |",
              "|---|---|---|---|---|---|---|"]
    pairs = [(a, "justrl") for a in arms if a != "justrl"] + \
        [("stapo", c) for c in ("randmask", "highmask", "fullmask") if c in arms]
    for a, b in pairs:
        for r in compare(arms, a, b):
            lines.append(f"| {a} - {b} | {r['outcome']} | {r['seeds']} | "
                         f"{r['a_mean']:.3f} / {r['b_mean']:.3f} | "
                         f"{', '.join(f'{d:+.3g}' for d in r['diffs'])} | {r['mean_diff']:+.3f} "
                         f"({r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}) | "
                         f"{r['pos']}/{r['neg']}, {r['p']:.3f} |")
    return "\n".join(lines)


def reading(arms: dict, seeds: int = 6) -> str:  # D69
    """The plan's one sentence, by its rules fixed before the runs (docs/experiments.md,
    "How each result will be read"): supports, supports but not S2T's choice, refutes, or cannot
    tell at this scale. Needs JustRL, STAPO and RandMask complete in all `seeds` seeds."""
    common = set(range(seeds))
    missing = [a for a in ("justrl", "stapo", "randmask") if not common <= set(arms.get(a, {}))]
    if missing:
        return f"not yet read: {', '.join(missing)} not complete in all {seeds} seeds"
    rows = {(r["a"], r["outcome"]): r for a in ("stapo", "randmask")
            for r in compare(arms, a, "justrl")}
    collapsed = {a: {s for s in common if arms[a][s]["collapse"] is not None}
                 for a in ("justrl", "stapo", "randmask")}
    justrl, prevented = len(collapsed["justrl"]), len(collapsed["justrl"] - collapsed["stapo"])
    stapo, rand, rise = \
        rows["stapo", "collapsed"], rows["randmask", "collapsed"], rows["stapo", "entropy rise"]
    rise_high = rise["ci"][1]
    said = (f"JustRL collapsed in {justrl} of {seeds} seeds, STAPO in {len(collapsed['stapo'])} "
            f"(sign test {stapo['pos']}/{stapo['neg']}, p = {stapo['p']:.3f}), RandMask in "
            f"{len(collapsed['randmask'])} (p = {rand['p']:.3f}); STAPO prevented {prevented} of "
            f"JustRL's collapses; entropy rise STAPO - JustRL {rise['mean_diff']:+.3f} "
            f"({rise['ci'][0]:+.3f}, {rise_high:+.3f})")
    if justrl < 4:
        return (f"cannot tell at this scale (JustRL collapsed in fewer than 4 seeds: the claim was "
                f"not tested): {said}")
    if stapo["neg"] > stapo["pos"] and stapo["p"] < 0.05:
        if rand["neg"] > rand["pos"] and rand["p"] < 0.05:
            return (f"supports, but not S2T's choice of tokens (RandMask prevents the collapse as "
                    f"well): {said}")
        return f"supports the claim at this scale: {said}"
    if prevented <= 1 and rise_high >= 0:
        return f"refutes the claim at this scale: {said}"
    return f"cannot tell at this scale: {said}"


def figure(arms: dict, out: Path) -> None:
    """Training accuracy, held-out accuracy (after 0, 4, 8, 12 steps) and rollout entropy per step,
    one column per arm, each seed a thin line of its own colour in every panel (collapse steps
    marked x)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(arms)  # read_runs's order
    fig, axes = plt.subplots(3, len(names), figsize=(3.2 * len(names), 7.4), sharex=True,
                             sharey="row", squeeze=False)
    handles = {}  # seed -> its line, for one legend of every seed
    for j, algo in enumerate(names):
        for seed, run in sorted(arms[algo].items()):
            steps, color = range(1, len(run["acc"]) + 1), f"C{seed % 10}"
            handles[seed], = axes[0][j].plot(steps, run["acc"], lw=0.9, alpha=0.8, color=color,
                                             label=f"seed {seed}")
            if run["collapse"]:
                axes[0][j].plot(run["collapse"], run["acc"][run["collapse"] - 1], "x", color=color)
            held = sorted(run["eval"].items())
            axes[1][j].plot([t for t, _ in held], [a for _, a in held], ".-", lw=0.9, alpha=0.8,
                            color=color)
            axes[2][j].plot(steps, run["entropy"], lw=0.9, alpha=0.8, color=color)
        collapsed = sum(r["collapse"] is not None for r in arms[algo].values())
        axes[0][j].set_title(f"{algo}: {collapsed} of {len(arms[algo])} collapsed", fontsize=9)
        axes[2][j].set_xlabel("step")
    for ax in axes.flat:
        ax.xaxis.get_major_locator().set_params(integer=True)  # steps
    axes[0][0].set_ylabel("training accuracy\n(32 samples of 4 prompts)")
    axes[1][0].set_ylabel("held-out accuracy\n(64 problems x 4)")
    axes[2][0].set_ylabel("rollout entropy (nats)")
    axes[0][-1].legend(handles=[handles[s] for s in sorted(handles)], fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    root, out = Path(argv[0]), Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
    if not root.is_dir():
        print(f"tools.collapse: error: {root} is not a folder of run folders", file=sys.stderr)
        return 2
    arms = read_runs(root)
    if not arms:
        print(f"tools.collapse: error: no complete run (12 steps, evaluated after 12) in {root}",
              file=sys.stderr)
        return 2
    print(table(arms))
    print(f"\nreading (the plan's rules): {reading(arms)}")
    if "--why" in argv:
        for algo in arms:
            print("\n" + why_table(arms, algo))
    if out:
        figure(arms, out)
        print(f"figure: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
