"""The console warnings of a run's steps: every group tied (no gradient at all), a machine
oversubscribed at start or when a step is far slower than the ones before it
(docs/performance.md); at start on a busy CPU machine, torch's threads lowered to the free cores
unless the user chose a count (`fit_threads`, train.py and eval.py)."""
from __future__ import annotations

import os
import sys
import time

import torch

from run_folder import plural, say

# torch's own thread count, before any caller could choose one (train.py and eval.py import this
# file before their first line runs)
THREADS_AT_IMPORT = torch.get_num_threads()


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


def fitted_threads(load: float, cores: int, threads: int, processes: int) -> int:
    """The most torch threads per process, at most `threads` and at least 1, that keep the load of
    others (`load`, before this run computes) plus this run's threads x processes within the cores
    (the bound `oversubscribed` tests)."""
    return max(1, min(threads, int((cores + 0.5 - load) // processes)))


PROC_STAT = "/proc/stat"  # Linux's CPU time counters (tests point it elsewhere: conftest.py)


def busy_cores(window: float = 0.5, stat: str = "") -> float:
    """The cores busy now: the machine's non-idle share of CPU time over `window` seconds (Linux's
    /proc/stat: user, nice, system, irq, softirq, steal against idle and iowait) x its CPUs; where
    it cannot be read, the 1-minute load average. The load average lags: a minute after `make run`'s
    own set-up ended it still read 1.2 of 2 cores, and the default run took 1 thread."""
    def times() -> tuple[int, int]:
        with open(stat or PROC_STAT) as f:
            user, nice, system, idle, iowait, irq, softirq, steal = \
                map(int, f.readline().split()[1:9])
        return user + nice + system + irq + softirq + steal, idle + iowait
    try:
        busy0, idle0 = times()
        time.sleep(window)
        busy1, idle1 = times()
    except (OSError, ValueError):
        return os.getloadavg()[0]
    total = (busy1 - busy0) + (idle1 - idle0)
    return (busy1 - busy0) / total * (os.cpu_count() or 1) if total > 0 else 0.0


def user_threads() -> bool:
    """Whether the user chose torch's thread count: OMP_NUM_THREADS or MKL_NUM_THREADS set, or
    torch.set_num_threads called before the run (a count other than torch's own)."""
    return any(os.environ.get(v, "").strip() for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")) \
        or torch.get_num_threads() != THREADS_AT_IMPORT


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def fit_threads(device, rank: int, prog: str = "train.py") -> None:
    """At start, on every rank of a CPU run: on a machine oversubscribed by other work now
    (`busy_cores`), torch's threads lowered to those that fit the free cores (`fitted_threads`),
    said in one line on rank 0;
    where the user chose the count (`user_threads`), kept, with `oversubscribed`'s warning. The
    thread count changes rounding, not the algorithm: a run repeats bit for bit at one count
    (docs/training.md, Reproducibility), which OMP_NUM_THREADS fixes."""
    if device.type != "cpu":
        return
    threads, processes = torch.get_num_threads(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    load, cores = busy_cores(), _cores()
    line = oversubscribed(load, cores, threads, processes)
    fit = fitted_threads(load, cores, threads, processes)
    if line and (user_threads() or fit >= threads):
        if rank == 0:
            print(f"{prog}: warning: {line}", file=sys.stderr, flush=True)
    elif line:
        torch.set_num_threads(fit)
        if rank == 0:
            print(f"{prog}: note: the machine is busy ({load:.1f} of {plural(cores, 'core')} "
                  f"busy): {plural(fit, 'torch thread')} per process instead of "
                  f"{threads}; OMP_NUM_THREADS=N fixes the count (a run repeats bit for bit at one "
                  f"count)", file=sys.stderr, flush=True)


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
    """A CPU run on a busy machine: at start (tokens_per_s empty) `fit_threads` (every rank); when a
    step is far slower than the ones before it (slow_step), one warning on rank 0 when the machine
    is oversubscribed (the load against the cores and torch's threads x this machine's processes),
    with how much slower."""
    if device.type != "cpu":
        return
    if not tokens_per_s:
        fit_threads(device, rank)
        return
    if rank != 0 or not slow_step(tokens_per_s):
        return
    threads, processes = torch.get_num_threads(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # ours: the run's own share, once running
    line = oversubscribed(os.getloadavg()[0], _cores(), threads, processes,
                          ours=threads * processes)
    before = sorted(tokens_per_s[:-1])
    if line:
        say(f"the last step ran {before[len(before) // 2] / tokens_per_s[-1]:.1f}x slower than the "
            f"ones before it: {line}", warning=True)
