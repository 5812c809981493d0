"""step_metrics/step_warnings.py: the console warnings of a run's steps: a busy machine named with
its fix, at start and when a step is far slower than the ones before it.
"""
import torch

import train
from step_metrics.step_warnings import oversubscribed, slow_step


# ==================================================================================================
# step_metrics/step_warnings.py: oversubscribed, slow_step
# ==================================================================================================
def test_busy_machine_is_named_with_its_fix(monkeypatch, capsys):
    """A machine whose load leaves fewer free cores than torch's threads x processes is named in one
    line with the fix (OMP_NUM_THREADS, or fewer processes): at start, and when a step is far slower
    than the ones before it.
    (The CPU default ran 10x slower beside another job without a word.)"""
    assert oversubscribed(0.2, 2, 2, 1) == ""  # a quiet machine
    assert oversubscribed(1.0, 2, 2, 1) == (
        "the machine is oversubscribed: load 1.0 on 2 cores besides this run's 2 torch threads x 1 "
        "process; set OMP_NUM_THREADS=1")
    assert oversubscribed(4.0, 8, 8, 1) == (
        "the machine is oversubscribed: load 4.0 on 8 cores besides this run's 8 torch threads x 1 "
        "process; set OMP_NUM_THREADS=4")
    assert oversubscribed(1.2, 2, 1, 2) == (
        "the machine is oversubscribed: load 1.2 on 2 cores besides this run's 1 torch thread x 2 "
        "processes; run fewer processes (torchrun --nproc_per_node)")
    assert oversubscribed(9.0, 16, 4, 2).endswith("; set OMP_NUM_THREADS=3 or run fewer processes")
    assert oversubscribed(3.0, 2, 1, 1) == ""  # one thread: nothing this run can lower
    assert oversubscribed(2.4, 2, 2, 1, ours=2.0) == ""  # running: its own threads are in the load
    assert oversubscribed(4.0, 2, 2, 1, ours=2.0).startswith(
        "the machine is oversubscribed: load 2.0 on 2 ")
    assert not slow_step([]) and not slow_step([100.0]) and not slow_step([100.0, 40.0])
    assert slow_step([100.0, 90.0, 20.0]) and slow_step([100.0, 20.0])
    assert not slow_step([100.0, 20.0, 20.0])  # the busy spell was told at its first slow step
    assert slow_step([100.0, 20.0, 100.0, 100.0, 20.0])  # a 2nd spell, after the machine was free
    threads = torch.get_num_threads()
    monkeypatch.setattr(train.os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    monkeypatch.setattr(train.os, "sched_getaffinity", lambda pid: {0, 1})
    try:
        torch.set_num_threads(2)
        train.busy(torch.device("cpu"), 0, [])  # at start: the load is others'
        train.busy(torch.device("cpu"), 0, [100.0, 20.0])  # slow step: 2 of the load are this run's
        train.busy(torch.device("cpu"), 0, [100.0, 90.0])  # not slow: no line
        train.busy(torch.device("cpu"), 1, [])  # rank 0 says it
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().err.splitlines() == [
        "train.py: warning: the machine is oversubscribed: load 3.0 on 2 cores besides this run's "
        "2 torch threads x 1 process; set OMP_NUM_THREADS=1",
        "train.py: warning: the machine is oversubscribed: load 1.0 on 2 cores besides this run's "
        "2 torch threads x 1 process; set OMP_NUM_THREADS=1"]
