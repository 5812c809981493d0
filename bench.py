"""Performance measurements, printed as markdown tables; ratios against a baseline run in the same process.

    python bench.py                 # everything (about an hour on 2 CPU cores)
    python bench.py logprobs        # chunked log-prob/entropy vs naive: memory and time at Qwen3's vocabulary
    python bench.py generate        # our sampler vs model.generate (tiny, SmolLM2), FSDP2 vs one process
    python bench.py grader          # reward.grade throughput

Not part of the test suite: timings on a shared machine are noisy, so nothing here asserts a speed.

logprobs: Paper: STAPO (arXiv:2602.15620) Sec. 2 needs log pi(y_t) and the full-vocabulary entropy H_t of every response
    token; this measures what computing them costs at Qwen3's vocabulary (V = 151,936) and Qwen3-1.7B's hidden size
    (D = 2048), fp32 on CPU, forward + backward of sum_t log pi(y_t), for N = 1024, 4096, 16384 tokens.
    
    Deliberate choices:
    1. Each (implementation, N) runs in its own process and reports its peak resident memory (ru_maxrss) minus the
       resident memory once the inputs (hidden, weight) exist, so the numbers do not mix. The weight gradient (V x D fp32,
       1.24 GB) is part of both.
    2. A naive run is only started where its predicted peak fits the memory limit (`max_gb`); otherwise the table shows
       the prediction: the naive extra memory is linear in N, so it is extrapolated from the measured N = 1024 run.
    3. Time ratios chunked/naive are measured in one process at N = 1024 (alternating, best of 2), because timings
       across processes are noisy on a shared machine; per-process times are printed too. With one chunk the chunked
       code recomputes nothing; with 4 chunks of 256 it recomputes 3 of them, the cost at any N > chunk_size.

generate: Prints a markdown table: tokens/s of both on the tiny model and on SmolLM2-135M-Instruct (same batch, length and
    sampling settings, interleaved repetitions, medians), how far decoding is from the machine's limit (bytes of weights
    read per step / measured copy bandwidth, and FLOPs per step / measured matmul throughput), and the time per token
    under 2-process FSDP2 (inside `rollout.gathered`) against the same rank decoding an unsharded copy.
    
    Deliberate choices:
    1. One thread per process (restored afterwards): the machine is shared, and OpenMP threads that spin while other
       processes hold the cores make multi-threaded timings meaningless. Ratios are what we report.
    2. EOS is set to an id that cannot be sampled, so both samplers decode exactly `max_new_tokens` steps.
    3. `model.generate` gets top_k=0 (its default is 50) so both sample from the same distribution.

grader: Paper: STAPO (arXiv:2602.15620) Sec. 6 grades 256 x 8 = 2,048 responses per rollout batch, so the grader must not be
    the bottleneck. Corpora: the responses of shared/data/grader_cases.jsonl (real answer forms, several parse paths),
    the golds of AIME, AMC, MATH-500 and OlympiadBench boxed in a response (mostly the string fast path), and hostile
    inputs (refused by the size guards, or cut by the deadline). Without ../shared/data it falls back to the
    repository's testdata/ (and says so). The last column counts verdicts that differ from the label (grader_cases:
    the human label; benchmark golds: a gold must grade itself; hostile inputs: only the 1 MB response is right).
    
    Deliberate choices:
    1. One process, best of `repeats` passes per corpus (the machine is shared, so the best pass is the least noisy);
       the slowest single grade is the maximum over all passes.
    2. "strict" (the paper's string match of the last box) is timed on the same corpus as the reference point.

"""
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import model
import reward
from model import Policy, load_model, shard_policy
from rollout import format_prompt, gathered, generate


# ------------------------------------------------------------------------------------------------------------------
# `python bench.py logprobs`: model.chunked_logprobs_entropy vs the naive full-logits computation (issue 3)
V, D = 151_936, 2048  # Qwen3 vocabulary, Qwen3-1.7B hidden size


def _inputs(N, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).requires_grad_()  # (N, D)
    weight = torch.randn(V, D, generator=g).mul_(0.02).requires_grad_()  # (V, D), in place: no temporary
    return hidden, weight, torch.randint(V, (N,), generator=g)


