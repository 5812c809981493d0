"""Opening a run folder (docs/outputs.md): a new run writes config.json and its logs; a resumed run
checks the recipe against config.json, verifies its checkpoint, recovers an interrupted export and
cuts its logs back to the checkpoint's step."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from command_line.errors import check_writable, one_line
from command_line.flags import RECORD
from run_folder.agreement import broadcast_failure
from run_folder.checkpoints import verified_checkpoint
from run_folder.console import RunError, plural, say
from run_folder.export import export_step, recover_export
from run_folder.files import (RESUMABLE, RUN_FILES, code_version, complete_steps,
                              refuse_another_format, write_atomic)
from run_folder.lock import Lock
from run_folder.logs import append, cut_logs


# ------------------------------------------------------------------------------------ opening a run
# the fields the built-in task (--data '') never reads: it has no fields to name and no Hub split
UNUSED_BUILTIN = ("prompt_key", "answer_key", "split")


def recipe(config: dict) -> dict:
    """What config.json records: the values in effect, without the flags that only say how this
    command starts (--resume, --overwrite), so that `--config OUT/config.json` reruns the recipe,
    and without the fields the built-in task never reads. config.json adds the code that wrote it
    (RECORD, "code": `code_version`), which neither --config nor a resume reads as a flag."""
    return {k: v for k, v in {**config, "resume": "", "overwrite": False}.items()
            if config["data"] or k not in UNUSED_BUILTIN}


def write_config(out: Path, config: dict, code: dict | None = None) -> None:
    """OUT/config.json: the recipe and the code that ran it (`code`, else `code_version`'s; a
    resume writes its own)."""
    record = {**recipe(config), RECORD: code or code_version()}
    write_atomic(out / "config.json", json.dumps(record, indent=1).encode())


def recorded_config(out: Path) -> dict:
    """The recipe in OUT's config.json, as a dict without its record of the code (RECORD; one-line
    errors for a missing or unreadable file, or a folder written by another version of train.py:
    `refuse_another_format`)."""
    path = out / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no run to resume: {path} does not exist")
    refuse_another_format(out)
    try:
        values = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path} is not a JSON object ({one_line(e)})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} is not a JSON object")
    return {k: v for k, v in values.items() if k != RECORD}


def resume_changes(recorded: dict, config: dict) -> dict:
    """{flag: [recorded, now]} of what a resume changes; ValueError for a flag outside RESUMABLE (a
    resumed run keeps its recipe). fsdp may change with the number of processes."""
    # heldout: the built-in task holds out its own 20 whatever was recorded (0 before config.json
    # recorded what a run held out), and null is --data's default share, which gives the same rows
    same_rows = not recorded.get("data") or recorded.get("heldout") is None
    changed = {k: [recorded.get(k), v] for k, v in recipe(config).items()
               if k not in ("out_dir", "fsdp") and recorded.get(k) != v
               and not (k == "heldout" and same_rows)}
    refused = [k for k in changed if k not in RESUMABLE
               or (k == "kv_cache_gb" and config["rollout_chunk"] == 0)]
    if refused:
        k = refused[0]
        raise ValueError(f"--{k.replace('_', '-')} {config[k]!r} differs from the resumed run's "
                         f"{recorded.get(k)!r}: a resumed run keeps its recipe (on resume only "
                         f"{', '.join('--' + r.replace('_', '-') for r in RESUMABLE)} may change); "
                         f"start a new run with --out-dir to change it")
    return changed


def open_run(config: dict, recorded: dict | None, rank: int, world: int, command: str
             ) -> tuple[int, Path | None, Lock | None] | None:
    """Every rank, after the inputs are read and before the model loads (command:
    `continue_command`, for a refusal to name): rank 0 locks OUT (`Lock`), then
    - a new run (recorded None): refuses a folder that holds a run, unless --overwrite or
      `--resume auto` (a run without a checkpoint: it starts anew), clears it, writes config.json;
    - a resume: picks the newest verified checkpoint (`verified_checkpoint`), refuses --steps below
      its steps, drops the log lines past it (`cut_logs`), records what changed in resumes.jsonl,
      rewrites config.json.
    Returns (steps done, the checkpoint folder or None, the lock on rank 0), or None when a resume
    has nothing left to do (every step done, not stopped, the export up to date): then nothing in
    OUT is touched."""
    out = Path(config["out_dir"])
    if recorded is not None and finished_read_only(out, config):
        return None  # nothing to lock, verify or repair
    lock, failed = None, None
    if rank == 0:
        try:
            lock = Lock(out)
        except (OSError, RunError) as e:
            failed = e
    failed = broadcast_failure(failed, rank)
    if failed:
        raise RunError(failed)
    try:
        if recorded is None:
            _on_rank0(rank, lambda: _start(out, config, command))
            return 0, None, lock
        done, path = verified_checkpoint(out, rank, world)
        if config["steps"] < done:
            raise RunError(f"--steps {config['steps']} is less than the {plural(done, 'step')} "
                           f"{out} has done")
        if finished(out, config, done):
            if lock is not None:
                lock.release()
            return None
        _on_rank0(rank, lambda: _continue(out, config, recorded, done))
        return done, path, lock
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def finished(out: Path, config: dict, done: int | None) -> bool:
    """Whether a resume of the run in OUT, with a checkpoint of `done` steps, has nothing to do:
    every step of `config` done, not stopped by a signal, its export (if any) up to date."""
    return done == config["steps"] and not (out / "stopped.json").exists() and (
        not config["export_hf"] or export_step(out / "hf") == done)


def finished_read_only(out: Path, config: dict) -> bool:
    """A finished run (`finished`, by its newest complete checkpoint, unverified) in a folder this
    process cannot write (a read-only mount): a resume has nothing to do, and cannot lock, verify or
    repair it."""
    steps = complete_steps(out)
    if not steps or not finished(out, config, steps[0]):
        return False
    try:
        check_writable("--out-dir", out)
    except OSError:
        return True
    return False


def _on_rank0(rank: int, work) -> None:
    """Every rank: rank 0 does `work()`; its failure raises RunError on every rank."""
    failed = None
    if rank == 0:
        try:
            work()
        except (OSError, ValueError, RunError) as e:
            failed = e
    failed = broadcast_failure(failed, rank)
    if failed:
        raise RunError(failed)


def _start(out: Path, config: dict, command: str) -> None:
    """Rank 0, a new run: refuse or clear a folder that holds a run, then write config.json.
    command: the user's command with --resume auto (`continue_command`), which starts anew a run
    without a checkpoint."""
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not config["overwrite"] and config["resume"] != "auto" and not complete_steps(out):
        raise RunError(f"--out-dir {out} holds a run that stopped before its first checkpoint "
                       f"({', '.join(found)}): start it again with {command}, choose another "
                       f"--out-dir, or replace it with --overwrite")
    if found and not config["overwrite"] and config["resume"] != "auto":
        raise RunError(f"--out-dir {out} holds a run ({', '.join(found)}): continue it with "
                       f"--resume {out} (or --resume auto), choose another --out-dir, or replace "
                       f"it with --overwrite")
    if found and not config["overwrite"]:
        say(f"{out} holds a run without a checkpoint (it stopped before its first): "
            f"starting it anew", warning=True)
    for name in found:
        if (out / name).is_dir():
            shutil.rmtree(out / name)
        else:
            (out / name).unlink()
    write_config(out, config)


def _continue(out: Path, config: dict, recorded: dict, done: int) -> None:
    """Rank 0, a resume after `done` steps: the folder as the checkpoint left it, what changed
    recorded."""
    recover_export(out)
    (out / "stopped.json").unlink(missing_ok=True)
    cut_logs(out, done)
    code = code_version()  # git, once: resumes.jsonl and config.json
    append(out, "resumes.jsonl", [{"step": done, "changed": resume_changes(recorded, config),
                                   RECORD: code}])
    write_config(out, config, code)
