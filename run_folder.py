"""The run folder: what a training run keeps on disk, and how it survives a cluster (docs/outputs.md).

The paper's runs last 5-7 days on 64 GPUs (docs/paper.md §6); such a run is preempted, requeued, restarted on
another number of nodes, and started twice by mistake. OUT = --out-dir holds `config.json`, the logs (`*.jsonl`,
one JSON object per line, each with its `step`), `checkpoint/step_N/`, `hf/` (the exported model) and `run.lock`.
What this file promises, each kept by one mechanism below:
1. One writer: rank 0 holds an exclusive lock on OUT/run.lock for the run's life (`Lock`); a second run or resume
   into the folder fails in one line naming the holder. The kernel drops the lock when its process dies, so a
   killed run never blocks its resume.
2. Logs cannot be torn: records are appended as whole lines (`append`); a resume drops a torn last line with a
   warning and the lines past its checkpoint by writing a new file and renaming it over the old one (`cut_logs`);
   a log untouched by that is never rewritten.
3. Checkpoints are verified: after the shards are written, the size and CRC-32 of every file go into
   `manifest.json`, and only then does `latest` name the folder (`save_checkpoint`); a resume checks them all
   (`verified_checkpoint`, the files shared out over the ranks) and falls back to the newest checkpoint that
   passes, with a warning.
4. Any world size: model and optimizer state are DCP shards, which torch.distributed.checkpoint reshards for any
   number of ranks; everything else (step, scheduler, RNG states) is one `state.pt`, the same for every rank.
5. Preemption: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) on any rank makes every rank stop at the same point, write a
   checkpoint and exit with status STOPPED (`Preemption`); a second Ctrl-C leaves at once (INTERRUPTED); the same
   command line with `--resume auto` continues the run (`continue_command` names it).
6. Exports are atomic, dated and verified: `hf/` is replaced by renaming a complete folder over it, and
   `hf/export.json` names the step it holds and every file's size and CRC-32 (`export`, `export_step`,
   `export_damage`: eval.py checks them before it loads the model).
`say` writes a line of rank 0 to the console, above train.py's progress bar (warnings on stderr).

Deliberate differences from verl / TRL / torchtitan checkpointing:
1. One complete, verified checkpoint is what `latest` names; verl and torchtitan trust the newest folder (a torn
   write is found at load time, if at all).
2. A signal does not save a mid-step state: a stop during the rollout abandons the step (the weights have not moved;
   the checkpoint is of the steps done), a stop during the updates finishes them first (docs/outputs.md#preemption).
3. A parameter shared by several modules (tied embeddings) is stored once (torch.distributed.checkpoint stores each
   name: SmolLM2's 113 MB embedding twice).
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import random
import re
import select
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from tqdm import tqdm

from command_line.errors import BAD_INPUT, InputError, check_writable, one_line

# The logs: one JSON object per line, each with the step it belongs to.
LOGS = ("metrics.jsonl", "eval.jsonl", "samples.jsonl", "spurious.jsonl", "tokens.jsonl", "resumes.jsonl")
# What a run writes into OUT: a new run refuses a folder that holds any of these unless --overwrite.
RUN_FILES = ("config.json", *LOGS, "checkpoint", "hf", "stopped.json", "metrics.png", "s2t.png", "gradient.png",
             "tensorboard", "wandb", "eval")
# Flags that may change when a run is resumed: how long it runs, what it evaluates and logs, how much memory a step
# takes, never what it computes (kv_cache_gb only with --rollout-chunk > 0: otherwise it sets the prompts per
# generate call, and with them the sampling seeds).
RESUMABLE = ("steps", "eval_every", "eval_samples", "samples_per_step", "spurious_per_step", "token_sample",
             "entropy_change", "save_every", "keep_checkpoints", "save_optimizer", "export_hf", "plots", "logger",
             "collective_timeout_min", "max_tokens_per_micro_batch", "chunk_size", "grad_checkpointing", "kv_cache_gb",
             "stop_deadline_s", "light")
STOPPED = 75  # exit status after a stop by signal, with a checkpoint written: run the same command again
#               (sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry")
INTERRUPTED = 130  # exit status after a second Ctrl-C, which leaves at once (128 + SIGINT, as a shell reports it)


class RunError(InputError):
    """A failure the user can act on (a full disk, a folder in use, no usable checkpoint): one line, exit 2."""


def say(message: str, rank: int = 0, warning: bool = False) -> None:
    """A line on rank 0's console (stderr for warnings), above train.py's progress bar."""
    if rank == 0:
        out = sys.stderr if warning else sys.stdout
        tqdm.write(f"train.py: warning: {message}" if warning else message, file=out)
        out.flush()


def plural(n: int, noun: str) -> str:
    """'1 step', '3 steps'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


