"""Stop signals (docs/outputs.md#preemption): SIGTERM, SIGUSR1 or SIGINT on any rank makes every
rank stop at the same point, write a checkpoint and exit with status STOPPED; a second Ctrl-C leaves
at once (INTERRUPTED); the same command with --resume auto continues (docs/paper.md,
"Deliberate differences": D84)."""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from command_line.errors import one_line
from run_folder.console import plural, say
from run_folder.files import complete_steps, write_atomic

# exit status after a stop by signal, with a checkpoint written: run the same command again
# (sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry")
STOPPED = 75


# exit status after a second Ctrl-C, which leaves at once (128 + SIGINT, as a shell reports it)
INTERRUPTED = 130


# --------------------------------------------------------------------------------------- preemption
class Preemption:  # D84
    """SIGTERM, SIGUSR1 and SIGINT (SLURM sends one of the first two before it preempts or at
    --signal=USR1@SECONDS; torchrun forwards SIGINT, SIGTERM and others to its workers; Ctrl-C in a
    terminal is SIGINT) set a flag instead of killing the process; the training loop stops at its
    next agreed point (`agreed`), writes a checkpoint and exits with STOPPED. A second stop signal
    with SIGINT among the two (Ctrl-C pressed again, or torchrun's SIGTERM after its SIGINT) leaves
    at once (`on_leave`), the last complete checkpoint kept.

    Any rank may receive the signal: `requested()` (polled by the sampler at every decode step, so a
    long rollout ends early) posts it in the process group's store and reads the other ranks' posts
    from it, at most once a second; `agreed()` is an all-reduce at the points where every rank stops
    together. Installed for the duration of a `with` block (the previous handlers come back after
    it).

    A watchdog thread sees each signal through `signal.set_wakeup_fd`, which the C-level handler
    writes even while the main thread is blocked in a collective or a long kernel (where the Python
    handler cannot run): it leaves at once at a second Ctrl-C, and calls `on_deadline` when a stop
    has not ended the run `deadline_s` seconds after its signal (`arm`; a frozen rank holds every
    other one in a collective, up to --collective-timeout-min)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    KEY = "stapo/stop"
    POLL_S = 1.0

    def __init__(self):
        self.signal, self.received, self.posted, self.polled, self.previous = \
            None, None, False, 0.0, {}
        self.deadline_s, self.on_deadline, self.armed, self.done = \
            None, None, threading.Event(), threading.Event()
        self.first, self.leaving = None, threading.Lock()  # the first signal's number on this rank
        # what continues the run (main: continue_command)
        self.command = "the same command with --resume auto"
        # called with the second signal's name (main: run_folder.leave)
        self.on_leave = self._leave_before_start

    def __enter__(self) -> Preemption:
        for s in self.SIGNALS:
            self.previous[s] = signal.signal(s, self._on_signal)
        read, self.wakeup = os.pipe()
        os.set_blocking(self.wakeup, False)
        self.previous_wakeup = signal.set_wakeup_fd(self.wakeup)
        threading.Thread(target=self._watch, args=(read,), daemon=True,
                         name="stop-watchdog").start()
        # one that came during startup (train.py) is kept
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.done.set()
        self.armed.set()
        signal.set_wakeup_fd(self.previous_wakeup)
        os.close(self.wakeup)  # the watchdog reads the end of the pipe and ends

    def arm(self, deadline_s: float, on_deadline) -> None:
        """From now on, on_deadline() runs (in the watchdog thread) when a stop signal has not ended
        the `with` block within deadline_s seconds."""
        self.deadline_s, self.on_deadline = deadline_s, on_deadline
        self.armed.set()

    # seconds a rank that got a stop signal waits for the others to join it (`starting`): torchrun
    # sends SIGTERM when a worker dies and SIGKILL 30 s later
    START_WAIT_S = 10.0

    def starting(self, join, *args):
        """join(*args): the process group's start (train.py: init_distributed), which waits for
        every rank. A rank that died before it (a crash, a bad node) never joins, and torchrun then
        stops the others with SIGTERM: a stop signal during (or before) the wait leaves
        START_WAIT_S seconds after it, in one line (nothing written yet), if the wait has not
        ended; before that, all ranks alive (a preemption), the run stops as usual."""
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # counted from the wait's start at least
            self.arm(self.START_WAIT_S + (time.monotonic() - self.received if self.received
                                          else 0.0), self._leave_waiting)
        try:
            return join(*args)
        finally:  # `arm` again (--stop-deadline-s) from here on
            self.armed.clear()
            self.deadline_s = self.on_deadline = None

    def _leave_waiting(self) -> None:
        print(f"train.py: warning: {self.signal or 'a stop signal'} came while this rank waited "
              f"for the others to start, and {self.START_WAIT_S:g} s later they have not (did one "
              f"fail?): leaving; nothing was written", file=sys.stderr, flush=True)
        os._exit(STOPPED)

    def _watch(self, read: int) -> None:
        """The watchdog thread: reads each signal's byte from the wakeup pipe; after a first stop
        signal it waits for `arm` and the deadline, and leaves at once at a second one with SIGINT
        among the two."""
        started = first = None
        try:
            while True:
                # seconds to the deadline, or None: until the next signal
                wait, deadline_s, on_deadline = None, self.deadline_s, self.on_deadline
                if started is not None and not self.armed.is_set():
                    wait = 0.2  # not armed yet: look again
                elif started is not None and deadline_s and not self.done.is_set():
                    wait = started + deadline_s - time.monotonic()
                    if wait <= 0:  # the main thread, blocked in C, may not have named it yet
                        self.signal = self.signal or signal.Signals(first).name
                        self._exit_after(on_deadline, STOPPED)
                if not select.select([read], [], [], wait)[0]:
                    continue
                byte = os.read(read, 1)
                if not byte or self.done.is_set():  # __exit__ closed the pipe
                    return
                if byte[0] not in self.SIGNALS:
                    continue
                if started is None:
                    started, first = time.monotonic(), byte[0]
                elif signal.SIGINT in (first, byte[0]):
                    # the main thread may not have run yet
                    self.signal = self.signal or signal.Signals(first).name
                    self._leave(byte[0])
        finally:
            os.close(read)

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal, self.received, self.first = \
                signal.Signals(signum).name, time.monotonic(), signum
        # Ctrl-C again (a stop posted by another rank has no `first`)
        elif signal.SIGINT in (signum, self.first):
            self._leave(signum)

    def _leave(self, signum: int) -> None:
        """A second stop signal with SIGINT among the two: `on_leave` ends the process (once, from
        whichever of the main thread and the watchdog sees it first)."""
        if self.leaving.acquire(blocking=False):
            self._exit_after(lambda: self.on_leave(signal.Signals(signum).name), INTERRUPTED)

    @staticmethod
    def _exit_after(leave, status: int) -> None:
        """leave(), which ends the process; if it raises instead, one line and exit `status`: never
        an exception into the code a signal interrupted (your reward function) nor a dead
        watchdog (a rank that never leaves)."""
        try:
            leave()
        except BaseException as e:  # noqa: BLE001 - whatever it was, the process leaves
            print(f"train.py: warning: leaving at once ({one_line(e)})", file=sys.stderr,
                  flush=True)
        os._exit(status)

    @staticmethod
    def _leave_before_start(name: str) -> None:
        print(f"train.py: {name} again before the run started: leaving at once "
              f"(nothing was written)", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)

    def requested(self) -> bool:
        """Whether this rank or (read at most once per POLL_S from the store) another one received a
        stop signal."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signal is not None
        # the group's key-value store (no public accessor)
        store = dist.distributed_c10d._get_default_store()
        if self.signal and not self.posted:
            store.set(self.KEY, self.signal)
            self.posted = True
        elif not self.signal and time.monotonic() - self.polled > self.POLL_S:
            self.polled = time.monotonic()
            if store.check([self.KEY]):
                self.signal, self.received = \
                    store.get(self.KEY).decode() + " (to another rank)", time.monotonic()
        return self.signal is not None

    def agreed(self) -> bool:
        """Every rank at the same point: whether any rank was asked to stop (one all-reduce)."""
        flag = torch.tensor([self.requested()], dtype=torch.long)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        # the rank that got it posted its name before this all-reduce
        if flag.item() and self.signal is None:
            store = dist.distributed_c10d._get_default_store()
            self.signal, self.received = \
                store.get(self.KEY).decode() + " (to another rank)", time.monotonic()
        return bool(flag.item())


