"""Every rank agrees on a failure (docs/outputs.md): a write that failed on one rank fails the run
on every rank at the same point, in one line, instead of leaving the others waiting in a
collective; a failure on one rank alone (your reward function) reaches the user as its one line,
and the other ranks' collectives that then fail add nothing (`failure`)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from command_line.errors import BAD_INPUT, one_line


def agreed_failure(failed: Exception | None) -> str | None:
    """Every rank: one line describing the first failure of any rank (naming it when not every rank
    failed), None when every rank succeeded; a collective."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, None if failed is None else one_line(failed))
    bad = [(r, m) for r, m in enumerate(parts) if m is not None]
    if not bad:
        return None
    return bad[0][1] if len(bad) == len(parts) else f"rank {bad[0][0]}: {bad[0][1]}"


def agreed_write_failure(failed: Exception | None, partial: Path, rank: int) -> str | None:
    """Every rank: `agreed_failure` of a write into the folder `partial`; after a failure on any
    rank, rank 0 has removed `partial`, what the write left. A collective."""
    failed = agreed_failure(failed)
    if failed is not None and rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    return failed


def agree(work, *args):
    """work(*args) on every rank; a bad input on any rank raises on every rank (naming the rank
    unless all failed), so that rank 0 prints it once and no rank waits in a collective for one that
    failed."""
    try:
        result, failed = work(*args), None
    except BAD_INPUT as e:
        result, failed = None, e
    failed = agreed_failure(failed)
    if failed:
        raise ValueError(failed)
    return result


def broadcast_failure(failed: Exception | None, rank: int) -> str | None:
    """Every rank: rank 0's failure as one line (None without one); a collective. For work only
    rank 0 does."""
    message = [None if failed is None else one_line(failed)]
    dist.broadcast_object_list(message, src=0)
    return message[0]


def failure(prog: str, e: Exception | str, rank: int, own: bool = False) -> int:
    """main's exit status 2 for the failure `e` on this rank, after its one line `PROG: error: ...`
    from the first rank that fails (the process group's store counts them), none from the others:
    their failures follow from it (a collective whose peer left: gloo's 'Connection closed by
    peer'). `own`: a failure of this rank alone (your reward function's), named by its rank. An
    error that is not a bad input, failing first, is raised again (a bug: its traceback)."""
    if not _first_failure(rank):
        return 2
    if not isinstance(e, (str, *BAD_INPUT)):
        raise e
    who = f"rank {rank}: " if own and dist.is_initialized() and dist.get_world_size() > 1 else ""
    print(f"{chr(10) if rank else ''}{prog}: error: {who}"  # below rank 0's progress bar
          f"{e if isinstance(e, str) else one_line(e)}", file=sys.stderr, flush=True)
    return 2


def _first_failure(rank: int) -> bool:
    """Whether this rank's failure is the run's first: the store's count of failed ranks (one
    process: always; before the process group exists every rank fails alike: rank 0's)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rank == 0
    try:  # the group's key-value store, which torchrun's agent serves (no public accessor)
        return dist.distributed_c10d._get_default_store().add("stapo/failed", 1) == 1
    except Exception:  # noqa: BLE001 - the store gone with its host: rank 0 speaks
        return rank == 0