# ---------------------------------------------------------------------------------------------- one writer
class Lock:
    """An exclusive `flock` on OUT/run.lock, held by rank 0 from before it reads the folder until the process
    ends; the file names the holder (host, pid, start). The kernel releases the lock when the holder dies (kill -9
    included), so a stale lock cannot block a resume.

    Shared filesystems: NFSv4 (and NFSv3 with lockd) carry flock across nodes as a whole-file lock; a crashed
    client's lock lasts until the server's lease expires (90 s by default). Lustre does so only when mounted with
    `-o flock`. With NFS's local_lock=flock (or =all) or Lustre's localflock the lock holds within one node: the run
    says so in one line (`node_local_flock`). Where the filesystem has no locks at all, the run warns and goes on
    unlocked."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "run.lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise RunError(f"{out} is in use by another run ({self.holder()}); one run writes into a folder at a time:"
                           f" wait for it, stop it, or choose another --out-dir") from None
        except OSError as e:  # ENOLCK, EOPNOTSUPP, ENOSYS: a filesystem without locks
            say(f"{out} cannot be locked ({e.strerror}): a second run into it would not be detected", warning=True)
        try:
            local = node_local_flock(out, MOUNTS.read_text())
        except OSError:  # no /proc (not Linux)
            local = None
        if local:
            say(f"{out} is on {local}: its lock holds within this node only, so a run on another node would not be "
                f"detected; remount without it (NFS: local_lock=none; Lustre: -o flock) or start one job per folder",
                warning=True)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"host {socket.gethostname()} pid {os.getpid()} since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())

    def holder(self) -> str:
        """Who holds the lock, as its file says (it writes that just after locking: wait a moment for it)."""
        for _ in range(50):
            text = self.path.read_text().strip()
            if text:
                return text
            time.sleep(0.02)
        return "a process that has not written its name yet"

    def release(self) -> None:
        os.close(self.fd)


MOUNTS = Path("/proc/self/mounts")  # device, mount point, type, options: one mount per line (Linux)


def node_local_flock(path: Path, mounts: str) -> str | None:
    """The mount that makes flock local to one node on the filesystem holding `path` (its deepest mount point in
    `mounts`, the text of /proc/self/mounts): 'nfs4 with local_lock=flock' (or =all), 'lustre with localflock'; None
    for any other. There flock succeeds on every node, so two nodes can both hold the one-writer lock."""
    path, found = path.resolve(), None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), parts[1]))  # a space is written \040
        if path.is_relative_to(point) and (found is None or len(point.parts) > len(found[0].parts)):
            found = (point, parts[2], parts[3].split(","))
    if found is None:
        return None
    _, kind, options = found
    local = [o for o in options if o in ("local_lock=flock", "local_lock=all", "localflock")]
    return f"{kind} with {local[0]}" if local and (kind.startswith("nfs") or kind == "lustre") else None


# --------------------------------------------------------------------------------------------------- logs
def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` whole: written to a new file, flushed to disk, renamed over it (a crash leaves the
    old file or the new one, never a torn one)."""
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


def append(out: Path, name: str, records: list[dict]) -> None:
    """Append records to the log OUT/name as whole lines (one write). A failure (a full disk) is a RunError that
    says the run can be resumed; a line it tore is dropped by the resume (`cut_logs`)."""
    if not records:
        return
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    try:
        with open(out / name, "ab") as f:
            f.write(data)
    except OSError as e:
        raise RunError(f"could not write {out / name} ({e.strerror or e}); {resumable(out)}") from None


def write_logs(out: Path, records: dict[str, list[dict]], rank: int, logger: Logger | None = None) -> None:
    """Every rank: rank 0 appends each log's records ({file name: lines}; `append`); a failure there raises RunError
    on every rank. Then the metrics.jsonl and eval.jsonl lines go to `logger` (--logger, rank 0) when given."""
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
    """The records of a log ([] if it does not exist): its lines that are whole JSON objects. The 1-based numbers of
    the others (torn writes: a last line without its newline, a damaged line) are appended to `torn` when given."""
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
    """A resume after `done` steps: drop each log's lines past step `done`, and lines torn by an interrupted write
    (with a warning naming the file). A log that needs no cut is not touched; another is rewritten whole
    (`write_atomic`), so a kill during the resume leaves it as it was or as it should be."""
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
    """Flush the logs to disk (before a checkpoint is named, so that a machine crash keeps the lines it covers)."""
    for name in LOGS:
        if (out / name).exists():
            with open(out / name, "rb") as f:
                os.fsync(f.fileno())


# ------------------------------------------------------------------------------------------------ checkpoints
def _step_dirs(out: Path) -> list[Path]:
    """OUT/checkpoint/step_N folders, newest first."""
    found = [p for p in (out / "checkpoint").glob("step_*") if p.name[5:].isdigit()]
    return sorted(found, key=lambda p: -int(p.name[5:]))


