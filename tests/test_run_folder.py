"""run_folder/: runs that survive a cluster (stop signals, --resume auto, other world sizes, one writer, torn logs,
verified checkpoints, exports) and the loggers.
"""
import importlib.util
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import eval as ev
import model
import run_folder
import run_folder.lock
import run_folder.logs
import train
from model import Policy, tiny_model
from rollout import Sampling, generate
from step_metrics import step_log
from tests.sampler_checks import toy_prompts, two_processes
from tests.toy_task import (
    EVEN,
    ROOT,
    md5s,
    one_line_error,
    one_thread,
    patch_toy_task,
    read_metrics,
    run_train,
    tensors_close,
    toy_args,
    toy_data,
)

# ==================================================================================================================
# run_folder/: runs that survive a cluster (stop signals, --resume auto, world sizes, one writer, logs,
# verified checkpoints, exports)
# ==================================================================================================================
_TIMES = {"time/rollout_s", "time/update_s", "tokens_per_s"}
# what 1 and 2 processes compute alike (the micro-batch layout, batch/*, is per rank; evaluations are seeded per rank)
_ANY_WORLD = ("reward/mean", "reward/acc", "response/len_mean", "loss/policy", "grad_norm", "entropy/mean",
              "s2t/candidates", "s2t/silenced", "updates")


def _same_run(a: Path, b: Path, keys: tuple[str, ...] | None = None, atol: float = 0.0) -> None:
    """Two run folders hold the same run: their metrics.jsonl lines (times aside, or only `keys`, to rel 1e-4) and,
    for every key, eval.jsonl; their exported weights (to `atol`)."""
    for name in ("metrics.jsonl",) if keys else ("metrics.jsonl", "eval.jsonl"):
        if name == "eval.jsonl" and not (a / name).exists() and not (b / name).exists():
            continue
        x, y = ([json.loads(line) for line in (f / name).read_text().splitlines()] for f in (a, b))
        assert [r["step"] for r in x] == [r["step"] for r in y], name
        for r, q in zip(x, y):
            r, q = ({k: v for k, v in d.items() if (k in keys if keys else k not in _TIMES)} for d in (r, q))
            assert {k: v for k, v in r.items() if isinstance(v, list)} == \
                {k: v for k, v in q.items() if isinstance(v, list)}, name  # eval/correct: counts, exactly
            r, q = ({k: v for k, v in d.items() if not isinstance(v, list)} for d in (r, q))
            assert r == pytest.approx(q, rel=1e-4 if keys else 1e-6, abs=1e-6 if keys else 1e-9), name
    tensors_close(load_file(a / "hf" / "model.safetensors"), load_file(b / "hf" / "model.safetensors"), atol=atol)


# the phase a signal comes in: (the call that sends it, its number, the steps of the checkpoint left, eval lines,
# where the stop line says it came)
_PHASES = {"rollout": (("rollout.PlainEngine", "sample"), 3, 1, [0], "in step 2's rollout (the step is dropped)"),
           "update": (("train", "StepLog"), 2, 2, [0], "in step 2 (its updates finished)"),  # once a step
           "eval": (("rollout.PlainEngine", "sample"), 4, 2, [0],  # --eval-every 2: eval 0, step 1, step 2, eval 2
                    "in the evaluation after 2 steps (it runs again on resume)")}


@pytest.mark.parametrize("phase", list(_PHASES))
def test_train_stop_signal_checkpoints_and_resume_auto_finishes_exactly(tmp_path, phase):
    """SIGTERM in the rollout (the step is abandoned), in the update (the step's updates finish first) or in an
    evaluation (it is dropped and run again by the resume): the run writes a checkpoint, says so in one line, writes
    stopped.json and exits with run_folder.STOPPED; the same command line (--resume auto) then finishes the run, equal
    to an uninterrupted one. (A SIGTERM killed the run at once: rc 143, nothing saved.)"""
    target, nth, kept, evals, where = _PHASES[phase]
    data = toy_data(tmp_path)
    args = toy_args(data, tmp_path / "cut", steps=3, heldout=2, eval_every=2, resume="auto")
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3, heldout=2, eval_every=2))
    proc = run_train(tmp_path, args, hook=("hook_signal_at", *target, nth), expect=run_folder.STOPPED)
    stopped = [x for x in proc.stdout.splitlines() if x.startswith("stopped by SIGTERM")]
    assert len(stopped) == 1
    assert stopped[0].startswith(f"stopped by SIGTERM {where}, {run_folder.plural(kept, 'step')} of 3 done, ")
    assert f"s after the signal: checkpoint/step_{kept} is kept" in stopped[0], proc.stdout[-2000:]
    assert json.loads((tmp_path / "cut" / "stopped.json").read_text()) == {
        "signal": "SIGTERM", "steps_done": kept, "checkpoint": f"checkpoint/step_{kept}"}
    assert [m["step"] for m in read_metrics(tmp_path / "cut")] == list(range(1, kept + 1))
    assert [json.loads(x)["step"] for x in (tmp_path / "cut" / "eval.jsonl").read_text().splitlines()] == evals
    run_train(tmp_path, args)  # the same command line
    assert not (tmp_path / "cut" / "stopped.json").exists()
    _same_run(tmp_path / "cut", tmp_path / "full")


