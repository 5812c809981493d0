"""Evaluate checkpoints the way the paper does (PAPER.md §7): k sampled answers per problem on AIME24, AIME25,
AMC23 (avg@32) and MATH500, Minerva, OlympiadBench (avg@4), graded by rule, one table row per checkpoint.

    python eval.py --models smollm2 --benchmarks gsm8k math500 --data-dir ../shared/data/benchmarks --limit 30 \
        --k 4 --max-new-tokens 512                                   # CPU, minutes
    python eval.py --models Qwen/Qwen3-1.7B-Base stapo=runs/stapo/hf --no-chat   # 1 GPU, the six from the Hub
    torchrun --standalone --nproc_per_node=8 eval.py --models runs/stapo/hf --preset justrl   # 8 GPUs
    python eval.py --regrade out/eval/results.json                  # re-grade saved samples, rewrite table.md

Sampling is a rollout engine (`--rollout plain`: rollout.generate; `vllm`: rollout.VLLMEngine), grading is
reward.grade; this file only loads the benchmarks, splits the problems across ranks, counts and writes. Outputs: OUT/results.json (the config and every
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
5. Each generate call is seeded from (seed + rank, its first problem's position), so samples (not the expectation)
   change with the number of ranks and the batch size.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import math
import os
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
PRESETS = {"train-aligned": (1.0, 1.0), "justrl": (0.7, 0.9)}  # (temperature, top_p), PAPER.md §7


# ---------------------------------------------------------------------------------------------------- benchmarks
def _field(key: str) -> Callable[[dict], str | None]:
    """The gold is a field as it is (AMC's floats such as 27.0 become "27.0": the grader compares numbers)."""
    return lambda row: None if row.get(key) is None else str(row[key]).strip()


def _last_box(key: str) -> Callable[[dict], str | None]:
    """The gold is the content of the last \\boxed{...} of a solution (reward.extract_answer's brace matching)."""
    return lambda row: reward.extract_answer(row.get(key) or "")


def _box_or_text(key: str) -> Callable[[dict], str | None]:
    """math-ai/aime24 keeps the answer in `solution`, boxed or bare: take the last box, else the text."""
    return lambda row: reward.extract_answer(row.get(key) or "") or _field(key)(row)


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
    "aime24": Benchmark("aime24.jsonl", Source("problem", _field("answer")),
                        "math-ai/aime24", Source("problem", _box_or_text("solution"))),
    "aime25": Benchmark("aime25.jsonl", Source("problem", _field("answer")),
                        "math-ai/aime25", Source("problem", _field("answer"))),
    "amc23": Benchmark("amc23.jsonl", Source("problem", _field("answer")),
                       "math-ai/amc23", Source("question", _field("answer"))),
    "math500": Benchmark("math500.jsonl", Source("problem", _field("answer")),
                         "HuggingFaceH4/MATH-500", Source("problem", _field("answer"))),
    "minerva": Benchmark("minerva_math.jsonl", Source("problem", _last_box("solution")),
                         "math-ai/minervamath", Source("question", _field("answer"))),
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
    benches = [b for b in BENCHMARKS if any(b in m["benchmarks"] for m in results["models"].values())]
    paper = [b for b in benches if b in PAPER_BENCHMARKS]
    cfg = results["config"]
    temperature, top_p = PRESETS[cfg["preset"]]
    lines = [f"avg@k (%), preset {cfg['preset']} (temperature {temperature}, top-p {top_p}), max "
             f"{cfg['max_new_tokens']} new tokens. Avg = mean over the {len(paper)} of the paper's six benchmarks "
             f"evaluated here ({', '.join(TITLES[b] for b in paper) or 'none'}); GSM8K is never averaged.", "",
             "| Model | " + " | ".join(TITLES[b] for b in benches) + " | Avg |",
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
            lines.append(f"| {label} | {TITLES[b]} | {m['problems']} | {m['k']} | {m['avg@k']:.2f} | "
                         f"{m['pass@k']:.2f} | {m['mean_length']:.1f} | {m['truncated']:.1f} |")
    return "\n".join(lines) + "\n"


def write_outputs(results: dict, out: str | Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    (out / "table.md").write_text(table(results))


# ---------------------------------------------------------------------------------------------------------- CLI
def cli(cls, argv: list[str] | None = None):
    """Parse argv into the dataclass `cls`: one --flag per field (underscores -> dashes), the string literal under
    each field is its --help. bool -> --flag/--no-flag, list[X] -> one or more X, Literal -> choices."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=(cls.__doc__ or "").strip(),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(cls):
        tp = hints[f.name]
        if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:  # X | None -> X
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        kw = {"default": f.default_factory() if f.default is MISSING else f.default, "help": docs.get(f.name, " ")}
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is list:
            kw.update(nargs="+", type=typing.get_args(tp)[0])
        elif typing.get_origin(tp) is Literal:
            kw.update(choices=typing.get_args(tp), type=str)
        else:
            kw["type"] = tp
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)
    return cls(**vars(parser.parse_args(argv)))


@dataclass
class Config:
    """Evaluate checkpoints on the STAPO benchmarks (avg@k, pass@k) and write results.json and table.md."""
    models: list[str] = field(default_factory=lambda: ["smollm2"])
    """checkpoints, one table row each: Hub id, local HF dir, .gguf file, 'smollm2' (packaged SmolLM2-135M-Instruct)
    or 'tiny' (random, tests); LABEL=NAME sets the row label"""
    benchmarks: list[str] = field(default_factory=lambda: list(PAPER_BENCHMARKS))
    """benchmarks: aime24 aime25 amc23 math500 minerva olympiadbench gsm8k"""
    data_dir: str | None = None
    """folder with one .jsonl per benchmark laid out like shared/data/benchmarks; default None = the HF Hub"""
    preset: Literal["train-aligned", "justrl"] = "train-aligned"
    """decoding: train-aligned = temperature 1.0, top-p 1.0; justrl = temperature 0.7, top-p 0.9"""
    k: int | None = None
    """samples per problem for every benchmark; default 32 for AIME24/AIME25/AMC23, 4 for the others"""
    max_new_tokens: int = 20480
    """response budget in tokens; longer responses are cut and counted as truncated"""
    limit: int | None = None
    """evaluate only the first LIMIT problems of each benchmark"""
    batch_size: int = 64
    """sequences per generate call on each rank (problems per call = max(1, batch_size // k))"""
    seed: int = 0
    """sampling seed; rank r uses seed + r"""
    out: str = "out/eval"
    """output folder for results.json and table.md"""
    chat: bool = True
    """format prompts with the tokenizer's chat template (--no-chat: raw problem + instruction, for base models)"""
    regrade: str | None = None
    """path of an existing results.json: re-grade its samples, rewrite it and table.md next to it, sample nothing"""
    rollout: str = "plain"
    """plain | vllm: sampling engine (vllm: a vLLM engine in this process, fed with the loaded weights; README)"""


# --------------------------------------------------------------------------------------------------- evaluation
def evaluate_model(name: str, cfg: Config, rank: int = 0, world: int = 1, device: str = "cpu"):
    """Sample k answers per problem on this rank's share of every benchmark, grade them, gather to rank 0.
    Yields (benchmark, {"k", "temperature", "top_p", "metrics", "problems": [...]}) after each benchmark on rank 0
    (None on the other ranks)."""
    import torch
    from tqdm import tqdm

    import model as model_lib
    import rollout

    dtype = torch.bfloat16 if device.startswith("cuda") else None
    lm, tokenizer = model_lib.load_model(name, dtype=dtype, device=device)
    lm.eval()
    temperature, top_p = PRESETS[cfg.preset]
    data = {b: load_benchmark(b, cfg.data_dir)[: cfg.limit] for b in cfg.benchmarks}
    longest = max(len(rollout.format_prompt(tokenizer, r["problem"], chat=cfg.chat)) for rows in data.values()
                  for r in rows)
    engine = rollout.make_engine(  # the vLLM engine's KV cache: one call's rows at full length
        cfg.rollout, lm, tokenizer, cfg.chat, max_model_len=longest + cfg.max_new_tokens, dtype=lm.dtype,
        kv_cache_memory_bytes=rollout.kv_cache_bytes(lm.config, cfg.batch_size, longest + cfg.max_new_tokens,
                                                     lm.dtype.itemsize))
    bar = tqdm(total=sum(len(rows[rank::world]) for rows in data.values()), desc=f"{name} (rank 0 of {world})",
               disable=rank != 0)
    with engine.ready(lm):  # vllm: the weights are pushed once, for every benchmark
        for b, rows in data.items():
            k = cfg.k or DEFAULT_K[b]
            mine = list(range(rank, len(rows), world))  # round-robin split of the problems over the ranks
            per_call = max(1, cfg.batch_size // k)
            problems = []
            for start in range(0, len(mine), per_call):
                idx = mine[start: start + per_call]
                prompts = [rollout.format_prompt(tokenizer, rows[i]["problem"], chat=cfg.chat) for i in idx]
                with torch.no_grad():  # rows j*k .. j*k+k-1 answer problem idx[j]
                    ro = engine.sample(prompts, k, [(cfg.seed + rank) * 1_000_003 + start], len(prompts),
                                       cfg.max_new_tokens, temperature, top_p)
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
            yield b, {"k": k, "temperature": temperature, "top_p": top_p, "metrics": benchmark_metrics(problems),
                      "problems": problems} if rank == 0 else None
    bar.close()
    engine.close()


def main(argv: list[str] | None = None) -> dict | None:
    cfg = cli(Config, argv)
    if cfg.regrade:
        results = regrade(json.loads(Path(cfg.regrade).read_text()))
        write_outputs(results, Path(cfg.regrade).parent)
        print(table(results))
        return results
    for b in cfg.benchmarks:
        if b not in BENCHMARKS:
            raise SystemExit(f"eval.py: unknown benchmark {b!r}; choose from {', '.join(BENCHMARKS)}")
    import torch
    import torch.distributed as dist

    import model  # noqa: F401  before init_process_group: torch.distributed.fsdp imported after it holds references
    # to the WORLD group, whose gloo threads then outlive destroy_process_group and can abort the process at exit

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = "cpu"
    if torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    results = {"config": asdict(cfg), "models": {}}
    for spec in cfg.models:
        label, _, name = spec.partition("=") if "=" in spec and not os.path.exists(spec) else ("", "", spec)
        results["models"][label or name] = {"name": name, "benchmarks": {}}
        for b, got in evaluate_model(name, cfg, rank, world, device):
            if rank == 0:
                results["models"][label or name]["benchmarks"][b] = got
                write_outputs(results, cfg.out)  # after every benchmark, so a long run keeps what it has
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if world > 1 and dist.is_initialized():  # closing a vLLM engine already tore the group down
        dist.destroy_process_group()
    if rank == 0:
        print(table(results))
        return results
    return None


if __name__ == "__main__":
    main()
