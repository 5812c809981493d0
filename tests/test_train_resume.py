"""train.py across runs of one folder (train.py's tests, split by topic): exact resume and its
errors, a folder that holds a run, checkpoints (full disk, torn, killed mid-write, weights only),
the HF export; the run folder (run_folder/) through whole runs: stop signals, --resume auto, other
world sizes, one writer, torn logs, verified checkpoints, exports.
"""
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import config
import eval as ev
import model
import reward
import run_folder
import run_folder.files
import run_folder.logs
import train
from model import Policy
from tests.toy_task import (
    CHECKS,
    EVEN,
    ROOT,
    TOY_VOCAB,
    full_disk,
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


# ==================================================================================================
# train.py: the training loop end to end
# ==================================================================================================
def test_train_resume_is_exact(tmp_path, monkeypatch, capsys):
    """A run with the cpu preset's --save-every 0 still checkpoints its last step; resuming it says
    so, and step 3 equals the uninterrupted run's step 3. Step N is one number everywhere:
    checkpoint/step_N, metrics.jsonl, eval.jsonl ("after N steps") and the console."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", steps=3, heldout=2,
                                   export_hf=False)) == 0
        assert train.main(toy_args(data, tmp_path / "cut", steps=2, heldout=2,
                                   export_hf=False)) == 0
        first = capsys.readouterr().out
        assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_2"
        assert "held-out accuracy after 2 steps:" in first and \
            "checkpoint/step_2" in first.splitlines()[-1]
        assert train.main(["--resume", str(tmp_path / "cut"), "--steps", "3"]) == 0
    resumed = capsys.readouterr().out
    assert (f"resuming from {tmp_path / 'cut' / 'checkpoint' / 'step_2'} at step 3 "
            f"(2 steps done)") in resumed
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == [1, 2, 3]
    assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_3"
    evals = [json.loads(x)["step"]
             for x in (tmp_path / "cut" / "eval.jsonl").read_text().splitlines()]
    assert evals == [0, 2, 3] and "held-out accuracy after 3 steps:" in resumed
    # the whole run
    assert f"stapo silenced {sum(int(m['s2t/silenced']) for m in cut)} tokens in " in resumed
    assert " of 3 steps, of " in resumed and "(tokens of correct answers with p < tau_p)" in resumed
    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    assert {k: v for k, v in cut[2].items() if k not in drop} == pytest.approx(
        {k: v for k, v in full[2].items() if k not in drop}, rel=1e-6, abs=1e-9)


def test_train_resume_errors_are_one_line(tmp_path, monkeypatch, capsys):
    patch_toy_task(monkeypatch, EVEN)
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", steps=2,
                                   export_hf=False)) == 0
    capsys.readouterr()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert train.main(["--resume", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"train.py: error: --steps 1 is less than the 2 steps {tmp_path / 'run'} has done")
    shutil.rmtree(tmp_path / "run" / "checkpoint")  # a run that stopped before its first checkpoint
    assert train.main(["--resume", str(tmp_path / "run"), "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and \
        err[0].startswith(f"train.py: error: {tmp_path / 'run'} has no checkpoint"), err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # nothing rewritten


def _same_steps(a: list[dict], b: list[dict]) -> None:
    """Two runs' metrics.jsonl lines agree, times aside."""
    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k not in drop} == pytest.approx(
            {k: v for k, v in y.items() if k not in drop}, rel=1e-6, abs=1e-9)


def test_train_a_run_failed_before_its_first_checkpoint_names_the_next_step(
        tmp_path, monkeypatch, capsys):
    """A first run that fails before its first checkpoint: rerunning its command says how to start
    it again (that command with --resume auto, or --overwrite), --resume RUN (no recipe given) names
    its config.json with --resume auto, and both commands train. (Rerunning said
    "continue it with --resume", and --resume then "has no checkpoint to resume from" with no next
    step.)"""
    patch_toy_task(monkeypatch, EVEN)
    data, run = toy_data(tmp_path), tmp_path / "run"
    setup = train.setup
    monkeypatch.setattr(train, "setup",
                        lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    args = toy_args(data, run, steps=1, export_hf=False)
    assert train.main(args) == 2 and (run / "config.json").is_file() and \
        not (run / "checkpoint").exists()
    capsys.readouterr()
    monkeypatch.setattr(train, "setup", setup)
    again = f"python train.py --config {run / 'config.json'} --resume auto"
    assert train.main(args) == 2
    one_line_error(capsys, f"--out-dir {run} holds a run that stopped before its first checkpoint "
                           f"(config.json): start it again with python "
                           f"{shlex.join(['train.py', *args, '--resume', 'auto'])}, choose another "
                           f"--out-dir, or replace it with --overwrite")
    assert train.main(["--resume", str(run)]) == 2
    one_line_error(capsys, f"{run} has no checkpoint to resume from: the run stopped before its "
                           f"first one (written every --save-every steps, at a stop by signal and "
                           f"at the last step); start it again with {again} (or replace it with "
                           f"--overwrite)")
    with one_thread():
        assert train.main(again.split()[2:]) == 0
        assert [m["step"] for m in read_metrics(run)] == [1]
        shutil.rmtree(run / "checkpoint")
        # the user's own command, as the refusal named it
        assert train.main(args + ["--resume", "auto"]) == 0
    assert [m["step"] for m in read_metrics(run)] == [1]


def test_read_only_run_folder(tmp_path, monkeypatch, capsys):
    """A finished run on a read-only mount: --resume has nothing to do (exit 0); eval.py --run and
    --plot refuse in one line before they sample or draw anything. (eval.py sampled, then lost its
    results in a traceback writing RUN/eval; --plot the same; --resume said exit 2.)"""
    patch_toy_task(monkeypatch, EVEN)
    run = tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), run, steps=1, plots=False)) == 0
    probe = tempfile.TemporaryFile

    # as a read-only mount answers (root writes into a chmod 555 folder)
    def read_only(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).is_relative_to(run):
            raise OSError(30, "Read-only file system")
        return probe(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    capsys.readouterr()
    assert train.main(["--resume", str(run)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{run} has done its 1 step and its export is "
                                                    f"up to date: nothing to do")
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as e:
        ev.main(["--run", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: --out {run / 'eval' / 'step_1'} cannot "
                                         f"be written: Read-only file system; write the results "
                                         f"elsewhere with --out DIR"], err
    with pytest.raises(SystemExit) as e:
        train.main(["--plot", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"train.py: error: --plot {run} cannot be written: "
                                         f"Read-only file system; write the figures elsewhere with "
                                         f"--out PNG"], err
    assert not (run / "metrics.png").exists() and not (run / "eval").exists()


def test_train_refuses_a_folder_that_holds_a_run(tmp_path, monkeypatch, capsys):
    """A new run in a folder that holds one is refused in one line (every file of the old run
    unchanged) unless --overwrite, which replaces it. (A 2-step run into a 4-step run's folder cut
    metrics.jsonl to 2 lines and deleted checkpoint/step_4, exit 0.)"""
    patch_toy_task(monkeypatch, EVEN)
    data, run = toy_data(tmp_path), tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(data, run, steps=2)) == 0
        before = md5s(run)
        capsys.readouterr()
        assert train.main(toy_args(data, run, steps=1)) == 2
        one_line_error(capsys, f"--out-dir {run} holds a run (config.json, metrics.jsonl")
        assert md5s(run) == before and "checkpoint/step_2/state.pt" in before
        assert train.main(toy_args(data, run, steps=1, overwrite=True)) == 0
    assert len(read_metrics(run)) == 1
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["latest", "step_1"]
    assert train.main(["--resume", str(run), "--overwrite"]) == 2
    one_line_error(capsys, "cannot be combined with --resume")
    # the input first, then the folder
    assert train.main(toy_args(str(tmp_path / "nope.jsonl"), run, steps=1)) == 2
    one_line_error(capsys, f"data file not found: {tmp_path / 'nope.jsonl'}")


def test_train_resume_keeps_the_recipe_and_records_what_changed(tmp_path, monkeypatch, capsys):
    """--resume with a flag that changes the recipe (--lr, --algo) is refused in one line and leaves
    the run as it was; flags that only change length, evaluation, logging or memory are applied and
    recorded in resumes.jsonl. (config.json recorded --lr 0.5 while the scheduler kept the old rate;
    --algo justrl relabelled a STAPO run.)"""
    patch_toy_task(monkeypatch, EVEN)
    run = tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), run, steps=2, heldout=2,
                                   export_hf=False)) == 0
        before = md5s(run)
        capsys.readouterr()
        for flags, expected in ((["--lr", "0.5"], "--lr 0.5 differs from the resumed run's 0.001"),
                                (["--algo", "justrl"],
                                 "--algo 'justrl' differs from the resumed run's 'stapo'"),
                                (["--out-dir", str(tmp_path / "elsewhere")], "cannot move it")):
            assert train.main(["--resume", str(run), "--steps", "3", *flags]) == 2
            one_line_error(capsys, expected)
            assert md5s(run) == before
        assert train.main(["--resume", str(run), "--steps", "3", "--eval-every", "1",
                           "--samples-per-step", "1", "--max-tokens-per-micro-batch", "5"]) == 0
    assert [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()] == [
        {"step": 2, "changed": {"steps": [2, 3], "max_tokens_per_micro_batch": [20, 5],
                                "eval_every": [0, 1], "samples_per_step": [4, 1]},
         "code": run_folder.code_version()}]
    assert json.loads((run / "config.json").read_text())["steps"] == 3 and \
        len(read_metrics(run)) == 3


