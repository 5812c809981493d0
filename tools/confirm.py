"""Does S2T help where every token counts? The gate, the power calculation, the outcomes, statistics
and reading of the confirmatory experiment (docs/experiments.md,
"Does S2T help where every token counts?"; docs/paper.md §4, §8).

    python -m tools.confirm gate RUN [RUN ...]
        # the JustRL-only gate: S2T's activity, the regime, the gradient shares
    python -m tools.confirm power
        # the seeds the plan needs (80% power for 0.04, the first spread)
    python -m tools.confirm RUNS [--out PNG]
        # RUNS/ALGO-SEED folders: the tables, the manipulation check, the reading

Primary outcome: each run's mean training accuracy (`reward/acc`) over the steps after warm-up
(steps 3-16: the 8 warm-up updates are the first 2 steps); the arms of a seed see the same fresh
prompts in the same order. Statistics: paired two-sided t-test with its 95% interval (Wilcoxon's
signed-rank test as a check), STAPO - JustRL first, then STAPO - RandMask (a fixed sequence: the
second counts only if the first is significant); secondaries (entropy rise, held-out accuracy after
the last step) with Holm's correction over their four tests; the collapse indicator descriptive
only; a manipulation check (tokens S2T silenced per run; RandMask's count equals S2T's rule).
Deliberate choices D71-D73: docs/paper.md, "Deliberate differences".
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from tools.collapse import collapse_step, entropy_rise

WARMUP_STEPS = 2  # 8 warm-up updates of 4 mini-batches: steps 1-2
STEPS = 16
# the difference in the primary outcome the plan is powered for, and the equivalence margin
DELTA = 0.04
ARMS = ("justrl", "stapo", "randmask")
# The first experiment's paired differences of the runs' mean training accuracy
# (docs/experiments.md, the collapse experiment's not-pre-registered row; seeds 0-5), whose pooled
# spread sizes this one.
FIRST_EXPERIMENT = {
    "stapo - justrl": [-0.0104, -0.0703, -0.0885, +0.0417, +0.0729, +0.00781],
    "randmask - justrl": [-0.00521, +0.0312, -0.0521, -0.159, -0.013, +0.00781],
    "fullmask - justrl": [+0.0286, -0.151, -0.00781, -0.0964, -0.0521, +0.0156],
    "highmask - justrl": [+0.0755, +0.0026, -0.0495, +0.0365, +0.099, +0.0443],
    "stapo - randmask": [-0.00521, -0.102, -0.0365, +0.201, +0.0859, 0.0],
}


# --------------------------------------------------------------------------------------- statistics
def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (Lentz's method, Numerical Recipes'
    betacf)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for x in [0, 1] (D71)."""
    if x <= 0 or x >= 1:
        return float(x >= 1)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) +
                     b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1 - front * _beta_fraction(b, a, 1 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom:
    I_(df / (df + t^2))(df / 2, 1 / 2)."""
    return incomplete_beta(df / 2, 0.5, df / (df + t * t))


def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with df degrees of freedom, by bisection on its
    CDF."""
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1 - t_two_sided_p(mid, df) / 2 < p else (lo, mid)
    return (lo + hi) / 2


def chi2_cdf(x: float, df: float) -> float:
    """P(X <= x) for chi-square with df degrees of freedom: the regularized lower incomplete gamma
    P(df/2, x/2) (its series below a + 1, else its continued fraction: Numerical Recipes' gammp)."""
    a, x = df / 2, x / 2
    if x <= 0:
        return 0.0
    front = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:
        term = total = 1 / a
        for n in range(1, 1000):
            term *= x / (a + n)
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return front * total
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an, b = -i * (i - a), b + 2
        d, c = 1 / (an * d + b), b + an / c
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return 1 - front * h


def chi2_quantile(p: float, df: float) -> float:
    """The p-quantile of chi-square with df degrees of freedom, by bisection on its CDF."""
    lo, hi = 0.0, df + 100 * math.sqrt(df) + 100
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def paired_t(diffs: list[float], level: float = 0.95) -> dict:
    """Paired two-sided t-test of mean(diffs) = 0: {mean, sd, t, p, ci (level), ci90}."""
    d = np.asarray(diffs, dtype=float)
    n, mean = len(d), float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else float("nan")
    se = sd / math.sqrt(n)
    t = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
    p = t_two_sided_p(t, n - 1) if math.isfinite(t) else 0.0
    half = {q: t_quantile(q, n - 1) * se for q in ((1 + level) / 2, 0.95)}
    return {"n": n, "mean": mean, "sd": sd, "t": t, "p": p,
            "ci": (mean - half[(1 + level) / 2], mean + half[(1 + level) / 2]),
            "ci90": (mean - half[0.95], mean + half[0.95])}


def wilcoxon(diffs: list[float]) -> tuple[float, float]:
    """(W+, exact two-sided p) of Wilcoxon's signed-rank test: zeros dropped, ties given their mean
    rank (D72)."""
    d = [x for x in diffs if x != 0]
    if not d:
        return 0.0, 1.0
    order = sorted(range(len(d)), key=lambda i: abs(d[i]))
    ranks = [0.0] * len(d)
    i = 0
    while i < len(d):  # tied |d| share the mean of their ranks
        j = i
        while j + 1 < len(d) and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    doubled = [round(2 * r) for r in ranks]  # integers
    counts = np.zeros(sum(doubled) + 1)  # counts[w]: sign assignments whose doubled W+ is w
    counts[0] = 1
    for r in doubled:
        counts[r:] += counts[:-r].copy()  # with or without this one
    w_plus = sum(r for r, x in zip(doubled, d) if x > 0)
    low = min(w_plus, sum(doubled) - w_plus)
    p = 2 * counts[:low + 1].sum() / counts.sum()
    return w_plus / 2, float(min(p, 1.0))


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - k) * ps[i]))
        out[i] = running
    return out


