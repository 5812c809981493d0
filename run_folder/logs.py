"""The run's logs (docs/outputs.md): one JSON object per line, appended whole; a resume drops a torn
last line with a warning and cuts the lines past its checkpoint by writing a new file and renaming
it over the old one."""
from __future__ import annotations

import json
import os
from pathlib import Path

from run_folder.agreement import broadcast_failure
from run_folder.console import RunError, say
from run_folder.files import LOGS, resumable, write_atomic
from run_folder.live_curves import Logger


def append(out: Path, name: str, records: list[dict]) -> None:
    """Append records to the log OUT/name as whole lines (one write). A failure (a full disk) is a
    RunError that says the run can be resumed; a line it tore is dropped by the resume
    (`cut_logs`)."""
    if not records:
        return
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    try:
        with open(out / name, "ab") as f:
            f.write(data)
    except OSError as e:
        raise RunError(f"could not write {out / name} ({e.strerror or e}); "
                       f"{resumable(out)}") from None


def write_logs(out: Path, records: dict[str, list[dict]], rank: int,
               logger: Logger | None = None) -> None:
    """Every rank: rank 0 appends each log's records ({file name: lines}; `append`); a failure there
    raises RunError on every rank. Then the metrics.jsonl and eval.jsonl lines go to `logger`
    (--logger, rank 0) when given."""
    failed = None
    if rank == 0:
        try:
            for name, lines in records.items():
                append(out, name, lines)
        except RunError as e:
            failed = e
    failed = broadcast_failure(failed, rank)
    if failed:
        raise RunError(failed)
    for name in ("eval.jsonl", "metrics.jsonl"):
        for record in records.get(name, []) if logger else []:
            logger.log(record)


def read_log(path: Path, torn: list[int] | None = None) -> list[dict]:
    """The records of a log ([] if it does not exist): its lines that are whole JSON objects. The
    1-based numbers of the others (torn writes: a last line without its newline, a damaged line) are
    appended to `torn` when given."""
    path, records, torn = Path(path), [], [] if torn is None else torn
    if path.is_file():
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    record = json.loads(raw) if raw.endswith(b"\n") else None
                except ValueError:
                    record = None
                if isinstance(record, dict):
                    records.append(record)
                else:
                    torn.append(n)
    return records


def cut_logs(out: Path, done: int) -> None:
    """A resume after `done` steps: drop each log's lines past step `done`, and lines torn by an
    interrupted write (with a warning naming the file). A log that needs no cut is not touched;
    another is rewritten whole (`write_atomic`), so a kill during the resume leaves it as it was or
    as it should be."""
    for name in LOGS:
        path = out / name
        torn = []
        records = read_log(path, torn)
        keep = [r for r in records if r.get("step", 0) <= done]
        for n in torn:
            say(f"{path} line {n} is torn (an interrupted write): dropped", warning=True)
        if torn or len(keep) < len(records):
            write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep).encode())


def fsync_logs(out: Path) -> None:
    """Flush the logs to disk (before a checkpoint is named, so that a machine crash keeps the lines
    it covers)."""
    for name in LOGS:
        if (out / name).exists():
            with open(out / name, "rb") as f:
                os.fsync(f.fileno())
