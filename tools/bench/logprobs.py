"""`python -m tools.bench logprobs`: model.chunked_logprobs_entropy against the naive full-logits
computation, forward + backward at Qwen3's vocabulary and Qwen3-1.7B's hidden size: peak memory
of each in its own process, and time (docs/model.md)."""
import json
import subprocess
import sys
import time

import torch

import model
from tools.bench.harness import ROOT, peak_rss_gb, rss_gb

V, D = 151_936, 2048  # Qwen3 vocabulary, Qwen3-1.7B hidden size


def _inputs(N, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).requires_grad_()  # (N, D)
    # (V, D), scaled in place: no temporary
    weight = torch.randn(V, D, generator=g).mul_(0.02).requires_grad_()
    return hidden, weight, torch.randint(V, (N,), generator=g)


def naive_logprobs(hidden, weight, targets):
    """What a first implementation writes: full (N, V) logits, log_softmax, entropy from the same
    tensor."""
    logp = (hidden @ weight.T).log_softmax(-1)  # (N, V)
    logprobs = logp.gather(1, targets[:, None]).squeeze(1)  # (N,)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # (N,)
    return logprobs, entropy


def chunked_logprobs(hidden, weight, targets, chunk_size=1024):
    return model.chunked_logprobs_entropy(hidden, weight, targets, chunk_size=chunk_size)


def _step(impl, hidden, weight, targets):
    """One forward + backward; returns seconds."""
    hidden.grad = weight.grad = None
    start = time.perf_counter()
    logprobs, _ = impl(hidden, weight, targets)
    logprobs.sum().backward()
    return time.perf_counter() - start


def _worker(name, N):
    """Run in a fresh process: peak extra memory (GiB) and time of one forward + backward."""
    hidden, weight, targets = _inputs(N)
    base = rss_gb()
    assert peak_rss_gb() < base + 0.1, \
        "making the inputs must not leave a higher peak than the inputs"
    impl = {"naive": naive_logprobs, "chunked": chunked_logprobs}[name]
    seconds = _step(impl, hidden, weight, targets)
    print(json.dumps({"peak_gb": peak_rss_gb() - base, "seconds": seconds}))


def _measure(name, N):
    """`_worker(name, N)` in a fresh Python process (imports this file as a module, whatever its
    name)."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            f"from tools.bench import logprobs as b; b._worker({name!r}, {N})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _available_gb():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20


def _same_process_times(N=1024, repeats=2):
    """Best-of-`repeats` wall time of naive, chunked with one chunk (no recomputation) and with 4
    chunks."""
    hidden, weight, targets = _inputs(N)
    impls = {"naive": naive_logprobs, "chunked": chunked_logprobs,
             "chunked x4": lambda *a: chunked_logprobs(*a, chunk_size=N // 4)}
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
