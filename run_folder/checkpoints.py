"""Checkpoints (docs/outputs.md): model and optimizer state as DCP shards (any world size),
everything else in one state.pt; the size and CRC-32 of every file go into manifest.json before
`latest` names the folder, and a resume verifies them all and falls back to the newest checkpoint
that passes (docs/paper.md, "Deliberate differences": D83 and D85)."""
from __future__ import annotations

import json
import os
import random
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from run_folder.agreement import agreed_write_failure
from run_folder.console import RunError, plural, say
from run_folder.files import FORMAT, _step_dirs, resumable, write_atomic
from run_folder.logs import fsync_logs


def crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _checksums(folder: Path, names: list[str], rank: int, world: int) -> dict[str, list | None]:
    """{name: [bytes, crc32], or None when unreadable} of the files `names` of a folder, each rank
    reading names[rank::world]; the result gathered on every rank (a collective)."""
    mine = {}
    for n in names[rank::world]:
        try:
            mine[n] = [os.path.getsize(folder / n), crc32(folder / n)]
        except OSError:
            mine[n] = None
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return {n: v for part in parts for n, v in part.items()}


def _unique_names(state_dict: dict) -> dict:  # D85
    """The state dict without the names of a parameter stored under an earlier name (tied
    embeddings)."""
    seen, unique = set(), {}
    for name, t in state_dict.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.device, local.data_ptr(), local.shape) if local.numel() else name
        if key not in seen:
            seen.add(key)
            unique[name] = t
    return unique


