"""A run's console lines and its error type: `say` prints rank 0's line above train.py's progress
bar (warnings on stderr); `RunError` is a failure the user can act on (a full disk, a folder in use,
no usable checkpoint)."""
from __future__ import annotations

import sys

from tqdm import tqdm

from command_line.errors import InputError


class RunError(InputError):
    """A failure the user can act on (a full disk, a folder in use, no usable checkpoint): one line,
    exit 2."""


def say(message: str, rank: int = 0, warning: bool = False) -> None:
    """A line on rank 0's console (stderr for warnings), above train.py's progress bar."""
    if rank == 0:
        out = sys.stderr if warning else sys.stdout
        tqdm.write(f"train.py: warning: {message}" if warning else message, file=out)
        out.flush()


def plural(n: int, noun: str) -> str:
    """'1 step', '3 steps'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")
