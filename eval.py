"""Evaluate checkpoints the way the paper does (docs/paper.md §7): k sampled answers per problem on
AIME24, AIME25, AMC23 (avg@32) and MATH500, Minerva, OlympiadBench (avg@4), graded by rule, one
table row per checkpoint.

    python eval.py --models smollm2 --benchmarks gsm8k math500 --data-dir testdata/benchmarks \
        --limit 30 --k 4 --max-new-tokens 512                       # CPU, minutes
    python eval.py --models Qwen/Qwen3-1.7B-Base stapo=runs/stapo/hf --no-chat   # 1 GPU
    torchrun --standalone --nproc_per_node=8 eval.py --models runs/stapo/hf --preset justrl
    python eval.py --regrade out/eval/results.json     # re-grade saved samples, rewrite table.md
    python eval.py --run out/train-cpu     # a run's export, as train.py evaluated it
    python eval.py --models tiny --data easy=my.jsonl --prompt-key q --answer-key a   # your JSONL

Sampling is a rollout engine (engines.choice.make_engine), grading is reward.correct, your own
files and a run's held-out set are read by data.py, the benchmarks by evaluation/benchmarks.py;
this file splits the problems across ranks, samples and grades them; evaluation/results.py counts
(avg@k, pass@k) and writes OUT/results.json and OUT/table.md (docs/evaluation.md). Every input is
checked before a model loads; an error is one line, exit status 2. Nothing here imports train.py.
Deliberate differences D52-D57: docs/paper.md, "Deliberate differences".
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

from command_line import errors, flags
import reward
from data import problem_seed
from evaluation.benchmarks import BENCHMARKS, PAPER_BENCHMARKS, load_sets
from evaluation.benchmarks import load_benchmark  # noqa: F401 (the public eval.load_benchmark)
from evaluation.checkpoints import (check_weights, export_command, label_name, stale_export,
                                    train_run)
from evaluation.results import (benchmark_metrics, read_results, regrade, settings, table,
                                write_outputs)

# (temperature, top_p), docs/paper.md §7
PRESETS = {"train-aligned": (1.0, 1.0), "justrl": (0.7, 0.9)}


@dataclass
class Config:
    """Evaluate checkpoints on the STAPO benchmarks or your own files (avg@k, pass@k); write
    results.json, table.md. With --run (or --models RUN/hf) prompts and sampling follow the training
    run's config.json."""
    models: list[str] = field(default_factory=lambda: ["smollm2"])
    """checkpoints, one table row each: Hub id, local HF dir, .gguf file, 'smollm2' (packaged
    SmolLM2-135M-Instruct) or 'tiny' (random, tests); LABEL=NAME sets the row label; with --run:
    RUN/hf"""
    run: str | None = None
    """a train.py output folder: evaluate RUN/hf with the run's prompt format (chat, instruction),
    sampling (temperature, top-p) and response budget (max_response_len), unless flags say
    otherwise; also found from --models RUN/hf"""
    benchmarks: list[str] = field(default_factory=lambda: list(PAPER_BENCHMARKS))
    """aime24 aime25 amc23 math500 minerva olympiadbench gsm8k, or heldout (the run's held-out
    problems, as train.py evaluated them); default: the six paper ones, none with --data, heldout
    with --run"""
    data: list[str] = field(default_factory=list)
    """your own eval sets: .jsonl/.json/.parquet files or Hub ids, read like train.py's --data
    (--prompt-key, --answer-key; dotted paths, chat message lists); NAME=FILE names its column
    (default: the file name)"""
    prompt_key: str = "problem"
    """field of the problem text in --data (default: the run's --prompt-key with --run)"""
    answer_key: str = "answer"
    """field of the gold answer in --data, a string or a list of strings (default: the run's with
    --run)"""
    split: str = "test"
    """split of --data Hub ids"""
    data_dir: str | None = None
    """folder with one .jsonl per benchmark, named and laid out like the repository's
    testdata/benchmarks (3 rows of each); default None = the HF Hub"""
    preset: Literal["train-aligned", "justrl"] = "train-aligned"
    """decoding when neither --temperature/--top-p nor a run set it:
    train-aligned = temperature 1.0, top-p 1.0; justrl = temperature 0.7, top-p 0.9"""
    temperature: float | None = None
    """sampling temperature; default: the run's, else the preset's"""
    top_p: float | None = None
    """nucleus sampling; default: the run's, else the preset's"""
    chat: bool = True
    """format prompts with the tokenizer's chat template (--no-chat: raw problem + instruction, for
    base models); default: the run's"""
    instruction: str | None = None
    """text appended to every problem; default: the run's, else the paper's \\boxed{} sentence
    (rollout.INSTRUCTION)"""
    k: int | None = None
    """samples per problem for every benchmark; default 32 for AIME24/AIME25/AMC23, the run's
    --eval-samples for heldout, 4 for the others"""
    max_new_tokens: int = 20480
    """response budget in tokens; longer responses are cut and counted as truncated; default: the
    run's --max-response-len with --run"""
    stop_text: list[str] = field(default_factory=list)
    """a response also ends with the token at which this text first appears (repeatable; train.py's
    --stop-text, vLLM's `stop`); default: the run's with --run"""
    limit: int | None = None
    """evaluate only the first LIMIT problems of each benchmark"""
    batch_size: int | None = None
    """sequences per generate call on each rank (problems per call = max(1, batch_size // k));
    default 64, and for heldout one problem per call, as train.py's held-out evaluation
    samples them"""
    seed: int | None = None
    """sampling seed (the call that starts at problem i uses data.problem_seed(seed, i), on any
    number of ranks); default: the run's --seed + 1 with --run, as train.py's held-out evaluation,
    else 0"""
    reward: str = "dapo"
    """what counts as correct, a positive reward (reward.correct): dapo or binary (reward.grade),
    strict (last-box string match) or your own FILE.py:FUNCTION / MODULE:FUNCTION; default: the
    run's --reward with --run"""
    out: str | None = None
    """output folder for results.json and table.md; default: RUN/eval with --run (or --models
    RUN/hf), else out/eval"""
    overwrite: bool = False
    """replace the results.json and table.md already in --out (without it, an --out that holds them
    is refused)"""
    regrade: str | None = None
    """path of an existing results.json: re-grade its samples with its --reward, rewrite it and
    table.md next to it, sample nothing"""
    rollout: Literal["plain", "vllm"] = "plain"
    """plain | vllm: sampling engine (vllm: a vLLM engine in this process, fed with the loaded
    weights; docs/rollouts.md)"""
    kv_cache_gb: float = 40.0
    """KV-cache budget per rank in GB (worst case: every row at the longest
    prompt + --max-new-tokens): bounds the problems per generate call below --batch-size, and is
    vLLM's KV cache"""
    collective_timeout_min: float = 60.0
    """with torchrun: minutes a rank waits for the others at the gather after each benchmark"""