def test_train_config_records_what_the_run_used_and_resumes(tmp_path, monkeypatch):
    """config.json records the held-out rows a run evaluated: the built-in task's 20 (it said 0),
    a tenth of --data's rows as their count (it said null); a built-in-task run records none of
    the fields only --data reads, and both the code that ran ("code": commit, dirty). Both resume,
    and so do runs whose config.json was written before
    (0 or null, those fields): the same held-out rows, nothing refused."""
    monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo":
                        1.0 if CHECKS[EVEN](response, gold) else -1.0)  # the full tiny model
    builtin, data = tmp_path / "builtin", tmp_path / "data"
    unused = {"prompt_key": "prompt", "answer_key": "answer", "split": "train"}
    with one_thread():
        for run, rows in ((builtin, ""), (data, toy_data(tmp_path))):
            args = toy_args(rows, run, steps=1, eval_samples=1, export_hf=False)
            at = args.index("--heldout")  # the default
            assert train.main(args[:at] + args[at + 2:]) == 0
        recorded = {run: json.loads((run / "config.json").read_text()) for run in (builtin, data)}
        assert recorded[builtin]["heldout"] == 20 and not set(unused) & set(recorded[builtin])
        assert recorded[data]["heldout"] == 5 and recorded[data]["answer_key"] == "answer"
        # the code that ran: this checkout's commit, whether it had changes (null without git)
        assert recorded[builtin]["code"] == recorded[data]["code"] == run_folder.code_version()
        for run in (builtin, data):
            assert train.main(["--resume", str(run), "--steps", "2"]) == 0
        # as config.json was written before it recorded the count
        (builtin / "config.json").write_text(json.dumps({**recorded[builtin], **unused,
                                                         "heldout": 0, "steps": 2}))
        (data / "config.json").write_text(json.dumps({**recorded[data], "heldout": None,
                                                      "steps": 2}))
        for run in (builtin, data):
            assert train.main(["--resume", str(run), "--steps", "3"]) == 0
            assert json.loads((run / "config.json").read_text()) == {**recorded[run], "steps": 3}
            assert [json.loads(x)["changed"] for x in (run / "resumes.jsonl").read_text()
                    .splitlines()] == [{"steps": [1, 2]}, {"steps": [2, 3]}]
            evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
            assert [e["eval/n"] for e in evals] == [recorded[run]["heldout"]] * 4


