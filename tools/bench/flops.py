"""`python -m tools.bench flops`: the update of the CPU default (`train.py --preset cpu`) and of a
long-tail batch: its achieved FLOP rate against matmuls of the model's own shapes and a 2048 x 2048
matmul, by token budget; right-padded rows, packed rows and packed rows with shared prompts; freed
memory kept or glibc's malloc as it comes (each in a fresh process); and where the update's time
goes (docs/performance.md)."""
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import model
import reward
import rollout
import train
from config import parse_config
from rollout import Rollout, format_prompt
from tools.bench.harness import ROOT, best_of, interleaved, train_run

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
    seconds = best_of(one_pass, reps)[0]
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
        t = interleaved({name: (lambda f=f: [f(mb.select(mi)).sum().backward() for mi in micro])
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
assert "startup.run" not in sys.modules, "the allocator's setting goes in before setup's import"
if not {keep}:
    # glibc's malloc as it comes: setup calls allocator.keep_freed_memory, a no-op from here on
    # (set before startup/run.py's import, which takes the name from allocator)
    allocator.keep_freed_memory = lambda: None
import train
from tools.bench import flops, harness
cfg = config.parse_config(["--preset", "cpu", "--max-tokens-per-micro-batch", "{budget}",
                           "--out-dir", tempfile.mkdtemp(prefix="bench-malloc-"),
                           "--overwrite"])[0]
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
state = harness.train_run(cfg, torch.device("cpu"))
run = replace(state, engine=flops._CachedEngine(state.engine))
with mock.patch.object(reward, "reward", flops._parity):  # the times after a warm-up step
    times = [train.logged_step(run, 0)[0]["time/update_s"] for _ in range({steps} + 1)][1:]
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
    state = train_run(cfg, torch.device("cpu"))
    config = state.policy.lm.config
    square = torch.randn(2048, 2048)
    square_rate = 2 * 2048 ** 3 / best_of(lambda: square @ square, 5)[0]
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
            train.logged_step(replace(state, engine=engine), 0)
        for budget in budgets:
            run = replace(state, cfg=replace(cfg, max_tokens_per_micro_batch=budget), engine=engine)
            times = []
            with mock.patch.object(reward, "reward", parity):
                for step in range(steps):
                    metrics = train.logged_step(run, 0)[0]
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
                p = _update_profile(lambda: train.logged_step(run, 0))
            rest = p["wall"] - p["lm_head"] - p["attention"] - p["optimizer"] - p["grad_clip"]
            share = lambda x: f"{x:.2f} ({x / p['wall']:.0%})"  # noqa: E731
            print(f"| {label} | {budget} | {p['wall']:.2f} | {share(p['lm_head'])} | "
                  f"{share(p['attention'])} | {share(rest)} | {share(p['optimizer'])} | "
                  f"{share(p['grad_clip'])} | {p['host syncs']:.3f} ({p['syncs']}) |", flush=True)
    dist.destroy_process_group()
