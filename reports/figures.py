"""Figures of training runs, drawn from the files train.py writes into a run folder
(docs/outputs.md), redrawn and overlaid later from those files alone (no model).

    python train.py --plot RUN [RUN ...] [--out PNG]     # also: python -m reports RUN

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
Choices D74-D82: docs/paper.md, "Deliberate differences".
"""
import math
import sys
from pathlib import Path

from reports.statistics import P_FLAT, gradient_analysis
from reports.summary import metric_value, run_config, run_summary, seed_groups
from run_folder.logs import read_log

def save(fig, out_png: str, dpi: int) -> None:
    """fig.savefig(out_png); a write that fails (a full disk) leaves no torn file and raises OSError
    naming it."""
    try:
        fig.savefig(out_png, dpi=dpi)
    except OSError as e:
        Path(out_png).unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror or str(e), str(out_png)) from None


METRIC_PANELS = (("metrics.jsonl", "reward/mean", "reward (+-1 mean)"),
                 ("metrics.jsonl", "entropy/mean", "entropy"),
                 ("metrics.jsonl", "s2t/silenced_frac", "silenced fraction"),
                 ("eval.jsonl", "eval/acc", "held-out accuracy, where evaluated"))
ENTROPY_CHANGE_PANELS = tuple(("metrics.jsonl", f"entropy_change/{kind}",
                               f"entropy change per update: {title}")
                              for kind, title in (("silenced", "silenced tokens"),
                                                  ("candidate", "kept candidates"),
                                                  ("other", "other tokens"))) + \
    (("metrics.jsonl", "entropy/mean", "entropy"),)  # train.py --entropy-change; D82
# s2t.grad_norm_logits, w = r A
GRADIENT_NORM = r"logit-gradient norm $|w|\,\sqrt{1 - 2p + \sum_v p_v^2}$"
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x")


def _pyplot():
    try:
        import logging

        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        # a font cache another matplotlib wrote (~/.cache/matplotlib) lacks the math fonts: 20
        # "findfont: ... not found" lines on the console, and the figures the same in DejaVu Sans
        logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    except ImportError:
        print("train.py: matplotlib is not installed, no figure (pip install matplotlib)",
              file=sys.stderr)
        return None
    return plt


def _label(run: str) -> str:
    config = run_config(run)
    return f"{run} ({config['algo']}, seed {config.get('seed', 0)})" if config else run


