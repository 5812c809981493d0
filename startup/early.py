"""The process before torch loads and after the run ends (docs/training.md, Reproducibility and
Stopping): MKL's conditional numerical reproducibility, set before torch loads MKL, a stop signal
that comes while the modules load held until the run's run_folder.Preemption takes it over, and the
exit without interpreter teardown. train.py imports this first; it imports nothing of the project
and not torch."""
import os
import signal
import sys

# Without it MKL may pick, per call, a summation order that depends on memory alignment. With the
# deterministic kernels of startup.run.setup, two runs of one command (or a run and its resume)
# agree bit for bit at a fixed thread count.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def hold_signals(prog: str) -> None:
    """A stop signal that comes while the modules load (seconds on a busy machine) waits, blocked,
    until run_folder.Preemption takes it over (without this it killed the run: exit 143, no
    stopped.json); Ctrl-C leaves at once, in one line (it printed a KeyboardInterrupt
    traceback)."""
    def interrupted(signum, frame):
        print(f"{prog}: interrupted (SIGINT) before the run began: nothing was written",
              file=sys.stderr, flush=True)
        os._exit(130)

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    signal.signal(signal.SIGINT, interrupted)


def leave(code: int) -> None:
    """Exit with `code` without interpreter teardown. FSDP's DTensors keep torch's process group
    alive past destroy_process_group, and when a gloo worker thread is still releasing the last
    collective's tensors as Python finalizes, it aborts the finished run ("terminate called without
    an active exception", ~1 run in 20 on CPU)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