def _command(args: list[str]) -> str:
    """The command a stop line names: the test's flags as `python train.py ...` (run_folder.continue_command)."""
    return "python " + shlex.join(["train.py", *args])


def test_train_ctrl_c_checkpoints_a_second_leaves_at_once_and_resume_auto_continues_exactly(tmp_path):
    """Ctrl-C (SIGINT) is a stop signal: in step 2's updates the run finishes them, writes a checkpoint, prints one
    line naming the command that continues and exits run_folder.STOPPED; a second Ctrl-C (here in step 2's rollout,
    after a checkpoint of step 1) leaves at once in one line, exit run_folder.INTERRUPTED, stopped.json naming
    step_1. Either way the same command with --resume auto finishes the run equal to an uninterrupted one, and
    no traceback is printed. (Ctrl-C printed 24 lines of KeyboardInterrupt, exit 130, nothing saved, and
    --resume auto started the run anew.)"""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3))
    once = toy_args(data, tmp_path / "once", steps=3, resume="auto")
    proc = run_train(tmp_path, once, hook=("hook_signal_at", "train", "StepLog", 2, "0", "SIGINT"),
                expect=run_folder.STOPPED)
    lines = [x for x in proc.stdout.splitlines() if "stopped by" in x]
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGINT in step 2 (its updates finished), 2 steps of 3 "
                                                   "done, "), proc.stdout[-2000:]
    assert lines[0].endswith(f"s after the signal: checkpoint/step_2 is kept; continue with: {_command(once)}")
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr[-2000:]
    run_train(tmp_path, once)
    _same_run(tmp_path / "once", tmp_path / "full")

    twice = toy_args(data, tmp_path / "twice", steps=3, save_every=1)  # the user's command: no --resume
    proc = run_train(tmp_path, twice, hook=("hook_signal_at", "rollout.PlainEngine", "sample", 2, "0", "SIGINT", 2),
                expect=run_folder.INTERRUPTED)
    again = twice + ["--resume", "auto"]
    assert proc.stderr.splitlines()[-1] == (f"train.py: warning: SIGINT after SIGINT: leaving without a checkpoint of "
                                            f"this stop; checkpoint/step_1 is kept; continue with: {_command(again)}")
    assert "Traceback" not in proc.stderr and "stopped by" not in proc.stdout, proc.stderr[-2000:]
    assert json.loads((tmp_path / "twice" / "stopped.json").read_text()) == {
        "signal": "SIGINT", "steps_done": 1, "checkpoint": "checkpoint/step_1"}
    run_train(tmp_path, again)
    _same_run(tmp_path / "twice", tmp_path / "full")


def test_train_ctrl_c_under_torchrun_stops_both_ranks_and_the_same_command_continues(tmp_path):
    """torchrun starts its workers in a session of their own (a terminal's Ctrl-C reaches torchrun only) and
    forwards SIGINT to each: both ranks stop at the same point with a checkpoint, rank 0 prints the one stop line,
    and the same torchrun command with --resume auto finishes the run, equal to an uninterrupted one. A second
    Ctrl-C makes torchrun send SIGTERM: a stop signal after SIGINT, which leaves at once."""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3))
    args = toy_args(data, tmp_path / "two", steps=3, resume="auto")
    proc = run_train(tmp_path, args, nproc=2, expect=None,  # torchrun exits 1 whatever its workers' status
                hook=("hook_signal_at", "train", "StepLog", 2, "0", "SIGINT", 1, True))
    lines = [x for x in proc.stdout.splitlines() if "stopped by" in x]
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGINT in step 2 (its updates finished), 2 steps of "
                                                   "3 done"), (proc.stdout[-2000:], proc.stderr[-3000:])
    assert lines[0].endswith("continue with: torchrun ... " + shlex.join(["train.py", *args]))
    assert "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "stopped.json").read_text())["checkpoint"] == "checkpoint/step_2"
    run_train(tmp_path, args, nproc=2)
    _same_run(tmp_path / "two", tmp_path / "full", keys=_ANY_WORLD, atol=1e-5)


