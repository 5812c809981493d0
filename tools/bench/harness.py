"""The benchmarks' shared harness: the repository's root, train.py's state for a benchmark that
calls `train.train_step` itself, timers (one call, alternating medians, best of n), this process's
resident memory, and another version of a source file loaded as a module (`--against FILE`)."""
import resource
import statistics
import time
from pathlib import Path

import run_folder
from config import read_inputs
from startup.run import Run, setup

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository: tools/bench/ sits in it


def train_run(cfg, device) -> Run:
    """train.py's state for `cfg` on one process (an initialized process group), without a run
    folder: what `train.main` builds before its loop, for benches that call `train.logged_step`
    themselves."""
    return setup(cfg, read_inputs(cfg, 1), 0, 1, device, None, run_folder.Preemption())


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each function, run in alternating order rep by rep (after one warm-up run
    each)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for rep in range(reps):
        for name in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
            times[name].append(timed(fns[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def best_of(fn, reps):
    """(best seconds of `reps` calls, the last output)."""
    out, best = None, float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def peak_rss_gb():
    """Peak resident memory of this process image (VmHWM). Not ru_maxrss: Linux carries the parent's
    resident size at fork into a child's ru_maxrss, so a child of a large bench process reported the
    parent's size."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith("VmHWM")) / 2**20  # KiB -> GiB


def rss_gb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def module_from_file(path: str):
    """The module of another version of a source file
    (e.g. `git show <commit>:rollout.py > /tmp/rollout_old.py`)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"against_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
