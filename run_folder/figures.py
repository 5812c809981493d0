"""Figures of training runs, drawn from the files train.py writes into a run folder
(docs/outputs.md), redrawn and overlaid later from those files alone (no model); closing lines.

    python train.py --plot RUN [RUN ...] [--out PNG]     # also: python -m run_folder.figures RUN

- `metrics.png`: reward, entropy and silenced fraction per step (metrics.jsonl), held-out accuracy.
- `s2t.png`: what S2T saw (tokens.jsonl, docs/paper.md §4): drawn tokens in the (p, H) plane with
  tau_p and the tau_h values, correct vs incorrect responses, the silenced tokens marked; beside it
  the logit-gradient norm |w| sqrt(1 - 2p + sum_v p_v^2) of silenced vs kept tokens (seeds pooled).
- `gradient.png`: RQ1, that norm's binned median against p and against H, with its correlations.
- `entropy_change.png` (`--entropy-change`): the entropy change an update made at silenced tokens,
  kept candidates and other tokens, per step, beside the entropy (the paper's mechanism).
- `counterfactual.png` (`python -m tools.counterfactual RUN --plot`, RQ2): each analysed token's
  effect on the success rate against its probability, by kind (counterfactual.jsonl).

matplotlib is optional: without it every function prints one line on stderr and draws nothing.
Choices 1-9: docs/paper.md, "Deliberate differences", run_folder/figures.py.
"""
import json
import math
import sys
from pathlib import Path

from command_line.errors import check_writable
from command_line.flags import OneLineParser
from run_folder.console import plural, say
from run_folder.files import RUN_FILES, complete_steps
from run_folder.logs import read_log

METRIC_PANELS = (("metrics.jsonl", "reward/mean", "reward (+-1 mean)"),
                 ("metrics.jsonl", "entropy/mean", "entropy"),
                 ("metrics.jsonl", "s2t/silenced_frac", "silenced fraction"),
                 ("eval.jsonl", "eval/acc", "held-out accuracy, where evaluated"))
ENTROPY_CHANGE_PANELS = tuple(("metrics.jsonl", f"entropy_change/{kind}",
                               f"entropy change per update: {title}")
                              for kind, title in (("silenced", "silenced tokens"),
                                                  ("candidate", "kept candidates"),
                                                  ("other", "other tokens"))) + \
    (("metrics.jsonl", "entropy/mean", "entropy"),)  # train.py --entropy-change; choice 8
# s2t.grad_norm_logits, w = r A
GRADIENT_NORM = r"logit-gradient norm $|w|\,\sqrt{1 - 2p + \sum_v p_v^2}$"
# below this p the factor sqrt(1 - 2p + sum p^2) is ~1: the norm is ~|w| whatever p (gradient.png)
P_FLAT = 0.1
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x")
USAGE = ("python train.py --plot RUN [RUN ...] [--out PNG] [--table | --sensitivity]: instead of "
         "training, redraw the figures of finished runs, overlaid (default: RUN/metrics.png, "
         "RUN/s2t.png and RUN/gradient.png for one run, FIRST_RUN/compare.png, compare_s2t.png and "
         "compare_gradient.png for several; --out PNG: PNG and PNG's stem + _s2t.png, "
         "_gradient.png), and print RQ1's correlations; --table: the runs side by side; "
         "--sensitivity: the (tau_p, quantile) grid")


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train.py: matplotlib is not installed, no figure (pip install matplotlib)",
              file=sys.stderr)
        return None
    return plt


def _config(run: str) -> dict:
    config = Path(run) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def _label(run: str) -> str:
    config = _config(run)
    return f"{run} ({config['algo']}, seed {config.get('seed', 0)})" if config else run


_NOT_A_SETTING = ("seed", "out_dir", "resume", "logger", "plots", "save_every", "save_optimizer",
                  "export_hf")


def seed_groups(run_dirs: list[str]) -> dict[str, list[str]]:
    """Runs that are seeds of one setting (config.json equal but for the seed and where outputs
    went), keyed by the algorithm, or by "algorithm (first run)" where one algorithm has several
    settings; a run without config.json is a group of its own."""
    settings, algos = {}, {}
    for run in dict.fromkeys(run_dirs):  # a folder given twice is one run
        config = _config(run)
        setting = {k: v for k, v in config.items() if k not in _NOT_A_SETTING}
        key = json.dumps(setting, sort_keys=True) if config else run
        settings.setdefault(key, []).append(run)
        algos.setdefault(key, config.get("algo", run))
    algos = list(algos.values())
    return {(a if algos.count(a) == 1 else f"{a} ({runs[0]})"): runs
            for a, runs in zip(algos, settings.values())}