def test_train_stop_signal_during_startup_exits_stopped_and_the_same_command_continues(tmp_path):
    """`python train.py` sent SIGTERM while its modules load (here: at `import torch`, the first heavy one): the
    signal waits for the stop handler, the run stops before its model loads, writes stopped.json and exits with
    run_folder.STOPPED; the same command line then trains. (It died at once: exit 143, no stopped.json, and a
    requeue script waiting for 75 dropped the job.)"""
    out = tmp_path / "run"
    args = ["--model", "tiny", "--data", "", "--no-chat", "--preset", "cpu", "--steps", "1", "--prompts-per-step", "2",
            "--mini-batch-prompts", "2", "--group-size", "2", "--max-response-len", "2", "--eval-samples", "0",
            "--no-plots", "--no-export-hf", "--out-dir", str(out), "--resume", "auto"]
    kill_at_torch = (  # SIGTERM to itself when train.py imports torch, then train.py as `python train.py` runs it
        "import os, runpy, signal, sys\n"
        "class Kill:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            sys.meta_path.remove(self)\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.meta_path.insert(0, Kill())\n"
        "sys.argv = ['train.py', *sys.argv[1:]]\n"
        "runpy.run_path('train.py', run_name='__main__')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", kill_at_torch, *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    assert proc.returncode == run_folder.STOPPED, (proc.returncode, proc.stderr[-2000:])
    assert json.loads((out / "stopped.json").read_text()) == {"signal": "SIGTERM", "steps_done": 0, "checkpoint": None}
    assert "stopped by SIGTERM during startup, 0 steps of 1 done" in proc.stdout, proc.stdout
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()
    proc = subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [m["step"] for m in read_metrics(out)] == [1] and not (out / "stopped.json").exists()
    # Ctrl-C while the modules load: nothing to save yet, so one line and exit at once (it printed a traceback)
    args[args.index(str(out))] = str(tmp_path / "interrupted")
    proc = subprocess.run([sys.executable, "-c", kill_at_torch.replace("SIGTERM", "SIGINT"), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == run_folder.INTERRUPTED and proc.stderr.splitlines() == [
        "train.py: interrupted (SIGINT) before the run began: nothing was written"], proc.stderr[-2000:]
    assert not (tmp_path / "interrupted").exists()


def test_train_stop_deadline_leaves_a_run_held_by_a_frozen_rank(tmp_path):
    """A stop signal whose stop cannot finish (the rank waits for a frozen one): --stop-deadline-s after the signal
    the rank leaves with a warning, stopped.json naming the last complete checkpoint and exit run_folder.STOPPED; the
    same command then finishes equal to an uninterrupted run. (Every rank waited for the collective timeout, 60
    minutes: no checkpoint, and the job's grace period ran out first.)"""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3))
    args = toy_args(data, tmp_path / "cut", steps=3, save_every=1, resume="auto", stop_deadline_s=1)
    proc = run_train(tmp_path, args, hook=("hook_signal_then_hang", 2), expect=run_folder.STOPPED)
    assert ("train.py: warning: rank 0: SIGTERM came 1 s ago (--stop-deadline-s) and the ranks have not stopped "
            "together (a rank frozen, or its network down?): leaving without a checkpoint of this stop; "
            "checkpoint/step_1 is kept") in proc.stderr, proc.stderr[-2000:]
    assert json.loads((tmp_path / "cut" / "stopped.json").read_text()) == {
        "signal": "SIGTERM", "steps_done": 1, "checkpoint": "checkpoint/step_1"}
    run_train(tmp_path, args)
    _same_run(tmp_path / "cut", tmp_path / "full")


def test_train_stop_signal_to_one_rank_stops_both_then_resume_on_other_world_sizes(tmp_path):
    """2 -> 1: SIGUSR1 to rank 1 only, in step 2's rollout: both ranks stop at the same point (rank 0 learns it through
    the process group), the checkpoint of step 1 stays; 1 process resumes it. 1 -> 2: a 1-process run stopped after
    step 1 resumes on 2 processes. Both finish equal to an uninterrupted 1-process run (--rollout-chunk 1; FSDP2 vs
    one process: float rounding), their held-out evaluations (eval.jsonl, the held-out samples.jsonl lines)
    included. (A 1-process run resumed on 2 failed: rank 1 found no rank1.pt; 3 held-out problems scored
    differently on 2 processes: each rank's call was seeded by its rank.)"""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3, heldout=3))
    two_one = toy_args(data, tmp_path / "two_one", steps=3, heldout=3, resume="auto")
    proc = run_train(tmp_path, two_one, nproc=2,
                hook=("hook_signal_at", "rollout.PlainEngine", "sample", 3, "1", "SIGUSR1"),
                expect=None)
    assert proc.returncode != 0 and ("stopped by SIGUSR1 (to another rank) in step 2's rollout (the step is "
                                      "dropped), 1 step of 3 done") in proc.stdout, proc.stderr
    assert json.loads((tmp_path / "two_one" / "stopped.json").read_text())["steps_done"] == 1
    run_train(tmp_path, two_one)
    one_two = toy_args(data, tmp_path / "one_two", steps=3, heldout=3, resume="auto")
    run_train(tmp_path, one_two, hook=("hook_signal_at", "rollout.PlainEngine", "sample", 3), expect=run_folder.STOPPED)
    run_train(tmp_path, one_two, nproc=2)
    for run in ("two_one", "one_two"):
        _same_run(tmp_path / run, tmp_path / "full", keys=_ANY_WORLD, atol=1e-5)
        logs = {name: [[json.loads(x) for x in (tmp_path / r / name).read_text().splitlines()] for r in (run, "full")]
                for name in ("eval.jsonl", "samples.jsonl")}
        assert logs["eval.jsonl"][0] == logs["eval.jsonl"][1]  # sums of counts: exact on any number of ranks
        held_out = [[s for s in lines if s["split"] == "heldout"] for lines in logs["samples.jsonl"]]
        assert held_out[0] == held_out[1] and len(held_out[0]) == 2 * 3