def complete_steps(out: Path) -> list[int]:
    """Steps of the complete checkpoints of OUT (a manifest.json, written last), newest first; not verified."""
    return [int(p.name[5:]) for p in _step_dirs(out) if (p / "manifest.json").is_file()]


def resumable(out: Path) -> str:
    """What a stopped run can do next, as the end of an error line."""
    steps = complete_steps(out)
    if not steps:
        return "no checkpoint was kept"
    return f"checkpoint/step_{steps[0]} is kept: python train.py --resume auto --out-dir {out} continues"


def again(out: Path) -> str:
    """How to start anew the run of OUT that stopped before its first checkpoint, for a command that named no recipe
    (--resume OUT): with its recipe (config.json)."""
    if (out / "config.json").is_file():
        return f"python train.py --config {out / 'config.json'} --resume auto"
    return f"the run's flags, --out-dir {out} and --resume auto"


def continue_command(argv: list[str]) -> str:
    """The user's own command line (train.py's flags `argv`) as it continues a run: with `--resume auto` unless it
    resumes already, without --overwrite (which would start anew); `torchrun ... train.py ...` under torchrun (its
    own flags are not visible to its workers)."""
    args = [a for a in argv if a not in ("--overwrite", "--no-overwrite")]
    if not any(a == "--resume" or a.startswith("--resume=") for a in args):
        args += ["--resume", "auto"]
    script = sys.argv[0] if Path(sys.argv[0]).name == "train.py" else "train.py"
    launcher = "torchrun ..." if "TORCHELASTIC_RUN_ID" in os.environ else "python"
    return f"{launcher} {shlex.join([script, *args])}"


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _checksums(folder: Path, names: list[str], rank: int, world: int) -> dict[str, list | None]:
    """{name: [bytes, crc32], or None when unreadable} of the files `names` of a folder, each rank reading
    names[rank::world]; the result gathered on every rank (a collective)."""
    mine = {}
    for n in names[rank::world]:
        try:
            mine[n] = [os.path.getsize(folder / n), _crc32(folder / n)]
        except OSError:
            mine[n] = None
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return {n: v for part in parts for n, v in part.items()}


def _unique_names(state_dict: dict) -> dict:
    """The state dict without the names of a parameter stored under an earlier name (tied embeddings)."""
    seen, unique = set(), {}
    for name, t in state_dict.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.device, local.data_ptr(), local.shape) if local.numel() else name
        if key not in seen:
            seen.add(key)
            unique[name] = t
    return unique


def save_checkpoint(out: Path, done: int, policy, optimizer, scheduler, config: dict, rank: int, world: int,
                    extra: dict | None = None) -> float:
    """Every rank: the checkpoint after `done` steps in OUT/checkpoint/step_<done>: DCP shards of the model (and of
    AdamW unless weights-only: config["save_optimizer"]), `state.pt` (step, scheduler, RNG states, config: the run's
    config.json values; `extra`: the trainer's own state, e.g. the S2T window), then `manifest.json` (every file's
    size and CRC-32), then `latest` names it; the oldest complete checkpoints beyond config["keep_checkpoints"] are
    deleted. Returns the seconds it took. A failure on any
    rank (a full disk) raises RunError on every rank, with the new folder removed and the previous checkpoints
    untouched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    t0, save_optimizer, keep = time.time(), config["save_optimizer"], config["keep_checkpoints"]
    path, latest = out / "checkpoint" / f"step_{done}", out / "checkpoint" / "latest"
    if rank == 0:  # left by a failed write, or past a damaged checkpoint that a resume skipped
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    failed = None
    try:
        model_sd, optim_sd = get_state_dict(policy, optimizer)
        dcp.save({"model": _unique_names(model_sd), **({"optim": optim_sd} if save_optimizer else {})},
                 checkpoint_id=str(path))
        if rank == 0:
            torch.save({"step": done, "optimizer": save_optimizer, "config": config, "world": world,
                        "scheduler": scheduler.state_dict(), "python_rng": random.getstate(),
                        "torch_rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                        **(extra or {})},
                       path / "state.pt")
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - OSError, torch's "[enforce fail at ...]"
        # DCP wraps each rank's error (a full disk in a shard) in a CheckpointException, a BaseException: its first
        failed = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
    failed = agreed_failure(failed)
    if failed is None:  # every file written: their sizes and checksums, then the manifest, then `latest`
        names = [sorted(p.name for p in path.iterdir()) if rank == 0 else None]
        dist.broadcast_object_list(names, src=0)  # one listing (a shared filesystem may list late elsewhere)
        files = _checksums(path, names[0], rank, world)
        try:
            unreadable = [n for n, v in files.items() if v is None]
            if unreadable:
                raise OSError(f"{unreadable[0]} cannot be read back")
            if rank == 0:
                write_atomic(path / "manifest.json", json.dumps({"step": done, "files": files}).encode())
                fsync_logs(out)
                write_atomic(latest, path.name.encode())
        except OSError as e:
            failed = e
        failed = agreed_failure(failed)
    if failed is not None:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        raise RunError(f"could not write {path} (a full disk?): {failed}; {resumable(out)}")
    if rank == 0:  # the newest `keep` complete checkpoints stay (this one included), and nothing older
        for old in [p for p in _step_dirs(out) if int(p.name[5:]) < done][max(keep - 1, 0):]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return time.time() - t0


def agreed_failure(failed: Exception | None) -> str | None:
    """Every rank: one line describing the first failure of any rank (naming it when not every rank failed), None
    when every rank succeeded; a collective."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, None if failed is None else one_line(failed))
    bad = [(r, m) for r, m in enumerate(parts) if m is not None]
    if not bad:
        return None
    return bad[0][1] if len(bad) == len(parts) else f"rank {bad[0][0]}: {bad[0][1]}"


