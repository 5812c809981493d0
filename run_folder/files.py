"""What a run folder holds (docs/outputs.md) and what to type next: the files a run writes
(`RUN_FILES`), the settings a resume may change (`RESUMABLE`), its format version (`FORMAT`: a
folder of another is refused before anything in it changes), an atomic write, the steps of its
complete checkpoints, the code that ran (`code_version`: config.json's "code"), and the command
lines that continue a stopped run."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

# The logs: one JSON object per line, each with the step it belongs to.
LOGS = ("metrics.jsonl", "eval.jsonl", "samples.jsonl", "spurious.jsonl", "tokens.jsonl",
        "resumes.jsonl")


# What a run writes into OUT: a new run refuses a folder that holds any of these unless --overwrite.
RUN_FILES = ("config.json", *LOGS, "checkpoint", "hf", "stopped.json", "metrics.png", "s2t.png",
             "gradient.png", "tensorboard", "wandb", "eval")


# The layout of what a checkpoint holds (manifest.json, state.pt), recorded in both as "format":
# a version of train.py that changes it raises this number, and each refuses the other's folders.
# A checkpoint without the key was written before it was recorded: format 1.
FORMAT = 1
STATE_KEYS = ("step", "optimizer", "scheduler", "python_rng", "torch_rng", "cuda_rng")


# Flags that may change when a run is resumed: how long it runs, what it evaluates and logs, how
# much memory a step takes, never what it computes (kv_cache_gb only with --rollout-chunk > 0:
# otherwise it sets the prompts per generate call, and with them the sampling seeds).
RESUMABLE = ("steps", "eval_every", "eval_samples", "samples_per_step", "spurious_per_step",
             "token_sample", "entropy_change", "save_every", "keep_checkpoints", "save_optimizer",
             "export_hf", "plots", "logger", "collective_timeout_min", "max_tokens_per_micro_batch",
             "chunk_size", "grad_checkpointing", "kv_cache_gb", "stop_deadline_s", "light")


# -------------------------------------------------------------------------------- the code that ran
def code_version(root: Path = Path(__file__).resolve().parents[1]) -> dict:
    """{"commit": the checkout's commit, "dirty": whether its tracked files differ from it or an
    untracked .py file, code a run may import, sits beside them (another untracked file, e.g. a log,
    does not count)}; both null outside a git checkout (a copy without .git) or without git.
    config.json records it as "code" (command_line.flags.RECORD: not a flag)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=30, check=True).stdout
    try:
        if Path(git("rev-parse", "--show-toplevel").strip()).resolve() != root.resolve():
            return {"commit": None, "dirty": None}  # a copy inside some other repository
        changes = git("status", "--porcelain", "--untracked-files=all").splitlines()
        return {"commit": git("rev-parse", "HEAD").strip(),
                "dirty": any(not c.startswith("??") or c.endswith(".py") for c in changes)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


# --------------------------------------------------------------------------------------------- logs
def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` whole: written to a new file, flushed to disk, renamed over it (a
    crash leaves the old file or the new one, never a torn one)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -------------------------------------------------------------------------------------- checkpoints
def _step_dirs(out: Path) -> list[Path]:
    """OUT/checkpoint/step_N folders, newest first."""
    found = [p for p in (out / "checkpoint").glob("step_*") if p.name[5:].isdigit()]
    return sorted(found, key=lambda p: -int(p.name[5:]))


def complete_steps(out: Path) -> list[int]:
    """Steps of the complete checkpoints of OUT (a manifest.json, written last), newest first; not
    verified."""
    return [int(p.name[5:]) for p in _step_dirs(out) if (p / "manifest.json").is_file()]


def refuse_another_format(out: Path) -> None:
    """ValueError in one line when a complete checkpoint of OUT was written by another version of
    train.py: its manifest.json or state.pt records another FORMAT, or (none recorded) is not laid
    out as this version writes them. Read only, by every rank, before anything in OUT changes. A
    file that cannot be read is left to the resume's verification (a damaged checkpoint)."""
    import torch

    for folder in [p for p in _step_dirs(out) if (p / "manifest.json").is_file()]:
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
            state = torch.load(folder / "state.pt", weights_only=False, map_location="cpu")
        except Exception:  # noqa: BLE001 - unreadable or damaged: the verification's to report
            continue
        for name, record, laid_out in (
                ("manifest.json", manifest, isinstance(manifest, dict)
                 and isinstance(manifest.get("files"), dict)),
                ("state.pt", state, isinstance(state, dict) and set(STATE_KEYS) <= set(state))):
            found = record.get("format", 1) if isinstance(record, dict) else None
            if found == FORMAT and laid_out:
                continue
            what = (f"run folder format {found!r}; this train.py reads format {FORMAT}"
                    if found not in (None, FORMAT) else "not laid out as this train.py writes it")
            raise ValueError(f"{folder / name} was written by another version of train.py "
                             f"({what}): continue the run with the version that wrote it, or "
                             f"train with this one into another --out-dir; nothing in {out} was "
                             f"changed")


def resumable(out: Path) -> str:
    """What a stopped run can do next, as the end of an error line."""
    steps = complete_steps(out)
    if not steps:
        return "no checkpoint was kept"
    return (f"checkpoint/step_{steps[0]} is kept: python train.py --resume auto --out-dir {out} "
            "continues")


def again(out: Path) -> str:
    """How to start anew the run of OUT that stopped before its first checkpoint, for a command that
    named no recipe (--resume OUT): with its recipe (config.json)."""
    if (out / "config.json").is_file():
        return f"python train.py --config {out / 'config.json'} --resume auto"
    return f"the run's flags, --out-dir {out} and --resume auto"


def continue_command(argv: list[str]) -> str:
    """The user's own command line (train.py's flags `argv`) as it continues a run: with
    `--resume auto` unless it resumes already, without --overwrite (which would start anew);
    `torchrun ... train.py ...` under torchrun (its own flags are not visible to its workers)."""
    args = [a for a in argv if a not in ("--overwrite", "--no-overwrite")]
    if not any(a == "--resume" or a.startswith("--resume=") for a in args):
        args += ["--resume", "auto"]
    script = sys.argv[0] if Path(sys.argv[0]).name == "train.py" else "train.py"
    launcher = "torchrun ..." if "TORCHELASTIC_RUN_ID" in os.environ else "python"
    return f"{launcher} {shlex.join([script, *args])}"