def test_train_full_disk_in_a_checkpoint_keeps_the_last_one(tmp_path, monkeypatch, capsys):
    """A checkpoint write that fails (a full disk: torch.save's 'unexpected pos') stops the run in
    one line, exit 2; the half-written folder is removed, `latest` still names the previous
    checkpoint, and resuming from it reproduces the uninterrupted run."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if "step_2" in str(path):  # the second checkpoint
            raise RuntimeError("[enforce fail at inline_container.cc:672] . "
                               "unexpected pos 704 vs 598")
        return save(obj, path, *args, **kwargs)

    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", steps=3, export_hf=False)) == 0
        monkeypatch.setattr(train.torch, "save", full_disk)
        assert train.main(toy_args(data, tmp_path / "cut", steps=3, save_every=1,
                                   export_hf=False)) == 2
        one_line_error(capsys, f"could not write {tmp_path / 'cut' / 'checkpoint' / 'step_2'} "
                               f"(a full disk?): [enforce fail at inline_container.cc:672] . "
                               f"unexpected pos 704 vs 598; ")
        assert sorted(p.name for p in (tmp_path / "cut" / "checkpoint").iterdir()) == \
            ["latest", "step_1"]
        assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_1"
        monkeypatch.setattr(train.torch, "save", save)
        assert train.main(["--resume", str(tmp_path / "cut")]) == 0
    _same_steps(read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "full"))


def test_train_full_disk_in_a_checkpoint_shard_is_one_line_even_in_a_stop(
        tmp_path, monkeypatch, capsys):
    """A full disk inside the DCP shard write of step_2 (DCP raises a CheckpointException, a
    BaseException): one line naming the folder, the disk error and the kept checkpoint, exit 2, no
    step_2/ left. The same during a stop (a SIGTERM in step 2's update): a warning, stopped.json
    naming step_1, exit run_folder.STOPPED, and the same command line continues. (A 20-line
    traceback, exit 1, a half-written step_2/; during a stop also no stopped.json.)"""
    import torch.distributed.checkpoint.filesystem as dcp_files
    patch_toy_task(monkeypatch, EVEN)
    data, write_item = toy_data(tmp_path), dcp_files._write_item

    def full_disk(transforms, stream, *args, **kwargs):
        if "step_2" in str(getattr(stream, "name", "")):
            stream.write(b"\0" * 100)  # the part that fit
            raise OSError(28, "No space left on device")
        return write_item(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(dcp_files, "_write_item", full_disk)
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "cut", steps=3, save_every=1,
                                   export_hf=False)) == 2
        one_line_error(capsys, f"train.py: error: could not write "
                               f"{tmp_path / 'cut' / 'checkpoint' / 'step_2'} (a full disk?): "
                               f"No space left on device; checkpoint/step_1 is kept: python "
                               f"train.py --resume auto --out-dir {tmp_path / 'cut'} continues")
        assert sorted(p.name for p in (tmp_path / "cut" / "checkpoint").iterdir()) == \
            ["latest", "step_1"]
        step_log, made = train.old_policy_stats, []

        def signal_in_step_2(*args):
            made.append(1)
            if len(made) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return step_log(*args)

        monkeypatch.setattr(train, "old_policy_stats", signal_in_step_2)
        args = toy_args(data, tmp_path / "stop", steps=3, save_every=1, export_hf=False,
                        resume="auto")
        assert train.main(args) == run_folder.STOPPED
        out, err = capsys.readouterr()
        assert (f"train.py: warning: could not write {tmp_path / 'stop' / 'checkpoint' / 'step_2'} "
                f"(a full disk?): No space left on device; checkpoint/step_1 is kept") in err and \
            "Traceback" not in err, err
        assert "stopped by SIGTERM in step 2 (its updates finished), 2 steps of 3 done" in out, out
        assert json.loads((tmp_path / "stop" / "stopped.json").read_text())["checkpoint"] == \
            "checkpoint/step_1"
        assert sorted(p.name for p in (tmp_path / "stop" / "checkpoint").iterdir()) == \
            ["latest", "step_1"]
        monkeypatch.setattr(dcp_files, "_write_item", write_item)
        monkeypatch.setattr(train, "old_policy_stats", step_log)
        assert train.main(args) == 0
    assert [m["step"] for m in read_metrics(tmp_path / "stop")] == [1, 2, 3]


def test_train_stop_on_a_full_disk_still_exits_stopped_naming_the_kept_checkpoint(
        tmp_path, monkeypatch, capsys):
    """Ctrl-C in step 2, right after the checkpoint of step 1, with the disk full from then on: the
    stop's checkpoint and stopped.json cannot be written; each is one warning naming its file, and
    the run still exits run_folder.STOPPED naming checkpoint/step_1; with space again the same
    command finishes. (stopped.json's write raised: exit 2, no stopped.json, so a requeue script
    that tests it or exit 75 dropped the job.)"""
    patch_toy_task(monkeypatch, EVEN)
    data, full, made = toy_data(tmp_path), [], []
    monkeypatch.setattr(run_folder.files, "open", full_disk(open, when=lambda: full),
                        raising=False)
    step_stats = train.old_policy_stats

    def signal_in_step_2(*args):
        made.append(1)
        if len(made) == 2:
            full.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return step_stats(*args)

    monkeypatch.setattr(train, "old_policy_stats", signal_in_step_2)
    args = toy_args(data, tmp_path / "run", steps=3, save_every=1, export_hf=False,
                    resume="auto")
    with one_thread():
        assert train.main(args) == run_folder.STOPPED
    out, err = capsys.readouterr()
    assert (f"train.py: warning: could not write {tmp_path / 'run' / 'stopped.json'} (No space "
            f"left on device): a requeue script that looks for it misses this stop; free space on "
            f"its disk") in err and "Traceback" not in err and "error" not in err, err
    assert (f"train.py: warning: could not write {tmp_path / 'run' / 'checkpoint' / 'step_2'} "
            f"(a full disk?)") in err, err
    assert "stopped by SIGINT in step 2 (its updates finished), 2 steps of 3 done" in out and \
        "checkpoint/step_1 is kept; continue with: " in out, out
    assert not (tmp_path / "run" / "stopped.json").exists() and \
        not list((tmp_path / "run").glob("*.tmp-*"))
    full.clear()
    monkeypatch.setattr(train, "old_policy_stats", step_stats)
    with one_thread():
        assert train.main(args) == 0
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_train_torn_latest_falls_back_to_the_newest_complete_checkpoint(
        tmp_path, monkeypatch, capsys):
    """checkpoint/latest torn (an older version wrote it in place): the resume warns and uses the
    newest complete step_N folder. (It was 'invalid literal for int()'.)"""
    patch_toy_task(monkeypatch, EVEN)
    run = tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), run, steps=2, export_hf=False)) == 0
        (run / "checkpoint" / "step_3").mkdir()  # an incomplete folder: no .metadata
        (run / "checkpoint" / "latest").write_text("ste")
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert (f"train.py: warning: {run / 'checkpoint' / 'latest'} names ste, which is missing or "
            f"incomplete") in err
    assert ("train.py: warning: resuming from step_2, the newest checkpoint that passes its "
            "checks") in err
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    assert (run / "checkpoint" / "latest").read_text() == "step_3"


def test_train_killed_inside_a_checkpoint_write_resumes_exactly(tmp_path):
    """A training process killed after writing a checkpoint's shards but before `latest` names it:
    the folder still resumes from the previous checkpoint, and the resumed run equals the
    uninterrupted one."""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3, export_hf=False))
    run_train(tmp_path, toy_args(data, tmp_path / "cut", steps=3, save_every=1, export_hf=False),
         hook=("hook_kill_in_the_second_checkpoint",), expect=9)
    assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_1"
    # written, never named
    assert (tmp_path / "cut" / "checkpoint" / "step_2" / ".metadata").is_file()
    run_train(tmp_path, ["--resume", str(tmp_path / "cut")])
    _same_steps(read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "full"))


def test_train_weights_only_checkpoint(tmp_path, monkeypatch, capsys):
    """--no-save-optimizer: the checkpoint holds no AdamW moments (about 1/3 of the size); a resume
    warns that AdamW restarts and trains on."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)

    def size(run):
        return sum(f.stat().st_size for f in (tmp_path / run / "checkpoint").rglob("*")
                   if f.is_file())

    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", export_hf=False)) == 0
        assert train.main(toy_args(data, tmp_path / "weights", export_hf=False,
                                   save_optimizer=False)) == 0
        assert size("weights") < 0.5 * size("full"), (size("weights"), size("full"))
        capsys.readouterr()
        assert train.main(["--resume", str(tmp_path / "weights"), "--steps", "2"]) == 0
    assert "holds weights only (--no-save-optimizer): AdamW restarts from zero moments" in \
        capsys.readouterr().err
    assert [m["step"] for m in read_metrics(tmp_path / "weights")] == [1, 2]


def test_train_hf_export_reproduces_logprobs(tmp_path, monkeypatch):
    patch_toy_task(monkeypatch, EVEN)
    cfg, _, _ = config.parse_config(toy_args(toy_data(tmp_path), tmp_path / "run", steps=1))
    rank, world, device = train.init_distributed()
    try:
        # main's steps, keeping the run's policy
        with one_thread(), run_folder.Preemption() as preemption:
            rows = config.read_inputs(cfg, world)
            _, _, lock = run_folder.open_run(asdict(cfg), None, rank, world, "")
            run = train.setup(cfg, rows, rank, world, device, None, preemption)
            assert train.train(run) == 0
            lock.release()
    finally:
        dist.destroy_process_group()
    policy = run.policy
    exported = Policy(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")).eval()
    input_ids = torch.randint(4, TOY_VOCAB, (3, 9))
    attention_mask = torch.ones_like(input_ids)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    with torch.no_grad():
        expected = policy.eval()(input_ids, attention_mask, response_mask)[0]
        got = exported(input_ids, attention_mask, response_mask)[0]
    assert read_metrics(tmp_path / "run")[0]["updates"] >= 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# ==================================================================================================
# run_folder/ through train.py: runs that survive a cluster (stop signals, --resume auto, world
# sizes, one writer, logs, verified checkpoints, exports)
# ==================================================================================================
_TIMES = {"time/rollout_s", "time/update_s", "tokens_per_s"}
# what 1 and 2 processes compute alike (the micro-batch layout, batch/*, is per rank; evaluations
# are seeded per rank)
_ANY_WORLD = ("reward/mean", "reward/acc", "response/len_mean", "loss/policy", "grad_norm",
              "entropy/mean", "s2t/candidates", "s2t/silenced", "updates")


def _same_run(a: Path, b: Path, keys: tuple[str, ...] | None = None, atol: float = 0.0) -> None:
    """Two run folders hold the same run: their metrics.jsonl lines (times aside, or only `keys`, to
    rel 1e-4) and, for every key, eval.jsonl; their exported weights (to `atol`)."""
    for name in ("metrics.jsonl",) if keys else ("metrics.jsonl", "eval.jsonl"):
        if name == "eval.jsonl" and not (a / name).exists() and not (b / name).exists():
            continue
        x, y = ([json.loads(line) for line in (f / name).read_text().splitlines()] for f in (a, b))
        assert [r["step"] for r in x] == [r["step"] for r in y], name
        for r, q in zip(x, y):
            r, q = ({k: v for k, v in d.items() if (k in keys if keys else k not in _TIMES)}
                    for d in (r, q))
            # eval/correct: counts, exactly
            assert {k: v for k, v in r.items() if isinstance(v, list)} == \
                {k: v for k, v in q.items() if isinstance(v, list)}, name
            r, q = ({k: v for k, v in d.items() if not isinstance(v, list)} for d in (r, q))
            assert r == pytest.approx(q, rel=1e-4 if keys else 1e-6,
                                      abs=1e-6 if keys else 1e-9), name
    tensors_close(load_file(a / "hf" / "model.safetensors"),
                  load_file(b / "hf" / "model.safetensors"), atol=atol)


_PLAIN = "engines.plain_engine.PlainEngine"  # its sample: a rollout or an evaluation
# the phase a signal comes in: (the call that sends it, its number, the steps of the checkpoint
# left, eval lines, where the stop line says it came)
_PHASES = {"rollout": ((_PLAIN, "sample"), 3, 1, [0],
                       "in step 2's rollout (the step is dropped)"),
           "update": (("train", "old_policy_stats"), 2, 2, [0],  # once a step
                      "in step 2 (its updates finished)"),
           # --eval-every 2: eval 0, step 1, step 2, eval 2
           "eval": ((_PLAIN, "sample"), 4, 2, [0],
                    "in the evaluation after 2 steps (it runs again on resume)")}


@pytest.mark.parametrize("phase", list(_PHASES))
def test_train_stop_signal_checkpoints_and_resume_auto_finishes_exactly(tmp_path, phase):
    """SIGTERM in the rollout (the step is abandoned), in the update (the step's updates finish
    first) or in an evaluation (it is dropped and run again by the resume): the run writes a
    checkpoint, says so in one line, writes stopped.json and exits with run_folder.STOPPED; the same
    command line (--resume auto) then finishes the run, equal to an uninterrupted one. (A SIGTERM
    killed the run at once: rc 143, nothing saved.)"""
    target, nth, kept, evals, where = _PHASES[phase]
    data = toy_data(tmp_path)
    args = toy_args(data, tmp_path / "cut", steps=3, heldout=2, eval_every=2, resume="auto")
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3, heldout=2, eval_every=2))
    proc = run_train(tmp_path, args, hook=("hook_signal_at", *target, nth),
                     expect=run_folder.STOPPED)
    stopped = [x for x in proc.stdout.splitlines() if x.startswith("stopped by SIGTERM")]
    assert len(stopped) == 1
    assert stopped[0].startswith(f"stopped by SIGTERM {where}, "
                                 f"{run_folder.plural(kept, 'step')} of 3 done, ")
    assert f"s after the signal: checkpoint/step_{kept} is kept" in stopped[0], proc.stdout[-2000:]
    assert json.loads((tmp_path / "cut" / "stopped.json").read_text()) == {
        "signal": "SIGTERM", "steps_done": kept, "checkpoint": f"checkpoint/step_{kept}"}
    assert [m["step"] for m in read_metrics(tmp_path / "cut")] == list(range(1, kept + 1))
    assert [json.loads(x)["step"]
            for x in (tmp_path / "cut" / "eval.jsonl").read_text().splitlines()] == evals
    run_train(tmp_path, args)  # the same command line
    assert not (tmp_path / "cut" / "stopped.json").exists()
    _same_run(tmp_path / "cut", tmp_path / "full")