def agree(work, *args):
    """work(*args) on every rank; a bad input on any rank raises on every rank (naming the rank unless all
    failed), so that rank 0 prints it once and no rank waits in a collective for one that failed."""
    try:
        result, failed = work(*args), None
    except BAD_INPUT as e:
        result, failed = None, e
    failed = agreed_failure(failed)
    if failed:
        raise ValueError(failed)
    return result


def broadcast_failure(failed: Exception | None, rank: int) -> str | None:
    """Every rank: rank 0's failure as one line (None without one); a collective. For work only rank 0 does."""
    message = [None if failed is None else one_line(failed)]
    dist.broadcast_object_list(message, src=0)
    return message[0]


def verified_checkpoint(out: Path, rank: int, world: int) -> tuple[int, Path]:
    """Every rank: (steps done, folder) of the newest checkpoint of OUT whose every file has its manifest's size and
    CRC-32 (each rank checks a share of the files). A newer checkpoint that fails, or a `latest` that names a missing
    one or cannot be read, is reported with a warning, and the run goes on from an older one (the newer ones are
    removed); with none left, RunError. A collective: rank 0 reads the folder, every rank reads its share of the
    files."""
    plan, latest, named = [None], out / "checkpoint" / "latest", None
    if rank == 0 and latest.is_file():
        try:
            named = latest.read_bytes().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:  # a flipped bit, a foreign file: the manifests decide
            say(f"{latest} cannot be read ({getattr(e, 'strerror', None) or 'not UTF-8'}): it names no checkpoint",
                warning=True)
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
                say(f"resuming from {name}, the newest checkpoint that passes its checks", warning=True)
                for newer in _step_dirs(out):  # damaged or incomplete: the run writes them again
                    if int(newer.name[5:]) > int(name[5:]):
                        shutil.rmtree(newer, ignore_errors=True)
                write_atomic(latest, name.encode())
            dist.barrier()
            return int(name[5:]), path
        what = ", ".join(f"{n} ({'unreadable' if found[n] is None else 'damaged'})" for n in bad[:3])
        say(f"{path} fails its manifest: {what}; trying an older checkpoint", rank, warning=True)
    raise RunError(f"{out} has no checkpoint that passes its checks (the run stopped before its first one, or every "
                   f"checkpoint is damaged); start it anew with --overwrite")


