"""Evaluate checkpoints the way the paper does (docs/paper.md §7): k sampled answers per problem on AIME24, AIME25,
AMC23 (avg@32) and MATH500, Minerva, OlympiadBench (avg@4), graded by rule, one table row per checkpoint.

    python eval.py --models smollm2 --benchmarks gsm8k math500 --data-dir ../shared/data/benchmarks --limit 30 \
        --k 4 --max-new-tokens 512                                   # CPU, minutes
    python eval.py --models Qwen/Qwen3-1.7B-Base stapo=runs/stapo/hf --no-chat   # 1 GPU, the six from the Hub
    torchrun --standalone --nproc_per_node=8 eval.py --models runs/stapo/hf --preset justrl   # 8 GPUs
    python eval.py --regrade out/eval/results.json                  # re-grade saved samples, rewrite table.md
    python eval.py --run out/train-cpu     # a train.py run's export: its prompts, sampling, held-out set
    python eval.py --models tiny --data easy=my.jsonl --prompt-key q --answer-key a   # your own JSONL

Sampling is a rollout engine (`--rollout plain`: rollout.generate; `vllm`: rollout.VLLMEngine), grading is
reward.grade; this file loads the problem sets (the built-in task, JSONL/JSON/parquet files and Hub datasets read
by `read_rows`, train.py's train/held-out split `load_rows`, the benchmarks), splits the problems across ranks,
counts and writes. Outputs: OUT/results.json (the config and every
sample's text, extracted answer, verdict, length in tokens, truncation flag) and OUT/table.md.

Deliberate differences from the paper's evaluation:
1. Rule-based grading only (reward.py); the paper adds an LLM verifier where the rules fail, so a response the
   rules cannot parse counts as wrong here.
2. Pure data parallelism: with torchrun every rank holds a full copy of the model and samples its share of the
   problems (round-robin); no tensor parallelism. `--rollout vllm` samples with a colocated vLLM engine per rank
   (rollout.VLLMEngine; with torchrun, one model per run: closing an engine tears down the process group).
3. Besides avg@k we report the unbiased pass@k (Chen et al. 2021, k = samples per problem), the mean response
   length in tokens and the truncation rate, which explain most avg@k differences between short and long budgets.
4. "Avg" is the mean avg@k over the six paper benchmarks **that were evaluated**; GSM8K (not in the paper) is
   shown but never averaged in.
5. Generate call c of a set (problems from position `start` of the rank's share) is seeded seed + rank +
   1_000_003 * start (the first call: seed + rank), so samples (not the expectation) change with the number of ranks
   and the batch size.
6. Beyond the paper: `--run` takes prompt format and sampling from a train.py run's config.json (flag > run >
   default), `heldout` is the run's held-out set and `--data` reads your own files with train.py's field logic.

Every input (names, paths, files, numbers) is checked before a model loads; an error is one line, exit status 2.
This file also holds `parse_flags`, the dataclass -> argparse builder of both scripts (here, so `--help` needs no
torch). train.py imports its problem sets and its CLI builder from here; nothing here imports train.py.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import inspect
import json
import math
import os
import random
import sys
import textwrap
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Literal

import reward

PAPER_BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
TITLES = {"aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23", "math500": "MATH500", "minerva": "Minerva",
          "olympiadbench": "Olympiad", "gsm8k": "GSM8K"}
DEFAULT_K = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4, "olympiadbench": 4, "gsm8k": 4}
OTHER_K = 4  # samples per problem of --data sets (and of heldout for a run without --eval-samples)
PRESETS = {"train-aligned": (1.0, 1.0), "justrl": (0.7, 0.9)}  # (temperature, top_p), docs/paper.md §7


# ------------------------------------------------------------------- problem sets (train.py --data, eval.py --data)
# The built-in task: every one-digit sum "What is a + b?" (100 problems, 20 held out), deterministic. Chosen by
# measuring SmolLM2-135M-Instruct (docs/training.md): with the raw-text prompt "...\nThe answer is" it is right on ~12% of
# them at T = 1.0 (~20% at 0.7; ~2% for word problems or a chat prompt with the \boxed{} instruction), so many
# groups of 8 have mixed rewards.
def builtin_task(split: str) -> list[dict]:
    """The built-in problems of `split` ('train': 80, 'test': 20), each {"problem", "answer"}."""
    rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10) for b in range(10)]
    random.Random(1234).shuffle(rows)
    return rows[20:] if split == "train" else rows[:20]


def _at_path(row: dict, key: str):
    """row["a"]["b"] for key "a.b" (None where a part is missing)."""
    for part in key.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


# DAPO-Math-17k wraps each problem in its own instructions ("... of the form Answer: $Answer ..."); we strip them and
# append the paper's \boxed{} instruction like JustRL does.
_DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
                "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
_DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def load_rows(cfg) -> tuple[list[dict], list[dict]]:
    """(train, held-out) lists of {"problem", "answer"} of a train.py config (its data, prompt_key, answer_key, split,
    heldout and seed): the rows of --data, shuffled by the seed, the first `heldout` held out; or the built-in task
    when --data is ''."""
    import torch

    if not cfg.data:
        return builtin_task("train"), builtin_task("test")
    rows = read_rows(cfg.data, cfg.prompt_key, cfg.answer_key, cfg.split)
    if cfg.heldout >= len(rows):
        raise ValueError(f"--heldout {cfg.heldout} leaves no training rows ({len(rows)} rows in {cfg.data})")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    rows = [rows[i] for i in order]
    return rows[cfg.heldout:], rows[:cfg.heldout]


def read_rows(data: str, prompt_key: str, answer_key: str, split: str = "train") -> list[dict]:
    """Rows {"problem", "answer"} of a local .jsonl/.json/.parquet file or a Hub dataset, in file order, duplicates
    dropped (difference 7). `prompt_key`/`answer_key` are dotted paths; a chat message list gives its last user
    turn; an answer is a string or a list of strings. train.py's --data and eval.py's --data."""
    import datasets

    datasets.disable_progress_bars()
    suffix = next((s for s in (".jsonl", ".json", ".parquet") if data.endswith(s)), None)
    if suffix and not os.path.isfile(data):
        raise FileNotFoundError(f"data file not found: {data}")
    if suffix == ".jsonl":
        table = read_jsonl(data)
    elif suffix:
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own error log line: ours is the one line
        try:
            table = datasets.load_dataset("parquet" if suffix == ".parquet" else "json", data_files=data,
                                          split="train")
        except Exception as e:  # noqa: BLE001 - datasets wraps every reason (empty file: StopIteration)
            raise ValueError(f"{data}: not a readable {suffix[1:]} file ({type(e).__name__}: "
                             f"{(str(e).strip().splitlines() or [''])[0][:200]})") from None
    else:
        table = datasets.load_dataset(data, split=split)
    if not len(table):
        raise ValueError(f"{data}: no rows")
    rows, seen = [], set()
    for i, row in enumerate(table):
        problem, answer = _at_path(row, prompt_key), _at_path(row, answer_key)
        if isinstance(problem, list):  # chat messages: the last user turn
            problem = next((m.get("content") for m in reversed(problem) if m.get("role") == "user"), None)
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError(f"{data} row {i}: no prompt in field {prompt_key!r}")
        if isinstance(answer, (int, float)):
            answer = str(answer)
        if not answer or not (isinstance(answer, str) or all(isinstance(a, str) for a in answer)):
            raise ValueError(f"{data} row {i}: no answer in field {answer_key!r}")
        problem = problem.removeprefix(_DAPO_PREFIX).removesuffix(_DAPO_SUFFIX)
        if (problem, str(answer)) not in seen:  # DAPO-Math-17k repeats each of its 17k problems 100 times
            seen.add((problem, str(answer)))
            rows.append({"problem": problem, "answer": answer})
    return rows


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSON-lines file (blank lines skipped); a line that is not a UTF-8 JSON object raises ValueError
    naming the file and the line."""
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} line {n}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not JSON ({e.msg} at character {e.pos + 1})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {n}: not a JSON object")
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------- benchmarks
def _gold_field(key: str) -> Callable[[dict], str | None]:
    """The gold is a field as it is (AMC's floats such as 27.0 become "27.0": the grader compares numbers)."""
    return lambda row: None if row.get(key) is None else str(row[key]).strip()