def power(n: int, sd: float, delta: float = DELTA, draws: int = 200_000, seed: int = 0) -> float:
    """The share of two-sided paired t-tests at level 0.05 on n differences ~ N(delta, sd^2) that
    reject (D73)."""
    d = np.random.default_rng(seed).normal(delta, sd, size=(draws, n))  # (draws, n)
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
    return float((np.abs(t) > t_quantile(0.975, n - 1)).mean())


def pooled_sd(groups: dict[str, list[float]]) -> tuple[float, int]:
    """(the pooled standard deviation of several groups of differences around their own means, its
    df)."""
    dev = [x - np.mean(v) for v in groups.values() for x in v]
    df = sum(len(v) - 1 for v in groups.values())
    return float(math.sqrt(sum(x * x for x in dev) / df)), df


def seeds_needed(sd: float, target: float = 0.8, delta: float = DELTA) -> int:
    """The fewest seeds (pairs) whose paired t-test has `target` power for `delta` at spread
    `sd`."""
    n = 3
    while power(n, sd, delta) < target:
        n += 1
    return n


# ----------------------------------------------------------------------------------------- the runs
def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.exists() else []


def read_run(folder: Path) -> dict:
    """A run folder's outcomes: the primary (mean training accuracy after warm-up), the secondaries
    (entropy rise, held-out accuracy after the last step and per problem), the collapse step and
    S2T's counts per step."""
    metrics, evals = _lines(folder / "metrics.jsonl"), _lines(folder / "eval.jsonl")
    config = json.loads((folder / "config.json").read_text())
    acc, entropy = [m["reward/acc"] for m in metrics], [m["entropy/mean"] for m in metrics]
    last = next((e for e in evals if e["step"] == len(metrics) and len(metrics) >= STEPS), None)
    return {"folder": folder, "algo": config["algo"], "seed": config["seed"],
            "steps": len(metrics), "acc": acc, "entropy": entropy,
            "primary": float(np.mean(acc[WARMUP_STEPS:])) if len(acc) > WARMUP_STEPS else None,
            "rise": entropy_rise(entropy) if len(entropy) > 1 else None,
            "collapse": collapse_step(acc), "heldout": last["eval/acc"] if last else None,
            "before": next((e["eval/acc"] for e in evals if e["step"] == 0), None),
            "silenced": [m["s2t/silenced"] for m in metrics],
            "rule": [m.get("s2t/rule_silenced") for m in metrics],
            "candidates": [m["s2t/candidates"] for m in metrics], "metrics": metrics}