def write_stopped(out: Path, signal_name: str, saved: int | None) -> str | None:
    """OUT/stopped.json: the run was stopped by a signal, with the checkpoint of `saved` steps
    (None: stopped before its first step); removed when the run goes on. A requeue script tests it
    (torchrun exits 1 whatever its workers' status; `python train.py` exits with STOPPED). Returns
    None, or the warning (naming the file, why and what to do) when it cannot be written (a full
    disk): the stop goes on, and exits with its status all the same."""
    path = out / "stopped.json"
    try:
        write_atomic(path, json.dumps({
            "signal": signal_name, "steps_done": saved or 0,
            "checkpoint": f"checkpoint/step_{saved}" if saved else None}).encode())
    except OSError as e:
        return (f"could not write {path} ({e.strerror or e}): a requeue script that looks for it "
                f"misses this stop; free space on its disk, then continue as this stop says")
    return None


def stopped(out_dir: str, steps: int, rank: int, preemption: Preemption, saved: int, where: str,
            done: int | None = None) -> int:
    """OUT/stopped.json and the one line of a run of `steps` steps in `out_dir` stopped by a signal
    after `done` steps (default: `saved`), with the checkpoint of `saved` steps (0: none); returns
    STOPPED."""
    done = saved if done is None else done
    if rank == 0 and (failed := write_stopped(Path(out_dir), preemption.signal, saved or None)):
        say(failed, rank, warning=True)
    kept = (f"checkpoint/step_{saved} is kept; continue with: {preemption.command}" if saved else
            f"nothing to keep; {preemption.command} starts it again")
    say(f"stopped by {preemption.signal} {where}, {plural(done, 'step')} of {steps} done, "
        f"{time.monotonic() - preemption.received:.1f} s after the signal: {kept}", rank)
    return STOPPED