def test_lock_on_a_node_local_flock_mount_says_so(tmp_path, monkeypatch, capsys):
    """NFS mounted with local_lock=flock (or =all) and Lustre with localflock grant flock on every node: the lock
    warns in one line naming the mount option and what to do. (Two nodes could both hold it without a word.)"""
    mounts = (f"/dev/vda / ext4 rw,relatime 0 0\n"
              f"server:/export {tmp_path} nfs4 rw,vers=4.2,local_lock=flock,addr=10.0.0.1 0 0\n"
              f"mds@tcp:/fs {tmp_path / 'lustre'} lustre rw,localflock 0 0\n"
              f"mds@tcp:/fs2 {tmp_path / 'lustre' / 'ok'} lustre rw,flock 0 0\n"
              f"server:/b {tmp_path}/with\\040space nfs rw,local_lock=none 0 0\n")  # a space is written \040
    local = run_folder.node_local_flock
    assert local(tmp_path / "run", mounts) == "nfs4 with local_lock=flock"
    assert local(tmp_path / "lustre" / "run", mounts) == "lustre with localflock"
    assert local(tmp_path / "lustre" / "ok" / "run", mounts) is None and local(Path("/home"), mounts) is None
    assert local(tmp_path / "with space" / "run", mounts) is None
    (tmp_path / "mounts").write_text(mounts)
    monkeypatch.setattr(run_folder.lock, "MOUNTS", tmp_path / "mounts")
    run_folder.Lock(tmp_path / "run").release()
    assert capsys.readouterr().err.strip().splitlines() == [
        f"train.py: warning: {tmp_path / 'run'} is on nfs4 with local_lock=flock: its lock holds within this node only,"
        f" so a run on another node would not be detected; remount without it (NFS: local_lock=none; Lustre: -o "
        f"flock) or start one job per folder"]