def _last_box(key: str) -> Callable[[dict], str | None]:
    """The gold is the content of the last \\boxed{...} of a solution (reward.extract_answer's brace matching)."""
    return lambda row: reward.extract_answer(row.get(key) or "")


def _box_or_text(key: str) -> Callable[[dict], str | None]:
    """math-ai/aime24 keeps the answer in `solution`, boxed or bare: take the last box, else the text."""
    return lambda row: reward.extract_answer(row.get(key) or "") or _gold_field(key)(row)


def _after_hashes(key: str) -> Callable[[dict], str | None]:
    """GSM8K: the gold is the number after the final '####' of the worked answer, thousands commas removed."""
    return lambda row: row[key].split("####")[-1].strip().replace(",", "") if "####" in (row.get(key) or "") else None


def _answer_list(key: str) -> Callable[[dict], list[str] | None]:
    """OlympiadBench: `final_answer` is a list of LaTeX strings; reward.grade takes the list as it is."""
    return lambda row: [str(a).strip() for a in row[key]] if row.get(key) else None


@dataclass(frozen=True)
class Source:
    """Where a benchmark lives and how its rows map to (problem, gold)."""
    problem_key: str
    gold: Callable[[dict], str | list[str] | None]


@dataclass(frozen=True)
class Benchmark:
    file: str                 # <data_dir>/<file>, laid out like shared/data/benchmarks
    local: Source
    hub_id: str               # datasets.load_dataset(hub_id, hub_config, split=hub_split)
    hub: Source
    hub_config: str | None = None
    hub_split: str = "test"