def _value(line: dict, key: str) -> float | None:
    """A metrics line's value of `key`, None where absent or where an entropy-change kind had no
    tokens (choice 8)."""
    value = line.get(key)
    return None if value is None or (key.startswith("entropy_change/") and value == 0.0) else value


def plot_metrics(run_dirs: list[str], out_png: str, panels: tuple = METRIC_PANELS) -> bool:
    """Reward, entropy, silenced fraction and held-out accuracy over steps (or other `panels`:
    (file, key, title)), one line per run; True if written."""
    plt = _pyplot()
    if plt is None:
        return False
    from matplotlib.ticker import MaxNLocator

    group = {run: name for name, runs in seed_groups(run_dirs).items() for run in runs}
    colors = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(group.values()))}  # choice 3
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (name, key, title) in zip(axes, panels):
        data = {}  # run -> {step: value} of the runs with this panel's key
        for run in run_dirs:
            lines = [m for m in read_log(Path(run) / name) if _value(m, key) is not None]
            if lines:
                data[run] = {m["step"]: m[key] for m in lines}
        # choice 3: group -> (steps, mean, runs per step) at the steps two or more of its runs have
        means = {}
        for g in dict.fromkeys(group[run] for run in data):
            runs = [values for run, values in data.items() if group[run] == g]
            steps = sorted(x for x in set().union(*runs) if sum(x in r for r in runs) > 1)
            if steps:
                have = [[r[x] for r in runs if x in r] for x in steps]
                means[g] = steps, [sum(v) / len(v) for v in have], sorted({len(v) for v in have})
        # choice 5: evaluations are points, with no line between them
        curves, points = {}, name == "eval.jsonl"
        for i, run in enumerate(run_dirs):
            if run in data:
                xs, ys, thin = list(data[run]), list(data[run].values()), group[run] in means
                ax.plot(xs, ys, linestyle="none" if points else STYLES[i % len(STYLES)],
                        marker=MARKERS[i % len(MARKERS)],
                        markevery=1 if points else max(1, len(xs) // 12), color=colors[group[run]],
                        label="_" + run if thin else _label(run),  # "_": not in the legend
                        **(dict(linewidth=0.8, alpha=0.6, markersize=3 if points else 2) if thin
                           else dict(markersize=6 if points else 4)))
                curves.setdefault((tuple(xs), tuple(ys)), []).append(Path(run).name)
        for g, (steps, mean, n) in means.items():
            ax.plot(steps, mean, color=colors[g], linewidth=2.5,
                    linestyle="none" if points else "-", marker="D" if points else None,
                    markersize=7, label=f"{g}: mean of {n[0]} runs (thin: each)" if len(n) == 1 else
                    f"{g}: mean of the {n[0]}-{n[-1]} runs with a value (thin: each)")
        if points and len(curves) == 1:  # one run: its measured values beside the points
            for x, y in zip(*next(iter(curves))):
                ax.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(6, -3),
                            fontsize=8)
        if points:
            ax.set_ylim(-0.04, 1.04)  # an accuracy
        if key.startswith("entropy_change/"):  # a change: its sign is the point
            ax.axhline(0, color="k", linewidth=0.6, linestyle="--")
        same = [names for names in curves.values() if len(names) > 1]  # choice 2
        if same:
            # three names a line, so that a long group stays inside the panel
            lines = ["identical: " + "\n    = ".join(" = ".join(n[i:i + 3])
                                                     for i in range(0, len(n), 3))
                     for n in same]
            ax.text(0.02, 0.02, "\n".join(lines), transform=ax.transAxes, fontsize=7, va="bottom")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("steps done (0 = before training)" if points else "step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # choice 1
        steps = [x for xs, _ in curves for x in xs]
        # points clear of the frame; whole steps around one
        if steps and (points or max(steps) - min(steps) < 2):
            pad = max(1, (max(steps) - min(steps)) / 20)
            ax.set_xlim(min(steps) - pad, max(steps) + pad)
        if not curves:
            ax.text(0.5, 0.5, f"no {name}", transform=ax.transAxes, ha="center", color="gray")
    named = {}  # choice 9: one legend under the panels, every label any panel has, once
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            named.setdefault(label, handle)
    ncol = max(1, min(len(named), 3))
    # inches under the panels: a row of 9-pt names each
    legend_in = 0.1 + 0.25 * -(-len(named) // ncol)
    fig.set_figheight(3.4 + legend_in)
    if named:
        fig.legend(list(named.values()), list(named), loc="lower center", ncol=ncol, fontsize=9)
    fig.tight_layout(rect=(0, legend_in / (3.4 + legend_in), 1, 1))
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return True


def plot_tokens(run_dirs: list[str], out_png: str) -> bool:
    """The S2T picture of the runs with a tokens.jsonl, one row per algorithm (its runs' tokens
    pooled); True if written."""
    rows = {g: [r for r in runs if read_log(Path(r) / "tokens.jsonl")]
            for g, runs in seed_groups(run_dirs).items()}
    rows = {g: runs for g, runs in rows.items() if runs}
    if not rows:
        return False
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(len(rows), 2, figsize=(13.5, 4 * len(rows)), squeeze=False)
    for (ax_h, ax_g), (g, runs) in zip(axes, rows.items()):
        records = [r for run in runs for r in read_log(Path(run) / "tokens.jsonl")]
        tau_p = _config(runs[0]).get("tau_p", 0.002)
        tok = {k: [v for r in records for v in r[k]]
               for k in ("p", "H", "A", "correct", "candidate", "silenced", "grad_norm", "weight")}
        n = len(tok["p"])
        # none without an entropy test
        taus = sorted(r["tau_h"] for r in records if r.get("tau_h") is not None)
        groups = [("incorrect response", lambda i: not tok["correct"][i] and not tok["silenced"][i],
                   dict(s=6, c="tab:gray", alpha=0.35, marker=".")),
                  ("correct response, kept", lambda i: tok["correct"][i] and not tok["silenced"][i]
                   and not tok["candidate"][i], dict(s=8, c="tab:blue", alpha=0.5, marker="o")),
                  ("candidate, kept" + (" (H >= tau_h)" if taus else ""),
                   lambda i: tok["candidate"][i] and not tok["silenced"][i],
                   dict(s=40, facecolors="none", edgecolors="tab:orange", marker="o")),
                  ("silenced", lambda i: tok["silenced"][i], dict(s=40, c="tab:red", marker="x"))]
        for name, member, style in groups:
            sel = [i for i in range(n) if member(i)]
            for ax, y in ((ax_h, "H"), (ax_g, "grad_norm")):
                ax.scatter([tok["p"][i] for i in sel], [tok[y][i] for i in sel],
                           label=f"{name} ({len(sel)})", **style)
        if taus:  # choice 6: the thresholds as one bar on the tau_p line, a tick at their median
            low, median, high = taus[0], taus[len(taus) // 2], taus[-1]
            ax_h.errorbar([tau_p], [median], yerr=[[median - low], [high - median]], fmt="_",
                          markersize=18, mew=2.5, elinewidth=4, alpha=0.8, capsize=0,
                          color="tab:red", zorder=3,
                          label=f"tau_h of {len(taus)} mini-batch{'es' if len(taus) > 1 else ''}: "
                                f"median {median:.2f}, {low:.2f}-{high:.2f}")
        for ax in (ax_h, ax_g):
            ax.set_xscale("log")
            ax.axvline(tau_p, color="k", linestyle="--", linewidth=0.8, label=f"tau_p = {tau_p:g}")
            ax.set_xlabel("p (probability of the sampled token)")
            ax.set_xlim(max(min(tok["p"], default=1e-6) / 2, 1e-9), 1.5)

        def mean(sel):
            w = sum(tok["weight"][i] for i in sel)
            return (f"{sum(tok['grad_norm'][i] * tok['weight'][i] for i in sel) / w:.3g}" if w
                    else "-")

        silenced = [i for i in range(n) if tok["silenced"][i]]
        kept = [i for i in range(n) if not tok["silenced"][i]]
        # gradient.png's tokens
        with_gradient = sum(g > 0 and a != 0 for g, a in zip(tok["grad_norm"], tok["A"]))
        ax_h.set_ylabel("entropy H")
        who = _label(runs[0]) if len(runs) == 1 else f"{len(runs)} runs of {g}"
        # two lines: a run's folder is a long name
        ax_h.set_title(f"{who}:\n{n:,} drawn tokens ({with_gradient:,} with a gradient), "
                       f"{len(records)} mini-batches", fontsize=10)
        ax_g.set_ylabel(GRADIENT_NORM)
        ax_g.set_title(f"mean norm (weighted): silenced {mean(silenced)} vs kept {mean(kept)}",
                       fontsize=10)
        # choice 6: beside the plane, over no token
        ax_g.legend(*ax_h.get_legend_handles_labels(), fontsize=10, loc="upper left",
                    bbox_to_anchor=(1.02, 1), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------
# RQ1, the gradient analysis (docs/paper.md §4, §8): token-wise policy-gradient magnitude vs p, H
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


def correlation_line(run: str) -> str:
    """One line of RQ1's correlations for a run folder ('' without tokens.jsonl)."""
    records = read_log(Path(run) / "tokens.jsonl")
    if not records:
        return ""
    a = gradient_analysis(records)
    fmt = lambda r: "-" if r is None else f"{r:+.2f}"  # noqa: E731
    return (f"logit-gradient norm vs p: Spearman {fmt(a['rho_p'])} ({fmt(a['rho_p_low'])} below "
            f"p = {P_FLAT:g}), vs H: {fmt(a['rho_h'])}, vs H at equal p (per unit advantage): "
            f"{fmt(a['rho_h_at_p'])} ({a['n']} drawn tokens with a gradient, "
            f"weighted; tokens.jsonl)")


def plot_gradient(run_dirs: list[str], out_png: str) -> bool:
    """RQ1's figure: the logit-gradient norm's binned median (and 25-75% band) against p (log scale)
    and against H, correct and incorrect responses, one colour per setting (seeds pooled); each
    panel's title gives the weighted Spearman correlations it illustrates (against p: over all
    tokens and below p = P_FLAT, where the curve is flat), the legend only the lines."""
    rows = {g: [r for r in runs if read_log(Path(r) / "tokens.jsonl")]
            for g, runs in seed_groups(run_dirs).items()}
    rows = {g: runs for g, runs in rows.items() if runs}
    plt = _pyplot() if rows else None
    if plt is None:
        return False
    fig, (ax_p, ax_h) = plt.subplots(1, 2, figsize=(12, 4.6))
    fmt = lambda r: "-" if r is None else f"{r:+.2f}"  # noqa: E731
    said_p, said_h = [], []
    for c, (g, runs) in enumerate(rows.items()):
        a = gradient_analysis([r for run in runs for r in read_log(Path(run) / "tokens.jsonl")])
        for kind, style in (("correct", "-"), ("incorrect", ":")):
            for ax, key, x_of in ((ax_p, "bins_p", lambda v: 10 ** v),
                                  (ax_h, "bins_h", lambda v: v)):
                bins = a[kind][key]
                if not bins:
                    continue
                xs = [x_of(b[0]) for b in bins]
                ax.plot(xs, [b[1] for b in bins], linestyle=style, marker="o", color=f"C{c}",
                        label=f"{g}, {kind} responses")
                if len(rows) == 1:
                    ax.fill_between(xs, [b[2] for b in bins], [b[3] for b in bins], color=f"C{c}",
                                    alpha=0.12)
        who = f"{g}: " if len(rows) > 1 else ""
        said_p.append(f"{who}Spearman {fmt(a['rho_p'])} over all tokens, {fmt(a['rho_p_low'])} "
                      f"below p = {P_FLAT:g}")
        said_h.append(f"{who}Spearman {fmt(a['rho_h'])}; at equal p, per unit advantage: "
                      f"{fmt(a['rho_h_at_p'])}")
    ax_p.set_xscale("logit")  # log near 0 and near 1, where the norm falls
    ax_p.axvline(P_FLAT, color="gray", linestyle="--", linewidth=0.8)
    ax_p.set_xlabel(f"p (probability of the sampled token; logit scale, bins of one decade below "
                    f"{P_FLAT:g})")
    ax_h.set_xlabel("entropy H (8 bins)")
    ax_p.set_title("\n".join(said_p), fontsize=9)
    ax_h.set_title("\n".join(said_h), fontsize=9)
    for ax in (ax_p, ax_h):
        ax.set_ylabel(GRADIENT_NORM + ": median, 25-75%", fontsize=9)
    fig.legend(*ax_p.get_legend_handles_labels(), loc="lower center", ncol=min(4, 2 * len(rows)),
               fontsize=10)
    fig.suptitle("RQ1: a token's logit-gradient norm against its probability and entropy "
                 "(tokens.jsonl, weighted)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08 + 0.05 * ((2 * len(rows) - 1) // 4), 1, 1))
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------
# Tables over runs: the algorithms side by side (RQ3/RQ4) and the threshold grid (RQ5)
def run_summary(run: str) -> dict:
    """What one run folder did: its setting (algo, tau_p, quantile, seed), the share of its response
    tokens and of its S2T candidates that were silenced over all steps, the steps that silenced any,
    held-out accuracy before and after (eval.jsonl), the last step's entropy, reward and accuracy,
    and (--entropy-change) the mean entropy change an update made per kind of token."""
    config, steps = _config(run), read_log(Path(run) / "metrics.jsonl")
    evals = read_log(Path(run) / "eval.jsonl")
    rows = config.get("prompts_per_step", 0) * config.get("group_size", 0)
    tokens = sum(m["response/len_mean"] * rows for m in steps)
    silenced, candidates = (sum(m.get("s2t/silenced", 0) for m in steps),
                            sum(m.get("s2t/candidates", 0) for m in steps))
    return {"run": run, "algo": config.get("algo"), "tau_p": config.get("tau_p"),
            "quantile": config.get("quantile"), "seed": config.get("seed"), "steps": len(steps),
            "silenced": silenced, "candidates": candidates,
            "silenced_of_tokens": silenced / tokens if tokens else 0.0,
            # 20-Entropy silences by entropy alone, not among the S2T candidates: no such share
            "silenced_of_candidates": None if config.get("algo") == "20-entropy" else
            silenced / candidates if candidates else 0.0,
            "silencing_steps": sum(m.get("s2t/silenced", 0) > 0 for m in steps),
            "acc_before": evals[0]["eval/acc"] if evals and evals[0]["step"] == 0 else None,
            "acc_after": evals[-1]["eval/acc"] if evals else None,
            "entropy_end": steps[-1]["entropy/mean"] if steps else None,
            "reward_end": steps[-1]["reward/mean"] if steps else None,
            "acc_end": steps[-1].get("reward/acc") if steps else None,
            # --entropy-change: mean of the step means over the steps with such tokens (choice 8)
            **{f"entropy_change_{kind}":
               _mean_or_none([v for v in (_value(m, f"entropy_change/{kind}") for m in steps)
                              if v is not None])
               for kind in ("silenced", "candidate", "other")}}


def silenced_summary(algo: str, steps: list[dict], files: list[str]) -> str:
    """The console line that counts what the mask silenced over a run (its metrics.jsonl lines)."""
    silenced = [int(m.get("s2t/silenced", 0)) for m in steps]
    candidates = sum(int(m.get("s2t/candidates", 0)) for m in steps)
    return (f"{algo} silenced {sum(silenced)} tokens in {sum(n > 0 for n in silenced)} of "
            f"{len(steps)} steps; S2T candidates (A > 0, p < tau_p): {candidates} "
            f"(metrics.jsonl s2t/*{'; see ' if files else ''}{', '.join(files)})")


def divergence(steps: list[dict]) -> str:
    """'' or the sentence that says which steps (metrics.jsonl lines) skipped an update for a
    non-finite gradient."""
    bad = [m["step"] for m in steps if m.get("skipped/nonfinite", 0) > 0]
    if not bad:
        return ""
    no_update = [m["step"] for m in steps
                 if m.get("skipped/nonfinite", 0) > 0 and m.get("updates", 0) == 0]
    where = ("steps " if len(bad) > 1 else "step ") + step_spans(bad)
    return (f"the run diverged: the gradient norm was not finite in {plural(len(bad), 'step')} of "
            f"{len(steps)} ({where}), {len(no_update)} of them made no update at all")


def step_spans(steps: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    spans = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _mean_or_none(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _cell(summaries: list[dict], key: str, fmt: str) -> str:
    """Mean over the runs of a cell (and the range when there are several):
    '0.833 (0.812-0.850)'."""
    values = [s[key] for s in summaries if s[key] is not None]
    if not values:
        return "-"
    mean = format(sum(values) / len(values), fmt)
    return (mean if len(values) == 1
            else f"{mean} ({format(min(values), fmt)}-{format(max(values), fmt)})")


_COLUMNS = (("seeds", None, None), ("held-out before", "acc_before", ".3f"),
            ("held-out after", "acc_after", ".3f"),
            ("training accuracy, last step", "acc_end", ".2f"),
            ("entropy at the end", "entropy_end", ".2f"),
            ("silenced % of tokens", "silenced_of_tokens", ".4%"),
            ("silenced % of candidates", "silenced_of_candidates", ".0%"),
            ("steps that silenced", "silencing_steps", ".1f"),
            *((f"entropy change per update, {name}", f"entropy_change_{kind}", "+.3f")
              for kind, name in (("silenced", "silenced"), ("candidate", "kept candidates"),
                                 ("other", "other"))))


def summary_table(run_dirs: list[str], by: str = "setting") -> str:
    """A markdown table of `run_summary` means over seeds: one row per setting (`seed_groups`: the
    algorithms side by side) or, with by="thresholds", per (tau_p, quantile) cell of a sensitivity
    grid; the entropy-change columns only where a run logged it (--entropy-change)."""
    if by == "thresholds":
        cells = {}
        for run in run_dirs:
            summary = run_summary(run)
            cells.setdefault((summary["tau_p"], summary["quantile"]), []).append(summary)
        rows = {f"| {t:g} | {q:g} |": cells[(t, q)] for t, q in sorted(cells)}
        head = "| tau_p | quantile |"
    else:
        rows = {f"| {g} |": [run_summary(r) for r in runs]
                for g, runs in seed_groups(run_dirs).items()}
        head = "| setting |"
    # the entropy_change_ columns only for runs that logged it
    columns = [c for c in _COLUMNS if not (c[1] or "").startswith("entropy_change_")
               or any(x[c[1]] is not None for summaries in rows.values() for x in summaries)]
    lines = [head + "".join(f" {name} |" for name, _, _ in columns),
             "|" + "---|" * (head.count("|") - 1 + len(columns))]
    for label, summaries in rows.items():
        lines.append(label + "".join(
            f" {len(summaries) if key is None else _cell(summaries, key, fmt)} |"
            for _, key, fmt in columns))
    return "\n".join(lines) + "\n"


def plot_sensitivity(run_dirs: list[str], out_png: str) -> bool:
    """RQ5's figure: four heat maps over the (tau_p, quantile) grid of the runs (seed means):
    silenced share of response tokens and of candidates, held-out accuracy after training, entropy
    at the end."""
    cells = {}
    for run in run_dirs:
        summary = run_summary(run)
        cells.setdefault((summary["tau_p"], summary["quantile"]), []).append(summary)
    plt = _pyplot() if cells else None
    if plt is None:
        return False
    taus, qs = sorted({t for t, _ in cells}), sorted({q for _, q in cells})
    panels = (("silenced_of_tokens", "silenced share of response tokens", ".3%"),
              ("silenced_of_candidates", "silenced share of candidates", ".0%"),
              ("acc_after", "held-out accuracy after training", ".3f"),
              ("entropy_end", "entropy, last step", ".2f"))
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for ax, (key, title, fmt) in zip(axes, panels):
        grid = [[None] * len(taus) for _ in qs]
        for (t, q), summaries in cells.items():
            values = [s[key] for s in summaries if s[key] is not None]
            grid[qs.index(q)][taus.index(t)] = sum(values) / len(values) if values else None
        shown = [[v if v is not None else float("nan") for v in row] for row in grid]
        ax.imshow(shown, cmap="viridis", origin="lower", aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                n = len(cells.get((taus[j], qs[i]), []))
                ax.text(j, i, "-" if v is None else f"{format(v, fmt)}\n({n} seed{'s' * (n > 1)})",
                        ha="center", va="center", fontsize=8, color="white")
        ax.set_xticks(range(len(taus)), [f"{t:g}" for t in taus])
        ax.set_yticks(range(len(qs)), [f"{q:g}" for q in qs])
        ax.set_xlabel("tau_p")
        ax.set_ylabel("quantile q")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------
# RQ2, what the mask removes (docs/paper.md §4, §8): each token's counterfactual effect on reward
KIND_STYLES = {"silenced": dict(color="tab:red", marker="x"),
               "candidate": dict(color="tab:orange", marker="o"),
               "other": dict(color="tab:blue", marker=".")}


def plot_counterfactual(lines: list[dict], out_png: str) -> bool:
    """The counterfactual.jsonl lines of tools/counterfactual.py: each token's effect on the success
    rate (with its standard error) against its probability p, coloured by kind (silenced, kept
    candidate, other), and the effects of each kind side by side with their mean; True if
    written."""
    if not lines:
        return False
    plt = _pyplot()
    if plt is None:
        return False
    fig, (ax_p, ax_k) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    kinds = [k for k in KIND_STYLES if any(x["kind"] == k for x in lines)]
    for j, kind in enumerate(kinds):
        mine = [x for x in lines if x["kind"] == kind]
        style = KIND_STYLES[kind]
        ax_p.errorbar([x["p"] for x in mine], [x["effect"] for x in mine],
                      yerr=[x["stderr"] for x in mine], linestyle="none", alpha=0.7,
                      label=f"{kind} ({len(mine)})", **style)
        # deterministic jitter
        spread = [j + 0.3 * ((i * 0.618) % 1 - 0.5) for i in range(len(mine))]
        ax_k.scatter(spread, [x["effect"] for x in mine], s=14, alpha=0.6, **style)
        mean = sum(x["effect"] for x in mine) / len(mine)
        ax_k.hlines(mean, j - 0.3, j + 0.3, colors="k", linewidth=2)
    for ax in (ax_p, ax_k):
        ax.axhline(0, color="k", linewidth=0.6, linestyle="--")
    ax_p.set_xscale("log")
    ax_p.set_xlabel("p (probability of the token under the policy that sampled it)")
    ax_p.set_ylabel("effect: success kept - success redrawn")
    ax_p.legend(fontsize=8)
    k = sorted({x["k"] for x in lines})
    ax_p.set_title(f"counterfactual effect of {len(lines)} tokens, K = {', '.join(map(str, k))}",
                   fontsize=9)
    ax_k.set_xticks(range(len(kinds)), kinds)
    ax_k.set_title("effects per kind, black: mean", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return True


def plot_counterfactual_groups(panels: dict[str, dict[str, list[dict]]], out_png: str,
                               interval) -> bool:
    """Many runs' counterfactual.jsonl lines
    (`python -m tools.counterfactual --table RUN ... --out PNG`), one panel per algorithm
    ({algorithm: {group of tokens: lines}}, counterfactual.pooled_groups): each group's contrasts
    Q(a) - Q(not a) side by side, its mean with the 95% interval over responses
    (interval(values, clusters) -> (low, high): counterfactual.cluster_interval), and under it the
    group's size and share negligible (the equivalence test); True if written."""
    panels = {name: {g: xs for g, xs in groups.items() if xs} for name, groups in panels.items()}
    plt = _pyplot() if any(panels.values()) else None
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), sharey=True,
                             squeeze=False)
    for ax, (name, groups) in zip(axes[0], panels.items()):
        labels = []
        for j, (group, xs) in enumerate(groups.items()):
            contrasts = [x["contrast"] for x in xs]
            style = KIND_STYLES.get(group.split(",")[0],
                                    dict(color="tab:purple" if "silences" in group else "tab:green",
                                         marker="+"))
            ax.scatter([j + 0.5 * ((i * 0.618) % 1 - 0.5) for i in range(len(xs))], contrasts, s=10,
                       alpha=0.45, **style)  # deterministic jitter
            mean = sum(contrasts) / len(contrasts)
            lo, hi = interval(contrasts, [(x.get("seed"), x.get("step"), x.get("row")) for x in xs])
            ax.errorbar([j], [mean], yerr=[[mean - lo], [hi - mean]], color="k", capsize=6,
                        linewidth=2, marker="_", markersize=18)
            # under each group, below the axis (no point hides it there): size and share negligible
            negligible = sum(x["negligible"] for x in xs) / len(xs)
            labels.append(group.replace(", ", "\n")
                          .replace("candidates the S2T rule ", "cand., S2T\n")
                          + f"\nn = {len(xs)}\n{negligible:.0%} negl.")
        ax.axhline(0, color="k", linewidth=0.6, linestyle="--")
        ax.set_xticks(range(len(groups)), labels, fontsize=6)
        ax.set_title(name, fontsize=9)
    axes[0][0].set_ylabel("contrast: success kept - success without the token\n(black: mean, 95% "
                          "interval over responses;\nnegl.: interval inside +-delta)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return True


def figures(run_dirs: list[str], out_png: str) -> list[str]:
    """The figures: the metrics one at out_png, the S2T one and the gradient one beside it
    (stem + _s2t.png and _gradient.png; s2t.png and gradient.png for metrics.png), and for runs made
    with --entropy-change the entropy change per kind of token (_entropy_change.png,
    entropy_change.png). Returns the paths written."""
    out = Path(out_png)
    beside = lambda name: out.with_name(f"{name}.png" if out.name == "metrics.png"  # noqa: E731
                                        else f"{out.stem}_{name}{out.suffix or '.png'}")
    written = [str(out)] if plot_metrics(run_dirs, str(out)) else []
    written += [str(beside("s2t"))] if plot_tokens(run_dirs, str(beside("s2t"))) else []
    written += [str(beside("gradient"))] if plot_gradient(run_dirs, str(beside("gradient"))) else []
    changed = any("entropy_change/other" in m for run in run_dirs
                  for m in read_log(Path(run) / "metrics.jsonl"))
    # and for runs made with --entropy-change, the entropy change figure
    return written + ([str(beside("entropy_change"))] if changed and plot_metrics(
        run_dirs, str(beside("entropy_change")), ENTROPY_CHANGE_PANELS) else [])


def main(argv: list[str], prog: str = "train.py") -> int:
    """`train.py --plot RUN [RUN ...] [--out PNG]` (or `python -m run_folder.figures RUN ...`) in
    any order; a missing run folder is a one-line error "PROG: error: ..."."""
    parser = OneLineParser(prog=prog, description=USAGE)
    parser.add_argument("runs", nargs="*", metavar="RUN", help="run folders (train.py --out-dir)")
    parser.add_argument("--plot", nargs="+", default=[], metavar="RUN",
                        help="run folders, as train.py --plot takes them")
    parser.add_argument("--out", help="PNG of the metrics figure (the S2T figure goes beside it)")
    parser.add_argument("--table", action="store_true", help="also print the runs' summary table, "
                        "one row per setting, seeds pooled (the algorithms side by side)")
    parser.add_argument("--sensitivity", action="store_true", help="instead: the (tau_p, quantile) "
                        "grid of the runs, as a table and OUT (default FIRST_RUN/sensitivity.png)")
    args = parser.parse_args(argv)
    runs = [*args.plot, *args.runs]
    if not runs:
        parser.error("give the run folders to draw: RUN [RUN ...]")
    missing = [r for r in runs if not (Path(r) / "metrics.jsonl").is_file()]
    if missing:
        parser.error(f"no run folder with a metrics.jsonl at {', '.join(missing)}")
    first = Path(runs[0])
    out = args.out or str(first / ("sensitivity.png" if args.sensitivity
                                   else "metrics.png" if len(runs) == 1 else "compare.png"))
    try:  # before anything is drawn: a read-only run folder, say
        check_writable("--out" if args.out else "--plot", Path(out).parent)
    except OSError as e:
        parser.error(f"{e}" + ("" if args.out else "; write the figures elsewhere with --out PNG"))
    if args.out:  # a figure into a folder that does not exist yet: make it
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.sensitivity:
        print(summary_table(runs, by="thresholds"))
        if not plot_sensitivity(runs, out):
            return 1
        print(out)
        return 0
    written = figures(runs, out)
    if args.table:
        print(summary_table(runs))
    for run in dict.fromkeys(runs):  # RQ1's numbers beside its figure
        if correlation_line(run):
            print(f"{run}: {correlation_line(run)}")
    print("\n".join(written))
    return 0 if written else 1


def closing_lines(cfg, out: Path) -> None:
    """A finished run's figures and closing lines, on rank 0 (train.py): what the mask silenced,
    RQ1's correlations, a divergence, what the run wrote and how to continue it."""
    if cfg.plots:
        figures([str(out)], str(out / "metrics.png"))
    shown = [n for n in ("spurious.jsonl", "s2t.png", "gradient.png") if (out / n).exists()]
    steps = read_log(out / "metrics.jsonl")  # resumed steps included
    say(silenced_summary(cfg.algo, steps, shown))
    if correlation_line(str(out)):  # RQ1: the gradient norm against p and H (gradient.png)
        say(correlation_line(str(out)))
    diverged = divergence(steps)
    if diverged:
        say(diverged + "; lower --lr (or raise --warmup-steps)", warning=True)
    made = [name for name in RUN_FILES if (out / name).is_file() and name != "stopped.json"]
    if not read_log(out / "eval.jsonl"):  # no accuracy before and after: say why and how to get it
        say("no held-out evaluation: " + ("--eval-samples 0" if not cfg.eval_samples else
            f"no held-out rows (--heldout N keeps N rows of {cfg.data} out of training)"))
    kept = complete_steps(out)
    made += [f"checkpoint/step_{kept[0]}"] if kept else []
    made += [f"hf/ (python eval.py --run {out})"] if cfg.export_hf else []
    say(f"outputs in {out}/: {', '.join(made)}; " + (f"{diverged}; " if diverged else "")
        + f"continue with python train.py --resume {out} --steps N")


if __name__ == "__main__":  # python -m run_folder.figures RUN [RUN ...]: train.py --plot's figures
    sys.exit(main(sys.argv[1:], prog="python -m run_folder.figures"))
