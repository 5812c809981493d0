"""The error type and the one-line messages every file may import (it imports nothing of the
project): a bad input is one line `PROG: error: ...` and exit status 2 (docs/paper.md,
"Deliberate differences": D50)."""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path


class InputError(Exception):
    """A failure the user can act on, told in one line with exit status 2 (`BAD_INPUT`):
    run_folder.RunError (a full disk, a folder in use, no usable checkpoint), reward.RewardError (an
    error raised by your --reward function)."""


# What bad inputs raise: one line `PROG: error: ...` and exit status 2 (`error`); also a full disk,
# a folder in use.
BAD_INPUT = (FileNotFoundError, ValueError, KeyError, ImportError, OSError, InputError)  # D50


def one_line(e: BaseException) -> str:
    """An error as one line: its message's first line (an OSError's reason without "[Errno N]",
    the reason inside a Rust library's `IoError(Os { ..., message: "..." })`: safetensors'), or its
    type."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    text = str(e).strip()
    rust = re.search(r'IoError\(Os \{[^}]*message: "([^"]+)"', text)
    return rust[1] if rust else text.splitlines()[0] if text else type(e).__name__


def check_writable(flag: str, folder: str | Path) -> None:
    """Raise OSError in one line (naming `flag`) when files cannot be made in `folder`, or where it
    does not exist yet in the nearest folder above it (which would hold it): a read-only mount, no
    permission, a file in the way. A probe file that leaves nothing behind."""
    folder = Path(folder)
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise OSError(f"{flag} {folder} cannot be made: {existing} is a file")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise OSError(f"{flag} {folder} cannot be written: {e.strerror or e}") from None


def error(prog: str, e: BaseException | str, rank: int = 0) -> int:
    """A bad input: one line `PROG: error: ...` on stderr (rank 0 only); returns the exit
    status 2."""
    if rank == 0:
        print(f"{prog}: error: {e if isinstance(e, str) else one_line(e)}", file=sys.stderr,
              flush=True)
    return 2
