"""The benchmarks of the paper's evaluation (docs/paper.md §7): AIME24, AIME25, AMC23 (avg@32) and
MATH500, Minerva, OlympiadBench (avg@4), and GSM8K beside them: where each lives (a local .jsonl
laid out like testdata/benchmarks, or its Hub copy), how its rows map to a problem and a gold
answer (`BENCHMARKS`), and `load_benchmark`, which eval.py names as its own
(`eval.load_benchmark`); the sets one evaluation samples (`load_sets`: these benchmarks, your
--data files, a training run's held-out problems)."""
from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import reward
from data import answer_value, check_utf8, load_rows, read_jsonl, read_rows, repeated_note
from evaluation.checkpoints import train_run

PAPER_BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
TITLES = {"aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23", "math500": "MATH500",
          "minerva": "Minerva", "olympiadbench": "Olympiad", "gsm8k": "GSM8K"}
DEFAULT_K = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4,
             "olympiadbench": 4, "gsm8k": 4}
OTHER_K = 4  # samples per problem of --data sets (and of heldout for a run without --eval-samples)


def _gold_field(key: str) -> Callable[[dict], str | list[str] | None]:
    """The gold is a field as it is (AMC's floats such as 27.0 become "27.0": the grader compares
    numbers); a JSON object, a boolean or NaN raises ValueError (answer_value)."""
    def gold(row):
        value = None if row.get(key) is None else answer_value(row[key])
        return value.strip() if isinstance(value, str) else value
    return gold


def _last_box(key: str) -> Callable[[dict], str | None]:
    """The gold is the content of the last \\boxed{...} of a solution
    (reward.extract_answer's brace matching)."""
    return lambda row: reward.extract_answer(row.get(key) or "")


def _box_or_text(key: str) -> Callable[[dict], str | None]:
    """math-ai/aime24 keeps the answer in `solution`, boxed or bare: take the last box,
    else the text."""
    return lambda row: reward.extract_answer(row.get(key) or "") or _gold_field(key)(row)


def _after_hashes(key: str) -> Callable[[dict], str | None]:
    """GSM8K: the gold is the number after the final '####' of the worked answer,
    thousands commas removed."""
    return lambda row: row[key].split("####")[-1].strip().replace(",", "") \
        if "####" in (row.get(key) or "") else None


def _answer_list(key: str) -> Callable[[dict], list[str] | None]:
    """OlympiadBench: `final_answer` is a list of LaTeX strings; reward.grade takes the list
    as it is."""
    return lambda row: [a.strip() for a in answer_value(row[key])] \
        if isinstance(row.get(key), list) and row[key] else _gold_field(key)(row)


@dataclass(frozen=True)
class Source:
    """Where a benchmark lives and how its rows map to (problem, gold)."""
    problem_key: str
    gold: Callable[[dict], str | list[str] | None]


@dataclass(frozen=True)
class Benchmark:
    file: str                 # <data_dir>/<file>, laid out like testdata/benchmarks
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
    "olympiadbench": Benchmark(
        "olympiadbench.jsonl", Source("question", _answer_list("final_answer")),
        "math-ai/olympiadbench", Source("question", _answer_list("final_answer"))),
    "gsm8k": Benchmark("gsm8k.jsonl", Source("question", _after_hashes("answer")),
                       "openai/gsm8k", Source("question", _after_hashes("answer")),
                       hub_config="main"),
}


def load_benchmark(name: str, data_dir: str | Path | None = None) -> list[dict]:
    """Rows {"problem": str, "answer": str, "gold": str | list[str], "fields": the row as read} of a
    benchmark, in file order.

    `answer` is the gold as one string (OlympiadBench's list joined by ", "); `gold` is what
    reward.grade gets (the list for OlympiadBench). From `<data_dir>/<file>.jsonl` if data_dir is
    given, else from the Hub through `datasets.load_dataset` (ids in BENCHMARKS). A row without a
    problem or a gold raises ValueError naming it.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    if data_dir is not None:
        path = Path(data_dir) / spec.file
        if not path.is_file():
            raise FileNotFoundError(f"benchmark {name}: {path} not found")
        numbered, source = read_jsonl(str(path)), spec.local
        at = lambda where: f"{where} of {path}"  # noqa: E731
    else:
        import datasets
        table = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.hub_split)
        numbered, source = [(f"row {i}", row) for i, row in enumerate(table, 1)], spec.hub
        at = lambda where: f"{where} of {spec.hub_id} ({spec.hub_split})"  # noqa: E731
    rows = []
    for where, row in numbered:
        problem = row.get(source.problem_key)
        try:
            gold = source.gold(row)
            if isinstance(problem, str):
                check_utf8(problem, "problem")
        except ValueError as e:
            raise ValueError(f"benchmark {name}: {at(where)}: {e}") from None
        if not isinstance(problem, str) or not problem.strip() or not gold:
            missing = ("problem" if not isinstance(problem, str) or not problem.strip()
                       else "gold answer")
            raise ValueError(f"benchmark {name}: {at(where)} has no {missing}: {str(row)[:200]}")
        answer = joined(gold)
        # fields: for --reward
        rows.append({"problem": problem, "answer": answer, "gold": gold, "fields": dict(row)})
    return rows



def load_sets(cfg) -> dict[str, dict]:
    """{name: {"k", "rows"}} for every benchmark and --data file of cfg (eval.py's Config), in
    order, cut to --limit. Rows are {"problem", "answer", "gold"} as load_benchmark gives them;
    --data files are read by read_rows (the field logic of train.py's --data), heldout is load_rows
    of the run's config."""
    sets = {}
    for b in cfg.benchmarks:
        if b == "heldout":
            run = train_run(cfg.run)
            rows = [{"problem": r["problem"], "answer": joined(r["answer"]), "gold": r["answer"],
                     "fields": r.get("fields", {})}
                    for r in load_rows(types.SimpleNamespace(**run))[1]]  # held out
            if not rows:
                raise ValueError(f"the run {cfg.run} has no held-out problems "
                                 f"(train.py --heldout N keeps some)")
            sets[b] = {"k": cfg.k or run["eval_samples"] or OTHER_K, "rows": rows}
        else:
            sets[b] = {"k": cfg.k or DEFAULT_K[b], "rows": load_benchmark(b, cfg.data_dir)}
    for spec in cfg.data:
        name, path = (spec.split("=", 1) if "=" in spec and not os.path.exists(spec)
                      else (Path(spec).stem, spec))
        if name in sets:
            raise ValueError(f"--data {spec}: the name {name!r} is taken; name it with NAME={path}")
        rows, repeated = read_rows(path, cfg.prompt_key, cfg.answer_key, cfg.split)
        # before the process group: torchrun's RANK
        if repeated and os.environ.get("RANK", "0") == "0":
            print(f"eval.py: note: {repeated_note(path, repeated, len(rows))}", file=sys.stderr,
                  flush=True)
        if not rows:
            raise ValueError(f"--data {path}: no rows")
        sets[name] = {"k": cfg.k or OTHER_K,
                      "rows": [{"problem": r["problem"], "answer": joined(r["answer"]),
                                "gold": r["answer"], "fields": r["fields"]} for r in rows]}
    return {name: {"k": s["k"], "rows": s["rows"][: cfg.limit]} for name, s in sets.items()}


def joined(answer: str | list[str]) -> str:
    """A gold answer as one string (a list of answers joined by ", ")."""
    return ", ".join(answer) if isinstance(answer, list) else answer
