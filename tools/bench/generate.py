"""`python -m tools.bench generate`: rollout.generate against transformers' model.generate
(tokens/s on the tiny model and SmolLM2-135M-Instruct, against the machine's roofline), and the
time per decoding step under 2-process FSDP2 against one process (docs/rollouts.md)."""
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed.sharding import gathered, shard_policy
from model import Policy, load_model
from rollout import Sampling, format_prompt, generate
from tools.bench.harness import interleaved, timed

_PROBLEMS = ["What is 12*13?", "Solve x^2 = 49 for x > 0.", "How many primes are below 30?",
             "Simplify 3/9.", "What is the sum of the interior angles of a hexagon?",
             "Compute 2^10.", "Find gcd(84, 36).", "1+1"]


def chat_prompts(tokenizer, batch):
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


def _machine_limits() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, matmul FLOP/s), medians of 5, this thread
    count."""
    src = torch.randn(64 * 2**20)  # 256 MiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / statistics.median(timed(lambda: dst.copy_(src))
                                                        for _ in range(5))
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = 2 * 1024**3 / statistics.median(timed(lambda: a @ b) for _ in range(5))
    return bandwidth, flops


def _compare(name, lm, prompts, steps, temperature, top_p, reps, limits):
    batch = len(prompts)
    t = interleaved({"ours": lambda: _ours(lm, prompts, steps, temperature, top_p),
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
    prompts = chat_prompts(tokenizer, batch)
    start = time.perf_counter()
    with gathered(policy):
        enter = time.perf_counter() - start
        t = interleaved({"fsdp": lambda: _ours(policy.lm, prompts, steps, 1.0, 1.0, seed=rank),
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
        print(_compare("tiny", lm, chat_prompts(tokenizer, 8), 64, 1.0, 1.0, 7, limits), flush=True)
        print(_compare("tiny", lm, chat_prompts(tokenizer, 8), 64, 0.7, 0.9, 7, limits), flush=True)
        lm, tokenizer = load_model("smollm2")
        print(_compare("SmolLM2-135M", lm, chat_prompts(tokenizer, 8), 32, 1.0, 1.0, 5, limits),
              flush=True)
        print(_compare("SmolLM2-135M", lm, chat_prompts(tokenizer, 1), 32, 1.0, 1.0, 5, limits),
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
