"""`python -m tools.bench preempt`: the CPU default stopped by SIGTERM (1 process) and by SIGUSR1 to
rank 1 (2 processes, torchrun) at several moments, then rerun by the same command: seconds from the
signal to the exit, and whether the finished run equals an uninterrupted one (docs/outputs.md)."""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tools.bench.harness import ROOT

def _worker_pids(proc: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (its children), read from their environment."""
    pids = {}
    for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            pids[rank] = int(child)
    return pids


def _stopped_run(cmd: list[str], delay: float, rank: int | None, sig) -> tuple[float, str]:
    """Start `cmd`, send `sig` after `delay` seconds (to worker `rank` of torchrun, or to the
    process), wait for it to exit -> (seconds from the signal to the exit, its stop line)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    time.sleep(delay)
    os.kill(proc.pid if rank is None else _worker_pids(proc)[rank], sig)
    t0 = time.time()
    out = proc.communicate()[0]
    seconds = time.time() - t0
    return seconds, next((x for x in out.splitlines() if x.startswith("stopped by")),
                         f"exit {proc.returncode}")


def _same_metrics(a: Path, b: Path) -> bool:
    """metrics.jsonl of two runs equal to 1e-6 but for times, and the exported weights to 1e-6."""
    from safetensors.torch import load_file

    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    x, y = ([{k: v for k, v in json.loads(line).items() if k not in drop}
             for line in (f / "metrics.jsonl").read_text().splitlines()] for f in (a, b))
    same = len(x) == len(y) and all(r.keys() == q.keys()
                                    and all(math.isclose(r[k], q[k], rel_tol=1e-6, abs_tol=1e-9)
                                            for k in r) for r, q in zip(x, y))
    wa, wb = (load_file(f / "hf" / "model.safetensors") for f in (a, b))
    return same and all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-6) for k in wa)


def bench_preempt(delays=(25, 50, 75), delays_two=(60,), steps=4):
    """`python train.py --resume auto --steps 4` (the CPU default: SmolLM2-135M; 4 steps hold every
    phase a signal can hit, for less than half the time of 10) stopped by SIGTERM `delay` seconds
    after it starts, and on 2 processes (torchrun, gloo) by SIGUSR1 to rank 1 only; then the same
    command again. Per stop: where it came (the stop line), seconds from the signal to the process's
    exit (the checkpoint write included), and whether the finished run equals an uninterrupted one
    (metrics.jsonl but for times, exported weights). Deliberate: wall-clock delays, so the phase hit
    varies with the machine's speed (the tests place signals exactly; this measures the time a real
    stop takes)."""
    import signal

    work = Path(tempfile.mkdtemp(prefix="bench-preempt-"))
    train_py = str(ROOT / "train.py")
    python = [sys.executable, train_py, "--resume", "auto", "--steps", str(steps)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                train_py, "--resume", "auto", "--steps", str(steps)]
    print(f"the CPU default (`python train.py --steps {steps}`), {torch.get_num_threads()} threads "
          f"per process, load average {os.getloadavg()[0]:.1f} at the start\n")
    print("| processes | signal | sent after s | where it came | signal -> exit s | "
          "resumed run = uninterrupted |")
    print("|---|---|---|---|---|---|")
    for launcher, name, delays_, rank, sig in ((python, "1", delays, None, signal.SIGTERM),
                                               (torchrun, "2", delays_two, 1, signal.SIGUSR1)):
        full = work / f"full-{name}"
        subprocess.run(launcher + ["--out-dir", str(full)], check=True, capture_output=True)
        for delay in delays_:
            out = work / f"cut-{name}-{delay}"
            seconds, line = _stopped_run(launcher + ["--out-dir", str(out)], delay, rank, sig)
            subprocess.run(launcher + ["--out-dir", str(out)], check=True, capture_output=True)
            where = line.split(",")[0].removeprefix("stopped by ")
            print(f"| {name} | {sig.name}{' to rank 1' if rank else ''} | {delay} | {where} | "
                  f"{seconds:.1f} | {'yes' if _same_metrics(out, full) else 'NO'} |", flush=True)
    shutil.rmtree(work, ignore_errors=True)
