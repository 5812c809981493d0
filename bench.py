"""Performance measurements, printed as markdown tables; ratios against a baseline run in the same process.

    python bench.py                 # everything (about an hour on 2 CPU cores)
    python bench.py logprobs        # chunked log-prob/entropy vs naive: memory and time at Qwen3's vocabulary
    python bench.py generate        # our sampler vs model.generate (tiny, SmolLM2), FSDP2 vs one process
    python bench.py grader          # reward.grade throughput
    python bench.py update          # token-budget vs sequence-count micro-batches; peak memory vs length vs estimate

Not part of the test suite: timings on a shared machine are noisy, so nothing here asserts a speed.

logprobs: Paper: STAPO (arXiv:2602.15620) Sec. 2 needs log pi(y_t) and the full-vocabulary entropy H_t of every response
    token; this measures what computing them costs at Qwen3's vocabulary (V = 151,936) and Qwen3-1.7B's hidden size
    (D = 2048), fp32 on CPU, forward + backward of sum_t log pi(y_t), for N = 1024, 4096, 16384 tokens.
    
    Deliberate choices:
    1. Each (implementation, N) runs in its own process and reports its peak resident memory (VmHWM) minus the
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
    inputs (refused by the size guards).
    
    Deliberate choices:
    1. One process, best of `repeats` passes per corpus (the machine is shared, so the best pass is the least noisy);
       the slowest single grade is the maximum over all passes.
    2. "strict" (the paper's string match of the last box) is timed on the same corpus as the reference point.

update: Paper: STAPO (arXiv:2602.15620) Sec. 6 trains on responses up to 15,360 tokens (veRL, dynamic batch size of 32,768
    tokens per GPU). (1) A rollout batch of 64 rows with a realistic length mix (lognormal, median ~245 response tokens,
    a tail to the cap of 1920 = 15360 / 8) through the update's forward + backward, split into 8-sequence micro-batches
    in rollout order (the former --micro-batch-size 8) or by token budget (`Rollout.micro_batches`): padding fraction,
    largest micro-batch, time per real token. (2) Peak memory of one training step vs length, with and without
    activation checkpointing, against `model.memory_estimate`.

    Deliberate choices:
    1. Scaled-down Qwen3 shapes (hidden 128, MLP 384, one 32-wide head) so that 16k-token rows run on a CPU; the
       memory model is checked on the same shapes it is later applied to at full size.
    2. Memory: each (length, checkpointing) in a fresh process, peak resident memory (VmHWM) minus the resident
       memory before the model exists, so the measurement covers every term the estimate has (fp32 parameters,
       gradients, AdamW states, activations).

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

from transformers import Qwen3Config, Qwen3ForCausalLM

import model
import reward
import train
from model import Policy, load_model, shard_policy
from rollout import Rollout, format_prompt, gathered, generate


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
    """Peak resident memory of this process image (VmHWM). Not ru_maxrss: Linux carries the parent's resident size
    at fork into a child's ru_maxrss, so a child of a large bench process reported the parent's size."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**20  # KiB -> GiB


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
_REWARD_DATA = Path(__file__).parent.parent / "shared" / "data"


def _reward_corpora():
    cases = [json.loads(line) for line in (_REWARD_DATA / "grader_cases.jsonl").read_text().splitlines() if line.strip()]
    golds = []
    for name, field in (("aime24", "answer"), ("aime25", "answer"), ("amc23", "answer"), ("math500", "answer")):
        for line in (_REWARD_DATA / "benchmarks" / f"{name}.jsonl").read_text().splitlines():
            golds.append(str(json.loads(line)[field]))
    for line in (_REWARD_DATA / "benchmarks" / "olympiadbench.jsonl").read_text().splitlines():
        golds.append(", ".join(json.loads(line)["final_answer"]))
    hostile = {"power tower": "\\boxed{9^{9^{9^{9}}}}", "100000!": "\\boxed{100000!}",
               "10,000 nested braces": "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
               "1 MB response": "x = 1 + 1. " * 100_000 + "\\boxed{5}", "unclosed boxes": "\\boxed{" * 50_000,
               "regex bait": "a" * 100_000 + "!"}
    return {
        "grader_cases": [(c["response"], c["gold"], c["id"]) for c in cases],
        "benchmark golds": [(f"So the answer is $\\boxed{{{g}}}$.", g, g[:30]) for g in golds],
        "hostile inputs": [(text, "5", name) for name, text in hostile.items()],
    }