def plot_metrics(run_dirs: list[str], out_png: str, panels: tuple = METRIC_PANELS) -> bool:
    """Reward, entropy, silenced fraction and held-out accuracy over steps (or other `panels`:
    (file, key, title)), one line per run; True if written."""
    plt = _pyplot()
    if plt is None:
        return False
    from matplotlib.ticker import MaxNLocator

    group = {run: name for name, runs in seed_groups(run_dirs).items() for run in runs}
    colors = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(group.values()))}  # D76
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (name, key, title) in zip(axes, panels):
        data = {}  # run -> {step: value} of the runs with this panel's key
        for run in run_dirs:
            lines = [m for m in read_log(Path(run) / name) if metric_value(m, key) is not None]
            if lines:
                data[run] = {m["step"]: m[key] for m in lines}
        # D76: group -> (steps, mean, runs per step) at the steps two or more of its runs have
        means = {}
        for g in dict.fromkeys(group[run] for run in data):
            runs = [values for run, values in data.items() if group[run] == g]
            steps = sorted(x for x in set().union(*runs) if sum(x in r for r in runs) > 1)
            if steps:
                have = [[r[x] for r in runs if x in r] for x in steps]
                means[g] = steps, [sum(v) / len(v) for v in have], sorted({len(v) for v in have})
        # D78: evaluations are points, with no line between them
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
        same = [names for names in curves.values() if len(names) > 1]  # D75
        if same:
            # three names a line, so that a long group stays inside the panel
            lines = ["identical: " + "\n    = ".join(" = ".join(n[i:i + 3])
                                                     for i in range(0, len(n), 3))
                     for n in same]
            ax.text(0.02, 0.02, "\n".join(lines), transform=ax.transAxes, fontsize=7, va="bottom")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("steps done (0 = before training)" if points else "step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # D74
        steps = [x for xs, _ in curves for x in xs]
        # points clear of the frame; whole steps around one
        if steps and (points or max(steps) - min(steps) < 2):
            pad = max(1, (max(steps) - min(steps)) / 20)
            ax.set_xlim(min(steps) - pad, max(steps) + pad)
        if not curves:
            ax.text(0.5, 0.5, f"no {name}", transform=ax.transAxes, ha="center", color="gray")
    named = {}  # D80: one legend under the panels, every label any panel has, once
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
    save(fig, out_png, 90)
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
    legends = []
    for (ax_h, ax_g), (g, runs) in zip(axes, rows.items()):
        records = [r for run in runs for r in read_log(Path(run) / "tokens.jsonl")]
        tau_p = run_config(runs[0]).get("tau_p", 0.002)
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
        if taus:  # D79: the thresholds as one bar on the tau_p line, a tick at their median
            low, median, high = taus[0], taus[len(taus) // 2], taus[-1]
            ax_h.errorbar([tau_p], [median], yerr=[[median - low], [high - median]], fmt="_",
                          markersize=18, mew=2.5, elinewidth=4, alpha=0.8, capsize=0,
                          color="tab:red", zorder=3,
                          label=f"tau_h of {_batches(len(taus), len(records))}: "
                                f"median {median:.2f}, {low:.2f}-{high:.2f}")
        for ax in (ax_h, ax_g):
            ax.set_xscale("log")
            ax.axvline(tau_p, color="k", linestyle="--", linewidth=0.8, label=f"tau_p = {tau_p:g}")
            ax.set_xlabel("p (probability of the sampled token)")
            ax.set_xlim(max(min(tok["p"], default=1e-6) / 2, 1e-9), 1.5)

        def mean(sel):
            w = sum(tok["weight"][i] for i in sel)  # weighted: means over all tokens (D77)
            return (f"{sum(tok['grad_norm'][i] * tok['weight'][i] for i in sel) / w:.3g}" if w
                    else "-")

        silenced = [i for i in range(n) if tok["silenced"][i]]
        kept = [i for i in range(n) if not tok["silenced"][i]]
        # gradient.png's tokens
        with_gradient = sum(g > 0 and a != 0 for g, a in zip(tok["grad_norm"], tok["A"]))
        ax_h.set_ylabel("entropy H")
        who = _label(runs[0]) if len(runs) == 1 else f"{len(runs)} runs of {g}"
        who = who if len(who) <= 80 else "..." + who[-77:]  # a long folder: its end, in the panel
        # two lines: a run's folder is a long name
        ax_h.set_title(f"{who}:\n{n:,} drawn token{'s' * (n != 1)} ({with_gradient:,} with a "
                       f"gradient), {len(records)} mini-batch{'es' * (len(records) != 1)}",
                       fontsize=10)
        ax_g.set_ylabel(GRADIENT_NORM)
        ax_g.set_title(f"mean norm (weighted): silenced {mean(silenced)} vs kept {mean(kept)}",
                       fontsize=10)
        # D79: beside the plane, over no token
        legends.append(ax_g.legend(*ax_h.get_legend_handles_labels(), fontsize=10,
                                   loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0))
    fig.canvas.draw()  # 5.5 in a panel beside the widest legend (titles were cut, ran together)
    fig.set_figwidth(11 + max(lg.get_window_extent().width for lg in legends) / fig.dpi + 0.3)
    fig.tight_layout()
    save(fig, out_png, 100)
    plt.close(fig)
    return True


def _batches(with_tau: int, every: int) -> str:
    """The mini-batches a tau_h bar summarizes, counted as the title counts them: "3 mini-batches",
    or "16 of the 24 mini-batches (those with candidates)"."""
    if with_tau == every:
        return f"{with_tau} mini-batch{'es' * (with_tau != 1)}"
    return f"{with_tau} of the {every} mini-batches (those with candidates)"


def _logit_ticks(ax, fig) -> None:
    """A logit-scaled p axis labelled at 1, 2 and 5 x 10^-k, 0.5, 0.9, 0.99 and 0.999 in its
    range, the decades and 0.5, 0.9, ... first, each label kept only where it touches none kept
    (matplotlib's own labels ran into each other: "2·10^-2 3·10^-2 4·10^-2")."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter

    low, high = ax.get_xlim()
    first = [10.0 ** -k for k in range(9, 0, -1)] + [0.5, 0.9, 0.99, 0.999]
    ticks = sorted(t for t in first + [m * 10.0 ** -k for k in range(9, 0, -1) for m in (2, 5)]
                   if low <= t <= high)
    texts = [f"{t:g}" if t >= 1e-3 else
             f"${t / 10 ** math.floor(math.log10(t)):.0f}\\cdot10^{{{math.floor(math.log10(t))}}}$"
             .replace("$1\\cdot", "$") for t in ticks]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.xaxis.set_major_formatter(FixedFormatter(texts))
    fig.canvas.draw()
    boxes = [label.get_window_extent().expanded(1, 1).padded(3) for label in ax.get_xticklabels()]
    kept = []
    for i in sorted(range(len(ticks)), key=lambda i: ticks[i] not in first):
        if all(not boxes[i].overlaps(boxes[j]) for j in kept):
            kept.append(i)
    ax.xaxis.set_major_formatter(FixedFormatter([t if i in kept else ""
                                                 for i, t in enumerate(texts)]))


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
    # one column per setting (correct, incorrect), below the panels, sized as drawn: inside the
    # figure
    legend = fig.legend(*ax_p.get_legend_handles_labels(), loc="lower center", ncol=len(rows),
                        fontsize=10)
    fig.suptitle("RQ1: a token's logit-gradient norm against its probability and entropy "
                 "(tokens.jsonl, weighted)", fontsize=11)
    fig.canvas.draw()
    fig.set_figwidth(max(fig.get_figwidth(),
                         legend.get_window_extent().width / fig.dpi + 0.4))  # a long name
    fig.canvas.draw()
    below = legend.get_window_extent().height / fig.bbox.height
    fig.tight_layout(rect=(0, below + 0.02, 1, 1))
    _logit_ticks(ax_p, fig)
    save(fig, out_png, 100)
    plt.close(fig)
    return True


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
    save(fig, out_png, 80)
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
    save(fig, out_png, 80)
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
    save(fig, out_png, 80)
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