@dataclass
class ModelAndOptimizer:
    """The training objects a checkpoint saves and restores: the policy (FSDP2-sharded or not), its
    AdamW optimizer and the optimizer's learning-rate scheduler."""
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def save_checkpoint(out: Path, done: int, trained: ModelAndOptimizer, config: dict, rank: int,
                    world: int, extra: dict | None = None) -> float:
    """Every rank: the checkpoint after `done` steps in OUT/checkpoint/step_<done>: DCP shards of
    the model (and of AdamW unless weights-only: config["save_optimizer"]), `state.pt` (step,
    scheduler, RNG states, config: the run's config.json values; `extra`: the trainer's own state,
    e.g. the S2T window), then `manifest.json` (every file's size and CRC-32), then `latest` names
    it; the oldest complete checkpoints beyond config["keep_checkpoints"] are deleted. Returns the
    seconds it took. A failure on any rank (a full disk) raises RunError on every rank, with the new
    folder removed and the previous checkpoints untouched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    policy, optimizer, scheduler = trained.policy, trained.optimizer, trained.scheduler
    t0, save_optimizer, keep = time.time(), config["save_optimizer"], config["keep_checkpoints"]
    path, latest = out / "checkpoint" / f"step_{done}", out / "checkpoint" / "latest"
    if rank == 0:  # left by a failed write, or past a damaged checkpoint that a resume skipped
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    failed = None
    try:
        model_sd, optim_sd = get_state_dict(policy, optimizer)
        dcp.save({"model": _unique_names(model_sd),
                  **({"optim": optim_sd} if save_optimizer else {})},
                 checkpoint_id=str(path))
        if rank == 0:
            torch.save({"format": FORMAT, "step": done, "optimizer": save_optimizer,
                        "config": config, "world": world,
                        "scheduler": scheduler.state_dict(), "python_rng": random.getstate(),
                        "torch_rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available()
                                    else None,
                        **(extra or {})},
                       path / "state.pt")
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - OSError, torch's "[enforce fail at ...]"
        # DCP wraps each rank's error (a full disk in a shard) in a CheckpointException, a
        # BaseException: its first
        failed = (next(iter(e.failures.values()))[0]
                  if isinstance(e, CheckpointException) and e.failures else e)
    failed = agreed_write_failure(failed, path, rank)
    if failed is None:  # every file written: sizes and checksums, then the manifest, then `latest`
        names = [sorted(p.name for p in path.iterdir()) if rank == 0 else None]
        # one listing (a shared filesystem may list late elsewhere)
        dist.broadcast_object_list(names, src=0)
        files = _checksums(path, names[0], rank, world)
        try:
            unreadable = [n for n, v in files.items() if v is None]
            if unreadable:
                raise OSError(f"{unreadable[0]} cannot be read back")
            if rank == 0:
                write_atomic(path / "manifest.json",
                             json.dumps({"format": FORMAT, "step": done, "files": files}).encode())
                fsync_logs(out)
                write_atomic(latest, path.name.encode())
        except OSError as e:
            failed = e
        failed = agreed_write_failure(failed, path, rank)
    if failed is not None:
        dist.barrier()
        raise RunError(f"could not write {path} (a full disk?): {failed}; {resumable(out)}")
    if rank == 0:  # the newest `keep` complete checkpoints stay (this one included), none older
        for old in [p for p in _step_dirs(out) if int(p.name[5:]) < done][max(keep - 1, 0):]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return time.time() - t0


def verified_checkpoint(out: Path, rank: int, world: int) -> tuple[int, Path]:  # D83
    """Every rank: (steps done, folder) of the newest checkpoint of OUT whose every file has its
    manifest's size and CRC-32 (each rank checks a share of the files). A newer checkpoint that
    fails, or a `latest` that names a missing one or cannot be read, is reported with a warning, and
    the run goes on from an older one (the newer ones are removed); with none left, RunError. A
    collective: rank 0 reads the folder, every rank reads its share of the files."""
    plan, latest, named = [None], out / "checkpoint" / "latest", None
    if rank == 0 and latest.is_file():
        try:
            named = latest.read_bytes().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:  # a flipped bit, foreign file: manifests decide
            say(f"{latest} cannot be read ({getattr(e, 'strerror', None) or 'not UTF-8'}): "
                f"it names no checkpoint", warning=True)
    if rank == 0:
        if named is not None and not (out / "checkpoint" / named / "manifest.json").is_file():
            say(f"{latest} names {named}, which is missing or incomplete", warning=True)
        plan = [[(p.name, _manifest(p)) for p in _step_dirs(out) if _manifest(p) is not None]]
    dist.broadcast_object_list(plan, src=0)
    for name, expected in plan[0]:  # newest first
        path = out / "checkpoint" / name
        found = _checksums(path, sorted(expected), rank, world)
        bad = [n for n in sorted(expected) if found[n] != expected[n]]
        if not bad:
            if rank == 0 and named != name:
                say(f"resuming from {name}, the newest checkpoint that passes its checks",
                    warning=True)
                for newer in _step_dirs(out):  # damaged or incomplete: the run writes them again
                    if int(newer.name[5:]) > int(name[5:]):
                        shutil.rmtree(newer, ignore_errors=True)
                write_atomic(latest, name.encode())
            dist.barrier()
            return int(name[5:]), path
        what = ", ".join(f"{n} ({'unreadable' if found[n] is None else 'damaged'})"
                         for n in bad[:3])
        say(f"{path} fails its manifest: {what}; trying an older checkpoint", rank, warning=True)
    raise RunError(f"{out} has no checkpoint that passes its checks (the run stopped before its "
                   f"first one, or every checkpoint is damaged); start it anew with --overwrite")


def _manifest(folder: Path) -> dict | None:
    """{file: [bytes, crc32]} of a checkpoint folder's manifest.json, None without a readable one
    (incomplete)."""
    try:
        return json.loads((folder / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_checkpoint(path: Path, trained: ModelAndOptimizer) -> dict:
    """Every rank: restore model, optimizer (when the checkpoint has it), scheduler and RNG states
    from the checkpoint folder `path` (any number of ranks: DCP reshards); returns its state.pt
    (step, config, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    policy, optimizer, scheduler = trained.policy, trained.optimizer, trained.scheduler
    state = torch.load(path / "state.pt", weights_only=False)
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    loaded = {"model": _unique_names(model_sd),
              **({"optim": optim_sd} if state["optimizer"] else {})}
    # in place: a tied name's tensor is its first name's, loaded too
    dcp.load(loaded, checkpoint_id=str(path))
    if state["optimizer"]:
        set_state_dict(policy, optimizer, model_state_dict=model_sd,
                       optim_state_dict=loaded["optim"])
    else:
        set_model_state_dict(policy, model_sd)
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])
    return state


def resume(checkpoint: Path, trained: ModelAndOptimizer, steps: int, rank: int
           ) -> tuple[int, torch.Tensor]:
    """A resumed run's start from `checkpoint` (load_checkpoint), said in one line: the steps done
    and the --quantile-window's earlier candidates (a warning when it holds weights only)."""
    state = load_checkpoint(checkpoint, trained)
    start = state["step"]
    say(f"resuming from {checkpoint} at step {start + 1} ({plural(start, 'step')} done)"
        if start < steps else f"{checkpoint}: all {plural(start, 'step')} done, nothing to train",
        rank)
    if not state["optimizer"] and start < steps:  # an export-only resume restarts nothing
        say(f"{checkpoint} holds weights only (--no-save-optimizer): AdamW restarts from zero "
            f"moments, so the resumed run differs from an uninterrupted one", rank, warning=True)
    return start, state.get("s2t_window", torch.zeros(0))
