"""Figures of training runs, drawn from the files train.py writes into a run folder (README.md, "Outputs").

    python train.py --plot RUN [RUN ...] [--out PNG]    # redraw / overlay finished runs (train.py hands over here)

- `metrics.png`: reward, entropy and silenced fraction per step (metrics.jsonl) and the held-out accuracy
  (eval.jsonl), one line per run.
- `s2t.png`: what S2T saw (tokens.jsonl, paper Sec. 4): the drawn response tokens in the (probability, entropy)
  plane with the tau_p line, the mini-batch tau_h values, correct vs incorrect responses and the silenced tokens
  marked; beside it the closed-form logit-gradient norm |w| sqrt(1 - 2p + sum_v p_v^2) of silenced vs kept tokens
  (the paper's claim: the low-p, low-H tokens of correct answers carry the largest gradients). One row per
  setting; the tokens of its seeds are pooled.

One concept, pictures of run folders: a file of its own so that train.py stays the story of one step and runs can
be redrawn and overlaid after the fact from their files alone (no torch, no model). matplotlib is optional: without
it every function prints one line on stderr and draws nothing.

Choices:
1. x is `step` as each file writes it: the N-th step (from 1) for metrics.jsonl, the number of completed steps for
   eval.jsonl (0 = before training); integer ticks only, whole steps around a lone point.
2. Every run gets its own line style and marker, and runs whose curves coincide on a panel are named in a note on
   it, since the last one drawn would otherwise hide the others.
3. Runs that differ only in the seed (`seed_groups`) share a colour; where a panel has several of them with steps
   in common, each is a thin line and a thick line is their mean at those steps.
4. The token picture shows the sample train.py drew (`s2t.token_sample`: every candidate and silenced token, and a
   fixed-size random sample of the others); the gradient-norm means in its title are weighted by `weight`, so they
   estimate the means over all response tokens.
"""
import argparse
import json
import sys
from pathlib import Path