def test_train_one_writer_per_folder(tmp_path, monkeypatch, capsys):
    """A second run or resume into a folder whose lock another process holds fails in one line naming the holder,
    and the folder is untouched; a lock released by its holder (or its death) does not block. Two runs started at
    once into one fresh folder: one trains, the other is refused. (Both exited 0 with metrics.jsonl steps
    [1,2,1,2,3,4,...].)"""
    patch_toy_task(monkeypatch, EVEN)
    data, run = toy_data(tmp_path), tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(data, run, steps=1, export_hf=False)) == 0
        before = md5s(run)
        held = run_folder.Lock(run)  # another writer
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "2"]) == 2
        one_line_error(capsys, f"{run} is in use by another run (host {socket.gethostname()} pid {os.getpid()} since ")
        assert md5s(run) == before
        held.release()
        assert train.main(["--resume", str(run), "--steps", "2"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_REWARD": EVEN}
    both = [subprocess.Popen([sys.executable, str(ROOT / "testdata" / "train_run.py"),
                              *toy_args(data, tmp_path / "fresh", steps=2)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in both]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    refused = next(err for rc, err in results if rc == 2)  # in use, or (if it came late) holding the run
    assert f"train.py: error: {tmp_path / 'fresh'} is in use by another run (host " in refused or (
        f"train.py: error: --out-dir {tmp_path / 'fresh'} holds a run" in refused), refused
    assert [m["step"] for m in read_metrics(tmp_path / "fresh")] == [1, 2]


def test_train_torn_log_lines_and_a_full_disk_in_a_log_write(tmp_path, monkeypatch, capsys):
    """A full disk while appending step 2's metrics line: one line (exit 2) naming the file and the kept checkpoint,
    a torn line left; the resume drops it with a warning naming the file and finishes equal to an uninterrupted run.
    A log that needs no cut is not rewritten. (It was an OSError traceback, then a JSONDecodeError naming no file.)"""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        metrics = tmp_path / "cut" / "metrics.jsonl"
        second = str(path) == str(metrics) and "a" in mode and metrics.exists()  # step 2's line
        f = real_open(path, mode, *args, **kwargs)
        if second:
            f.write(b'{"step": 2, "reward/me')  # the part that fit
            f.close()
            raise OSError(28, "No space left on device")
        return f

    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", steps=3, save_every=1, heldout=2)) == 0
        monkeypatch.setattr(run_folder.logs, "open", full_disk, raising=False)
        assert train.main(toy_args(data, tmp_path / "cut", steps=3, save_every=1, heldout=2)) == 2
        one_line_error(capsys, f"could not write {tmp_path / 'cut' / 'metrics.jsonl'} (No space left on device); "
                                f"checkpoint/step_1 is kept: python train.py --resume auto --out-dir ")
        monkeypatch.delattr(run_folder.logs, "open")
        samples, evals = ((tmp_path / "cut" / name).stat().st_ino for name in ("samples.jsonl", "eval.jsonl"))
        assert train.main(["--resume", str(tmp_path / "cut")]) == 0
    err = capsys.readouterr().err
    assert f"train.py: warning: {tmp_path / 'cut' / 'metrics.jsonl'} line 2 is torn (an interrupted write): " in err
    assert (tmp_path / "cut" / "samples.jsonl").stat().st_ino != samples  # cut: step 2's lines went
    assert (tmp_path / "cut" / "eval.jsonl").stat().st_ino == evals  # nothing to cut: not rewritten
    _same_run(tmp_path / "cut", tmp_path / "full")


def test_train_checkpoints_are_verified_and_fall_back(tmp_path, monkeypatch, capsys):
    """4 KB of zeros in a shard of the newest checkpoint: the resume names the damaged file, falls back to the older
    kept checkpoint and finishes equal to the uninterrupted run. `latest` naming a missing step: a warning and the
    newest complete one; a `latest` that is not UTF-8: a warning naming it and the newest complete one. No checkpoint
    passing its checks: one line, exit 2. (A zeroed shard resumed silently with 1,023 zero weights; a `latest` naming
    step_99 gave '--steps 6 is less than the 99 steps'; a non-UTF-8 one a line naming no file, no fallback.)"""
    patch_toy_task(monkeypatch, EVEN)
    data, run = toy_data(tmp_path), tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", steps=3)) == 0
        assert train.main(toy_args(data, run, steps=2, save_every=1, keep_checkpoints=2)) == 0
        assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["latest", "step_1", "step_2"]
        shard = max((run / "checkpoint" / "step_2").glob("*.distcp"), key=lambda p: p.stat().st_size)
        with open(shard, "r+b") as f:
            f.seek(1024)
            f.write(bytes(4096))
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "3"]) == 0
        err = capsys.readouterr().err
        assert f"{run / 'checkpoint' / 'step_2'} fails its manifest: {shard.name} (damaged)" in err, err
        assert "resuming from step_1, the newest checkpoint that passes its checks" in err
        _same_run(run, tmp_path / "full")
        (run / "checkpoint" / "latest").write_text("step_99")
        assert train.main(["--resume", str(run), "--steps", "3", "--no-export-hf"]) == 0
        assert "latest names step_99, which is missing or incomplete" in capsys.readouterr().err
        (run / "checkpoint" / "latest").write_bytes(b"step_\xff3")  # a flipped bit: named, then the manifests decide
        assert train.main(["--resume", str(run), "--steps", "3", "--no-export-hf"]) == 0
        err = capsys.readouterr().err
        assert f"{run / 'checkpoint' / 'latest'} cannot be read (not UTF-8): it names no checkpoint" in err, err
        assert "resuming from step_3, the newest" in err and (run / "checkpoint" / "latest").read_text() == "step_3"
        (run / "checkpoint" / "step_3" / ".metadata").write_bytes(b"")  # the only checkpoint left (keep 2: 2 and 3)
        shutil.rmtree(run / "checkpoint" / "step_2")
        assert train.main(["--resume", str(run), "--steps", "4"]) == 2
    one_line_error(capsys, f"{run} has no checkpoint that passes its checks")


def test_train_export_is_atomic_dated_and_eval_warns_when_stale(tmp_path, monkeypatch, capsys):
    """A failing export (a full disk) leaves the previous hf/ whole and says so in one line; `--resume auto` with
    every step done exports again (and, with the export up to date, does nothing, touching nothing); hf/export.json
    names the step it holds and its files' checksums, and eval.py --run warns when the run's checkpoint is newer and
    refuses a flipped bit in one line. (A full disk left hf/ with only its config files, or the old export beside a
    newer checkpoint without a word; a flipped bit was evaluated silently.)"""
    patch_toy_task(monkeypatch, EVEN)
    data, run = toy_data(tmp_path), tmp_path / "run"
    save = model.save_hf

    def full_disk(*args, **kwargs):
        save(*args, **kwargs)
        raise OSError(28, "No space left on device")

    umask = os.umask(0o022)
    try:
        with one_thread():
            assert train.main(toy_args(data, run, steps=1)) == 0
    finally:
        os.umask(umask)
    # every file readable by others under umask 022, as the run's other files (the weights were written 0600)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (run / "hf").iterdir()} == {
        p.name: "0o644" for p in (run / "hf").iterdir()}
    with one_thread():
        first = md5s(run / "hf")
        assert json.loads((run / "hf" / "export.json").read_text())["step"] == 1
        monkeypatch.setattr(model, "save_hf", full_disk)
        assert train.main(["--resume", str(run), "--steps", "2"]) == 2
        one_line_error(capsys, f"could not export the model to {run / 'hf'} (No space left on device); the "
                                f"checkpoint is kept")
        assert md5s(run / "hf") == first and not (run / "hf.partial").exists()
        monkeypatch.setattr(model, "save_hf", save)
        argv = toy_args(data, run, steps=2, resume="auto")
        assert train.main(argv) == 0  # nothing to train: the export
        assert json.loads((run / "hf" / "export.json").read_text())["step"] == 2
        before = md5s(run)
        capsys.readouterr()
        assert train.main(argv) == 0
        assert capsys.readouterr().out.strip().endswith(f"{run} has done its 2 steps and its export is up to date: "
                                                        f"nothing to do")
        assert md5s(run) == before
        assert train.main(["--resume", str(run), "--steps", "3", "--no-export-hf"]) == 0
    capsys.readouterr()
    cfg = ev.parse_config(["--run", str(run), "--benchmarks", "heldout"])
    assert cfg.run == str(run)
    assert ev.stale_export(run) == (f"{run / 'hf'} holds the model after 2 steps, but the run's newest checkpoint is "
                                    f"after 3 (python train.py --resume {run} --export-hf exports it)")
    files = json.loads((run / "hf" / "export.json").read_text())["files"]  # each file's size and CRC-32
    assert set(files) == {p.name for p in (run / "hf").iterdir()} - {"export.json"}
    with open(run / "hf" / "model.safetensors", "r+b") as f:  # a flipped bit past the header: a loadable model
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as e:
        ev.main(["--models", str(run / "hf"), "--data", data, "--prompt-key", "prompt", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: {run / 'hf'}: model.safetensors (damaged) differs from its "
                                         f"export.json checksums; copy or export it again (python train.py --resume "
                                         f"RUN --export-hf)"], err


def test_checkpoint_stores_a_tied_weight_once_and_restores_it(tmp_path):
    """Tied embeddings (SmolLM2's, Qwen3-1.7B's): the checkpoint holds the weight under its first name only (113 MB
    less for SmolLM2) and the load restores both names to the saved values, still one tensor; the manifest lists
    every file with its size and CRC-32."""
    lm = tiny_model()
    lm.config.tie_word_embeddings = True
    lm.tie_weights()
    policy = Policy(lm)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    saved = {k: v.clone() for k, v in policy.state_dict().items()}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trained = run_folder.ModelAndOptimizer(policy, optimizer, scheduler)
        settings = {"save_optimizer": True, "keep_checkpoints": 1}
        run_folder.save_checkpoint(tmp_path, 1, trained, settings, 0, 1)
        import torch.distributed.checkpoint as dcp
        names = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step_1")).read_metadata().state_dict_metadata
        assert "model.lm.model.embed_tokens.weight" in names and "model.lm.lm_head.weight" not in names, list(names)
        with torch.no_grad():
            for p in policy.parameters():
                p.zero_()
        done, path = run_folder.verified_checkpoint(tmp_path, 0, 1)
        assert (done, path.name) == (1, "step_1")
        run_folder.load_checkpoint(path, trained)
    finally:
        dist.destroy_process_group()
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)
    assert policy.lm.lm_head.weight is policy.lm.model.embed_tokens.weight
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(manifest) == sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert all(size == (path / n).stat().st_size for n, (size, _) in manifest.items())


def test_train_resume_checks_a_hand_edited_config(tmp_path, monkeypatch, capsys):
    """A run's config.json edited by hand: a value of the wrong type or an unknown key is one line (exit 2) naming
    the file and the key, and nothing in the run changes. (`"lr": "0.001"` resumed with a string learning rate.)"""
    patch_toy_task(monkeypatch, EVEN)
    run = tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), run, steps=1, export_hf=False)) == 0
    config = json.loads((run / "config.json").read_text())
    for edit, expected in (({"lr": "0.001"}, "'lr' must be a number, not the text '0.001'"),
                           ({"lrr": 0.1}, "unknown key 'lrr' (did you mean 'lr'?)")):
        (run / "config.json").write_text(json.dumps({**config, **edit}))
        before = md5s(run)
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "2"]) == 2
        one_line_error(capsys, f"{run / 'config.json'}: {expected}")
        assert md5s(run) == before


