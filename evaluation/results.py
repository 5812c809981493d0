"""What an evaluation counts and writes (docs/paper.md §7; docs/evaluation.md): avg@k, the mean
over problems of the fraction of k samples graded correct, and the unbiased pass@k, the mean
response length and the truncation rate beside it (`benchmark_metrics`); OUT/results.json (every
sample with its verdict) read back and checked (`read_results`), graded again with the current
reward.py (`regrade`), and OUT/table.md, the paper's table with one row per checkpoint (`table`)
(docs/paper.md, "Deliberate differences": D54 and D55)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import reward
from data import describe
from evaluation.benchmarks import BENCHMARKS, PAPER_BENCHMARKS, TITLES


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from n samples of which c are correct:
    1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def benchmark_metrics(problems: list[dict]) -> dict:  # D54
    """avg@k = mean over problems of the fraction of correct samples; pass@k with k = samples per
    problem; mean length (tokens) and truncation rate over all samples. Accuracies in percent."""
    samples = [s for p in problems for s in p["samples"]]
    k = min(len(p["samples"]) for p in problems)
    return {
        "problems": len(problems), "k": k,
        "avg@k": 100 * sum(sum(s["correct"] for s in p["samples"]) / len(p["samples"])
                           for p in problems) / len(problems),
        "pass@k": 100 * sum(pass_at_k(len(p["samples"]), sum(s["correct"] for s in p["samples"]), k)
                            for p in problems) / len(problems),
        "mean_length": sum(s["length"] for s in samples) / len(samples),
        "truncated": 100 * sum(s["truncated"] for s in samples) / len(samples),
    }


def read_results(path: str | Path) -> dict:
    """The results.json at `path`, checked to be what eval.py writes (a config with the settings
    table.md names, and per model and benchmark the problems, each with its gold and samples);
    otherwise ValueError in one line."""
    try:
        results = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--regrade {path}: not JSON ({e})") from None
    if not isinstance(results, dict):
        raise ValueError(f"--regrade {path}: not an eval.py results.json ({describe(results)})")
    if not isinstance(results.get("config"), dict) or not isinstance(results.get("models"), dict):
        raise ValueError(f"--regrade {path}: not an eval.py results.json "
                         f"(without 'config' and 'models')")
    missing = [k for k in ("chat", "instruction", "run", "temperature", "top_p", "max_new_tokens")
               if k not in results["config"]]
    if missing:
        raise ValueError(f"--regrade {path}: its config lacks {', '.join(missing)}")
    if not results["models"]:
        raise ValueError(f"--regrade {path}: no models, so no samples to grade")
    for label, model in results["models"].items():
        benchmarks = model.get("benchmarks") if isinstance(model, dict) else None
        for b, bench in (benchmarks.items() if isinstance(benchmarks, dict) and benchmarks
                         else [(None, None)]):
            problems = bench.get("problems") if isinstance(bench, dict) else None
            if not problems or not all(
                    isinstance(p, dict) and "gold" in p and p.get("samples")
                    and all(isinstance(s, dict) and isinstance(s.get("text"), str)
                            for s in p["samples"]) for p in problems):
                raise ValueError(f"--regrade {path}: model {label}"
                                 + (f", benchmark {b}" if b else "") + " has no samples to grade")
    return results


def regrade(results: dict) -> dict:
    """Grade every stored sample again with the current reward.py, and the reward its config names,
    and recompute the metrics (in place)."""
    mode = results["config"].get("reward", "dapo")
    for model in results["models"].values():
        for bench in model["benchmarks"].values():
            for p in bench["problems"]:
                for s in p["samples"]:
                    s["extracted"] = reward.extract_answer(s["text"])
                    # p: its problem and fields
                    s["correct"] = reward.correct(s["text"], p["gold"], mode, p)
            bench["metrics"] = benchmark_metrics(bench["problems"])
    return results


def table(results: dict) -> str:
    """The paper's layout (rows = models, columns = benchmarks + Avg of the paper benchmarks
    evaluated), avg@k in percent; then one line per model and benchmark with pass@k,
    length and truncation."""
    seen = [b for m in results["models"].values() for b in m["benchmarks"]]
    benches = ([b for b in BENCHMARKS if b in seen]
               + list(dict.fromkeys(b for b in seen if b not in BENCHMARKS)))
    paper = [b for b in benches if b in PAPER_BENCHMARKS]  # Avg: these only (D55)
    cfg = results["config"]
    prompt = (f"{'chat template' if cfg['chat'] else 'raw text'} + instruction "
              f"{cfg['instruction']!r}")
    source = f" (settings of the run {cfg['run']})" if cfg["run"] else ""
    correct = ("" if cfg.get("reward", "dapo") == "dapo"
               else f", correct = a positive reward of {cfg['reward']}")
    average = (f" Avg = mean over the {len(paper)} of the paper's six benchmarks evaluated here "
               f"({', '.join(TITLES[b] for b in paper)}); GSM8K and your own sets are never "
               f"averaged." if paper else "")  # no paper benchmark: no Avg column
    from run_folder.console import plural  # here: run_folder loads torch, eval.py's --help does not

    # train.py exports
    exports = [f"{label} is the export after {plural(e['step'], 'step')} (checksum {e['checksum']})"
               for label, model in results["models"].items() if (e := model.get("export"))]
    lines = [f"avg@k (%), temperature {cfg['temperature']}, top-p {cfg['top_p']}, "
             f"max {cfg['max_new_tokens']} new tokens, {prompt}{source}{correct}.{average}"
             + (f" {'; '.join(exports)}." if exports else ""), "",
             "| Model | " + " | ".join(TITLES.get(b, b) for b in benches)
             + (" | Avg |" if paper else " |"),
             "|---" * (len(benches) + 1 + bool(paper)) + "|"]
    for label, model in results["models"].items():
        got = model["benchmarks"]
        cells = [f"{got[b]['metrics']['avg@k']:.2f}" if b in got else "-" for b in benches]
        done = [got[b]["metrics"]["avg@k"] for b in paper if b in got]
        avg = ([f"{sum(done) / len(done):.2f}" if done and len(done) == len(paper) else "-"]
               if paper else [])
        lines.append(f"| {label} | " + " | ".join(cells + avg) + " |")
    lines += ["",
              "| Model | Benchmark | problems | k | avg@k | pass@k | mean length | truncated % |",
              "|---|---|---|---|---|---|---|---|"]
    for label, model in results["models"].items():
        for b, bench in model["benchmarks"].items():
            m = bench["metrics"]
            lines.append(f"| {label} | {TITLES.get(b, b)} | {m['problems']} | {m['k']} | "
                         f"{m['avg@k']:.2f} | {m['pass@k']:.2f} | {m['mean_length']:.1f} | "
                         f"{m['truncated']:.1f} |")
    return "\n".join(lines) + "\n"


def write_outputs(results: dict, out: str | Path) -> None:
    """OUT/results.json and OUT/table.md, each replaced whole (a full disk leaves the earlier file
    or none, never a torn one that blocks the next attempt); a failure is an OSError in one line
    naming the file."""
    from run_folder.files import write_atomic

    out = Path(out)
    for name, text in (("results.json", json.dumps(results, indent=1, ensure_ascii=False,
                                                   default=str)),  # a row's date
                       ("table.md", table(results))):
        try:
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(out / name, text.encode())
        except OSError as e:
            raise OSError(f"could not write {out / name} ({e.strerror or e}): free space on its "
                          f"disk") from None


def settings(cfg) -> str:
    """The prompts and sampling an evaluation of a training run takes from it (eval.py's Config)."""
    return (f"{'chat template' if cfg.chat else 'raw text'}, instruction {cfg.instruction!r}, "
            f"temperature {cfg.temperature}, top-p {cfg.top_p}, {cfg.max_new_tokens} new tokens"
            + (f", stop texts {cfg.stop_text!r}" if cfg.stop_text else ""))