METRIC_PANELS = (("metrics.jsonl", "reward/mean", "reward (+-1 mean)"), ("metrics.jsonl", "entropy/mean", "entropy"),
                 ("metrics.jsonl", "s2t/silenced_frac", "silenced fraction"),
                 ("eval.jsonl", "eval/acc", "held-out accuracy (after N steps)"))
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x")
USAGE = ("python train.py --plot RUN [RUN ...] [--out PNG]: instead of training, redraw the figures of finished runs, "
         "overlaid (default: RUN/metrics.png and RUN/s2t.png for one run, FIRST_RUN/compare.png and "
         "FIRST_RUN/compare_s2t.png for several; --out PNG: PNG and PNG's stem + _s2t.png)")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a .jsonl file ([] if it does not exist)."""
    path = Path(path)
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train.py: matplotlib is not installed, no figure (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def _config(run: str) -> dict:
    config = Path(run) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def _label(run: str) -> str:
    config = _config(run)
    return f"{run} ({config['algo']}, seed {config.get('seed', 0)})" if config else run


_NOT_A_SETTING = ("seed", "out_dir", "resume", "logger", "plots", "save_every", "save_optimizer", "export_hf")


def seed_groups(run_dirs: list[str]) -> dict[str, list[str]]:
    """Runs that are seeds of one setting (config.json equal but for the seed and where outputs went), keyed by the
    algorithm, or by "algorithm (first run)" where one algorithm has several settings; a run without config.json is
    a group of its own."""
    settings, algos = {}, {}
    for run in dict.fromkeys(run_dirs):  # a folder given twice is one run
        config = _config(run)
        setting = {k: v for k, v in config.items() if k not in _NOT_A_SETTING}
        key = json.dumps(setting, sort_keys=True) if config else run
        settings.setdefault(key, []).append(run)
        algos.setdefault(key, config.get("algo", run))
    algos = list(algos.values())
    return {(a if algos.count(a) == 1 else f"{a} ({runs[0]})"): runs for a, runs in zip(algos, settings.values())}


def plot_metrics(run_dirs: list[str], out_png: str) -> bool:
    """Reward, entropy, silenced fraction and held-out accuracy over steps, one line per run; True if written."""
    plt = _pyplot()
    if plt is None:
        return False
    from matplotlib.ticker import MaxNLocator

    group = {run: name for name, runs in seed_groups(run_dirs).items() for run in runs}
    colors = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(group.values()))}  # choice 3
    fig, axes = plt.subplots(1, len(METRIC_PANELS), figsize=(4.2 * len(METRIC_PANELS), 3.4))
    for ax, (name, key, title) in zip(axes, METRIC_PANELS):
        data = {}  # run -> {step: value} of the runs with this panel's key
        for run in run_dirs:
            lines = [m for m in read_jsonl(Path(run) / name) if key in m]
            if lines:
                data[run] = {m["step"]: m[key] for m in lines}
        means = {}  # choice 3: group -> (steps, mean, runs) where it has several runs with steps in common
        for g in dict.fromkeys(group[run] for run in data):
            runs = [values for run, values in data.items() if group[run] == g]
            steps = sorted(set.intersection(*(set(r) for r in runs)))
            if len(runs) > 1 and steps:
                means[g] = steps, [sum(r[x] for r in runs) / len(runs) for x in steps], len(runs)
        curves = {}
        for i, run in enumerate(run_dirs):
            if run in data:
                xs, ys, thin = list(data[run]), list(data[run].values()), group[run] in means
                ax.plot(xs, ys, linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)],
                        markevery=max(1, len(xs) // 12), color=colors[group[run]],
                        label="_" + run if thin else _label(run),  # "_": not in the legend
                        **(dict(linewidth=0.8, alpha=0.6, markersize=2) if thin else dict(markersize=4)))
                curves.setdefault((tuple(xs), tuple(ys)), []).append(Path(run).name)
        for g, (steps, mean, n) in means.items():
            ax.plot(steps, mean, color=colors[g], linewidth=2.5, label=f"{g}: mean of {n} runs (thin: each)")
        same = [names for names in curves.values() if len(names) > 1]  # choice 2
        if same:
            ax.text(0.02, 0.02, "\n".join("identical: " + " = ".join(n) for n in same), transform=ax.transAxes,
                    fontsize=7, va="bottom")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("steps done" if name == "eval.jsonl" else "step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # choice 1
        steps = [x for xs, _ in curves for x in xs]
        if steps and max(steps) - min(steps) < 2:  # a single point or two: whole steps around it
            ax.set_xlim(min(steps) - 1, max(steps) + 1)
        if not curves:
            ax.text(0.5, 0.5, f"no {name}", transform=ax.transAxes, ha="center", color="gray")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return True


def plot_tokens(run_dirs: list[str], out_png: str) -> bool:
    """The S2T picture of the runs with a tokens.jsonl, one row per algorithm (its runs' tokens pooled); True if
    written."""
    rows = {g: [r for r in runs if read_jsonl(Path(r) / "tokens.jsonl")] for g, runs in seed_groups(run_dirs).items()}
    rows = {g: runs for g, runs in rows.items() if runs}
    if not rows:
        return False
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 4 * len(rows)), squeeze=False)
    for (ax_h, ax_g), (g, runs) in zip(axes, rows.items()):
        records = [r for run in runs for r in read_jsonl(Path(run) / "tokens.jsonl")]
        tau_p = _config(runs[0]).get("tau_p", 0.002)
        tok = {k: [v for r in records for v in r[k]]
               for k in ("p", "H", "correct", "candidate", "silenced", "grad_norm", "weight")}
        n = len(tok["p"])
        taus = sorted({r["tau_h"] for r in records if r.get("tau_h") is not None})  # none without an entropy test
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
                ax.scatter([tok["p"][i] for i in sel], [tok[y][i] for i in sel], label=f"{name} ({len(sel)})",
                           **style)
        if taus:
            ax_h.hlines(taus, 1e-9, tau_p, colors="tab:red", alpha=0.25, linewidth=0.8,
                        label=f"mini-batch tau_h ({len(taus)} values)")
        for ax in (ax_h, ax_g):
            ax.set_xscale("log")
            ax.axvline(tau_p, color="k", linestyle="--", linewidth=0.8, label=f"tau_p = {tau_p:g}")
            ax.set_xlabel("p (probability of the sampled token)")
            ax.set_xlim(max(min(tok["p"], default=1e-6) / 2, 1e-9), 1.5)

        def mean(sel):
            w = sum(tok["weight"][i] for i in sel)
            return f"{sum(tok['grad_norm'][i] * tok['weight'][i] for i in sel) / w:.3g}" if w else "-"

        silenced = [i for i in range(n) if tok["silenced"][i]]
        kept = [i for i in range(n) if not tok["silenced"][i]]
        ax_h.set_ylabel("entropy H")
        who = _label(runs[0]) if len(runs) == 1 else f"{len(runs)} runs of {g}"
        ax_h.set_title(f"{who}: {n} drawn tokens, {len(records)} mini-batches", fontsize=9)
        ax_g.set_ylabel("|w| sqrt(1 - 2p + sum p^2)")
        ax_g.set_title(f"logit-gradient norm, mean silenced {mean(silenced)} vs kept {mean(kept)}",
                       fontsize=9)
        ax_h.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return True


def figures(run_dirs: list[str], out_png: str) -> list[str]:
    """Both figures: the metrics one at out_png, the S2T one beside it (stem + _s2t.png; s2t.png for metrics.png).
    Returns the paths written."""
    out = Path(out_png)
    s2t_png = out.with_name("s2t.png" if out.name == "metrics.png" else f"{out.stem}_s2t{out.suffix or '.png'}")
    written = [str(out)] if plot_metrics(run_dirs, str(out)) else []
    return written + ([str(s2t_png)] if plot_tokens(run_dirs, str(s2t_png)) else [])


def main(argv: list[str]) -> int:
    """`train.py --plot RUN [RUN ...] [--out PNG]` in any order; a missing run folder is a one-line error."""
    parser = argparse.ArgumentParser(prog="train.py --plot", description=USAGE)
    parser.add_argument("--plot", nargs="+", required=True, metavar="RUN", help="run folders (train.py --out-dir)")
    parser.add_argument("--out", help="PNG of the metrics figure (the S2T figure goes beside it)")
    parser.error = lambda message: parser.exit(2, f"train.py: error: {message}\n")  # one line, no usage block
    args = parser.parse_args(argv)
    missing = [r for r in args.plot if not (Path(r) / "metrics.jsonl").is_file()]
    if missing:
        parser.error(f"no run folder with a metrics.jsonl at {', '.join(missing)}")
    first = Path(args.plot[0])
    out = args.out or str(first / ("metrics.png" if len(args.plot) == 1 else "compare.png"))
    written = figures(args.plot, out)
    print("\n".join(written))
    return 0 if written else 1
