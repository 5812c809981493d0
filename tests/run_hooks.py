"""The hooks testdata/train_run.py calls by name before training, in a fresh process: a stop signal
at a chosen call, a kill between a checkpoint's files and `latest`, a count of micro-batches, data
one rank cannot read."""
import os
import sys
import threading

import config
import train
from engines.plain_engine import PlainEngine


def hook_count_micro_batches(log: str) -> None:
    """(testdata/train_run.py) Every rank appends (its own micro-batch count, the agreed count) of
    each split to LOG/rank<R>."""
    all_max = train.all_max

    def logged_max(value):
        agreed = all_max(value)
        with open(os.path.join(log, "rank" + os.environ.get("RANK", "0")), "a") as f:
            f.write(f"{value} {agreed}\n")
        return agreed
    train.all_max = logged_max


def hook_kill_in_the_second_checkpoint() -> None:
    """(testdata/train_run.py) The process dies (exit 9) between the second checkpoint's files and
    `latest`."""
    replace_file, named = os.replace, []

    def dies_before_latest(src, dst):
        if str(dst).endswith("latest"):
            named.append(dst)
            if len(named) == 2:
                os._exit(9)
        return replace_file(src, dst)
    os.replace = dies_before_latest


# ==================================================================================================
# run_folder/: runs that survive a cluster (stop signals, --resume auto, world sizes, one writer,
# logs, verified checkpoints, exports)
# ==================================================================================================
def hook_signal_at(owner: str, name: str, nth: int, rank: str = "0", sig: str = "SIGTERM",
                   times: int = 1, parent: bool = False) -> None:
    """(testdata/train_run.py) A stop signal from inside the run at a chosen call (deterministic: no
    timing): `sig` `times` times to this process (or, `parent`, to the one that started it:
    torchrun) at the nth call of OWNER.NAME (owner: "train" or "engines.plain_engine.PlainEngine"),
    on rank `rank`."""
    import signal

    module, _, cls = owner.rpartition(".") if "." in owner else (owner, "", "")
    target = getattr(sys.modules[module], cls) if cls else sys.modules[module]
    original, calls = getattr(target, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth and os.environ.get("RANK", "0") == rank:
            for _ in range(times):
                os.kill(os.getppid() if parent else os.getpid(), getattr(signal, sig))
        return original(*args, **kwargs)
    setattr(target, name, wrapped)


def hook_full_disk(names: list[str], then: str = "", *args) -> None:
    """(testdata/train_run.py) run_folder's atomic writes of the files `names` fail as on a full
    disk (ENOSPC at their temporary file), then the hook named `then` with `args`, if any."""
    import builtins

    import run_folder.files
    from tests.toy_task import full_disk

    run_folder.files.open = full_disk(builtins.open, tuple(names))
    if then:
        globals()[then](*args)


def hook_signal_then_hang(nth: int) -> None:
    """(testdata/train_run.py) SIGTERM at the nth rollout, and then the rollout never returns, as a
    rank waits in a collective for a frozen one (SIGSTOP, a dead network)."""
    import signal

    sample, calls = PlainEngine.sample, []

    def hangs(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait()
        return sample(*args, **kwargs)
    PlainEngine.sample = hangs


def hook_rank_1_dies_before_the_process_group(joining: str) -> None:
    """(testdata/train_run.py) Rank 1 dies (exit 1) before it joins the process group, as a worker
    that crashes during startup, once rank 0 is joining it (the file `joining` exists)."""
    import time

    init_distributed = train.init_distributed

    def dies(*args, **kwargs):
        if os.environ.get("RANK") == "1":
            while not os.path.exists(joining):  # an order of events, not a timing
                time.sleep(0.05)
            os._exit(1)
        open(joining, "w").close()
        return init_distributed(*args, **kwargs)
    train.init_distributed = dies


def hook_data_unreadable_on_rank_1() -> None:
    """(testdata/train_run.py) Rank 1 cannot read the data (a file one node does not see)."""
    load_rows = config.load_rows

    def unreadable(cfg):
        if os.environ.get("RANK") == "1":
            raise ValueError("toy.jsonl line 3: unreadable here")
        return load_rows(cfg)
    config.load_rows = unreadable  # train.read_inputs reads the data