# eval.py field <- the train.py config.json field it takes its default from (how the run
# formats and samples)
RUN_FIELDS = {"chat": "chat", "instruction": "instruction", "temperature": "temperature",
              "top_p": "top_p", "max_new_tokens": "max_response_len", "prompt_key": "prompt_key",
              "answer_key": "answer_key", "reward": "reward", "stop_text": "stop_text"}
BATCH_SIZE = 64  # --batch-size's default, but for heldout


def parse_config(argv: list[str] | None = None) -> Config:  # D57
    """argv -> Config. Each value: the flag given, else the training run's (--run, or the run folder
    an --models HF directory sits in), else the default. Checks names and paths; loads no data and
    no model."""
    given = flags.parse_flags(Config, argv, "eval.py")
    if given.get("regrade"):
        if not os.path.isfile(given["regrade"]):
            raise FileNotFoundError(f"--regrade: no such file: {given['regrade']}")
        return Config(**given)
    values, run = dict(given), None
    if given.get("run"):
        run = train_run(given["run"])
        if run is None:
            raise FileNotFoundError(f"--run {given['run']}: not a train.py output folder "
                                    f"(no config.json)")
        hf = Path(given["run"]) / "hf"
        if "models" not in given:
            if not hf.is_dir():
                raise FileNotFoundError(
                    f"--run: {hf} not found (train.py writes it at the end unless --no-export-hf)"
                    f"; {export_command(Path(given['run']), run)}")
            values["models"] = [str(hf)]
    else:  # an HF export inside a run folder brings the run's settings
        runs = {str(Path(name).parent): train_run(Path(name).parent)
                for name in (label_name(spec)[1] for spec in given.get("models", []))
                if os.path.isdir(name)}
        runs = {folder: c for folder, c in runs.items() if c is not None}
        if len({json.dumps([c.get(t) for t in RUN_FIELDS.values()]) for c in runs.values()}) > 1:
            raise ValueError(f"--models come from runs with different prompt or sampling settings "
                             f"({', '.join(runs)}); evaluate them separately or give --run")
        if runs:
            values["run"], run = next(iter(runs.items()))
    if run:
        # a run older than a field: that field's default
        inherited = {k: run[t] for k, t in RUN_FIELDS.items()
                     if t in run and (run["data"] or not k.endswith("_key"))}
        # the field names of a built-in-task run say nothing about --data
        values = {**inherited, **values}
        if "preset" in given:  # an explicit --preset beats the run's sampling
            values = {**values, **dict(zip(("temperature", "top_p"), PRESETS[given["preset"]])),
                      **{k: given[k] for k in ("temperature", "top_p") if k in given}}
    if "benchmarks" not in given:
        # null: the default share (data.py)
        has_heldout = run and (not run["data"] or run["heldout"] != 0)
        values["benchmarks"] = ([] if given.get("data") else ["heldout"] if has_heldout
                                else list(PAPER_BENCHMARKS))
    preset_t, preset_p = PRESETS[values.get("preset", "train-aligned")]
    if values.get("temperature") is None:
        values["temperature"] = preset_t
    if values.get("top_p") is None:
        values["top_p"] = preset_p
    if values.get("instruction") is None:
        import rollout
        values["instruction"] = rollout.INSTRUCTION
    # train.py seeds its held-out evaluation with --seed + 1 (evaluation.heldout.heldout_accuracy)
    if values.get("seed") is None:
        values["seed"] = run["seed"] + 1 if run else 0
    # a run's export after N steps: RUN/eval/step_N, so a newer one gets its own
    if values.get("out") is None:
        import run_folder

        step = run_folder.export_step(Path(values["run"]) / "hf") if run else None
        values["out"] = ("out/eval" if not run else str(Path(values["run"]) / "eval")
                         if step is None else str(Path(values["run"]) / "eval" / f"step_{step}"))
    if not values["out"].strip():  # Path("") is the working directory
        raise ValueError("--out '' names no folder: give one, e.g. --out out/eval")
    cfg = Config(**values)
    # an unknown mode or a broken FILE.py:FUNCTION: one line, before any model
    reward.load_reward(cfg.reward)
    for b in cfg.benchmarks:
        if b not in BENCHMARKS and b != "heldout":
            raise ValueError(f"unknown benchmark {b!r}; choose from {', '.join(BENCHMARKS)}, "
                             f"heldout (with --run); your own files: --data FILE")
    if "heldout" in cfg.benchmarks and not run:
        raise ValueError("benchmark 'heldout' is a training run's held-out set: give --run RUN")
    if cfg.data_dir is not None and not os.path.isdir(cfg.data_dir):
        raise FileNotFoundError(f"--data-dir {cfg.data_dir}: no such folder")
    for name, rule in (("temperature", cfg.temperature > 0), ("top_p", 0 < cfg.top_p <= 1),
                       ("k", cfg.k is None or cfg.k >= 1),
                       ("max_new_tokens", cfg.max_new_tokens >= 1),
                       ("limit", cfg.limit is None or cfg.limit >= 1),
                       ("batch_size", cfg.batch_size is None or cfg.batch_size >= 1),
                       ("kv_cache_gb", cfg.kv_cache_gb > 0),
                       ("collective_timeout_min", cfg.collective_timeout_min > 0)):
        if not rule:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)} is out of range")
    if not cfg.benchmarks and not cfg.data:
        raise ValueError("nothing to evaluate: no --benchmarks and no --data")
    return cfg