BENCHMARKS = {
    "aime24": Benchmark("aime24.jsonl", Source("problem", _gold_field("answer")),
                        "math-ai/aime24", Source("problem", _box_or_text("solution"))),
    "aime25": Benchmark("aime25.jsonl", Source("problem", _gold_field("answer")),
                        "math-ai/aime25", Source("problem", _gold_field("answer"))),
    "amc23": Benchmark("amc23.jsonl", Source("problem", _gold_field("answer")),
                       "math-ai/amc23", Source("question", _gold_field("answer"))),
    "math500": Benchmark("math500.jsonl", Source("problem", _gold_field("answer")),
                         "HuggingFaceH4/MATH-500", Source("problem", _gold_field("answer"))),
    "minerva": Benchmark("minerva_math.jsonl", Source("problem", _last_box("solution")),
                         "math-ai/minervamath", Source("question", _gold_field("answer"))),
    "olympiadbench": Benchmark("olympiadbench.jsonl", Source("question", _answer_list("final_answer")),
                               "math-ai/olympiadbench", Source("question", _answer_list("final_answer"))),
    "gsm8k": Benchmark("gsm8k.jsonl", Source("question", _after_hashes("answer")),
                       "openai/gsm8k", Source("question", _after_hashes("answer")), hub_config="main"),
}