def _command(args: list[str]) -> str:
    """The command a stop line names: the test's flags as `python train.py ...`
    (run_folder.continue_command)."""
    return "python " + shlex.join(["train.py", *args])


def test_train_ctrl_c_checkpoints_a_second_leaves_at_once_and_resume_auto_continues_exactly(
        tmp_path):
    """Ctrl-C (SIGINT) is a stop signal: in step 2's updates the run finishes them, writes a
    checkpoint, prints one line naming the command that continues and exits run_folder.STOPPED; a
    second Ctrl-C (here in step 2's rollout, after a checkpoint of step 1) leaves at once in one
    line, exit run_folder.INTERRUPTED, stopped.json naming step_1. Either way the same command with
    --resume auto finishes the run equal to an uninterrupted one, and no traceback is printed.
    (Ctrl-C printed 24 lines of KeyboardInterrupt, exit 130, nothing saved, and --resume auto
    started the run anew.)"""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3))
    once = toy_args(data, tmp_path / "once", steps=3, resume="auto")
    proc = run_train(tmp_path, once,
                     hook=("hook_signal_at", "train", "old_policy_stats", 2, "0", "SIGINT"),
                     expect=run_folder.STOPPED)
    lines = [x for x in proc.stdout.splitlines() if "stopped by" in x]
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGINT in step 2 (its updates "
                                                   "finished), 2 steps of 3 done, "), \
        proc.stdout[-2000:]
    assert lines[0].endswith(f"s after the signal: checkpoint/step_2 is kept; continue with: "
                             f"{_command(once)}")
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, \
        proc.stderr[-2000:]
    run_train(tmp_path, once)
    _same_run(tmp_path / "once", tmp_path / "full")

    # the user's command: no --resume
    twice = toy_args(data, tmp_path / "twice", steps=3, save_every=1)
    proc = run_train(tmp_path, twice,
                     hook=("hook_signal_at", _PLAIN, "sample", 2, "0", "SIGINT", 2),
                     expect=run_folder.INTERRUPTED)
    again = twice + ["--resume", "auto"]
    assert proc.stderr.splitlines()[-1] == (f"train.py: warning: SIGINT after SIGINT: leaving "
                                            f"without a checkpoint of this stop; checkpoint/step_1 "
                                            f"is kept; continue with: {_command(again)}")
    assert "Traceback" not in proc.stderr and "stopped by" not in proc.stdout, proc.stderr[-2000:]
    assert json.loads((tmp_path / "twice" / "stopped.json").read_text()) == {
        "signal": "SIGINT", "steps_done": 1, "checkpoint": "checkpoint/step_1"}
    run_train(tmp_path, again)
    _same_run(tmp_path / "twice", tmp_path / "full")


