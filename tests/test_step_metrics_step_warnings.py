"""step_metrics/step_warnings.py: the console warnings of a run's steps: a busy machine named with
its fix, at start and when a step is far slower than the ones before it; torch's threads fitted to
a busy machine unless the user chose them.
"""
import pytest
import torch

import train
from step_metrics import step_warnings
from step_metrics.step_warnings import oversubscribed, slow_step


# ==================================================================================================
# step_metrics/step_warnings.py: oversubscribed, slow_step, fit_threads
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
    monkeypatch.setattr(step_warnings, "busy_cores", lambda: 3.0)  # at start: the cores busy now
    monkeypatch.setattr(train.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's count: warned about, never changed
    try:
        torch.set_num_threads(2)
        train.busy(torch.device("cpu"), 0, [])  # at start: the load is others'
        train.busy(torch.device("cpu"), 0, [100.0, 20.0])  # slow step: 2 of the load are this run's
        train.busy(torch.device("cpu"), 0, [100.0, 90.0])  # not slow: no line
        train.busy(torch.device("cpu"), 1, [])  # rank 0 says it
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().err.splitlines() == [
        "train.py: warning: the machine is oversubscribed: load 3.0 on 2 cores besides this run's "
        "2 torch threads x 1 process; set OMP_NUM_THREADS=1",
        "train.py: warning: the last step ran 5.0x slower than the ones before it: the machine is "
        "oversubscribed: load 1.0 on 2 cores besides this run's 2 torch threads x 1 process; set "
        "OMP_NUM_THREADS=1"]


def test_busy_machine_fits_torch_threads_unless_the_user_chose_them(monkeypatch, capsys):
    """At start on a busy CPU machine train.py and eval.py lower torch's threads to the free cores
    and say so in one line (10x slower steps with 2 threads beside other work, only a warning);
    where OMP_NUM_THREADS, MKL_NUM_THREADS or torch.set_num_threads chose the count, it stays and
    the warning says what to set."""
    assert [step_warnings.fitted_threads(load, 2, 2, 1) for load in (0.0, 0.4, 0.6, 3.0)] == \
        [2, 2, 1, 1]
    assert step_warnings.fitted_threads(4.0, 16, 8, 2) == 6  # 4 + 6 x 2 <= 16 cores
    threads = torch.get_num_threads()
    monkeypatch.setattr(step_warnings, "busy_cores", lambda: 1.2)
    monkeypatch.setattr(step_warnings.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(step_warnings, "THREADS_AT_IMPORT", 2)  # torch's own count: 2
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    cpu = torch.device("cpu")
    try:
        torch.set_num_threads(2)
        step_warnings.fit_threads(cpu, 1, "eval.py")  # every rank fits, rank 0 says it
        assert torch.get_num_threads() == 1 and capsys.readouterr().err == ""
        torch.set_num_threads(2)
        train.busy(cpu, 0, [])
        assert torch.get_num_threads() == 1
        assert capsys.readouterr().err.splitlines() == [
            "train.py: note: the machine is busy (1.2 of 2 cores busy): 1 torch thread per process "
            "instead of 2; OMP_NUM_THREADS=N fixes the count (a run repeats bit for bit at one "
            "count)"]
        step_warnings.fit_threads(torch.device("cuda"), 0)  # not a CPU run: nothing
        monkeypatch.setattr(step_warnings, "busy_cores", lambda: 0.2)
        torch.set_num_threads(2)
        step_warnings.fit_threads(cpu, 0)  # an idle machine: nothing
        assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""
        monkeypatch.setattr(step_warnings, "busy_cores", lambda: 1.2)
        for chosen in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "set_num_threads"):
            with monkeypatch.context() as m:
                if chosen == "set_num_threads":
                    m.setattr(step_warnings, "THREADS_AT_IMPORT", 3)
                else:
                    m.setenv(chosen, "2")
                torch.set_num_threads(2)
                step_warnings.fit_threads(cpu, 0, "eval.py")
                assert torch.get_num_threads() == 2, chosen
                assert capsys.readouterr().err.splitlines() == [
                    "eval.py: warning: the machine is oversubscribed: load 1.2 on 2 cores besides "
                    "this run's 2 torch threads x 1 process; set OMP_NUM_THREADS=1"], chosen
    finally:
        torch.set_num_threads(threads)


def test_busy_cores_reads_the_cpu_time_of_now_not_the_lagging_load_average(tmp_path, monkeypatch):
    """/proc/stat's counters over the window: 150 busy and 50 idle ticks on a 2-CPU machine are 1.5
    cores busy, an idle window 0 however high the 1-minute load average still is (it read 1.2 a
    minute after `make run`'s set-up, and the default run took 1 thread); without /proc/stat, the
    load average."""
    stat = tmp_path / "stat"
    lines = iter(["cpu  100 0 50 1000 10 0 0 0 0 0\n", "cpu  200 0 100 1040 20 0 0 0 0 0\n"])
    stat.write_text(next(lines))
    monkeypatch.setattr(step_warnings.time, "sleep", lambda s: stat.write_text(next(lines)))
    monkeypatch.setattr(step_warnings.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(step_warnings.os, "getloadavg", lambda: (1.2, 1.2, 1.2))
    assert step_warnings.busy_cores(stat=str(stat)) == pytest.approx(1.5)
    lines = iter(["cpu  100 0 50 1000 10 0 0 0 0 0\n", "cpu  100 0 50 1200 10 0 0 0 0 0\n"])
    stat.write_text(next(lines))
    assert step_warnings.busy_cores(stat=str(stat)) == 0.0
    assert step_warnings.busy_cores(stat=str(tmp_path / "none")) == 1.2
