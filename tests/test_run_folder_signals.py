"""run_folder/signals.py: a stop signal to one rank reaches every rank through the process group's
store.
"""
import json
import os
import tempfile
from pathlib import Path

import torch.distributed as dist

import run_folder
from tests.sampler_checks import two_processes


# ==================================================================================================
# run_folder/signals.py: Preemption
# ==================================================================================================
def _signal_worker(rank: int, init_file: str, out_dir: str):
    import signal
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    with run_folder.Preemption() as preemption:
        preemption.POLL_S = 0.0  # read the store at every call (the default: at most once a second)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        first = preemption.requested()  # rank 1: posts its signal; rank 0: not posted yet or seen
        dist.barrier()
        seen = preemption.requested()
        agreed = preemption.agreed()
        Path(out_dir, f"{rank}.json").write_text(
            json.dumps([first if rank else None, seen, agreed, preemption.signal]))
    dist.destroy_process_group()
    os._exit(0)


def test_stop_signal_to_one_rank_reaches_the_other_through_the_store():
    """SIGUSR1 to rank 1 only: rank 0's `requested()` (the sampler's poll) sees it through the
    process group's store, before any collective, and both agree to stop, naming the signal."""
    with tempfile.TemporaryDirectory() as tmp:
        two_processes(_signal_worker, tmp, "2 processes hung")
        zero, one = (json.loads(Path(tmp, f"{rank}.json").read_text()) for rank in range(2))
    assert one == [True, True, True, "SIGUSR1"]
    assert zero == [None, True, True, "SIGUSR1 (to another rank)"]


def test_a_leave_that_fails_never_raises_into_the_interrupted_code(monkeypatch, capsys):
    """The second Ctrl-C's leave, or the --stop-deadline-s guard's, that raises (a folder it cannot
    read, a full disk): one line, and the process exits with its status all the same; nothing is
    raised into the code the signal interrupted (your reward function), nor does the watchdog
    thread die with the rank left running."""
    import signal

    def fails(*args):
        raise OSError(28, "No space left on device")

    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)  # the process stays: the test reads its status
    preemption = run_folder.Preemption()
    preemption.on_leave = fails
    preemption._leave(signal.SIGINT)
    preemption.leaving.release()
    preemption._exit_after(fails, run_folder.STOPPED)
    assert exits == [run_folder.INTERRUPTED, run_folder.STOPPED]
    assert capsys.readouterr().err.splitlines() == [
        "train.py: warning: leaving at once (No space left on device)"] * 2