def _reward_run(items, fn, repeats):
    best, slowest = float("inf"), (0.0, "")
    for _ in range(repeats):
        start = time.perf_counter()
        for response, gold, name in items:
            t = time.perf_counter()
            fn(response, gold)
            slowest = max(slowest, (time.perf_counter() - t, name))
        best = min(best, time.perf_counter() - start)
    return len(items) / best, slowest


def bench_reward(repeats=3):
    reward.grade("\\boxed{\\sqrt{2}}", "\\sqrt{2}+0")  # warm sympy's caches once
    print("| corpus | responses | grade /s | strict /s | slowest grade (ms) | slowest case |")
    print("|---|---|---|---|---|---|")
    for name, items in _reward_corpora().items():
        rate, (worst, case) = _reward_run(items, reward.grade, repeats)
        strict, _ = _reward_run(items, lambda r, g: reward.reward(r, g, mode="strict"), repeats)
        print(f"| {name} | {len(items)} | {rate:,.0f} | {strict:,.0f} | {worst * 1e3:.1f} | {case} |")

# ------------------------------------------------------------------------------------------------------------------
# `python bench.py update`: token-budget vs sequence-count micro-batches; peak memory vs length and the memory model
def _scaled_qwen3(layers=4, vocab=1024):
    """A scaled-down Qwen3 (hidden 128, MLP 384, one 32-wide head): the shape of the real one, CPU-sized."""
    return Qwen3Config(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=layers,
                       num_attention_heads=1, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)