def leave(out_dir: str, rank: int, preemption: Preemption, why: str, status: int,
          every_rank: bool) -> None:
    """Leave now, without a checkpoint of this stop (the watchdog thread of `Preemption`, or its
    signal handler): stopped.json (rank 0) naming the newest complete checkpoint, one line (on every
    rank when `every_rank`, else on rank 0), exit `status`. `why` begins the line: what made the
    rank leave."""
    out, kept, failed = Path(out_dir), [], None
    try:  # a full disk, an unreadable folder: said in one line, and the rank leaves all the same
        kept = complete_steps(out)
        if rank == 0:
            failed = write_stopped(out, preemption.signal or "a stop signal",
                                   kept[0] if kept else None)
    except OSError as e:
        failed = f"could not read or write {out} ({one_line(e)})"
    then = (f"checkpoint/step_{kept[0]} is kept; continue with: {preemption.command}" if kept else
            f"no checkpoint was kept; {preemption.command} starts the run again")
    if every_rank or rank == 0:
        # below a progress bar's unfinished line
        bar = "\n" if rank == 0 and tqdm._instances else ""
        who = 'rank %d: ' % rank if every_rank else ''
        print(bar + "".join(f"train.py: warning: {who}{line}\n" for line in [failed] if line)
              + f"train.py: warning: {who}{why}: leaving without a checkpoint of this stop; {then}",
              file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def leave_at_deadline(out_dir: str, deadline_s: float, rank: int, preemption: Preemption) -> None:
    """--stop-deadline-s (deadline_s) passed since a stop signal and the ranks have not stopped
    together: leave now with exit status STOPPED, one line on every rank (the frozen one may be
    rank 0)."""
    leave(out_dir, rank, preemption, f"{preemption.signal or 'a stop signal'} came {deadline_s:g} "
          f"s ago (--stop-deadline-s) and the ranks have not stopped together (a rank frozen, or "
          f"its network down?)", STOPPED, every_rank=True)


def leave_at_interrupt(out_dir: str, rank: int, preemption: Preemption, name: str) -> None:
    """A second stop signal with Ctrl-C among the two (`Preemption`): leave at once with exit status
    INTERRUPTED, one line on rank 0 (torchrun signals every rank)."""
    leave(out_dir, rank, preemption, f"{name} after {preemption.signal}", INTERRUPTED,
          every_rank=False)