def test_train_ctrl_c_under_torchrun_stops_both_ranks_and_the_same_command_continues(tmp_path):
    """torchrun starts its workers in a session of their own (a terminal's Ctrl-C reaches torchrun
    only) and forwards SIGINT to each: both ranks stop at the same point with a checkpoint, rank 0
    prints the one stop line, and the same torchrun command with --resume auto finishes the run,
    equal to an uninterrupted one. A second Ctrl-C makes torchrun send SIGTERM: a stop signal after
    SIGINT, which leaves at once."""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3))
    args = toy_args(data, tmp_path / "two", steps=3, resume="auto")
    # torchrun exits 1 whatever its workers' status
    proc = run_train(tmp_path, args, nproc=2, expect=None,
                     hook=("hook_signal_at", "train", "old_policy_stats", 2, "0", "SIGINT", 1,
                           True))
    lines = [x for x in proc.stdout.splitlines() if "stopped by" in x]
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGINT in step 2 (its updates "
                                                   "finished), 2 steps of 3 done"), \
        (proc.stdout[-2000:], proc.stderr[-3000:])
    assert lines[0].endswith("continue with: torchrun ... " + shlex.join(["train.py", *args]))
    assert "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "stopped.json").read_text())["checkpoint"] == \
        "checkpoint/step_2"
    run_train(tmp_path, args, nproc=2)
    _same_run(tmp_path / "two", tmp_path / "full", keys=_ANY_WORLD, atol=1e-5)


