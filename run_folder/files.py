"""What a run folder holds (docs/outputs.md) and what to type next: the files a run writes
(`RUN_FILES`), the settings a resume may change (`RESUMABLE`), an atomic write, the steps of its
complete checkpoints, and the command lines that continue a stopped run."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

# The logs: one JSON object per line, each with the step it belongs to.
LOGS = ("metrics.jsonl", "eval.jsonl", "samples.jsonl", "spurious.jsonl", "tokens.jsonl",
        "resumes.jsonl")


# What a run writes into OUT: a new run refuses a folder that holds any of these unless --overwrite.
RUN_FILES = ("config.json", *LOGS, "checkpoint", "hf", "stopped.json", "metrics.png", "s2t.png",
             "gradient.png", "tensorboard", "wandb", "eval")


# Flags that may change when a run is resumed: how long it runs, what it evaluates and logs, how
# much memory a step takes, never what it computes (kv_cache_gb only with --rollout-chunk > 0:
# otherwise it sets the prompts per generate call, and with them the sampling seeds).
RESUMABLE = ("steps", "eval_every", "eval_samples", "samples_per_step", "spurious_per_step",
             "token_sample", "entropy_change", "save_every", "keep_checkpoints", "save_optimizer",
             "export_hf", "plots", "logger", "collective_timeout_min", "max_tokens_per_micro_batch",
             "chunk_size", "grad_checkpointing", "kv_cache_gb", "stop_deadline_s", "light")


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
