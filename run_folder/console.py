"""A run's console lines and its error type: `say` prints rank 0's line above train.py's progress
bar (warnings on stderr); `RunError` is a failure the user can act on (a full disk, a folder in use,
no usable checkpoint); `quiet_library_bars` keeps transformers' own progress bars off it."""
from __future__ import annotations

import os
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


def quiet_library_bars() -> None:
    """transformers' own progress bars ("Loading weights", "Writing model shards", a GGUF file's
    conversion) off, so that the console holds the run's lines; on again with
    TRANSFORMERS_VERBOSITY=info (or debug). The Hub's download bars stay."""
    if os.environ.get("TRANSFORMERS_VERBOSITY", "").lower() in ("info", "debug"):
        return
    from transformers.utils import logging

    logging.set_tqdm_hook(lambda factory, args, kwargs: factory(*args, **{**kwargs,
                                                                         "disable": True}))


def plural(n: int, noun: str) -> str:
    """'1 step', '3 steps'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")