def _manifest(folder: Path) -> dict | None:
    """{file: [bytes, crc32]} of a checkpoint folder's manifest.json, None without a readable one (incomplete)."""
    try:
        return json.loads((folder / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_checkpoint(path: Path, policy, optimizer, scheduler) -> dict:
    """Every rank: restore model, optimizer (when the checkpoint has it), scheduler and RNG states from the
    checkpoint folder `path` (any number of ranks: DCP reshards); returns its state.pt (step, config, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    state = torch.load(path / "state.pt", weights_only=False)
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    loaded = {"model": _unique_names(model_sd), **({"optim": optim_sd} if state["optimizer"] else {})}
    dcp.load(loaded, checkpoint_id=str(path))  # in place: a tied name's tensor is its first name's, loaded too
    if state["optimizer"]:
        set_state_dict(policy, optimizer, model_state_dict=model_sd, optim_state_dict=loaded["optim"])
    else:
        set_model_state_dict(policy, model_sd)
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])
    return state


# ---------------------------------------------------------------------------------------------- opening a run
def recipe(config: dict) -> dict:
    """What config.json records: the values in effect, without the flags that only say how this command starts
    (--resume, --overwrite), so that `--config OUT/config.json` reruns the recipe."""
    return {**config, "resume": "", "overwrite": False}


def recorded_config(out: Path) -> dict:
    """The config.json of the run in OUT, as a dict (one-line errors for a missing or unreadable file)."""
    path = out / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no run to resume: {path} does not exist")
    try:
        values = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path} is not a JSON object ({one_line(e)})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} is not a JSON object")
    return values


def resume_changes(recorded: dict, config: dict) -> dict:
    """{flag: [recorded, now]} of what a resume changes; ValueError for a flag outside RESUMABLE (a resumed run keeps
    its recipe). fsdp may change with the number of processes."""
    changed = {k: [recorded.get(k), v] for k, v in recipe(config).items()
               if k not in ("out_dir", "fsdp") and recorded.get(k) != v}
    refused = [k for k in changed if k not in RESUMABLE or (k == "kv_cache_gb" and config["rollout_chunk"] == 0)]
    if refused:
        k = refused[0]
        raise ValueError(f"--{k.replace('_', '-')} {config[k]!r} differs from the resumed run's {recorded.get(k)!r}: "
                         f"a resumed run keeps its recipe (on resume only "
                         f"{', '.join('--' + r.replace('_', '-') for r in RESUMABLE)} may change); start a new run "
                         f"with --out-dir to change it")
    return changed


def open_run(config: dict, recorded: dict | None, rank: int, world: int, command: str
             ) -> tuple[int, Path | None, Lock | None] | None:
    """Every rank, after the inputs are read and before the model loads (command: `continue_command`, for a refusal
    to name): rank 0 locks OUT (`Lock`), then
    - a new run (recorded None): refuses a folder that holds a run, unless --overwrite or `--resume auto` (a run
      without a checkpoint: it starts anew), clears it, writes config.json;
    - a resume: picks the newest verified checkpoint (`verified_checkpoint`), refuses --steps below its steps,
      drops the log lines past it (`cut_logs`), records what changed in resumes.jsonl, rewrites config.json.
    Returns (steps done, the checkpoint folder or None, the lock on rank 0), or None when a resume has nothing left
    to do (every step done, not stopped, the export up to date): then nothing in OUT is touched."""
    out = Path(config["out_dir"])
    if recorded is not None and finished_read_only(out, config):
        return None  # nothing to lock, verify or repair
    lock, failed = None, None
    if rank == 0:
        try:
            lock = Lock(out)
        except (OSError, RunError) as e:
            failed = e
    failed = broadcast_failure(failed, rank)
    if failed:
        raise RunError(failed)
    try:
        if recorded is None:
            _on_rank0(rank, lambda: _start(out, config, command))
            return 0, None, lock
        done, path = verified_checkpoint(out, rank, world)
        if config["steps"] < done:
            raise RunError(f"--steps {config['steps']} is less than the {done} steps {out} has done")
        if finished(out, config, done):
            if lock is not None:
                lock.release()
            return None
        _on_rank0(rank, lambda: _continue(out, config, recorded, done))
        return done, path, lock
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def finished(out: Path, config: dict, done: int | None) -> bool:
    """Whether a resume of the run in OUT, with a checkpoint of `done` steps, has nothing to do: every step of
    `config` done, not stopped by a signal, its export (if any) up to date."""
    return done == config["steps"] and not (out / "stopped.json").exists() and (
        not config["export_hf"] or export_step(out / "hf") == done)


def finished_read_only(out: Path, config: dict) -> bool:
    """A finished run (`finished`, by its newest complete checkpoint, unverified) in a folder this process cannot
    write (a read-only mount): a resume has nothing to do, and cannot lock, verify or repair it."""
    steps = complete_steps(out)
    if not steps or not finished(out, config, steps[0]):
        return False
    try:
        check_writable("--out-dir", out)
    except OSError:
        return True
    return False


def _on_rank0(rank: int, work) -> None:
    """Every rank: rank 0 does `work()`; its failure raises RunError on every rank."""
    failed = None
    if rank == 0:
        try:
            work()
        except (OSError, ValueError, RunError) as e:
            failed = e
    failed = broadcast_failure(failed, rank)
    if failed:
        raise RunError(failed)


def _start(out: Path, config: dict, command: str) -> None:
    """Rank 0, a new run: refuse or clear a folder that holds a run, then write config.json. command: the user's
    command with --resume auto (`continue_command`), which starts anew a run without a checkpoint."""
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not config["overwrite"] and config["resume"] != "auto" and not complete_steps(out):
        raise RunError(f"--out-dir {out} holds a run that stopped before its first checkpoint ({', '.join(found)}): "
                       f"start it again with {command}, choose another --out-dir, or replace it with --overwrite")
    if found and not config["overwrite"] and config["resume"] != "auto":
        raise RunError(f"--out-dir {out} holds a run ({', '.join(found)}): continue it with --resume {out} (or "
                       f"--resume auto), choose another --out-dir, or replace it with --overwrite")
    if found and not config["overwrite"]:
        say(f"{out} holds a run without a checkpoint (it stopped before its first): starting it anew", warning=True)
    for name in found:
        if (out / name).is_dir():
            shutil.rmtree(out / name)
        else:
            (out / name).unlink()
    write_atomic(out / "config.json", json.dumps(recipe(config), indent=1).encode())


def _continue(out: Path, config: dict, recorded: dict, done: int) -> None:
    """Rank 0, a resume after `done` steps: the folder as the checkpoint left it, what changed recorded."""
    recover_export(out)
    (out / "stopped.json").unlink(missing_ok=True)
    cut_logs(out, done)
    append(out, "resumes.jsonl", [{"step": done, "changed": resume_changes(recorded, config)}])
    write_atomic(out / "config.json", json.dumps(recipe(config), indent=1).encode())


# ------------------------------------------------------------------------------------------------- preemption
class Preemption:
    """SIGTERM, SIGUSR1 and SIGINT (SLURM sends one of the first two before it preempts or at --signal=USR1@SECONDS;
    torchrun forwards SIGINT, SIGTERM and others to its workers; Ctrl-C in a terminal is SIGINT) set a flag instead of
    killing the process; the training loop stops at its next agreed point (`agreed`), writes a checkpoint and exits
    with STOPPED. A second stop signal with SIGINT among the two (Ctrl-C pressed again, or torchrun's SIGTERM after
    its SIGINT) leaves at once (`on_leave`), the last complete checkpoint kept.

    Any rank may receive the signal: `requested()` (polled by the sampler at every decode step, so a long rollout
    ends early) posts it in the process group's store and reads the other ranks' posts from it, at most once a
    second; `agreed()` is an all-reduce at the points where every rank stops together. Installed for the duration of
    a `with` block (the previous handlers come back after it).

    A watchdog thread sees each signal through `signal.set_wakeup_fd`, which the C-level handler writes even while
    the main thread is blocked in a collective or a long kernel (where the Python handler cannot run): it leaves at
    once at a second Ctrl-C, and calls `on_deadline` when a stop has not ended the run `deadline_s` seconds after its
    signal (`arm`; a frozen rank holds every other one in a collective, up to --collective-timeout-min)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    KEY = "stapo/stop"
    POLL_S = 1.0

    def __init__(self):
        self.signal, self.received, self.posted, self.polled, self.previous = None, None, False, 0.0, {}
        self.deadline_s, self.on_deadline, self.armed, self.done = None, None, threading.Event(), threading.Event()
        self.first, self.leaving = None, threading.Lock()  # the first signal's number on this rank
        self.command = "the same command with --resume auto"  # what continues the run (main: continue_command)
        self.on_leave = self._leave_before_start  # called with the second signal's name (main: run_folder.leave)

    def __enter__(self) -> Preemption:
        for s in self.SIGNALS:
            self.previous[s] = signal.signal(s, self._on_signal)
        read, self.wakeup = os.pipe()
        os.set_blocking(self.wakeup, False)
        self.previous_wakeup = signal.set_wakeup_fd(self.wakeup)
        threading.Thread(target=self._watch, args=(read,), daemon=True, name="stop-watchdog").start()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)  # one that came during startup (train.py) is kept
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.done.set()
        self.armed.set()
        signal.set_wakeup_fd(self.previous_wakeup)
        os.close(self.wakeup)  # the watchdog reads the end of the pipe and ends

    def arm(self, deadline_s: float, on_deadline) -> None:
        """From now on, on_deadline() runs (in the watchdog thread) when a stop signal has not ended the `with` block
        within deadline_s seconds."""
        self.deadline_s, self.on_deadline = deadline_s, on_deadline
        self.armed.set()

    def _watch(self, read: int) -> None:
        """The watchdog thread: reads each signal's byte from the wakeup pipe; after a first stop signal it waits for
        `arm` and the deadline, and leaves at once at a second one with SIGINT among the two."""
        started = first = None
        try:
            while True:
                wait = None  # seconds to the deadline, or None: until the next signal
                if started is not None and not self.armed.is_set():
                    wait = 0.2  # not armed yet: look again
                elif started is not None and self.deadline_s and not self.done.is_set():
                    wait = started + self.deadline_s - time.monotonic()
                    if wait <= 0:
                        self.on_deadline()
                        return
                if not select.select([read], [], [], wait)[0]:
                    continue
                byte = os.read(read, 1)
                if not byte or self.done.is_set():  # __exit__ closed the pipe
                    return
                if byte[0] not in self.SIGNALS:
                    continue
                if started is None:
                    started, first = time.monotonic(), byte[0]
                elif signal.SIGINT in (first, byte[0]):
                    self.signal = self.signal or signal.Signals(first).name  # the main thread may not have run yet
                    self._leave(byte[0])
        finally:
            os.close(read)

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal, self.received, self.first = signal.Signals(signum).name, time.monotonic(), signum
        elif signal.SIGINT in (signum, self.first):  # Ctrl-C again (a stop posted by another rank has no `first`)
            self._leave(signum)

    def _leave(self, signum: int) -> None:
        """A second stop signal with SIGINT among the two: `on_leave` ends the process (once, from whichever of the
        main thread and the watchdog sees it first)."""
        if self.leaving.acquire(blocking=False):
            self.on_leave(signal.Signals(signum).name)

    @staticmethod
    def _leave_before_start(name: str) -> None:
        print(f"train.py: {name} again before the run started: leaving at once (nothing was written)",
              file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)

    def requested(self) -> bool:
        """Whether this rank or (read at most once per POLL_S from the store) another one received a stop signal."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signal is not None
        store = dist.distributed_c10d._get_default_store()  # the group's key-value store (no public accessor)
        if self.signal and not self.posted:
            store.set(self.KEY, self.signal)
            self.posted = True
        elif not self.signal and time.monotonic() - self.polled > self.POLL_S:
            self.polled = time.monotonic()
            if store.check([self.KEY]):
                self.signal, self.received = store.get(self.KEY).decode() + " (to another rank)", time.monotonic()
        return self.signal is not None

    def agreed(self) -> bool:
        """Every rank at the same point: whether any rank was asked to stop (one all-reduce)."""
        flag = torch.tensor([self.requested()], dtype=torch.long)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal is None:  # the rank that got it posted its name before this all-reduce
            store = dist.distributed_c10d._get_default_store()
            self.signal, self.received = store.get(self.KEY).decode() + " (to another rank)", time.monotonic()
        return bool(flag.item())


def write_stopped(out: Path, signal_name: str, saved: int | None) -> None:
    """OUT/stopped.json: the run was stopped by a signal, with the checkpoint of `saved` steps (None: stopped
    before its first step); removed when the run goes on. A requeue script tests it (torchrun exits 1 whatever
    its workers' status; `python train.py` exits with STOPPED)."""
    write_atomic(out / "stopped.json", json.dumps({"signal": signal_name, "steps_done": saved or 0, "checkpoint":
                                                   f"checkpoint/step_{saved}" if saved else None}).encode())


def stopped(out_dir: str, steps: int, rank: int, preemption: Preemption, saved: int, where: str,
            done: int | None = None) -> int:
    """OUT/stopped.json and the one line of a run of `steps` steps in `out_dir` stopped by a signal after `done` steps
    (default: `saved`), with the checkpoint of `saved` steps (0: none); returns STOPPED."""
    done = saved if done is None else done
    if rank == 0:
        write_stopped(Path(out_dir), preemption.signal, saved or None)
    kept = (f"checkpoint/step_{saved} is kept; continue with: {preemption.command}" if saved else
            f"nothing to keep; {preemption.command} starts it again")
    say(f"stopped by {preemption.signal} {where}, {plural(done, 'step')} of {steps} done, "
        f"{time.monotonic() - preemption.received:.1f} s after the signal: {kept}", rank)
    return STOPPED


def leave(out_dir: str, rank: int, preemption: Preemption, why: str, status: int, every_rank: bool) -> None:
    """Leave now, without a checkpoint of this stop (the watchdog thread of `Preemption`, or its signal handler):
    stopped.json (rank 0) naming the newest complete checkpoint, one line (on every rank when `every_rank`, else on
    rank 0), exit `status`. `why` begins the line: what made the rank leave."""
    out, kept = Path(out_dir), complete_steps(Path(out_dir))
    if rank == 0:
        write_stopped(out, preemption.signal or "a stop signal", kept[0] if kept else None)
    then = (f"checkpoint/step_{kept[0]} is kept; continue with: {preemption.command}" if kept else
            f"no checkpoint was kept; {preemption.command} starts the run again")
    if every_rank or rank == 0:
        bar = "\n" if rank == 0 and tqdm._instances else ""  # below a progress bar's unfinished line
        print(f"{bar}train.py: warning: {'rank %d: ' % rank if every_rank else ''}{why}: leaving without a checkpoint "
              f"of this stop; {then}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def leave_at_deadline(out_dir: str, deadline_s: float, rank: int, preemption: Preemption) -> None:
    """--stop-deadline-s (deadline_s) passed since a stop signal and the ranks have not stopped together: leave now
    with exit status STOPPED, one line on every rank (the frozen one may be rank 0)."""
    leave(out_dir, rank, preemption, f"{preemption.signal or 'a stop signal'} came {deadline_s:g} s ago "
          f"(--stop-deadline-s) and the ranks have not stopped together (a rank frozen, or its network down?)",
          STOPPED, every_rank=True)


def leave_at_interrupt(out_dir: str, rank: int, preemption: Preemption, name: str) -> None:
    """A second stop signal with Ctrl-C among the two (`Preemption`): leave at once with exit status INTERRUPTED,
    one line on rank 0 (torchrun signals every rank)."""
    leave(out_dir, rank, preemption, f"{name} after {preemption.signal}", INTERRUPTED, every_rank=False)


# --------------------------------------------------------------------------------------------------- export
def export(policy, tokenizer, out: Path, step: int, dtype: torch.dtype, rank: int) -> None:
    """Every rank: the model after `step` steps as a Hugging Face folder OUT/hf, written into OUT/hf.partial (with
    `export.json` naming the step and each file's size and CRC-32, last) and renamed over OUT/hf; the previous export
    stays whole until then. A
    failure (a full disk, an unwritable folder) removes the partial folder and raises RunError on every rank."""
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
            for p in [p for p in partial.iterdir() if p.is_file()]:  # transformers writes the weights 0600 (a
                os.chmod(p, 0o666 & ~umask)  # temporary file renamed): readable by others, as the other files are
            files = {p.name: [p.stat().st_size, _crc32(p)] for p in sorted(partial.iterdir()) if p.is_file()}
            write_atomic(partial / "export.json", json.dumps({"step": step, "files": files}).encode())
            if final.exists():
                os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        failed = e
    failed = agreed_failure(failed)
    if failed is not None:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            if old.exists() and not final.exists():
                os.replace(old, final)
        raise RunError(f"could not export the model to {final} ({failed}); the checkpoint is kept: python train.py "
                       f"--resume auto --out-dir {out} exports it again")


def recover_export(out: Path) -> None:
    """An export interrupted between its two renames: OUT/hf.previous (the old export) and OUT/hf.partial complete
    or not, OUT/hf missing. Put the newest complete folder back as OUT/hf."""
    final = out / "hf"
    if final.exists():
        return
    for candidate in (out / "hf.partial", out / "hf.previous"):
        if (candidate / "export.json").is_file():
            os.replace(candidate, final)
            return


def export_damage(folder: Path) -> str | None:
    """The first file of an exported model folder whose size or CRC-32 differs from its export.json (a flipped bit,
    a cut copy), as 'NAME (damaged)' or 'NAME (missing)'; None when every file matches or no export.json lists
    them (a folder not exported by train.py)."""
    try:
        files = json.loads((Path(folder) / "export.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for name, expected in files.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} (missing)"
        if [path.stat().st_size, _crc32(path)] != expected:
            return f"{name} (damaged)"
    return None


def export_id(folder: Path) -> dict | None:
    """What identifies a train.py export, for the evaluations of it: {"step": the step it holds, "checksum": the
    CRC-32 of its export.json's file list (each file's size and CRC-32), so of its weights}; None for a folder that
    is not one (a Hub id, a model saved elsewhere)."""
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


# ----------------------------------------------------------------------------------------------- live curves
LOGGERS = {"": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # --logger -> the package it needs


def check_logger(name: str) -> None:
    """A one-line error for an unknown --logger or one whose package is missing (before anything loads)."""
    if name not in LOGGERS:
        raise ValueError(f"unknown --logger {name!r}; valid: '', tensorboard, wandb")
    if name and importlib.util.find_spec(LOGGERS[name]) is None:
        raise ImportError(f"--logger {name} needs the {LOGGERS[name]} package: pip install {LOGGERS[name]}")


class Logger:
    """--logger: live curves in OUT/tensorboard or OUT/wandb of every metrics.jsonl and eval.jsonl line, each
    logged at its `step` with all its other keys. The package is imported only when chosen."""

    def __init__(self, name: str, out: Path, config: dict):
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out / "tensorboard"))
        else:
            import wandb

            self.writer = wandb.init(project="stapo", name=out.name, dir=str(out), config=config)

    def log(self, record: dict) -> None:
        values = {k: v for k, v in record.items() if k != "step" and not isinstance(v, list)}  # scalars only
        if hasattr(self.writer, "add_scalar"):  # tensorboard
            for key, value in values.items():
                self.writer.add_scalar(key, value, record["step"])
        else:
            self.writer.log(values, step=record["step"])

    def close(self) -> None:
        (self.writer.close if hasattr(self.writer, "close") else self.writer.finish)()  # tensorboard, wandb


def open_logger(name: str, out: Path, config: dict) -> Logger | None:
    """The --logger `name` ('' = none) writing into the run folder OUT."""
    return Logger(name, out, config) if name else None
