"""What finished runs did, read from the files train.py writes into a run folder (docs/outputs.md;
docs/paper.md §8: RQ1's correlations, RQ3/RQ4's algorithms side by side, RQ5's threshold grid):
runs that are seeds of one setting (`seed_groups`), one run's summary (`run_summary`), the markdown
table over runs (`summary_table`), and the lines train.py prints at a run's end: what the mask
silenced (`silenced_summary`), a divergence (`divergence`); RQ1's correlations (`correlation_line`)
for `--plot`. D82 (an entropy change of 0.0 is no such tokens) and D81 (a correlation's scope):
docs/paper.md, "Deliberate differences".
"""
import json
from pathlib import Path

from command_line.flags import RECORD
from reports.statistics import P_FLAT, gradient_analysis
from run_folder.console import plural
from run_folder.logs import read_log


# --------------------------------------------------------------------------------------------------
# Runs read back: their settings, the seeds of one setting, a metrics line's values
def run_config(run: str) -> dict:
    """A run folder's config.json ({} without one)."""
    config = Path(run) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


_NOT_A_SETTING = ("seed", "out_dir", "resume", "logger", "plots", "save_every", "save_optimizer",
                  "export_hf", RECORD)


def seed_groups(run_dirs: list[str]) -> dict[str, list[str]]:
    """Runs that are seeds of one setting (config.json equal but for the seed and where outputs
    went), keyed by the algorithm, or by "algorithm (first run)" where one algorithm has several
    settings; a run without config.json is a group of its own."""
    settings, algos = {}, {}
    for run in dict.fromkeys(run_dirs):  # a folder given twice is one run
        config = run_config(run)
        setting = {k: v for k, v in config.items() if k not in _NOT_A_SETTING}
        key = json.dumps(setting, sort_keys=True) if config else run
        settings.setdefault(key, []).append(run)
        algos.setdefault(key, config.get("algo", run))
    algos = list(algos.values())
    return {(a if algos.count(a) == 1 else f"{a} ({runs[0]})"): runs
            for a, runs in zip(algos, settings.values())}


def metric_value(line: dict, key: str) -> float | None:
    """A metrics line's value of `key`, None where absent or where an entropy-change kind had no
    tokens (D82)."""
    value = line.get(key)
    return None if value is None or (key.startswith("entropy_change/") and value == 0.0) else value


# --------------------------------------------------------------------------------------------------
# Tables over runs: the algorithms side by side (RQ3/RQ4) and the threshold grid (RQ5)
def run_summary(run: str) -> dict:
    """What one run folder did: its setting (algo, tau_p, quantile, seed), the share of its response
    tokens and of its S2T candidates that were silenced over all steps, the steps that silenced any,
    held-out accuracy before and after (eval.jsonl), the last step's entropy, reward and accuracy,
    and (--entropy-change) the mean entropy change an update made per kind of token."""
    config, steps = run_config(run), read_log(Path(run) / "metrics.jsonl")
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
            # --entropy-change: mean of the step means over the steps with such tokens (D82)
            **{f"entropy_change_{kind}":
               _mean_or_none([v for v in (metric_value(m, f"entropy_change/{kind}")
                                          for m in steps) if v is not None])
               for kind in ("silenced", "candidate", "other")}}


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


# --------------------------------------------------------------------------------------------------
# The closing lines of a run (train.py prints them at its end)
def silenced_summary(algo: str, steps: list[dict], files: list[str]) -> str:
    """The console line that counts what the mask silenced over a run (its metrics.jsonl lines)."""
    silenced = [int(m.get("s2t/silenced", 0)) for m in steps]
    candidates = sum(int(m.get("s2t/candidates", 0)) for m in steps)
    return (f"{algo} silenced {plural(sum(silenced), 'token')} in {sum(n > 0 for n in silenced)} "
            f"of {plural(len(steps), 'step')}, of {plural(candidates, 'candidate')} (tokens of "
            f"correct answers with p < tau_p)" + (f"; see {', '.join(files)}" if files else ""))


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


def correlation_line(run: str) -> str:
    """One line of RQ1's correlations for a run folder ('' without tokens.jsonl; D81)."""
    records = read_log(Path(run) / "tokens.jsonl")
    if not records:
        return ""
    a = gradient_analysis(records)
    fmt = lambda r: "-" if r is None else f"{r:+.2f}"  # noqa: E731
    return (f"logit-gradient norm vs p: Spearman {fmt(a['rho_p'])} ({fmt(a['rho_p_low'])} below "
            f"p = {P_FLAT:g}), vs H: {fmt(a['rho_h'])}, vs H at equal p (per unit advantage): "
            f"{fmt(a['rho_h_at_p'])} ({a['n']} drawn tokens with a gradient, "
            f"weighted; tokens.jsonl)")
