"""train.py across runs of one folder: exact resume and its errors, a folder that holds a run, checkpoints (full disk,
torn, killed mid-write, weights only), the HF export.
"""
import json
import os
import shlex
import shutil
import signal
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import config
import eval as ev
import model
import run_folder
import train
from model import Policy
from tests.toy_task import (
    EVEN,
    TOY_VOCAB,
    md5s,
    one_line_error,
    one_thread,
    patch_toy_task,
    read_metrics,
    run_train,
    toy_args,
    toy_data,
)


# ==================================================================================================================
# train.py: the training loop end to end
# ==================================================================================================================
def test_train_resume_is_exact(tmp_path, monkeypatch, capsys):
    """A run with the cpu preset's --save-every 0 still checkpoints its last step; resuming it says so, and step 3
    equals the uninterrupted run's step 3. Step N is one number everywhere: checkpoint/step_N, metrics.jsonl,
    eval.jsonl ("after N steps") and the console."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", steps=3, heldout=2, export_hf=False)) == 0
        assert train.main(toy_args(data, tmp_path / "cut", steps=2, heldout=2, export_hf=False)) == 0
        first = capsys.readouterr().out
        assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_2"
        assert "held-out accuracy after 2 steps:" in first and "checkpoint/step_2" in first.splitlines()[-1]
        assert train.main(["--resume", str(tmp_path / "cut"), "--steps", "3"]) == 0
    resumed = capsys.readouterr().out
    assert f"resuming from {tmp_path / 'cut' / 'checkpoint' / 'step_2'} at step 3 (2 steps done)" in resumed
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == [1, 2, 3]
    assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_3"
    evals = [json.loads(x)["step"] for x in (tmp_path / "cut" / "eval.jsonl").read_text().splitlines()]
    assert evals == [0, 2, 3] and "held-out accuracy after 3 steps:" in resumed
    assert f"stapo silenced {sum(int(m['s2t/silenced']) for m in cut)} tokens in " in resumed  # the whole run
    assert " of 3 steps; S2T candidates" in resumed
    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    assert {k: v for k, v in cut[2].items() if k not in drop} == pytest.approx(
        {k: v for k, v in full[2].items() if k not in drop}, rel=1e-6, abs=1e-9)


def test_train_resume_errors_are_one_line(tmp_path, monkeypatch, capsys):
    patch_toy_task(monkeypatch, EVEN)
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", steps=2, export_hf=False)) == 0
    capsys.readouterr()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert train.main(["--resume", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"train.py: error: --steps 1 is less than the 2 steps {tmp_path / 'run'} has done")
    shutil.rmtree(tmp_path / "run" / "checkpoint")  # a run that stopped before its first checkpoint
    assert train.main(["--resume", str(tmp_path / "run"), "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"train.py: error: {tmp_path / 'run'} has no checkpoint"), err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # nothing rewritten


def _same_steps(a: list[dict], b: list[dict]) -> None:
    """Two runs' metrics.jsonl lines agree, times aside."""
    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k not in drop} == pytest.approx(
            {k: v for k, v in y.items() if k not in drop}, rel=1e-6, abs=1e-9)


