"""One writer (docs/outputs.md): rank 0 holds an exclusive lock on OUT/run.lock for the run's life;
a second run or resume into the folder fails in one line naming the holder. The kernel drops the
lock when its process dies, so a killed run never blocks its resume."""
from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
import time
from pathlib import Path

from run_folder.console import RunError, say


# --------------------------------------------------------------------------------------- one writer
class Lock:
    """An exclusive `flock` on OUT/run.lock, held by rank 0 from before it reads the folder until
    the process ends; the file names the holder (host, pid, start). The kernel releases the lock
    when the holder dies (kill -9 included), so a stale lock cannot block a resume.

    Shared filesystems: NFSv4 (and NFSv3 with lockd) carry flock across nodes as a whole-file lock;
    a crashed client's lock lasts until the server's lease expires (90 s by default). Lustre does so
    only when mounted with `-o flock`. With NFS's local_lock=flock (or =all) or Lustre's localflock
    the lock holds within one node: the run says so in one line (`node_local_flock`). Where the
    filesystem has no locks at all, the run warns and goes on unlocked."""

    def __init__(self, out: Path, reader: str = ""):
        """reader: the program ('eval.py') that takes a shared lock instead, to read the run and
        write beside it: refused while a run writes there; no run can start there (--overwrite
        included) until it ends; none where the folder cannot hold a lock file (read-only: no run
        writes there either)."""
        self.path, self.fd = out / "run.lock", None
        try:
            if not reader:
                out.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            if reader and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return
            raise _unwritable(self.path, e) from None
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if reader else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            if reader:
                raise RunError(f"{out} is being written by a training run ({self.holder()}): "
                               f"evaluate it when that run has ended, or stop it") from None
            raise RunError(f"{out} is in use by another run ({self.holder()}); one run writes into "
                           f"a folder at a time: wait for it, stop it, or choose another "
                           f"--out-dir") from None
        except OSError as e:  # ENOLCK, EOPNOTSUPP, ENOSYS: a filesystem without locks
            if reader:
                return
            say(f"{out} cannot be locked ({e.strerror}): a second run into it would not be "
                f"detected", warning=True)
        try:
            local = node_local_flock(out, MOUNTS.read_text())
        except OSError:  # no /proc (not Linux)
            local = None
        if local and not reader:
            say(f"{out} is on {local}: its lock holds within this node only, so a run on another "
                f"node would not be detected; remount without it (NFS: local_lock=none; Lustre: "
                f"-o flock) or start one job per folder", warning=True)
        try:
            os.ftruncate(self.fd, 0)
            since = time.strftime('%Y-%m-%d %H:%M:%S')
            os.write(self.fd, f"{reader + ' ' if reader else ''}host {socket.gethostname()} pid "
                              f"{os.getpid()} since {since}\n".encode())
        except OSError as e:  # a full disk: no empty lock file left (this process holds the lock)
            if reader:
                return
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            raise _unwritable(self.path, e) from None

    def holder(self) -> str:
        """Who holds the lock, as its file says (it writes that just after locking: wait a moment
        for it)."""
        for _ in range(50):
            text = self.path.read_text().strip()
            if text:
                return text
            time.sleep(0.02)
        return "a process that has not written its name yet"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _unwritable(path: Path, e: OSError) -> RunError:
    """The one line of a lock file that cannot be made or written (a full disk, a read-only
    folder)."""
    return RunError(f"could not write {path} ({e.strerror or e}): free space on its disk (or make "
                    f"the folder writable), then run the same command again")


MOUNTS = Path("/proc/self/mounts")  # device, mount point, type, options: one mount per line (Linux)


def node_local_flock(path: Path, mounts: str) -> str | None:
    """The mount that makes flock local to one node on the filesystem holding `path` (its deepest
    mount point in `mounts`, the text of /proc/self/mounts): 'nfs4 with local_lock=flock' (or =all),
    'lustre with localflock'; None for any other. There flock succeeds on every node, so two nodes
    can both hold the one-writer lock."""
    path, found = path.resolve(), None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        # a space is written \040
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), parts[1]))
        if path.is_relative_to(point) and (found is None or len(point.parts) > len(found[0].parts)):
            found = (point, parts[2], parts[3].split(","))
    if found is None:
        return None
    _, kind, options = found
    local = [o for o in options if o in ("local_lock=flock", "local_lock=all", "localflock")]
    return f"{kind} with {local[0]}" if local and (kind.startswith("nfs") or kind == "lustre") \
        else None
