"""The Hugging Face export (docs/outputs.md): hf/ is replaced by renaming a complete folder over it,
and hf/export.json names the step it holds and every file's size and CRC-32; eval.py checks them
before it loads."""
from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import torch

from run_folder.agreement import agreed_write_failure
from run_folder.checkpoints import crc32
from run_folder.console import RunError
from run_folder.files import write_atomic


# ------------------------------------------------------------------------------------------- export
def export(policy, tokenizer, out: Path, step: int, dtype: torch.dtype, rank: int) -> None:
    """Every rank: the model after `step` steps as a Hugging Face folder OUT/hf, written into
    OUT/hf.partial (with `export.json` naming the step and each file's size and CRC-32, last) and
    renamed over OUT/hf; the previous export stays whole until then. A failure (a full disk, an
    unwritable folder) removes the partial folder and raises RunError on every rank."""
    from model import save_hf

    partial, final, old = out / "hf.partial", out / "hf", out / "hf.previous"
    failed = None
    try:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        save_hf(policy, tokenizer, str(partial), dtype=dtype)
        if rank == 0:
            umask = os.umask(0o022)
            os.umask(umask)  # read it back: the process's umask
            # transformers writes the weights 0600 (a temporary file renamed): made readable by
            # others, as the other files are
            for p in [p for p in partial.iterdir() if p.is_file()]:
                os.chmod(p, 0o666 & ~umask)
            files = {p.name: [p.stat().st_size, crc32(p)] for p in sorted(partial.iterdir())
                     if p.is_file()}
            write_atomic(partial / "export.json",
                         json.dumps({"step": step, "files": files}).encode())
            if final.exists():
                os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - OSError; safetensors' own error for a full disk
        failed = e
    failed = agreed_write_failure(failed, partial, rank)
    if failed is not None:
        if rank == 0 and old.exists() and not final.exists():
            os.replace(old, final)
        raise RunError(f"could not export the model to {final} ({failed}); the checkpoint is kept: "
                       f"free space if the disk is full, then python train.py --resume auto "
                       f"--out-dir {out} exports it again")


def recover_export(out: Path) -> None:
    """An export interrupted between its two renames: OUT/hf.previous (the old export) and
    OUT/hf.partial complete or not, OUT/hf missing. Put the newest complete folder back as
    OUT/hf."""
    final = out / "hf"
    if final.exists():
        return
    for candidate in (out / "hf.partial", out / "hf.previous"):
        if (candidate / "export.json").is_file():
            os.replace(candidate, final)
            return


def export_damage(folder: Path) -> str | None:
    """The first file of an exported model folder whose size or CRC-32 differs from its export.json
    (a flipped bit, a cut copy), as 'NAME (damaged)' or 'NAME (missing)'; None when every file
    matches or no export.json lists them (a folder not exported by train.py)."""
    try:
        files = json.loads((Path(folder) / "export.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for name, expected in files.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} (missing)"
        if [path.stat().st_size, crc32(path)] != expected:
            return f"{name} (damaged)"
    return None


def export_id(folder: Path) -> dict | None:
    """What identifies a train.py export, for the evaluations of it: {"step": the step it holds,
    "checksum": the CRC-32 of its export.json's file list (each file's size and CRC-32), so of its
    weights}; None for a folder that is not one (a Hub id, a model saved elsewhere)."""
    try:
        record = json.loads((Path(folder) / "export.json").read_text())
        files = json.dumps(record["files"], sort_keys=True).encode()
        return {"step": int(record["step"]), "checksum": f"{zlib.crc32(files):08x}"}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def export_step(folder: Path) -> int | None:
    """The step an exported model folder holds (its export.json), None if it does not say."""
    try:
        return int(json.loads((Path(folder) / "export.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