def load_benchmark(name: str, data_dir: str | Path | None = None) -> list[dict]:
    """Rows {"problem": str, "answer": str, "gold": str | list[str]} of a benchmark, in file order.

    `answer` is the gold as one string (OlympiadBench's list joined by ", "); `gold` is what reward.grade gets
    (the list for OlympiadBench). From `<data_dir>/<file>.jsonl` if data_dir is given, else from the Hub through
    `datasets.load_dataset` (ids in BENCHMARKS). A row without a problem or a gold raises ValueError naming it.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    if data_dir is not None:
        path = Path(data_dir) / spec.file
        if not path.is_file():
            raise FileNotFoundError(f"benchmark {name}: {path} not found")
        with open(path, encoding="utf-8") as f:
            raw = [json.loads(line) for line in f if line.strip()]
        source, where = spec.local, str(path)
    else:
        import datasets
        raw = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.hub_split)
        source, where = spec.hub, f"{spec.hub_id} ({spec.hub_split})"
    rows = []
    for i, row in enumerate(raw):
        problem, gold = row.get(source.problem_key), source.gold(row)
        if not problem or not gold or (isinstance(gold, list) and not all(gold)):
            missing = "problem" if not problem else "gold answer"
            raise ValueError(f"benchmark {name}: row {i} of {where} has no {missing}: {str(row)[:200]}")
        answer = ", ".join(gold) if isinstance(gold, list) else gold
        rows.append({"problem": problem, "answer": answer, "gold": gold})
    return rows


# ------------------------------------------------------------------------------------------------------- metrics
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def benchmark_metrics(problems: list[dict]) -> dict:
    """avg@k = mean over problems of the fraction of correct samples; pass@k with k = samples per problem;
    mean length (tokens) and truncation rate over all samples. Accuracies in percent."""
    samples = [s for p in problems for s in p["samples"]]
    k = min(len(p["samples"]) for p in problems)
    return {
        "problems": len(problems), "k": k,
        "avg@k": 100 * sum(sum(s["correct"] for s in p["samples"]) / len(p["samples"]) for p in problems)
        / len(problems),
        "pass@k": 100 * sum(pass_at_k(len(p["samples"]), sum(s["correct"] for s in p["samples"]), k)
                            for p in problems) / len(problems),
        "mean_length": sum(s["length"] for s in samples) / len(samples),
        "truncated": 100 * sum(s["truncated"] for s in samples) / len(samples),
    }


def regrade(results: dict) -> dict:
    """Grade every stored sample again with the current reward.py and recompute the metrics (in place)."""
    for model in results["models"].values():
        for bench in model["benchmarks"].values():
            for p in bench["problems"]:
                for s in p["samples"]:
                    s["extracted"], s["correct"] = reward.extract_answer(s["text"]), reward.grade(s["text"], p["gold"])
            bench["metrics"] = benchmark_metrics(bench["problems"])
    return results


def table(results: dict) -> str:
    """The paper's layout (rows = models, columns = benchmarks + Avg of the paper benchmarks evaluated), avg@k in
    percent; then one line per model and benchmark with pass@k, length and truncation."""
    seen = [b for m in results["models"].values() for b in m["benchmarks"]]
    benches = [b for b in BENCHMARKS if b in seen] + list(dict.fromkeys(b for b in seen if b not in BENCHMARKS))
    paper = [b for b in benches if b in PAPER_BENCHMARKS]
    cfg = results["config"]
    prompt = f"{'chat template' if cfg['chat'] else 'raw text'} + instruction {cfg['instruction']!r}"
    source = f" (settings of the run {cfg['run']})" if cfg["run"] else ""
    lines = [f"avg@k (%), temperature {cfg['temperature']}, top-p {cfg['top_p']}, max {cfg['max_new_tokens']} new "
             f"tokens, {prompt}{source}. "
             f"Avg = mean over the {len(paper)} of the paper's six benchmarks evaluated here "
             f"({', '.join(TITLES[b] for b in paper) or 'none'}); GSM8K and your own sets are never averaged.", "",
             "| Model | " + " | ".join(TITLES.get(b, b) for b in benches) + " | Avg |",
             "|---" * (len(benches) + 2) + "|"]
    for label, model in results["models"].items():
        got = model["benchmarks"]
        cells = [f"{got[b]['metrics']['avg@k']:.2f}" if b in got else "-" for b in benches]
        done = [got[b]["metrics"]["avg@k"] for b in paper if b in got]
        avg = f"{sum(done) / len(done):.2f}" if done and len(done) == len(paper) else "-"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {avg} |")
    lines += ["", "| Model | Benchmark | problems | k | avg@k | pass@k | mean length | truncated % |",
              "|---|---|---|---|---|---|---|---|"]
    for label, model in results["models"].items():
        for b, bench in model["benchmarks"].items():
            m = bench["metrics"]
            lines.append(f"| {label} | {TITLES.get(b, b)} | {m['problems']} | {m['k']} | {m['avg@k']:.2f} | "
                         f"{m['pass@k']:.2f} | {m['mean_length']:.1f} | {m['truncated']:.1f} |")
    return "\n".join(lines) + "\n"


def write_outputs(results: dict, out: str | Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    (out / "table.md").write_text(table(results))


# ---------------------------------------------------------------------------------------------------------- CLI
# One command-line builder for train.py and eval.py. It lives here because eval.py imports torch lazily, so that
# `python eval.py --help` stays fast; train.py imports it.
class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_flags(cls, argv: list[str] | None, prog: str, notes: dict[str, str] | None = None) -> dict:
    """The flags given in argv, as {field: value}, for the dataclass `cls` (absent flags are absent: the caller
    layers them over its defaults, a preset or a training run's config.json).

    One --flag per field (underscores -> dashes); its --help is the string literal under the field, its default
    and `notes[field]`. bool -> --flag/--no-flag, list[X] -> one or more X, Literal -> choices, X | None -> X or
    'none'. A bad flag prints one line `PROG: error: ...` and exits with status 2."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}
    hints = typing.get_type_hints(cls)
    parser = OneLineParser(prog=prog, description=(cls.__doc__ or "").strip(), argument_default=argparse.SUPPRESS)
    for f in fields(cls):
        tp = hints[f.name]
        default = f.default_factory() if f.default is MISSING else f.default
        note = f" ({notes[f.name]})" if notes and f.name in notes else ""
        kw = {"help": f"{docs[f.name]} [default: {default!r}{note}]".replace("%", "%%")}
        optional = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
        if optional:  # X | None -> X
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is list:
            kw.update(nargs="+", type=typing.get_args(tp)[0])
        elif typing.get_origin(tp) is Literal:
            kw.update(choices=typing.get_args(tp), type=str)
        else:
            kw["type"] = _or_none(tp) if optional else tp
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)
    return vars(parser.parse_args(argv))


def _or_none(tp: type) -> Callable[[str], object]:
    def convert(text: str):
        return None if text.lower() == "none" else tp(text)

    convert.__name__ = tp.__name__  # argparse names it in "invalid float value: 'x'"
    return convert


