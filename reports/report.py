"""A run's report: at the end of a run, its figures and closing lines (`closing_lines`: what the
mask silenced, a divergence, what the run wrote; docs/outputs.md), and the
command line that redraws and overlays finished runs from their files alone (`main`: `python
train.py --plot RUN ...`, `python -m reports RUN ...`; docs/paper.md §8: RQ1's correlations,
--table's algorithms side by side, --sensitivity's (tau_p, quantile) grid).
"""
from pathlib import Path

from command_line.errors import check_writable
from command_line.flags import OneLineParser
from reports.figures import figures, plot_sensitivity
from reports.summary import correlation_line, divergence, silenced_summary, summary_table
from run_folder.console import RunError, say
from run_folder.files import RUN_FILES, complete_steps
from run_folder.logs import read_log

USAGE = ("python train.py --plot RUN [RUN ...] [--out PNG] [--table | --sensitivity]: instead of "
         "training, redraw the figures of finished runs, overlaid (default: RUN/metrics.png, "
         "RUN/s2t.png and RUN/gradient.png for one run, FIRST_RUN/compare.png, compare_s2t.png and "
         "compare_gradient.png for several; --out PNG: PNG and PNG's stem + _s2t.png, "
         "_gradient.png), and print RQ1's correlations; --table: the runs side by side; "
         "--sensitivity: the (tau_p, quantile) grid")


def main(argv: list[str], prog: str = "train.py") -> int:
    """`train.py --plot RUN [RUN ...] [--out PNG]` (or `python -m reports RUN ...`) in any
    order; a missing run folder is a one-line error "PROG: error: ..."."""
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
    """A finished run's figures and closing lines, on rank 0 (train.py): what the mask silenced, a
    divergence, what the run wrote and how to continue it. RQ1's correlations are gradient.png's
    title and `--plot`'s lines, not the run's."""
    if cfg.plots:
        try:
            figures([str(out)], str(out / "metrics.png"))
        except OSError as e:  # a full disk
            raise RunError(f"could not write {e.filename or out} ({e.strerror or e}): the run is "
                           f"complete (checkpoint and export written); free space, then python "
                           f"train.py --plot {out} draws its figures") from None
    shown = [n for n in ("spurious.jsonl", "s2t.png", "gradient.png") if (out / n).exists()]
    steps = read_log(out / "metrics.jsonl")  # resumed steps included
    say(silenced_summary(cfg.algo, steps, shown))
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