def test_train_a_run_failed_before_its_first_checkpoint_names_the_next_step(tmp_path, monkeypatch, capsys):
    """A first run that fails before its first checkpoint: rerunning its command says how to start it again (that
    command with --resume auto, or --overwrite), --resume RUN (no recipe given) names its config.json with --resume
    auto, and both commands train. (Rerunning said "continue it with --resume", and --resume then "has no checkpoint
    to resume from" with no next step.)"""
    patch_toy_task(monkeypatch, EVEN)
    data, run = toy_data(tmp_path), tmp_path / "run"
    setup = train.setup
    monkeypatch.setattr(train, "setup", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    args = toy_args(data, run, steps=1, export_hf=False)
    assert train.main(args) == 2 and (run / "config.json").is_file() and not (run / "checkpoint").exists()
    capsys.readouterr()
    monkeypatch.setattr(train, "setup", setup)
    again = f"python train.py --config {run / 'config.json'} --resume auto"
    assert train.main(args) == 2
    one_line_error(capsys, f"--out-dir {run} holds a run that stopped before its first checkpoint (config.json): "
                            f"start it again with python {shlex.join(['train.py', *args, '--resume', 'auto'])}, "
                            f"choose another --out-dir, or replace it with --overwrite")
    assert train.main(["--resume", str(run)]) == 2
    one_line_error(capsys, f"{run} has no checkpoint to resume from: the run stopped before its first one (written "
                            f"every --save-every steps, at a stop by signal and at the last step); start it again with "
                            f"{again} (or replace it with --overwrite)")
    with one_thread():
        assert train.main(again.split()[2:]) == 0
        assert [m["step"] for m in read_metrics(run)] == [1]
        shutil.rmtree(run / "checkpoint")
        assert train.main(args + ["--resume", "auto"]) == 0  # the user's own command, as the refusal named it
    assert [m["step"] for m in read_metrics(run)] == [1]


def test_read_only_run_folder(tmp_path, monkeypatch, capsys):
    """A finished run on a read-only mount: --resume has nothing to do (exit 0); eval.py --run and --plot refuse in
    one line before they sample or draw anything. (eval.py sampled, then lost its results in a traceback writing
    RUN/eval; --plot the same; --resume said exit 2.)"""
    patch_toy_task(monkeypatch, EVEN)
    run = tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), run, steps=1, plots=False)) == 0
    probe = tempfile.TemporaryFile

    def read_only(*args, dir=None, **kwargs):  # as a read-only mount answers (root writes into a chmod 555 folder)
        if dir is not None and Path(dir).is_relative_to(run):
            raise OSError(30, "Read-only file system")
        return probe(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    capsys.readouterr()
    assert train.main(["--resume", str(run)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{run} has done its 1 step and its export is up to date: nothing "
                                                    f"to do")
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as e:
        ev.main(["--run", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: --out {run / 'eval' / 'step_1'} cannot be written: "
                                         f"Read-only file system; write the results elsewhere with --out DIR"], err
    with pytest.raises(SystemExit) as e:
        train.main(["--plot", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"train.py: error: --plot {run} cannot be written: Read-only file system; "
                                         f"write the figures elsewhere with --out PNG"], err
    assert not (run / "metrics.png").exists() and not (run / "eval").exists()


def test_train_refuses_a_folder_that_holds_a_run(tmp_path, monkeypatch, capsys):
    """A new run in a folder that holds one is refused in one line (every file of the old run unchanged) unless
    --overwrite, which replaces it. (A 2-step run into a 4-step run's folder cut metrics.jsonl to 2 lines and deleted
    checkpoint/step_4, exit 0.)"""
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
    assert train.main(toy_args(str(tmp_path / "nope.jsonl"), run, steps=1)) == 2  # the input first, then the folder
    one_line_error(capsys, f"data file not found: {tmp_path / 'nope.jsonl'}")


def test_train_resume_keeps_the_recipe_and_records_what_changed(tmp_path, monkeypatch, capsys):
    """--resume with a flag that changes the recipe (--lr, --algo) is refused in one line and leaves the run as it
    was; flags that only change length, evaluation, logging or memory are applied and recorded in resumes.jsonl.
    (config.json recorded --lr 0.5 while the scheduler kept the old rate; --algo justrl relabelled a STAPO run.)"""
    patch_toy_task(monkeypatch, EVEN)
    run = tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), run, steps=2, heldout=2, export_hf=False)) == 0
        before = md5s(run)
        capsys.readouterr()
        for flags, expected in ((["--lr", "0.5"], "--lr 0.5 differs from the resumed run's 0.001"),
                                (["--algo", "justrl"], "--algo 'justrl' differs from the resumed run's 'stapo'"),
                                (["--out-dir", str(tmp_path / "elsewhere")], "cannot move it")):
            assert train.main(["--resume", str(run), "--steps", "3", *flags]) == 2
            one_line_error(capsys, expected)
            assert md5s(run) == before
        assert train.main(["--resume", str(run), "--steps", "3", "--eval-every", "1", "--samples-per-step", "1",
                           "--max-tokens-per-micro-batch", "5"]) == 0
    assert [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()] == [{"step": 2, "changed": {
        "steps": [2, 3], "max_tokens_per_micro_batch": [20, 5], "eval_every": [0, 1], "samples_per_step": [4, 1]}}]
    assert json.loads((run / "config.json").read_text())["steps"] == 3 and len(read_metrics(run)) == 3


def test_train_full_disk_in_a_checkpoint_keeps_the_last_one(tmp_path, monkeypatch, capsys):
    """A checkpoint write that fails (a full disk: torch.save's 'unexpected pos') stops the run in one line, exit 2;
    the half-written folder is removed, `latest` still names the previous checkpoint, and resuming from it
    reproduces the uninterrupted run."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)
    save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if "step_2" in str(path):  # the second checkpoint
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return save(obj, path, *args, **kwargs)

    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", steps=3, export_hf=False)) == 0
        monkeypatch.setattr(train.torch, "save", full_disk)
        assert train.main(toy_args(data, tmp_path / "cut", steps=3, save_every=1, export_hf=False)) == 2
        one_line_error(capsys, f"could not write {tmp_path / 'cut' / 'checkpoint' / 'step_2'} (a full disk?): "
                                f"[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598; ")
        assert sorted(p.name for p in (tmp_path / "cut" / "checkpoint").iterdir()) == ["latest", "step_1"]
        assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_1"
        monkeypatch.setattr(train.torch, "save", save)
        assert train.main(["--resume", str(tmp_path / "cut")]) == 0
    _same_steps(read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "full"))


def test_train_full_disk_in_a_checkpoint_shard_is_one_line_even_in_a_stop(tmp_path, monkeypatch, capsys):
    """A full disk inside the DCP shard write of step_2 (DCP raises a CheckpointException, a BaseException): one line
    naming the folder, the disk error and the kept checkpoint, exit 2, no step_2/ left. The same during a stop (a
    SIGTERM in step 2's update): a warning, stopped.json naming step_1, exit run_folder.STOPPED, and the same command
    line continues. (A 20-line traceback, exit 1, a half-written step_2/; during a stop also no stopped.json.)"""
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
        assert train.main(toy_args(data, tmp_path / "cut", steps=3, save_every=1, export_hf=False)) == 2
        one_line_error(capsys, f"train.py: error: could not write {tmp_path / 'cut' / 'checkpoint' / 'step_2'} (a "
                                f"full disk?): No space left on device; checkpoint/step_1 is kept: python train.py "
                                f"--resume auto --out-dir {tmp_path / 'cut'} continues")
        assert sorted(p.name for p in (tmp_path / "cut" / "checkpoint").iterdir()) == ["latest", "step_1"]
        step_log, made = train.StepLog, []

        def signal_in_step_2(*args):
            made.append(1)
            if len(made) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return step_log(*args)

        monkeypatch.setattr(train, "StepLog", signal_in_step_2)
        args = toy_args(data, tmp_path / "stop", steps=3, save_every=1, export_hf=False, resume="auto")
        assert train.main(args) == run_folder.STOPPED
        out, err = capsys.readouterr()
        assert f"train.py: warning: could not write {tmp_path / 'stop' / 'checkpoint' / 'step_2'} (a full disk?): " \
               f"No space left on device; checkpoint/step_1 is kept" in err and "Traceback" not in err, err
        assert "stopped by SIGTERM in step 2 (its updates finished), 2 steps of 3 done" in out, out
        assert json.loads((tmp_path / "stop" / "stopped.json").read_text())["checkpoint"] == "checkpoint/step_1"
        assert sorted(p.name for p in (tmp_path / "stop" / "checkpoint").iterdir()) == ["latest", "step_1"]
        monkeypatch.setattr(dcp_files, "_write_item", write_item)
        monkeypatch.setattr(train, "StepLog", step_log)
        assert train.main(args) == 0
    assert [m["step"] for m in read_metrics(tmp_path / "stop")] == [1, 2, 3]


def test_train_torn_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path, monkeypatch, capsys):
    """checkpoint/latest torn (an older version wrote it in place): the resume warns and uses the newest complete
    step_N folder. (It was 'invalid literal for int()'.)"""
    patch_toy_task(monkeypatch, EVEN)
    run = tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), run, steps=2, export_hf=False)) == 0
        (run / "checkpoint" / "step_3").mkdir()  # an incomplete folder: no .metadata
        (run / "checkpoint" / "latest").write_text("ste")
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert f"train.py: warning: {run / 'checkpoint' / 'latest'} names ste, which is missing or incomplete" in err
    assert "train.py: warning: resuming from step_2, the newest checkpoint that passes its checks" in err
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    assert (run / "checkpoint" / "latest").read_text() == "step_3"


def test_train_killed_inside_a_checkpoint_write_resumes_exactly(tmp_path):
    """A training process killed after writing a checkpoint's shards but before `latest` names it: the folder still
    resumes from the previous checkpoint, and the resumed run equals the uninterrupted one."""
    data = toy_data(tmp_path)
    run_train(tmp_path, toy_args(data, tmp_path / "full", steps=3, export_hf=False))
    run_train(tmp_path, toy_args(data, tmp_path / "cut", steps=3, save_every=1, export_hf=False),
         hook=("hook_kill_in_the_second_checkpoint",), expect=9)
    assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_1"
    assert (tmp_path / "cut" / "checkpoint" / "step_2" / ".metadata").is_file()  # written, never named
    run_train(tmp_path, ["--resume", str(tmp_path / "cut")])
    _same_steps(read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "full"))


def test_train_weights_only_checkpoint(tmp_path, monkeypatch, capsys):
    """--no-save-optimizer: the checkpoint holds no AdamW moments (about 1/3 of the size); a resume warns that AdamW
    restarts and trains on."""
    patch_toy_task(monkeypatch, EVEN)
    data = toy_data(tmp_path)

    def size(run):
        return sum(f.stat().st_size for f in (tmp_path / run / "checkpoint").rglob("*") if f.is_file())

    with one_thread():
        assert train.main(toy_args(data, tmp_path / "full", export_hf=False)) == 0
        assert train.main(toy_args(data, tmp_path / "weights", export_hf=False, save_optimizer=False)) == 0
        assert size("weights") < 0.5 * size("full"), (size("weights"), size("full"))
        capsys.readouterr()
        assert train.main(["--resume", str(tmp_path / "weights"), "--steps", "2"]) == 0
    assert "holds weights only (--no-save-optimizer): AdamW restarts from zero moments" in capsys.readouterr().err
    assert [m["step"] for m in read_metrics(tmp_path / "weights")] == [1, 2]


def test_train_hf_export_reproduces_logprobs(tmp_path, monkeypatch):
    patch_toy_task(monkeypatch, EVEN)
    cfg, _, _ = config.parse_config(toy_args(toy_data(tmp_path), tmp_path / "run", steps=1))
    rank, world, device = train.init_distributed()
    try:
        with one_thread(), run_folder.Preemption() as preemption:  # main's steps, keeping the run's policy
            rows = train.read_inputs(cfg, world)
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