@dataclass
class Config:
    """Evaluate checkpoints on the STAPO benchmarks or your own files (avg@k, pass@k); write results.json, table.md.
    With --run (or --models RUN/hf) prompts and sampling follow the training run's config.json."""
    models: list[str] = field(default_factory=lambda: ["smollm2"])
    """checkpoints, one table row each: Hub id, local HF dir, .gguf file, 'smollm2' (packaged SmolLM2-135M-Instruct)
    or 'tiny' (random, tests); LABEL=NAME sets the row label; with --run: RUN/hf"""
    run: str | None = None
    """a train.py output folder: evaluate RUN/hf with the run's prompt format (chat, instruction), sampling
    (temperature, top-p) and response budget (max_response_len), unless flags say otherwise; also found from
    --models RUN/hf"""
    benchmarks: list[str] = field(default_factory=lambda: list(PAPER_BENCHMARKS))
    """aime24 aime25 amc23 math500 minerva olympiadbench gsm8k, or heldout (the run's held-out problems, as
    train.py evaluated them); default: the six paper ones, none with --data, heldout with --run"""
    data: list[str] = field(default_factory=list)
    """your own eval sets: .jsonl/.json/.parquet files or Hub ids, read like train.py's --data (--prompt-key,
    --answer-key; dotted paths, chat message lists); NAME=FILE names its column (default: the file name)"""
    prompt_key: str = "problem"
    """field of the problem text in --data (default: the run's --prompt-key with --run)"""
    answer_key: str = "answer"
    """field of the gold answer in --data, a string or a list of strings (default: the run's with --run)"""
    split: str = "test"
    """split of --data Hub ids"""
    data_dir: str | None = None
    """folder with one .jsonl per benchmark laid out like shared/data/benchmarks; default None = the HF Hub"""
    preset: Literal["train-aligned", "justrl"] = "train-aligned"
    """decoding when neither --temperature/--top-p nor a run set it: train-aligned = temperature 1.0, top-p 1.0;
    justrl = temperature 0.7, top-p 0.9"""
    temperature: float | None = None
    """sampling temperature; default: the run's, else the preset's"""
    top_p: float | None = None
    """nucleus sampling; default: the run's, else the preset's"""
    chat: bool = True
    """format prompts with the tokenizer's chat template (--no-chat: raw problem + instruction, for base models);
    default: the run's"""
    instruction: str | None = None
    """text appended to every problem; default: the run's, else the paper's \\boxed{} sentence (rollout.INSTRUCTION)"""
    k: int | None = None
    """samples per problem for every benchmark; default 32 for AIME24/AIME25/AMC23, the run's --eval-samples for
    heldout, 4 for the others"""
    max_new_tokens: int = 20480
    """response budget in tokens; longer responses are cut and counted as truncated; default: the run's
    --max-response-len with --run"""
    limit: int | None = None
    """evaluate only the first LIMIT problems of each benchmark"""
    batch_size: int = 64
    """sequences per generate call on each rank (problems per call = max(1, batch_size // k))"""
    seed: int = 0
    """sampling seed; rank r uses seed + r"""
    out: str = "out/eval"
    """output folder for results.json and table.md"""
    regrade: str | None = None
    """path of an existing results.json: re-grade its samples, rewrite it and table.md next to it, sample nothing"""
    rollout: str = "plain"
    """plain | vllm: sampling engine (vllm: a vLLM engine in this process, fed with the loaded weights; docs/rollouts.md)"""
    kv_cache_gb: float = 40.0
    """KV-cache budget per rank in GB (worst case: every row at the longest prompt + --max-new-tokens): bounds the
    problems per generate call below --batch-size, and is vLLM's KV cache"""
    collective_timeout_min: float = 60.0
    """with torchrun: minutes a rank waits for the others at the gather after each benchmark"""


# eval.py field <- the train.py config.json field it takes its default from (how the run formats and samples)
RUN_FIELDS = {"chat": "chat", "instruction": "instruction", "temperature": "temperature", "top_p": "top_p",
              "max_new_tokens": "max_response_len", "prompt_key": "prompt_key", "answer_key": "answer_key"}


def train_run(folder: str | Path) -> dict | None:
    """The config of a train.py output folder (its config.json), or None when `folder` is not one."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return config if isinstance(config, dict) and "max_response_len" in config else None


def stale_export(run: Path) -> None:
    """Warn (rank 0) when the run's export RUN/hf holds fewer steps than its newest checkpoint (run_folder.py)."""
    import run_folder

    exported, kept = run_folder.export_step(run / "hf"), run_folder.complete_steps(run)
    if exported is not None and kept and kept[0] > exported and os.environ.get("RANK", "0") == "0":
        print(f"eval.py: warning: {run / 'hf'} holds the model after {exported} steps, but the run's newest checkpoint "
              f"is after {kept[0]} (python train.py --resume {run} --export-hf exports it)", file=sys.stderr)