def test_train_stop_signal_during_startup_exits_stopped_and_the_same_command_continues(tmp_path):
    """`python train.py` sent SIGTERM while its modules load (here: at `import torch`, the first
    heavy one): the signal waits for the stop handler, the run stops before its model loads, writes
    stopped.json and exits with run_folder.STOPPED; the same command line then trains. (It died at
    once: exit 143, no stopped.json, and a requeue script waiting for 75 dropped the job.)"""
    out = tmp_path / "run"
    args = ["--model", "tiny", "--data", "", "--no-chat", "--preset", "cpu", "--steps", "1",
            "--prompts-per-step", "2", "--mini-batch-prompts", "2", "--group-size", "2",
            "--max-response-len", "2", "--eval-samples", "0", "--no-plots", "--no-export-hf",
            "--out-dir", str(out), "--resume", "auto"]
    # SIGTERM to itself when train.py imports torch, then train.py as `python train.py` runs it
    kill_at_torch = (
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
    proc = subprocess.run([sys.executable, "-c", kill_at_torch, *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == run_folder.STOPPED, (proc.returncode, proc.stderr[-2000:])
    assert json.loads((out / "stopped.json").read_text()) == {"signal": "SIGTERM", "steps_done": 0,
                                                              "checkpoint": None}
    assert "stopped by SIGTERM during startup, 0 steps of 1 done" in proc.stdout, proc.stdout
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()
    proc = subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [m["step"] for m in read_metrics(out)] == [1] and not (out / "stopped.json").exists()
    # Ctrl-C while the modules load: nothing to save yet, so one line and exit at once
    # (it printed a traceback)
    args[args.index(str(out))] = str(tmp_path / "interrupted")
    proc = subprocess.run([sys.executable, "-c", kill_at_torch.replace("SIGTERM", "SIGINT"), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == run_folder.INTERRUPTED and proc.stderr.splitlines() == [
        "train.py: interrupted (SIGINT) before the run began: nothing was written"], \
        proc.stderr[-2000:]
    assert not (tmp_path / "interrupted").exists()


def test_train_stop_deadline_leaves_a_run_held_by_a_frozen_rank(tmp_path):
    """A stop signal whose stop cannot finish (the rank waits for a frozen one): --stop-deadline-s
    after the signal the rank leaves with a warning, stopped.json naming the last complete
    checkpoint and exit run_folder.STOPPED; the same command then finishes equal to an uninterrupted
    run. (Every rank waited for the collective timeout, 60 minutes: no checkpoint, and the job's
    grace period ran out first.)"""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3))
    args = toy_args(data, tmp_path / "cut", steps=3, save_every=1, resume="auto", stop_deadline_s=1)
    proc = run_train(tmp_path, args, hook=("hook_signal_then_hang", 2), expect=run_folder.STOPPED)
    assert ("train.py: warning: rank 0: SIGTERM came 1 s ago (--stop-deadline-s) and the ranks "
            "have not stopped together (a rank frozen, or its network down?): leaving without a "
            "checkpoint of this stop; checkpoint/step_1 is kept") in proc.stderr, \
        proc.stderr[-2000:]
    assert json.loads((tmp_path / "cut" / "stopped.json").read_text()) == {
        "signal": "SIGTERM", "steps_done": 1, "checkpoint": "checkpoint/step_1"}
    run_train(tmp_path, args)
    _same_run(tmp_path / "cut", tmp_path / "full")


def test_train_second_ctrl_c_or_deadline_on_a_full_disk_leaves_in_one_line(tmp_path):
    """A full disk where stopped.json goes. A second Ctrl-C that comes inside your reward function:
    one warning naming stopped.json, the usual line naming checkpoint/step_1, exit
    run_folder.INTERRUPTED, and your function is not blamed. A stop held by a frozen rank: the
    --stop-deadline-s guard still leaves, exit run_folder.STOPPED. (The signal handler's OSError
    surfaced inside the reward function: "reward function ... raised OSError", exit 2; the
    watchdog thread died on the write and the rank never left.)"""
    data, own = toy_data(tmp_path), tmp_path / "own_reward.py"
    own.write_text("import os, signal\ncalls = []\n\n\ndef first_digit(response, answer):\n"
                   "    calls.append(1)\n"
                   "    if len(calls) == 17:  # step 2's first response: Ctrl-C twice\n"
                   "        os.kill(os.getpid(), signal.SIGINT)\n"
                   "        os.kill(os.getpid(), signal.SIGINT)\n"
                   "    return 1.0 if response.strip()[:1] == answer else -1.0\n")
    args = toy_args(data, tmp_path / "twice", steps=3, save_every=1, export_hf=False,
                    reward=f"{own}:first_digit")
    proc = run_train(tmp_path, args, hook=("hook_full_disk", ["stopped.json"]),
                     expect=run_folder.INTERRUPTED, timeout=300)
    err = proc.stderr.splitlines()
    assert err[-2:] == [
        f"train.py: warning: could not write {tmp_path / 'twice' / 'stopped.json'} (No space left "
        f"on device): a requeue script that looks for it misses this stop; free space on its disk, "
        f"then continue as this stop says",
        f"train.py: warning: SIGINT after SIGINT: leaving without a checkpoint of this stop; "
        f"checkpoint/step_1 is kept; continue with: {_command(args + ['--resume', 'auto'])}"], \
        proc.stderr[-2000:]
    assert "reward function" not in proc.stderr and "Traceback" not in proc.stderr
    args = toy_args(data, tmp_path / "frozen", steps=3, save_every=1, stop_deadline_s=1)
    proc = run_train(tmp_path, args, hook=("hook_full_disk", ["stopped.json"],
                                           "hook_signal_then_hang", 2),
                     expect=run_folder.STOPPED, timeout=120)
    assert ("train.py: warning: rank 0: SIGTERM came 1 s ago (--stop-deadline-s) and the ranks "
            "have not stopped together") in proc.stderr and \
        "checkpoint/step_1 is kept" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
    assert not list((tmp_path / "frozen").glob("stopped.json*"))


def test_train_stop_signal_to_one_rank_stops_both_then_resume_on_other_world_sizes(tmp_path):
    """2 -> 1: SIGUSR1 to rank 1 only, in step 2's rollout: both ranks stop at the same point
    (rank 0 learns it through the process group), the checkpoint of step 1 stays; 1 process resumes
    it. 1 -> 2: a 1-process run stopped after step 1 resumes on 2 processes. Both finish equal to an
    uninterrupted 1-process run (--rollout-chunk 1; FSDP2 vs one process: float rounding), their
    held-out evaluations (eval.jsonl, the held-out samples.jsonl lines) included. (A 1-process run
    resumed on 2 failed: rank 1 found no rank1.pt; 3 held-out problems scored differently on 2
    processes: each rank's call was seeded by its rank.)"""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3, heldout=3))
    two_one = toy_args(data, tmp_path / "two_one", steps=3, heldout=3, resume="auto")
    proc = run_train(tmp_path, two_one, nproc=2,
                     hook=("hook_signal_at", _PLAIN, "sample", 3, "1", "SIGUSR1"),
                     expect=None)
    assert proc.returncode != 0 and ("stopped by SIGUSR1 (to another rank) in step 2's rollout "
                                     "(the step is dropped), 1 step of 3 done") in proc.stdout, \
        proc.stderr
    assert json.loads((tmp_path / "two_one" / "stopped.json").read_text())["steps_done"] == 1
    run_train(tmp_path, two_one)
    one_two = toy_args(data, tmp_path / "one_two", steps=3, heldout=3, resume="auto")
    run_train(tmp_path, one_two, hook=("hook_signal_at", _PLAIN, "sample", 3),
              expect=run_folder.STOPPED)
    run_train(tmp_path, one_two, nproc=2)
    for run in ("two_one", "one_two"):
        _same_run(tmp_path / run, tmp_path / "full", keys=_ANY_WORLD, atol=1e-5)
        logs = {name: [[json.loads(x) for x in (tmp_path / r / name).read_text().splitlines()]
                       for r in (run, "full")]
                for name in ("eval.jsonl", "samples.jsonl")}
        # sums of counts: exact on any number of ranks
        assert logs["eval.jsonl"][0] == logs["eval.jsonl"][1]
        held_out = [[s for s in lines if s["split"] == "heldout"]
                    for lines in logs["samples.jsonl"]]
        assert held_out[0] == held_out[1] and len(held_out[0]) == 2 * 3


def test_train_one_writer_per_folder(tmp_path, monkeypatch, capsys):
    """A second run or resume into a folder whose lock another process holds fails in one line
    naming the holder, and the folder is untouched; a lock released by its holder (or its death)
    does not block. Two runs started at once into one fresh folder: one trains, the other is
    refused. (Both exited 0 with metrics.jsonl steps [1,2,1,2,3,4,...].)"""
    patch_toy_task(monkeypatch, EVEN)
    data, run = toy_data(tmp_path), tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(data, run, steps=1, export_hf=False)) == 0
        before = md5s(run)
        held = run_folder.Lock(run)  # another writer
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "2"]) == 2
        one_line_error(capsys, f"{run} is in use by another run (host {socket.gethostname()} "
                               f"pid {os.getpid()} since ")
        assert md5s(run) == before
        held.release()
        assert train.main(["--resume", str(run), "--steps", "2"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_REWARD": EVEN}
    both = [subprocess.Popen([sys.executable, str(ROOT / "testdata" / "train_run.py"),
                              *toy_args(data, tmp_path / "fresh", steps=2)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in both]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    # in use, or (if it came late) holding the run
    refused = next(err for rc, err in results if rc == 2)
    assert f"train.py: error: {tmp_path / 'fresh'} is in use by another run (host " in refused or (
        f"train.py: error: --out-dir {tmp_path / 'fresh'} holds a run" in refused), refused
    assert [m["step"] for m in read_metrics(tmp_path / "fresh")] == [1, 2]


def test_train_torn_log_lines_and_a_full_disk_in_a_log_write(tmp_path, monkeypatch, capsys):
    """A full disk while appending step 2's metrics line: one line (exit 2) naming the file and the
    kept checkpoint, a torn line left; the resume drops it with a warning naming the file and
    finishes equal to an uninterrupted run. A log that needs no cut is not rewritten. (It was an
    OSError traceback, then a JSONDecodeError naming no file.)"""
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
        one_line_error(capsys, f"could not write {tmp_path / 'cut' / 'metrics.jsonl'} "
                               f"(No space left on device); checkpoint/step_1 is kept: "
                               f"python train.py --resume auto --out-dir ")
        monkeypatch.delattr(run_folder.logs, "open")
        samples, evals = ((tmp_path / "cut" / name).stat().st_ino
                          for name in ("samples.jsonl", "eval.jsonl"))
        assert train.main(["--resume", str(tmp_path / "cut")]) == 0
    err = capsys.readouterr().err
    assert (f"train.py: warning: {tmp_path / 'cut' / 'metrics.jsonl'} line 2 is torn "
            f"(an interrupted write): ") in err
    assert (tmp_path / "cut" / "samples.jsonl").stat().st_ino != samples  # cut: step 2's lines went
    assert (tmp_path / "cut" / "eval.jsonl").stat().st_ino == evals  # nothing to cut: not rewritten
    _same_run(tmp_path / "cut", tmp_path / "full")


def test_train_checkpoints_are_verified_and_fall_back(tmp_path, monkeypatch, capsys):
    """4 KB of zeros in a shard of the newest checkpoint: the resume names the damaged file, falls
    back to the older kept checkpoint and finishes equal to the uninterrupted run. `latest` naming a
    missing step: a warning and the newest complete one; a `latest` that is not UTF-8: a warning
    naming it and the newest complete one. No checkpoint passing its checks: one line, exit 2. (A
    zeroed shard resumed silently with 1,023 zero weights; a `latest` naming step_99 gave '--steps 6
    is less than the 99 steps'; a non-UTF-8 one a line naming no file, no fallback.)"""
    patch_toy_task(monkeypatch, EVEN)
    data, run = toy_data(tmp_path), tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", steps=3)) == 0
        assert train.main(toy_args(data, run, steps=2, save_every=1, keep_checkpoints=2)) == 0
        assert sorted(p.name for p in (run / "checkpoint").iterdir()) == \
            ["latest", "step_1", "step_2"]
        shard = max((run / "checkpoint" / "step_2").glob("*.distcp"),
                    key=lambda p: p.stat().st_size)
        with open(shard, "r+b") as f:
            f.seek(1024)
            f.write(bytes(4096))
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "3"]) == 0
        err = capsys.readouterr().err
        assert (f"{run / 'checkpoint' / 'step_2'} fails its manifest: "
                f"{shard.name} (damaged)") in err, err
        assert "resuming from step_1, the newest checkpoint that passes its checks" in err
        _same_run(run, tmp_path / "full")
        (run / "checkpoint" / "latest").write_text("step_99")
        assert train.main(["--resume", str(run), "--steps", "3", "--no-export-hf"]) == 0
        assert "latest names step_99, which is missing or incomplete" in capsys.readouterr().err
        # a flipped bit: named, then the manifests decide
        (run / "checkpoint" / "latest").write_bytes(b"step_\xff3")
        assert train.main(["--resume", str(run), "--steps", "3", "--no-export-hf"]) == 0
        err = capsys.readouterr().err
        assert (f"{run / 'checkpoint' / 'latest'} cannot be read (not UTF-8): "
                f"it names no checkpoint") in err, err
        assert "resuming from step_3, the newest" in err and \
            (run / "checkpoint" / "latest").read_text() == "step_3"
        # the only checkpoint left (keep 2: 2 and 3)
        (run / "checkpoint" / "step_3" / ".metadata").write_bytes(b"")
        shutil.rmtree(run / "checkpoint" / "step_2")
        assert train.main(["--resume", str(run), "--steps", "4"]) == 2
    one_line_error(capsys, f"{run} has no checkpoint that passes its checks")


def test_train_export_is_atomic_dated_and_eval_warns_when_stale(tmp_path, monkeypatch, capsys):
    """A failing export (a full disk) leaves the previous hf/ whole and says so in one line;
    `--resume auto` with every step done exports again (and, with the export up to date, does
    nothing, touching nothing); hf/export.json names the step it holds and its files' checksums, and
    eval.py --run warns when the run's checkpoint is newer and refuses a flipped bit in one line. (A
    full disk left hf/ with only its config files, or the old export beside a newer checkpoint
    without a word; a flipped bit was evaluated silently.)"""
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
    # every file others can read under umask 022, as the run's other files (the weights were 0600)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (run / "hf").iterdir()} == {
        p.name: "0o644" for p in (run / "hf").iterdir()}
    with one_thread():
        first = md5s(run / "hf")
        assert json.loads((run / "hf" / "export.json").read_text())["step"] == 1
        monkeypatch.setattr(model, "save_hf", full_disk)
        assert train.main(["--resume", str(run), "--steps", "2"]) == 2
        one_line_error(capsys, f"could not export the model to {run / 'hf'} "
                               f"(No space left on device); the checkpoint is kept")
        assert md5s(run / "hf") == first and not (run / "hf.partial").exists()
        monkeypatch.setattr(model, "save_hf", save)
        argv = toy_args(data, run, steps=2, resume="auto")
        assert train.main(argv) == 0  # nothing to train: the export
        assert json.loads((run / "hf" / "export.json").read_text())["step"] == 2
        before = md5s(run)
        capsys.readouterr()
        assert train.main(argv) == 0
        assert capsys.readouterr().out.strip().endswith(f"{run} has done its 2 steps and its "
                                                        f"export is up to date: nothing to do")
        assert md5s(run) == before
        assert train.main(["--resume", str(run), "--steps", "3", "--no-export-hf"]) == 0
    capsys.readouterr()
    cfg = ev.parse_config(["--run", str(run), "--benchmarks", "heldout"])
    assert cfg.run == str(run)
    assert ev.stale_export(run) == (f"{run / 'hf'} holds the model after 2 steps, but the run's "
                                    f"newest checkpoint is after 3 (python train.py --resume {run} "
                                    f"--export-hf exports it)")
    # each file's size and CRC-32
    files = json.loads((run / "hf" / "export.json").read_text())["files"]
    assert set(files) == {p.name for p in (run / "hf").iterdir()} - {"export.json"}
    # a flipped bit past the header: a loadable model
    with open(run / "hf" / "model.safetensors", "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as e:
        ev.main(["--models", str(run / "hf"), "--data", data, "--prompt-key", "prompt",
                 "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: {run / 'hf'}: model.safetensors "
                                         f"(damaged) differs from its export.json checksums; copy "
                                         f"or export it again (python train.py --resume RUN "
                                         f"--export-hf)"], err


def test_train_full_disk_in_the_export_the_lock_or_the_figures_is_one_line(
        tmp_path, monkeypatch, capsys):
    """A full disk in the Hugging Face export (safetensors' own error), at the very start (writing
    run.lock) or after the export (a figure): one line naming the file and the fix, exit 2, and
    nothing torn or empty left (no hf.partial/, no run.lock, no metrics.png); the export's
    resume exports exactly. (A 17-line safetensors traceback, exit 1; `train.py: error: No space
    left on device`, naming no file, with an empty run.lock left.)"""
    import matplotlib.figure
    import transformers.modeling_utils as hf_files
    from safetensors import SafetensorError

    patch_toy_task(monkeypatch, EVEN)
    data, run, save = toy_data(tmp_path), tmp_path / "run", hf_files.safe_save_file

    def safetensors_full_disk(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(bytes(100))  # the part that fit
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(hf_files, "safe_save_file", safetensors_full_disk)
    args = toy_args(data, run, steps=1, resume="auto")
    with one_thread():
        assert train.main(args) == 2
        one_line_error(capsys, f"could not export the model to {run / 'hf'} (No space left on "
                               f"device); the checkpoint is kept: free space if the disk is full, "
                               f"then python train.py --resume auto --out-dir {run} exports it")
        assert not (run / "hf.partial").exists() and not (run / "hf").exists()
        monkeypatch.setattr(hf_files, "safe_save_file", save)
        assert train.main(args) == 0  # the export, nothing trained
    assert json.loads((run / "hf" / "export.json").read_text())["step"] == 1
    assert [m["step"] for m in read_metrics(run)] == [1]

    write = os.write

    def lock_full_disk(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("run.lock"):
            raise OSError(28, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(os, "write", lock_full_disk)
    assert train.main(toy_args(data, tmp_path / "fresh", steps=1)) == 2
    monkeypatch.setattr(os, "write", write)
    one_line_error(capsys, f"could not write {tmp_path / 'fresh' / 'run.lock'} (No space left on "
                           f"device): free space on its disk (or make the folder writable), then "
                           f"run the same command again")
    assert list((tmp_path / "fresh").iterdir()) == []

    def figure_full_disk(figure, path, *args, **kwargs):
        Path(path).write_bytes(b"\x89PNG")  # the part that fit
        raise OSError(28, "No space left on device")  # a write's error names no file

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", figure_full_disk)
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "figures", steps=1, plots=True)) == 2
    one_line_error(capsys, f"could not write {tmp_path / 'figures' / 'metrics.png'} (No space "
                           f"left on device): the run is complete (checkpoint and export "
                           f"written); free space, then python train.py --plot "
                           f"{tmp_path / 'figures'} draws its figures")
    assert not (tmp_path / "figures" / "metrics.png").exists()


def test_train_refuses_a_folder_of_another_format_before_changing_it(
        tmp_path, monkeypatch, capsys):
    """A checkpoint records the run folder's format (manifest.json, state.pt). One written by
    another version of train.py (another format, or a layout this one does not write) is refused in
    one line naming the file and what to do, never --overwrite, before anything in the folder
    changes; --resume auto too. (A changed manifest was 'no checkpoint passes its checks ... start
    it anew with --overwrite', which deletes an intact checkpoint; a changed state.pt was
    `train.py: error: 'python_rng'` after config.json was rewritten and resumes.jsonl appended.)"""
    patch_toy_task(monkeypatch, EVEN)
    data, run = toy_data(tmp_path), tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(data, run, steps=1, export_hf=False)) == 0
    step = run / "checkpoint" / "step_1"
    manifest, state = json.loads((step / "manifest.json").read_text()), \
        torch.load(step / "state.pt", weights_only=False)
    assert manifest["format"] == state["format"] == run_folder.FORMAT == 1
    state_pt = (step / "state.pt").read_bytes()

    def newer_state(**change):  # a state.pt another version wrote, its manifest entry to match
        new = {k: v for k, v in {**state, **change}.items() if v is not None}
        torch.save(new, step / "state.pt")
        files = {**manifest["files"], "state.pt": [(step / "state.pt").stat().st_size,
                                                   run_folder.crc32(step / "state.pt")]}
        (step / "manifest.json").write_text(json.dumps({**manifest, "files": files}))

    cases = (
        (lambda: (step / "manifest.json").write_text(json.dumps({**manifest, "format": 2})),
         "manifest.json", "run folder format 2; this train.py reads format 1"),
        (lambda: (step / "manifest.json").write_text(json.dumps(
            {"step": 1, "entries": manifest["files"]})),
         "manifest.json", "not laid out as this train.py writes it"),
        (lambda: newer_state(format=2, python_rng=None), "state.pt",
         "run folder format 2; this train.py reads format 1"),
        (lambda: newer_state(format=None, python_rng=None), "state.pt",
         "not laid out as this train.py writes it"))
    for change, name, what in cases:
        change()
        before = md5s(run)
        capsys.readouterr()
        for argv in (["--resume", str(run), "--steps", "2"],
                     toy_args(data, run, steps=2, export_hf=False, resume="auto")):
            assert train.main(argv) == 2
            one_line_error(capsys, f"train.py: error: {step / name} was written by another version "
                                   f"of train.py ({what}): continue the run with the version "
                                   f"that wrote it, or train with this one into another "
                                   f"--out-dir; nothing in {run} was changed")
            assert md5s(run) == before
        (step / "manifest.json").write_text(json.dumps(manifest))
        (step / "state.pt").write_bytes(state_pt)
    with one_thread():
        assert train.main(["--resume", str(run), "--steps", "2"]) == 0


def test_train_resume_checks_a_hand_edited_config(tmp_path, monkeypatch, capsys):
    """A run's config.json edited by hand: a value of the wrong type or an unknown key is one line
    (exit 2) naming the file and the key, and nothing in the run changes. (`"lr": "0.001"` resumed
    with a string learning rate.)"""
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