def read_runs(root: Path) -> dict[str, dict[int, dict]]:
    """{algo: {seed: run}} of the complete runs (STEPS steps, evaluated after the last) in root's
    ALGO-SEED folders."""
    arms: dict[str, dict[int, dict]] = {}
    for folder in sorted(p for p in root.iterdir()
                         if (p / "metrics.jsonl").exists() and (p / "config.json").exists()):
        run = read_run(folder)
        if run["steps"] >= STEPS and run["heldout"] is not None:
            arms.setdefault(run["algo"], {})[run["seed"]] = run
    return arms


# ----------------------------------------------------------------------------------------- the gate
def gate(folders: list[Path]) -> str:
    """The JustRL-only gate's report (docs/experiments.md, its rules 1-3): S2T's activity a step,
    the regime's training accuracy after warm-up, and the gradient shares."""
    runs = [read_run(f) for f in folders]
    rule = [x for r in runs for x in r["rule"]]
    lines = ["| seed | steps | training acc, steps 1-16 | mean after warm-up | candidates a step | "
             "S2T would silence a step | held-out before / after |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['seed']} | {r['steps']} | {', '.join(f'{a:.2f}' for a in r['acc'])} | "
                     f"{r['primary']:.3f} | {np.mean(r['candidates']):.2f} | "
                     f"{np.mean(r['rule']):.2f} | "
                     f"{r['before'] if r['before'] is None else round(r['before'], 3)} / "
                     f"{r['heldout'] if r['heldout'] is None else round(r['heldout'], 3)} |")
    share = [m for r in runs for m in r["metrics"] if m.get("grad_share/n")]
    cells = [m for r in runs for m in r["metrics"] if "shares/grad_candidate_graded" in m]
    graded = sum(m["shares/n_" + k + "_graded"] for m in cells
                 for k in ("candidate", "low_p", "high_p_pos", "high_p_rest"))
    total = graded + sum(m["shares/n_" + k + "_after"] for m in cells
                         for k in ("candidate", "low_p", "high_p_pos", "high_p_rest"))
    lines += ["", f"S2T's rule would silence {np.mean(rule):.2f} tokens a step ({sum(rule):.0f} in "
              f"{len(rule)} steps; the gate's bar 0.25): " +
              ("**below the bar**: the experiment ends" if np.mean(rule) < 0.25
               else "the gate passes")]
    if share:
        g, g_c, rest = (np.array([m[f"grad_share/{k}"] for m in share])
                        for k in ("all", "candidates", "without"))
        lines.append(f"parameter-gradient norm in the {len(share)} mini-batches with candidates "
                     f"(norms of sums): whole objective {g.mean():.3f}, the candidates' terms "
                     f"alone {g_c.mean():.3f} ({g_c.mean() / g.mean():.0%} of the whole's mean; "
                     f"per mini-batch {np.min(g_c / g):.0%}-{np.max(g_c / g):.0%}), without them "
                     f"{rest.mean():.3f} ({rest.mean() / g.mean():.0%})")
    if cells:
        logit = np.mean([m["shares/grad_candidate_graded"] + m["shares/grad_candidate_after"]
                         for m in cells])
        n_cand = np.mean([m["shares/n_candidate_graded"] + m["shares/n_candidate_after"]
                          for m in cells])
        n_all = total / len(cells)
        lines.append(f"summed per-token logit-gradient norm (no cancellation): candidates "
                     f"{logit:.1%} of a step's, {n_cand:.2f} of its {n_all:.0f} tokens "
                     f"({n_cand / n_all:.2%}): per token {logit / (n_cand / n_all):.1f}x the "
                     f"average, as the formula has it for p < tau_p (about |rA| a token)"
                     if n_cand else "no candidates")
        lines.append(f"tokens in the graded part: {graded / total:.1%} (the rest: the token that "
                     f"ends at the blank line, and responses cut at the length limit)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- the outcomes
def compare(arms: dict, a: str, b: str, outcome: str) -> dict | None:
    """The paired comparison a - b of one outcome over the seeds both arms completed (None without
    any)."""
    seeds = sorted(set(arms.get(a, {})) & set(arms.get(b, {})))
    if len(seeds) < 2:
        return None
    diffs = [arms[a][s][outcome] - arms[b][s][outcome] for s in seeds]
    w_plus, w_p = wilcoxon(diffs)
    return {"a": a, "b": b, "outcome": outcome, "seeds": seeds, "diffs": diffs, **paired_t(diffs),
            "a_mean": float(np.mean([arms[a][s][outcome] for s in seeds])),
            "b_mean": float(np.mean([arms[b][s][outcome] for s in seeds])), "w_plus": w_plus,
            "w_p": w_p}


def manipulation(arms: dict) -> tuple[bool, str]:
    """(passed, in words): S2T silenced tokens (its runs' mean >= 0.25 a step, the gate's bar), and
    RandMask silenced exactly S2T's rule's count in every step of every run."""
    stapo = [np.mean(r["silenced"]) for r in arms.get("stapo", {}).values()]
    rand = [r for r in arms.get("randmask", {}).values()]
    equal = all(s == q for r in rand for s, q in zip(r["silenced"], r["rule"]))
    active = bool(stapo) and float(np.mean(stapo)) >= 0.25
    words = (f"STAPO silenced {np.mean(stapo) if stapo else 0:.2f} tokens a step "
             f"(runs {min(stapo, default=0):.2f}-{max(stapo, default=0):.2f}); RandMask's count "
             f"{'equals' if equal else 'differs from'} S2T's rule in every step")
    return active and equal and bool(rand), words


def reading(primary: dict | None, control: dict | None, passed: bool) -> str:
    """The plan's reading of the primary comparisons (docs/experiments.md, fixed before the main
    runs)."""
    if primary is None:
        return "no complete pairs yet"
    if not passed:
        return "not a test: the manipulation check failed"
    if primary["p"] < 0.05 and primary["mean"] < 0:
        return "harms at this scale"
    if primary["p"] < 0.05:
        chosen = control is not None and control["p"] < 0.05 and control["mean"] > 0
        return "supports the claim at this scale" if chosen else \
            "supports, but not S2T's choice of tokens"
    if -DELTA < primary["ci90"][0] and primary["ci90"][1] < DELTA:
        return (f"refutes at this scale: an effect of {DELTA} or more is excluded (90% interval "
                f"inside +-{DELTA})")
    return "cannot tell at this scale"


def report(arms: dict) -> str:
    """The arm table, the primary and secondary comparisons, the manipulation check and the
    reading."""
    lines = ["| arm | seeds | training acc after warm-up | entropy rise | "
             "held-out after the last step | collapsed (descriptive) | "
             "silenced / candidates a step |", "|---|---|---|---|---|---|---|"]
    for algo in [a for a in ARMS if a in arms]:
        runs = list(arms[algo].values())
        lines.append(f"| {algo} | {len(runs)} | {np.mean([r['primary'] for r in runs]):.3f} | "
                     f"{np.mean([r['rise'] for r in runs]):+.3f} | "
                     f"{np.mean([r['heldout'] for r in runs]):.3f} | "
                     f"{sum(r['collapse'] is not None for r in runs)} | "
                     f"{np.mean([np.mean(r['silenced']) for r in runs]):.2f} / "
                     f"{np.mean([np.mean(r['candidates']) for r in runs]):.2f} |")
    primary = compare(arms, "stapo", "justrl", "primary")
    control = compare(arms, "stapo", "randmask", "primary") \
        if primary and primary["p"] < 0.05 else None
    second = [c for pair in (("stapo", "justrl"), ("stapo", "randmask"))
              for o in ("rise", "heldout") if (c := compare(arms, *pair, o))]
    for c, adjusted in zip(second, holm([c["p"] for c in second])):
        c["holm"] = adjusted
    names = {"primary": "training acc after warm-up (primary)", "rise": "entropy rise",
             "heldout": "held-out acc"}
    lines += ["", "| comparison | outcome | seeds | means | mean diff (95% t interval) | "
              "90% interval | t-test p | Holm p | Wilcoxon p |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in [primary, compare(arms, "stapo", "randmask", "primary"), *second]:
        if c:
            adjusted = f"{c['holm']:.3f}" if "holm" in c else "-"
            lines.append(f"| {c['a']} - {c['b']} | {names[c['outcome']]} | {len(c['seeds'])} | "
                         f"{c['a_mean']:.3f} / {c['b_mean']:.3f} | "
                         f"{c['mean']:+.4f} ({c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}) | "
                         f"({c['ci90'][0]:+.4f}, {c['ci90'][1]:+.4f}) | {c['p']:.3f} | "
                         f"{adjusted} | {c['w_p']:.3f} |")
    passed, words = manipulation(arms)
    lines += ["", f"manipulation check: {'passed' if passed else 'FAILED'}: {words}",
              f"reading (the plan's rules): {reading(primary, control, passed)}"]
    return "\n".join(lines)


def figure(arms: dict, out: Path) -> None:
    """Training accuracy and rollout entropy per step, one column per arm, one line per seed; and
    the paired differences of the primary outcome, STAPO - JustRL and STAPO - RandMask, one dot per
    seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [a for a in ARMS if a in arms]
    fig, axes = plt.subplots(3, len(present), figsize=(4.2 * len(present), 9.5), squeeze=False)
    for j, algo in enumerate(present):
        for run in arms[algo].values():
            steps = range(1, run["steps"] + 1)
            axes[0, j].plot(steps, run["acc"], lw=0.8, alpha=0.5)
            axes[1, j].plot(steps, run["entropy"], lw=0.8, alpha=0.5)
        axes[0, j].set_title(f"{algo} ({len(arms[algo])} seeds)")
        axes[0, j].axvspan(0.5, WARMUP_STEPS + 0.5, color="0.9")
        axes[0, j].set_ylabel("training accuracy")
        axes[1, j].set_ylabel("rollout entropy (nats)")
        axes[1, j].set_xlabel("step")
    for j, (a, b) in enumerate((("stapo", "justrl"), ("stapo", "randmask"))[:len(present)]):
        ax = axes[2, j]
        c = compare(arms, a, b, "primary")
        if c:
            ax.scatter(c["seeds"], c["diffs"], s=12)
            ax.axhline(0, color="0.5", lw=0.8)
            ax.axhspan(*c["ci"], color="C1", alpha=0.2,
                       label=f"mean {c['mean']:+.3f}, 95% t interval")
            ax.legend(fontsize=9)
        ax.set_title(f"{a} - {b}: training acc after warm-up")
        ax.set_xlabel("seed")
    for ax in axes[2, 2:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["power"]:
        sd, df = pooled_sd(FIRST_EXPERIMENT)
        n = seeds_needed(sd)
        print(f"the first experiment's pooled spread of paired differences: sd {sd:.4f} ({df} df); "
              f"80% power for a difference of {DELTA} at level 0.05 needs {n} seeds "
              f"(power {power(n, sd):.3f}); with 30: {power(30, sd):.3f}")
        return 0
    if not argv or argv[0].startswith("-") or (argv[0] == "gate" and len(argv) < 2):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if argv[0] == "gate":
        missing = [f for f in argv[1:] if not (Path(f) / "metrics.jsonl").is_file()]
        if missing:
            print(f"tools.confirm: error: {missing[0]} is not a run folder (no metrics.jsonl)",
                  file=sys.stderr)
            return 2
        print(gate([Path(f) for f in argv[1:]]))
        return 0
    root = Path(argv[0])
    if not root.is_dir():
        print(f"tools.confirm: error: {root} is not a folder of run folders", file=sys.stderr)
        return 2
    arms = read_runs(root)
    if not arms:
        print(f"tools.confirm: error: no complete run ({STEPS} steps, evaluated after the last) "
              f"in {root}", file=sys.stderr)
        return 2
    print(report(arms))
    if "--out" in argv:
        figure(arms, Path(argv[argv.index("--out") + 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