def _label_name(spec: str) -> tuple[str, str]:
    """LABEL=NAME -> (LABEL, NAME); NAME alone -> (NAME, NAME)."""
    label, _, name = spec.partition("=") if "=" in spec and not os.path.exists(spec) else (spec, "", spec)
    return label or name, name


def parse_config(argv: list[str] | None = None) -> Config:
    """argv -> Config. Each value: the flag given, else the training run's (--run, or the run folder an --models HF
    directory sits in), else the default. Checks names and paths; loads no data and no model."""
    given = parse_flags(Config, argv, "eval.py")
    if given.get("regrade"):
        if not os.path.isfile(given["regrade"]):
            raise FileNotFoundError(f"--regrade: no such file: {given['regrade']}")
        return Config(**given)
    values, run = dict(given), None
    if given.get("run"):
        run = train_run(given["run"])
        if run is None:
            raise FileNotFoundError(f"--run {given['run']}: not a train.py output folder (no config.json)")
        hf = Path(given["run"]) / "hf"
        if "models" not in given:
            if not hf.is_dir():
                raise FileNotFoundError(f"--run: {hf} not found (train.py writes it at the end unless --no-export-hf)")
            values["models"] = [str(hf)]
    else:  # an HF export inside a run folder brings the run's settings
        runs = {str(Path(name).parent): train_run(Path(name).parent)
                for name in (_label_name(spec)[1] for spec in given.get("models", [])) if os.path.isdir(name)}
        runs = {folder: c for folder, c in runs.items() if c is not None}
        if len({json.dumps([c[t] for t in RUN_FIELDS.values()]) for c in runs.values()}) > 1:
            raise ValueError(f"--models come from runs with different prompt or sampling settings ({', '.join(runs)})"
                             f"; evaluate them separately or give --run")
        if runs:
            values["run"], run = next(iter(runs.items()))
    if run:
        stale_export(Path(values["run"]))
        inherited = {k: run[t] for k, t in RUN_FIELDS.items() if run["data"] or not k.endswith("_key")}
        values = {**inherited, **values}  # the field names of a built-in-task run say nothing about --data
        if "preset" in given:  # an explicit --preset beats the run's sampling
            values = {**values, **dict(zip(("temperature", "top_p"), PRESETS[given["preset"]])),
                      **{k: given[k] for k in ("temperature", "top_p") if k in given}}
    if "benchmarks" not in given:
        has_heldout = run and (not run["data"] or run["heldout"] > 0)
        values["benchmarks"] = [] if given.get("data") else ["heldout"] if has_heldout else list(PAPER_BENCHMARKS)
    preset_t, preset_p = PRESETS[values.get("preset", "train-aligned")]
    if values.get("temperature") is None:
        values["temperature"] = preset_t
    if values.get("top_p") is None:
        values["top_p"] = preset_p
    if values.get("instruction") is None:
        import rollout
        values["instruction"] = rollout.INSTRUCTION
    cfg = Config(**values)
    for b in cfg.benchmarks:
        if b not in BENCHMARKS and b != "heldout":
            raise ValueError(f"unknown benchmark {b!r}; choose from {', '.join(BENCHMARKS)}, heldout (with --run); "
                             f"your own files: --data FILE")
    if "heldout" in cfg.benchmarks and not run:
        raise ValueError("benchmark 'heldout' is a training run's held-out set: give --run RUN")
    if cfg.data_dir is not None and not os.path.isdir(cfg.data_dir):
        raise FileNotFoundError(f"--data-dir {cfg.data_dir}: no such folder")
    for name, rule in (("temperature", cfg.temperature > 0), ("top_p", 0 < cfg.top_p <= 1),
                       ("k", cfg.k is None or cfg.k >= 1), ("max_new_tokens", cfg.max_new_tokens >= 1),
                       ("limit", cfg.limit is None or cfg.limit >= 1), ("batch_size", cfg.batch_size >= 1),
                       ("kv_cache_gb", cfg.kv_cache_gb > 0), ("collective_timeout_min", cfg.collective_timeout_min > 0)):
        if not rule:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)} is out of range")
    if not cfg.benchmarks and not cfg.data:
        raise ValueError("nothing to evaluate: no --benchmarks and no --data")
    if cfg.rollout not in ("plain", "vllm"):
        raise ValueError(f"unknown --rollout {cfg.rollout!r}; valid: plain, vllm")
    return cfg