# --------------------------------------------------------------------------------------- evaluation
class Opened(NamedTuple):
    """A checkpoint ready to sample (`open_engine`)."""
    engine: object  # its rollout engine (engines.choice.make_engine)
    lm: object  # the model
    tokenizer: object
    per_call: dict[str, int]  # problems per generate call of each set


def open_engine(name: str, cfg: Config, sets: dict[str, dict], rank: int = 0,
                device=None) -> Opened:
    """The checkpoint `name` ready to sample: the model loaded, its KV-cache budget applied, its
    rollout engine made (raises on a checkpoint that cannot load or sample here)."""
    import torch

    import model as model_lib
    import rollout
    import run_folder
    from memory.estimate import kv_cache_bytes

    device = torch.device("cpu") if device is None else device
    dtype = torch.bfloat16 if device.type == "cuda" else None
    run_folder.quiet_library_bars()  # transformers' "Loading weights"
    lm, tokenizer = model_lib.load_model(name, dtype=dtype, device=device,
                                         require_chat_template=cfg.chat)
    lm.eval()
    longest = max(len(rollout.format_prompt(tokenizer, r["problem"], cfg.chat, cfg.instruction))
                  for s in sets.values() for r in s["rows"]) + cfg.max_new_tokens
    # problems per generate call: --batch-size rows, fewer where their worst-case KV cache would
    # exceed --kv-cache-gb, but at least one problem's k rows (the plain sampler holds them at once;
    # vLLM queues what does not fit its KV cache of at most --kv-cache-gb)
    row_bytes, budget = (kv_cache_bytes(lm.config, 1, longest, lm.dtype.itemsize),
                         int(cfg.kv_cache_gb * 1e9))
    # heldout without --batch-size as evaluation.heldout.heldout_accuracy: a call per problem
    per_call = {b: 1 if b == "heldout" and cfg.batch_size is None
                else max(1, min(cfg.batch_size or BATCH_SIZE, budget // row_bytes) // s["k"])
                for b, s in sets.items()}
    # the largest call, every row at its longest
    need = max(per_call[b] * s["k"] for b, s in sets.items()) * row_bytes
    if rank == 0:
        calls = ", ".join(f"{b} {per_call[b]} x {s['k']}" for b, s in sets.items())
        kv = min(need, budget) if cfg.rollout == "vllm" else need
        over = "; one problem's k rows exceed it" if need > budget else ""
        print(f"eval.py: {name}: problems x samples per generate call: {calls}; KV cache at most "
              f"{kv / 2**30:.2f} GiB per rank (--kv-cache-gb {cfg.kv_cache_gb:g} = "
              f"{cfg.kv_cache_gb * 1e9 / 2**30:.2f} GiB{over})", flush=True)
    from engines import choice

    engine = choice.make_engine(cfg.rollout, lm, tokenizer, cfg.chat, max_model_len=longest,
                                dtype=lm.dtype, stop_text=cfg.stop_text,
                                kv_cache_memory_bytes=max(min(need, budget), row_bytes))
    return Opened(engine, lm, tokenizer, per_call)


def evaluate_model(opened: Opened, name: str, cfg: Config, sets: dict[str, dict], rank: int = 0,
                   world: int = 1):
    """Sample k answers per problem on this rank's share of every set with the checkpoint `name`
    (`open_engine`), grade them, gather to rank 0; closes the engine at the end. Yields (set name,
    {"k", "temperature", "top_p", "metrics", "problems": [...]}) after each set on rank 0 (None on
    the other ranks)."""
    import torch
    from tqdm import tqdm

    import rollout

    engine, lm, tokenizer, per_call = opened
    # this rank's calls: every world-th one; pure data parallelism (D53)
    calls = {b: [range(start, min(start + per_call[b], len(s["rows"])))
                 for start in range(0, len(s["rows"]), per_call[b])][rank::world]
             for b, s in sets.items()}
    bar = tqdm(total=sum(len(idx) for b in calls for idx in calls[b]),
               desc=f"{name} (rank 0 of {world})", disable=rank != 0)
    try:
        with engine.ready(lm):  # vllm: the weights are pushed once, for every set
            for b, s in sets.items():
                k, rows = s["k"], s["rows"]
                problems = []
                for idx in calls[b]:
                    prompts = [rollout.format_prompt(tokenizer, rows[i]["problem"], cfg.chat,
                                                     cfg.instruction)
                               for i in idx]
                    # rows j*k .. j*k+k-1 answer problem idx[j] (D56: the seed)
                    with torch.no_grad():
                        ro = engine.sample(prompts, k, [problem_seed(cfg.seed, idx[0])],
                                           len(prompts), cfg.max_new_tokens, cfg.temperature,
                                           cfg.top_p)
                    texts = ro.texts(tokenizer)
                    lengths = ro.response_mask.sum(-1).tolist()  # (B,) tokens including EOS
                    truncated = ro.truncated.tolist()  # (B,)
                    # the row each response answers; graded by rule only (D52)
                    answered = [rows[idx[r // k]] for r in range(len(texts))]
                    values = reward.rewards(texts, [row["gold"] for row in answered], cfg.reward,
                                            answered)
                    for j, i in enumerate(idx):
                        gold = rows[i]["gold"]
                        problems.append({"index": i, "problem": rows[i]["problem"], "gold": gold,
                                         "fields": rows[i]["fields"], "samples": [
                            {"text": texts[r], "extracted": reward.extract_answer(texts[r]),
                             "correct": values[r] > 0, "length": int(lengths[r]),
                             "truncated": bool(truncated[r])} for r in range(j * k, j * k + k)]})
                    bar.update(len(idx))
                if world > 1:
                    import torch.distributed as dist
                    parts = [None] * world if rank == 0 else None
                    dist.gather_object(problems, parts, dst=0)
                    problems = sorted((p for part in parts for p in part),
                                      key=lambda p: p["index"]) \
                        if rank == 0 else []
                yield b, {"k": k, "temperature": cfg.temperature, "top_p": cfg.top_p,
                          "metrics": benchmark_metrics(problems),
                          "problems": problems} if rank == 0 else None
    finally:  # also when your --reward function raises: the bar's line ends before the error's
        bar.close()
    engine.close()


def main(argv: list[str] | None = None) -> dict | None:
    """`python eval.py [flags]`: the results (rank 0). A bad input, a full disk, your --reward
    function failing, a training run writing into --run: one line, exit status 2; Ctrl-C: one line,
    exit status 130, results.json holding the benchmarks finished before it."""
    rank, held = int(os.environ.get("RANK", 0)), {"locks": [], "out": None}
    try:
        return evaluate(argv, rank, held)
    except KeyboardInterrupt:
        if rank == 0:
            kept = (f"{held['out']}/results.json holds the benchmarks finished before it"
                    if held["out"] else "nothing was written")
            print(f"\neval.py: interrupted (SIGINT): {kept}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        for lock in held["locks"]:
            lock.release()


def evaluate(argv: list[str] | None, rank: int, held: dict) -> dict | None:
    """main's work; `held`: the run folder's lock ("locks") and the --out it wrote ("out")."""
    try:  # every input is checked before a model loads: one line, exit status 2, nothing written
        cfg = parse_config(argv)
        if cfg.run:  # no train.py writes into the run while it is evaluated (run_folder/lock.py)
            import run_folder
            held["locks"].append(run_folder.Lock(Path(cfg.run), reader="eval.py"))
            cfg = parse_config(argv)  # the run as the lock holds it
        if cfg.regrade:  # graded and tabled in full before anything is rewritten
            errors.check_writable("--regrade", Path(cfg.regrade).parent)
            results = regrade(read_results(cfg.regrade))
            text = table(results)
        else:
            if (Path(cfg.out) / "results.json").exists() and not cfg.overwrite:
                raise ValueError(f"--out {cfg.out} holds the results of an earlier evaluation "
                                 f"(results.json): choose another --out, or replace them "
                                 f"with --overwrite")
            try:  # before any sampling: a read-only run folder, say
                errors.check_writable("--out", cfg.out)
            except OSError as e:
                raise OSError(f"{e}; write the results elsewhere with --out DIR") from None
            sets = load_sets(cfg)
            import model
            for spec in cfg.models:
                model.check_model_name(label_name(spec)[1], "--models")
                check_weights(label_name(spec)[1])
    except errors.BAD_INPUT as e:
        raise SystemExit(errors.error("eval.py", e, rank))
    if cfg.regrade:
        try:
            write_outputs(results, Path(cfg.regrade).parent)
        except OSError as e:
            raise SystemExit(errors.error("eval.py", f"{e}, then run it again", rank)) from None
        print(text)
        return results
    if cfg.run and rank == 0 and (stale := stale_export(Path(cfg.run))):
        print(f"eval.py: warning: {stale}", file=sys.stderr)
    if cfg.run and rank == 0:
        print(f"eval.py: prompts and sampling of the run {cfg.run}: {settings(cfg)}", flush=True)
    import torch

    import model  # noqa: F401
    import rollout  # noqa: F401
    import run_folder
    from distributed.process_group import init_distributed
    from step_metrics.step_warnings import fit_threads

    # model and rollout (torch.distributed.fsdp) before the process group: imported after it, fsdp
    # holds the WORLD group, whose gloo threads outlive destroy_process_group and abort the exit
    rank, world, device = init_distributed(cfg.collective_timeout_min, always=False)
    fit_threads(device, rank, "eval.py")  # a busy CPU machine: fewer torch threads
    results = {"config": asdict(cfg), "models": {}}
    for spec in cfg.models:
        label, name = label_name(spec)
        results["models"][label] = {"name": name, "export": run_folder.export_id(Path(name)),
                                    "benchmarks": {}}
        try:  # a checkpoint without weights or config, or one vLLM refuses: one line too
            opened = open_engine(name, cfg, sets, rank, device)
        except errors.BAD_INPUT as e:
            raise SystemExit(errors.error("eval.py", e, rank))
        try:  # your --reward function raising, a full disk: one line naming it
            for b, got in evaluate_model(opened, name, cfg, sets, rank, world):
                if rank == 0:
                    results["models"][label]["benchmarks"][b] = got
                    # after every benchmark, so a long run keeps what it has
                    write_outputs(results, cfg.out)
                    held["out"] = cfg.out
        except reward.RewardError as e:
            raise SystemExit(errors.error("eval.py", e, rank))
        except OSError as e:
            again = (f" with --overwrite ({cfg.out}/results.json holds the benchmarks finished "
                     f"before)" if (Path(cfg.out) / "results.json").exists() and not cfg.overwrite
                     else "")
            raise SystemExit(errors.error("eval.py", f"{e}, then run the same command again"
                                          f"{again}", rank)) from None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if world > 1 and torch.distributed.is_initialized():  # closing a vLLM engine may have ended it
        torch.distributed.destroy_process_group()
    if rank == 0:
        print(table(results))
        print(f"eval.py: results in {cfg.out}/results.json and {cfg.out}/table.md")
        return results
    return None


if __name__ == "__main__":
    main()