def _naive(hidden, weight, targets):
    """What a first implementation writes: full (N, V) logits, log_softmax, entropy from the same tensor."""
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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB


def _rss_gb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def _worker(name, N):
    """Run in a fresh process: peak extra memory (GiB) and time of one forward + backward."""
    hidden, weight, targets = _inputs(N)
    base = _rss_gb()
    assert _peak_rss_gb() < base + 0.1, "making the inputs must not leave a higher peak than the inputs"
    seconds = _step({"naive": _naive, "chunked": _chunked}[name], hidden, weight, targets)
    print(json.dumps({"peak_gb": _peak_rss_gb() - base, "seconds": seconds}))


def _measure(name, N):
    """`_worker(name, N)` in a fresh Python process (imports this file as a module, whatever its name)."""
    here = Path(__file__)
    code = f"import sys; sys.path.insert(0, {str(here.parent)!r}); import {here.stem} as b; b._worker({name!r}, {N})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _available_gb():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20


def _same_process_times(N=1024, repeats=2):
    """Best-of-`repeats` wall time of naive, chunked with one chunk (no recomputation) and with 4 chunks."""
    hidden, weight, targets = _inputs(N)
    impls = {"naive": _naive, "chunked": _chunked, "chunked x4": lambda *a: _chunked(*a, chunk_size=N // 4)}
    times = {name: [] for name in impls}
    for _ in range(repeats):
        for name, impl in impls.items():  # alternating, so load changes hit all three alike
            times[name].append(_step(impl, hidden, weight, targets))
    return {name: min(t) for name, t in times.items()}


def bench_model(sizes=(1024, 4096, 16384), max_gb=12.0):
    print(f"chunked_logprobs_entropy vs naive, forward + backward, V={V}, D={D}, fp32 CPU, chunk_size=1024, "
          f"{torch.get_num_threads()} threads")
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
        print(f"| {N} | {naive_mem} | {chunked['peak_gb']:.2f} | {naive_time} | {chunked['seconds']:.1f} |", flush=True)
    best = _same_process_times()
    print(f"\nSame process, N=1024, best of 2: naive {best['naive']:.1f} s; chunked, 1 chunk of 1024 (no "
          f"recomputation) {best['chunked']:.1f} s = {best['chunked'] / best['naive']:.2f}x; chunked, 4 chunks of 256 "
          f"(3 recomputed) {best['chunked x4']:.1f} s = {best['chunked x4'] / best['naive']:.2f}x")

# ------------------------------------------------------------------------------------------------------------------
# `python bench.py generate`: rollout.generate vs transformers' model.generate, and under FSDP2 (issue 4)
_PROBLEMS = ["What is 12*13?", "Solve x^2 = 49 for x > 0.", "How many primes are below 30?", "Simplify 3/9.",
             "What is the sum of the interior angles of a hexagon?", "Compute 2^10.", "Find gcd(84, 36).", "1+1"]


def _prompt_ids(tokenizer, batch):
    return [format_prompt(tokenizer, _PROBLEMS[i % len(_PROBLEMS)]) for i in range(batch)]


def _ours(lm, prompts, steps, temperature, top_p, seed=0):
    never = lm.config.vocab_size  # an EOS id that is never sampled: decode exactly `steps` tokens
    return generate(lm, prompts, steps, temperature=temperature, top_p=top_p, eos_token_id=never,
                    pad_token_id=lm.config.pad_token_id, generator=torch.Generator().manual_seed(seed))


def _hf(lm, prompts, steps, temperature, top_p):
    P = max(len(p) for p in prompts)
    pad = lm.config.pad_token_id
    input_ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])  # (B, P) left-padded
    attention_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])  # (B, P)
    return lm.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=steps, do_sample=True,
                       temperature=temperature, top_p=top_p, top_k=0, eos_token_id=lm.config.vocab_size,
                       pad_token_id=pad)


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each function, run in alternating order rep by rep (after one warm-up run each)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for rep in range(reps):
        for name in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
            times[name].append(_timed(fns[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _machine_limits() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, matmul FLOP/s), medians of 5, this thread count."""
    src = torch.randn(64 * 2**20)  # 256 MiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / statistics.median(_timed(lambda: dst.copy_(src)) for _ in range(5))
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = 2 * 1024**3 / statistics.median(_timed(lambda: a @ b) for _ in range(5))
    return bandwidth, flops


def _compare(name, lm, tokenizer, batch, steps, temperature, top_p, reps, limits):
    prompts = _prompt_ids(tokenizer, batch)
    t = _interleaved({"ours": lambda: _ours(lm, prompts, steps, temperature, top_p),
                      "hf": lambda: _hf(lm, prompts, steps, temperature, top_p)}, reps)
    bandwidth, flops = limits
    n_params = sum(p.numel() for p in lm.parameters())  # tied embeddings are counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    step_limit = max(weight_bytes / bandwidth, 2 * n_params * batch / flops)  # roofline: one step reads all weights
    per_step = t["ours"] / steps  # includes the prefill, amortized
    return (f"| {name} | {batch} x {steps}, T={temperature}, top-p={top_p} | {batch * steps / t['ours']:.0f} | "
            f"{batch * steps / t['hf']:.0f} | {t['hf'] / t['ours']:.2f}x | {per_step * 1e3:.1f} ms | "
            f"{step_limit * 1e3:.1f} ms ({100 * step_limit / per_step:.0f}%) |")


def _fsdp_worker(rank: int, init_file: str, out_dir: str, name: str, batch: int, steps: int, reps: int):
    """Each rank decodes its own batch twice, interleaved: with the FSDP2-sharded Policy inside `gathered`, and
    with an unsharded copy of the same model (the 1-process baseline under the same load)."""
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
        mp.start_processes(_fsdp_worker, args=(os.path.join(tmp, "init"), tmp, name, batch, steps, reps), nprocs=2,
                           start_method="spawn")
        results = [torch.load(os.path.join(tmp, f"{rank}.pt")) for rank in range(2)]
    fsdp = max(r["fsdp"] for r in results) / steps  # the slower rank sets the pace
    plain = max(r["plain"] for r in results) / steps
    enter = max(r["enter"] for r in results)
    return (f"| {name} | 2 ranks x {batch} x {steps} | {fsdp * 1e3:.2f} ms | {plain * 1e3:.2f} ms | "
            f"{fsdp / plain:.2f}x | {enter * 1e3:.0f} ms |")


def bench_rollout():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        limits = _machine_limits()
        print(f"\nrollout.generate vs model.generate, CPU, 1 thread; copy bandwidth {limits[0] / 1e9:.1f} GB/s, "
              f"matmul {limits[1] / 1e9:.0f} GFLOP/s (medians of interleaved repetitions)\n")
        print("| model | batch x new tokens, sampling | ours tok/s | generate tok/s | speed-up | ours per step | "
              "roofline per step (% reached) |")
        print("|---|---|---|---|---|---|---|")
        lm, tokenizer = load_model("tiny")
        print(_compare("tiny", lm, tokenizer, 8, 64, 1.0, 1.0, 7, limits), flush=True)
        print(_compare("tiny", lm, tokenizer, 8, 64, 0.7, 0.9, 7, limits), flush=True)
        lm, tokenizer = load_model("smollm2")
        print(_compare("SmolLM2-135M", lm, tokenizer, 8, 32, 1.0, 1.0, 5, limits), flush=True)
        print(_compare("SmolLM2-135M", lm, tokenizer, 1, 32, 1.0, 1.0, 5, limits), flush=True)
        del lm
        print("\nFSDP2 (gloo, 2 processes, 1 thread each): time per decoding step inside `gathered` vs the same rank "
              "decoding an unsharded copy\n")
        print("| model | work | FSDP2 per step | unsharded per step | ratio | unshard at entry |")
        print("|---|---|---|---|---|---|")
        print(_fsdp_row("tiny", 8, 64, 5), flush=True)
        print(_fsdp_row("smollm2", 8, 32, 3), flush=True)
    finally:
        torch.set_num_threads(threads)

# ------------------------------------------------------------------------------------------------------------------
# `python bench.py grader`: reward.grade: grades per second and the slowest grade (issue 5)
_REWARD_DATA = Path(__file__).parent.parent / "shared" / "data"  # the full benchmark files, beside the repository
_REWARD_FALLBACK = Path(__file__).parent / "testdata"  # the few rows kept in the repository


def _reward_hostile():
    """Hostile inputs: size guards, regex bait, and six nesting constructs 10,000 deep (a subset of test_stapo's)."""
    hostile = {"power tower": "\\boxed{9^{9^{9^{9}}}}", "100000!": "\\boxed{100000!}",
               "1 MB response": "x = 1 + 1. " * 100_000 + "\\boxed{5}", "unclosed boxes": "\\boxed{" * 50_000,
               "regex bait": "a" * 100_000 + "!",
               "20,000 joined boxes": ", ".join(f"\\boxed{{{k}}}" for k in range(20_000)),
               "100 nested radicals": "\\boxed{" + "+".join(f"\\sqrt{{{k}+\\sqrt{{{k + 1}}}}}" for k in range(100))
                                      + "}"}
    for name, (open_, close) in {"boxes": ("\\boxed{", "}"), "braces": ("{", "}"), "\\frac": ("\\frac{1}{", "}"),
                                 "\\sqrt": ("\\sqrt{", "}"), "\\left(": ("\\left(", "\\right)"),
                                 "\\text": ("\\text{", "}")}.items():
        hostile[f"10,000 nested {name}"] = "\\boxed{" + open_ * 10_000 + "1" + close * 10_000 + "}"
    return hostile


def _reward_corpora():
    """(response, gold, name, label) per corpus; label: the right verdict (None: ambiguous, not counted)."""
    data = _REWARD_DATA if (_REWARD_DATA / "grader_cases.jsonl").exists() else _REWARD_FALLBACK
    if data == _REWARD_FALLBACK:
        print(f"{_REWARD_DATA} not found: using the repository's {data} (fewer cases, smaller benchmark files)\n")
    cases = [json.loads(line) for line in (data / "grader_cases.jsonl").read_text().splitlines() if line.strip()]
    golds = []
    for name, field in (("aime24", "answer"), ("aime25", "answer"), ("amc23", "answer"), ("math500", "answer")):
        for line in (data / "benchmarks" / f"{name}.jsonl").read_text().splitlines():
            golds.append(str(json.loads(line)[field]))
    for line in (data / "benchmarks" / "olympiadbench.jsonl").read_text().splitlines():
        golds.append(", ".join(json.loads(line)["final_answer"]))
    return {
        f"grader_cases ({data.parent.name}/{data.name})": [
            (c["response"], c["gold"], c["id"], None if c["ambiguous"] else c["correct"]) for c in cases],
        "benchmark golds": [(f"So the answer is $\\boxed{{{g}}}$.", g, g[:30], True) for g in golds],
        "hostile inputs": [(text, "5", name, name == "1 MB response") for name, text in _reward_hostile().items()],
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
    reward.grade("\\boxed{\\sqrt{2}}", "\\sqrt{2}+0")  # warm sympy's caches once
    corpora = _reward_corpora()
    print(f"timeout {reward.TIMEOUT_S} s per grade\n")
    print("| corpus | responses | grade /s | strict /s | slowest grade (ms) | slowest case | verdicts != label |")
    print("|---|---|---|---|---|---|---|")
    for name, items in corpora.items():
        rate, (worst, case), wrong = _reward_run(items, reward.grade, repeats)
        strict, _, _ = _reward_run(items, lambda r, g: reward.reward(r, g, mode="strict") > 0, repeats)
        print(f"| {name} | {len(items)} | {rate:,.0f} | {strict:,.0f} | {worst * 1e3:.1f} | {case} | {wrong} |")

BENCHES = {"logprobs": bench_model, "generate": bench_rollout, "grader": bench_reward}

if __name__ == "__main__":
    names = sys.argv[1:] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        sys.exit(f"bench.py: unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}")
    for name in names:
        print(f"\n## {name}\n", flush=True)
        BENCHES[name]()
