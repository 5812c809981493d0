"""`python -m tools.bench update`: token-budget against sequence-count micro-batches of the update
on a realistic length mix; memory.estimate.memory_estimate at the paper's recipe; peak memory of
one training step against length and the memory model (docs/memory.md)."""
import json
import os
import subprocess
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import train
from config import Config
from memory.estimate import RolloutCall, memory_estimate
from model import Policy
from rollout import Rollout
from tools.bench.gpu import QWEN3
from tools.bench.harness import ROOT, interleaved, peak_rss_gb, rss_gb

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
    base = rss_gb()
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
    print(json.dumps({"peak_gb": peak_rss_gb() - base}))


def _memory_row(length, checkpointing):
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tools.bench import update as b; "
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
        t = interleaved({name: (lambda m=micro: _update_pass(policy, batch, m, cfg))
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