def load_sets(cfg: Config) -> dict[str, dict]:
    """{name: {"k", "rows"}} for every benchmark and --data file of cfg, in order, cut to --limit. Rows are
    {"problem", "answer", "gold"} as load_benchmark gives them; --data files are read by read_rows (the field
    logic of train.py's --data), heldout is load_rows of the run's config."""
    sets = {}
    for b in cfg.benchmarks:
        if b == "heldout":
            run = train_run(cfg.run)
            rows = [{"problem": r["problem"], "answer": _joined(r["answer"]), "gold": r["answer"]}
                    for r in load_rows(types.SimpleNamespace(**run))[1]]
            if not rows:
                raise ValueError(f"the run {cfg.run} has no held-out problems (train.py --heldout N keeps some)")
            sets[b] = {"k": cfg.k or run["eval_samples"] or OTHER_K, "rows": rows}
        else:
            sets[b] = {"k": cfg.k or DEFAULT_K[b], "rows": load_benchmark(b, cfg.data_dir)}
    for spec in cfg.data:
        name, path = spec.split("=", 1) if "=" in spec and not os.path.exists(spec) else (Path(spec).stem, spec)
        if name in sets:
            raise ValueError(f"--data {spec}: the name {name!r} is taken; name it with NAME={path}")
        rows = read_rows(path, cfg.prompt_key, cfg.answer_key, cfg.split)
        if not rows:
            raise ValueError(f"--data {path}: no rows")
        sets[name] = {"k": cfg.k or OTHER_K,
                      "rows": [{"problem": r["problem"], "answer": _joined(r["answer"]), "gold": r["answer"]}
                               for r in rows]}
    return {name: {"k": s["k"], "rows": s["rows"][: cfg.limit]} for name, s in sets.items()}


def _joined(answer: str | list[str]) -> str:
    return ", ".join(answer) if isinstance(answer, list) else answer


