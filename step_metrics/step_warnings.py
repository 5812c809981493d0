"""The console warnings of a run's steps: every group tied (no gradient at all), a machine
oversubscribed at start or when a step is far slower than the ones before it
(docs/performance.md)."""
from __future__ import annotations

import os

import torch

from run_folder import plural, say


def zero_gradient(metrics: dict, group_size: int) -> str:
    """'' or the sentence that says why a step's policy gradient was zero (every group of
    `group_size` responses had equal rewards: its metrics.jsonl line) and what helps."""
    if metrics["adv/zero_frac"] != 1.0:
        return ""
    acc, step = metrics["reward/acc"], metrics["step"]
    no_update = " and no update was made" if metrics["updates"] == 0 else ""
    return (f"step {step}: every response was right, so the policy gradient is zero{no_update}; "
            f"use harder data"
            if acc == 1 else
            f"step {step}: in every group the {group_size} responses had equal rewards (train_acc "
            f"{acc:.2f}), so the policy gradient is zero{no_update}; use easier data, a larger "
            f"--group-size or a higher --temperature")


def oversubscribed(load: float, cores: int, threads: int, processes: int, ours: float = 0.0) -> str:
    """'' or the sentence that says the machine has fewer free cores than this run's threads want,
    and what helps.
    load: the 1-minute load average (os.getloadavg), of which `ours` is this run's own (0 before
    it computes);
    threads: torch's threads per process; processes: this run's processes on this machine.
    Oversubscribed when others + threads * processes > cores + 0.5, others = load - ours (torch's
    threads then wait for each other: a step of the CPU default took 130-180 s instead of 15 s
    beside another job), and this run has more than one thread to give up."""
    others, want = max(load - ours, 0.0), threads * processes
    if want == 1 or others + want <= cores + 0.5:  # one thread: nothing this run can lower
        return ""
    free = max(int(cores - others), 1)
    fix = (f"set OMP_NUM_THREADS={max(free // processes, 1)}" +
           (" or run fewer processes" if processes > 1 else "")
           if threads > 1 else "run fewer processes (torchrun --nproc_per_node)")
    return (f"the machine is oversubscribed: load {others:.1f} on {plural(cores, 'core')} besides "
            f"this run's {plural(threads, 'torch thread')} x {processes} "
            f"process{'es' if processes > 1 else ''}; {fix}")


def slow_step(tokens_per_s: list[float], factor: float = 3.0) -> bool:
    """Whether the last step (tokens_per_s: metrics.jsonl's, one per step of this attempt) is
    `factor` times slower than the median of the steps before it, when the step before it was not
    (so a busy spell is told once)."""
    def slow(i):
        before = sorted(tokens_per_s[:i])
        return i > 0 and tokens_per_s[i] * factor < before[len(before) // 2]
    n = len(tokens_per_s)
    return n > 0 and slow(n - 1) and not slow(n - 2)


def busy(device, rank: int, tokens_per_s: list[float]) -> None:
    """On rank 0 of a CPU run: one warning when the machine is oversubscribed (oversubscribed: the
    load against the cores and torch's threads x this machine's processes), at start (tokens_per_s
    empty) and when a step is far slower than the ones before it (slow_step)."""
    if device.type != "cpu" or rank != 0 or (tokens_per_s and not slow_step(tokens_per_s)):
        return
    threads, processes = torch.get_num_threads(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # ours: the run's own share, once running
    line = oversubscribed(os.getloadavg()[0], cores, threads, processes,
                          ours=threads * processes if tokens_per_s else 0.0)
    if line:
        say(line, warning=True)