QWEN3 = {  # the config.json numbers of the Qwen3 base models the paper trains (vocabulary 151,936)
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "Qwen3-14B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def _memory_worker(length, checkpointing):
    """In a fresh process: peak extra resident memory (GiB) of the fp32 model, AdamW states and one training
    forward + backward of one row of `length` tokens (64 prompt + the rest response), from before the model exists."""
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
    here = Path(__file__)
    code = (f"import sys; sys.path.insert(0, {str(here.parent)!r}); import {here.stem} as b; "
            f"b._memory_worker({length}, {checkpointing})")
    # a fixed mmap threshold: freed tensors go back to the OS at once, so the peak resident memory tracks live tensors
    # (what a GPU's max_memory_allocated counts) instead of glibc's heap, which keeps freed blocks of up to 32 MiB
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    measured = json.loads(out.stdout.strip().splitlines()[-1])["peak_gb"]
    est = model.memory_estimate(_scaled_qwen3(), tokens=length, checkpointing=checkpointing, fsdp=False,
                                compute_bytes=4)["train_peak"]
    return measured, est


def _length_mix(rows, seed=0):
    """Response lengths of a rollout batch at 1/8 of the paper's scale: most short, a long tail up to the cap
    (15360 / 8 = 1920), as math RL responses are; prompts 20-128 tokens."""
    g = torch.Generator().manual_seed(seed)
    response = (torch.randn(rows, generator=g) * 0.8 + 5.5).exp().clamp(8, 1920).long()  # median ~245
    return torch.randint(20, 129, (rows,), generator=g), response


def _mix_rollout(rows, seed=0):
    prompt_len, response_len = _length_mix(rows, seed)
    P, T = int(prompt_len.max()), int(response_len.max())
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()  # (B, P) left-padded
    response_mask = (torch.arange(T) < response_len[:, None]).long()  # (B, T)
    g = torch.Generator().manual_seed(seed)
    return Rollout(torch.randint(4, 1024, (rows, P), generator=g), prompt_mask,
                   torch.randint(4, 1024, (rows, T), generator=g), response_mask, torch.zeros(rows, T),
                   torch.zeros(rows, dtype=torch.bool))


def _update_pass(policy, batch, micro, cfg):
    """Forward + backward of every micro-batch (the update's work); returns the padded tokens fed."""
    fed, lengths = 0, batch.lengths()
    for mi in micro:
        train.policy_forward(policy, batch.select(mi), cfg, torch.device("cpu"))[0].sum().backward()
        fed += len(mi) * int(lengths[mi].max())
    return fed


def bench_update(rows=64, lengths=(2048, 4096, 8192, 16384)):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batch, cfg = _mix_rollout(rows), train.Config()
        real = int(batch.lengths().sum())
        torch.manual_seed(0)
        policy = Policy(Qwen3ForCausalLM(_scaled_qwen3(layers=2))).train()
        schemes = {"8 sequences (old --micro-batch-size 8)": list(torch.arange(rows).split(8))}
        for budget in (4096, 8192, 16384):
            schemes[f"token budget {budget}"] = batch.micro_batches(budget)
        fed = {name: _update_pass(policy, batch, micro, cfg) for name, micro in schemes.items()}
        t = _interleaved({name: (lambda m=micro: _update_pass(policy, batch, m, cfg))
                          for name, micro in schemes.items()}, reps=3)
        base = next(iter(schemes))
        median = int(batch.response_mask.sum(1).median())
        print(f"update forward + backward, {rows} rows (response lengths: median {median}, max "
              f"{batch.response_mask.shape[1]}), scaled-down Qwen3 (2 layers), fp32 CPU, 1 thread, median of 3\n")
        print("| micro-batches | count | largest (padded tokens) | batch/pad_frac | time per real token | "
              "vs 8 sequences |")
        print("|---|---|---|---|---|---|")
        for name, micro in schemes.items():
            largest = max(len(mi) * int(batch.lengths()[mi].max()) for mi in micro)
            print(f"| {name} | {len(micro)} | {largest} | {1 - real / fed[name]:.3f} | {t[name] / real * 1e6:.1f} us | "
                  f"{t[name] / t[base]:.2f}x |", flush=True)

        print("\nmodel.memory_estimate at the paper's recipe (256 prompts x G=8 per step, --rollout-chunk 8, prompt "
              "1024 + response 15360, 32768 tokens per micro-batch, bf16 compute, FSDP2), GiB per rank\n")
        print("| model | GPUs | params + grads + AdamW | activations, ckpt on (off) | training peak, ckpt on (off) | "
              "rows per generate call | KV cache | rollout peak | rollout peak, --rollout-chunk 1 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, shape in QWEN3.items():
            config = Qwen3Config(vocab_size=151_936, **shape)
            for world in (8, 64):
                rows = min(8, 256 // world) * 8
                on, off = (model.memory_estimate(config, world, rollout_rows=rows, checkpointing=c) for c in (1, 0))
                one = model.memory_estimate(config, world, rollout_rows=8)
                print(f"| {name} | {world} | {on['params'] + on['grads'] + on['adam']:.1f} | {on['activations']:.1f} "
                      f"({off['activations']:.1f}) | {on['train_peak']:.1f} ({off['train_peak']:.1f}) | {rows} | "
                      f"{on['kv_cache']:.1f} | {on['rollout_peak']:.1f} | {one['rollout_peak']:.1f} |")

        print("\npeak memory of one training step vs length (1 row; fp32 model + AdamW + forward + backward), "
              "scaled-down Qwen3 (4 layers), CPU, each in its own process; estimate: model.memory_estimate\n")
        print("| tokens | checkpointing | measured GiB | estimate GiB | estimate / measured |")
        print("|---|---|---|---|---|")
        for L in lengths:
            for checkpointing in (False, True):
                measured, est = _memory_row(L, checkpointing)
                print(f"| {L} | {'on' if checkpointing else 'off'} | {measured:.3f} | {est:.3f} | "
                      f"{est / measured:.2f} |", flush=True)
    finally:
        torch.set_num_threads(threads)


BENCHES = {"logprobs": bench_model, "generate": bench_rollout, "grader": bench_reward, "update": bench_update}

if __name__ == "__main__":
    names = sys.argv[1:] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        sys.exit(f"bench.py: unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}")
    for name in names:
        print(f"\n## {name}\n", flush=True)
        BENCHES[name]()