# --------------------------------------------------------------------------------------------------- evaluation
def open_engine(name: str, cfg: Config, sets: dict[str, dict], rank: int = 0, device: str = "cpu"):
    """(engine, lm, tokenizer, problems per generate call of each set) for the checkpoint `name`: the model loaded,
    its KV-cache budget applied, its rollout engine made (raises on a checkpoint that cannot load or sample here)."""
    import torch

    import model as model_lib
    import rollout

    dtype = torch.bfloat16 if device.startswith("cuda") else None
    lm, tokenizer = model_lib.load_model(name, dtype=dtype, device=device, require_chat_template=cfg.chat)
    lm.eval()
    longest = max(len(rollout.format_prompt(tokenizer, r["problem"], cfg.chat, cfg.instruction))
                  for s in sets.values() for r in s["rows"]) + cfg.max_new_tokens
    # problems per generate call: --batch-size rows, fewer where their worst-case KV cache would exceed
    # --kv-cache-gb, but at least one problem's k rows (the plain sampler holds them at once; vLLM queues what does
    # not fit its KV cache of at most --kv-cache-gb)
    row_bytes, budget = model_lib.kv_cache_bytes(lm.config, 1, longest, lm.dtype.itemsize), int(cfg.kv_cache_gb * 1e9)
    per_call = {b: max(1, min(cfg.batch_size, budget // row_bytes) // s["k"]) for b, s in sets.items()}
    need = max(per_call[b] * s["k"] for b, s in sets.items()) * row_bytes  # the largest call, every row at its longest
    if rank == 0:
        calls = ", ".join(f"{b} {per_call[b]} x {s['k']}" for b, s in sets.items())
        kv = min(need, budget) if cfg.rollout == "vllm" else need
        over = "; one problem's k rows exceed it" if need > budget else ""
        print(f"eval.py: {name}: problems x samples per generate call: {calls}; KV cache at most {kv / 1e9:.2f} GB "
              f"per rank (--kv-cache-gb {cfg.kv_cache_gb:g}{over})", flush=True)
    engine = rollout.make_engine(cfg.rollout, lm, tokenizer, cfg.chat, max_model_len=longest, dtype=lm.dtype,
                                 kv_cache_memory_bytes=max(min(need, budget), row_bytes))
    return engine, lm, tokenizer, per_call


def evaluate_model(engine, lm, tokenizer, per_call: dict[str, int], name: str, cfg: Config, sets: dict[str, dict],
                   rank: int = 0, world: int = 1):
    """Sample k answers per problem on this rank's share of every set, grade them, gather to rank 0; closes the
    engine at the end. Yields (set name, {"k", "temperature", "top_p", "metrics", "problems": [...]}) after each
    set on rank 0 (None on the other ranks)."""
    import torch
    from tqdm import tqdm

    import rollout

    bar = tqdm(total=sum(len(s["rows"][rank::world]) for s in sets.values()), desc=f"{name} (rank 0 of {world})",
               disable=rank != 0)
    with engine.ready(lm):  # vllm: the weights are pushed once, for every set
        for b, s in sets.items():
            k, rows = s["k"], s["rows"]
            mine = list(range(rank, len(rows), world))  # round-robin split of the problems over the ranks
            problems = []
            for start in range(0, len(mine), per_call[b]):
                idx = mine[start: start + per_call[b]]
                prompts = [rollout.format_prompt(tokenizer, rows[i]["problem"], cfg.chat, cfg.instruction)
                           for i in idx]
                with torch.no_grad():  # rows j*k .. j*k+k-1 answer problem idx[j] (difference 5: the seed)
                    ro = engine.sample(prompts, k, [cfg.seed + rank + 1_000_003 * start], len(prompts),
                                       cfg.max_new_tokens, cfg.temperature, cfg.top_p)
                texts = ro.texts(tokenizer)
                lengths = ro.response_mask.sum(-1).tolist()  # (B,) tokens including EOS
                truncated = ro.truncated.tolist()  # (B,)
                for j, i in enumerate(idx):
                    gold = rows[i]["gold"]
                    problems.append({"index": i, "problem": rows[i]["problem"], "gold": gold, "samples": [
                        {"text": texts[r], "extracted": reward.extract_answer(texts[r]),
                         "correct": reward.grade(texts[r], gold), "length": int(lengths[r]),
                         "truncated": bool(truncated[r])} for r in range(j * k, j * k + k)]})
                bar.update(len(idx))
            if world > 1:
                import torch.distributed as dist
                parts = [None] * world if rank == 0 else None
                dist.gather_object(problems, parts, dst=0)
                problems = sorted((p for part in parts for p in part), key=lambda p: p["index"]) if rank == 0 else []
            yield b, {"k": k, "temperature": cfg.temperature, "top_p": cfg.top_p,
                      "metrics": benchmark_metrics(problems), "problems": problems} if rank == 0 else None
    bar.close()
    engine.close()


BAD_INPUT = (FileNotFoundError, ValueError, KeyError, ImportError, OSError)  # what bad inputs raise


def fail(error: Exception, rank: int):
    """A bad input: one line on rank 0 (the error's first line), exit status 2."""
    if rank == 0:
        text = str(error).strip()
        print(f"eval.py: error: {text.splitlines()[0] if text else type(error).__name__}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict | None:
    rank = int(os.environ.get("RANK", 0))
    try:  # every input is checked before a model loads: one line, exit status 2, nothing written
        cfg = parse_config(argv)
        if cfg.regrade:
            results = regrade(json.loads(Path(cfg.regrade).read_text()))
        else:
            sets = load_sets(cfg)
            import model
            for spec in cfg.models:
                model.check_model_name(_label_name(spec)[1])
    except BAD_INPUT as e:
        fail(e, rank)
    if cfg.regrade:
        write_outputs(results, Path(cfg.regrade).parent)
        print(table(results))
        return results
    if cfg.run and rank == 0:
        print(f"eval.py: prompts and sampling of the run {cfg.run}: {'chat template' if cfg.chat else 'raw text'}, "
              f"instruction {cfg.instruction!r}, temperature {cfg.temperature}, top-p {cfg.top_p}, "
              f"{cfg.max_new_tokens} new tokens", flush=True)
    import torch
    import torch.distributed as dist

    # `model` is imported above, before init_process_group: torch.distributed.fsdp imported after it holds
    # references to the WORLD group, whose gloo threads then outlive destroy_process_group and can abort the exit.
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = "cpu"
    if torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    if world > 1:  # as train.py: NCCL for CUDA tensors, gloo for CPU ones (the object gathers)
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(minutes=cfg.collective_timeout_min))
    results = {"config": asdict(cfg), "models": {}}
    for spec in cfg.models:
        label, name = _label_name(spec)
        results["models"][label] = {"name": name, "benchmarks": {}}
        try:  # a checkpoint without weights or config, or one vLLM refuses: one line too
            opened = open_engine(name, cfg, sets, rank, device)
        except BAD_INPUT as e:
            fail(e, rank)
        for b, got in evaluate_model(*opened, name, cfg, sets, rank, world):
            if rank == 0:
                results["models"][label]["benchmarks"][b] = got
                write_outputs(results, cfg.out)  # after every benchmark, so a long run keeps what it has
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if world > 1 and dist.is_initialized():  # closing a vLLM engine already tore the group down
        dist.destroy_process_group()
    if rank == 0:
        print(table(results))
        print(f"eval.py: results in {cfg.out}/results.json and {cfg.out}/table.md")
        return results
    return None


if __name__ == "__main__":
    main()