def test_train_entropy_change_per_kind_of_token(tmp_path, monkeypatch):
    """--entropy-change logs the mean entropy change an update made at silenced tokens, kept candidates and other
    tokens. With lr 0 the policy does not move: every change is exactly 0 (the positions before and after are the
    same); with lr 1e-2 the update moves them; without the flag the keys are absent."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    keys = [f"entropy_change/{kind}" for kind in ("silenced", "candidate", "other")]
    with one_thread():
        for lr in (0.0, 1e-2):
            assert train.main(toy_args(data, tmp_path / f"lr{lr}", steps=2, lr=lr, tau_p=0.5, entropy_change=True,
                                        export_hf=False)) == 0
        assert train.main(toy_args(data, tmp_path / "off", steps=1, export_hf=False)) == 0
    still, moved = read_metrics(tmp_path / "lr0.0"), read_metrics(tmp_path / "lr0.01")
    assert sum(m["updates"] for m in still) > 0 and sum(m["s2t/silenced"] for m in still) > 0
    assert all(m[k] == 0.0 for m in still for k in keys), still
    assert any(m["entropy_change/other"] != 0.0 for m in moved)
    assert not any(k in read_metrics(tmp_path / "off")[0] for k in keys)
    for m in still + moved:  # the kind x part split: shares of the gradient norm, tokens, entropy change
        tokens = m["response/len_mean"] * 16  # 4 prompts x G 4, each in one mini-batch
        assert sum(m[f"shares/n_{cell}"] for cell in step_log.CELLS) == pytest.approx(tokens)
        assert sum(m[f"shares/grad_{cell}"] for cell in step_log.CELLS) == pytest.approx(1.0)
    assert all(m[f"shares/dH_{cell}"] == 0.0 for m in still for cell in step_log.CELLS)
    assert any(m[f"shares/dH_{cell}"] != 0.0 for m in moved for cell in step_log.CELLS)


def test_train_sets_mkl_reproducibility_before_torch_loads():
    """train.py asks MKL for conditional numerical reproducibility before torch loads it: without it, SmolLM2's
    backward at 2 threads differed in the last bits from run to run (layers 0-20, 1e-6), so a resumed CPU run drifted
    from the uninterrupted one (`python -m tools.bench preempt`); a value the user set is kept."""
    code = "import os, sys; import train; print(os.environ['MKL_CBWR'], 'torch' in sys.modules)"
    for env, expected in (({}, "AUTO,STRICT True"), ({"MKL_CBWR": "COMPATIBLE"}, "COMPATIBLE True")):
        env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | env
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
        assert out.stdout.strip() == expected, out.stderr[-2000:]
    source = (ROOT / "train.py").read_text()
    assert source.index('os.environ.setdefault("MKL_CBWR"') < source.index("\nimport torch")


def test_rollout_stop_ends_a_call_at_the_next_check():
    """generate(stop=...): asked at every stop check (each decode step on CPU), a true answer ends the call there, so a
    stop signal during a long rollout does not wait for it; without it the same call runs to its end."""
    lm, prompts, asked = tiny_model(), toy_prompts(), []

    def stop():
        asked.append(1)
        return len(asked) >= 3

    whole = generate(lm, prompts, Sampling(30, 1.0), generator=torch.Generator().manual_seed(0))
    cut = generate(lm, prompts, Sampling(30, 1.0), generator=torch.Generator().manual_seed(0),
                   stop=stop)
    assert whole.response_ids.shape[1] > 10 and cut.response_ids.shape[1] == 3 and len(asked) == 3
    assert torch.equal(cut.response_ids, whole.response_ids[:, :3].masked_fill(cut.response_mask == 0, 0))


def _signal_worker(rank: int, init_file: str, out_dir: str):
    import signal
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    with run_folder.Preemption() as preemption:
        preemption.POLL_S = 0.0  # read the store at every call (the default reads it at most once a second)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        first = preemption.requested()  # rank 1: posts its signal; rank 0: not posted yet or seen
        dist.barrier()
        seen = preemption.requested()
        agreed = preemption.agreed()
        Path(out_dir, f"{rank}.json").write_text(json.dumps([first if rank else None, seen, agreed, preemption.signal]))
    dist.destroy_process_group()
    os._exit(0)


def test_stop_signal_to_one_rank_reaches_the_other_through_the_store():
    """SIGUSR1 to rank 1 only: rank 0's `requested()` (the sampler's poll) sees it through the process group's store,
    before any collective, and both agree to stop, naming the signal."""
    with tempfile.TemporaryDirectory() as tmp:
        two_processes(_signal_worker, tmp, "2 processes hung")
        zero, one = (json.loads(Path(tmp, f"{rank}.json").read_text()) for rank in range(2))
    assert one == [True, True, True, "SIGUSR1"]
    assert zero == [None, True, True, "SIGUSR1 (to another rank)"]


def test_train_bad_input_on_one_rank_is_one_line_naming_it(tmp_path):
    """A data error on rank 1 only (a file one node cannot read): both ranks exit 2 and rank 0 prints it once,
    naming rank 1. A step asking for more prompts than the data has is refused in one line. (Rank 1's errors were
    never printed: the user saw a gloo 'Connection reset by peer' traceback.)"""
    data = toy_data(tmp_path)
    proc = run_train(tmp_path, toy_args(data, tmp_path / "run"), nproc=2, hook=("hook_data_unreadable_on_rank_1",),
                expect=None)
    errors = [x for x in proc.stderr.splitlines() if "train.py: error:" in x]
    assert proc.returncode != 0 and errors == ["train.py: error: rank 1: toy.jsonl line 3: unreadable here"], errors
    assert not (tmp_path / "run").exists()
    proc = run_train(tmp_path, toy_args(data, tmp_path / "big", prompts_per_step=100, mini_batch_prompts=100),
                expect=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        "train.py: error: --prompts-per-step 100 is more than the 55 training problems of "
        f"{data} (a step takes each at most once): lower it")


# ---------------------------------------------------------------- the loggers (run_folder.Logger)

@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_train_logger_gets_the_metrics_keys(tmp_path, monkeypatch, name):
    """--logger receives exactly the keys of metrics.jsonl and eval.jsonl lines, at their steps."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed (optional: pip install {name})")
    patch_toy_task(monkeypatch, EVEN)
    logged = []
    if name == "wandb":
        import wandb

        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_SILENT", "true")
        log = wandb.sdk.wandb_run.Run.log
        monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log",
                            lambda self, data, step=None, **kw: (logged.append((step, dict(data))),
                                                                 log(self, data, step=step, **kw))[1])
    out = tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), out, steps=2, heldout=4, logger=name,
                                    export_hf=False)) == 0
    lines = read_metrics(out) + [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    expected = {key for line in lines for key in line if key != "step" and not isinstance(line[key], list)}
    assert "eval/correct" not in expected  # the per-problem counts stay in eval.jsonl
    if name == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
        events.Reload()
        assert set(events.Tags()["scalars"]) == expected
        logged = [(e.step, {key: e.value}) for key in expected for e in events.Scalars(key)]
    else:
        assert list((out / "wandb").glob("offline-run-*"))
    got = defaultdict(dict)
    for step, data in logged:
        got[step].update(data)
    assert {key for data in got.values() for key in data} == expected
    for line in lines:
        for key, value in line.items():
            if key != "step" and not isinstance(value, list):
                assert got[line["step"]][key] == pytest.approx(value, rel=1e-6), key


def test_train_logger_missing_package_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else find_spec(n, *a))
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", logger="tensorboard")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install tensorboard" in err[0] and not (tmp_path / "run").exists()
    assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", logger="mlflow")) == 2
    assert "unknown --logger 'mlflow'" in capsys.readouterr().err
