"""The run folder: what a training run keeps on disk, and how it survives a cluster
(docs/outputs.md; the paper's runs last 5-7 days on 64 GPUs, docs/paper.md §6). OUT = --out-dir
holds config.json, the logs (*.jsonl), checkpoint/step_N/, hf/ (the exported model) and run.lock.
One concept per file, imported here under one name
(`run_folder.open_run`, `run_folder.Preemption`, ...):

    console.py      RunError, `say` (rank 0's line above the progress bar), `quiet_library_bars`
    files.py        what the folder holds, an atomic write, the commands that continue a stopped run
    agreement.py    every rank agrees on a failure
    lock.py         one writer: an exclusive lock on OUT/run.lock
    live_curves.py  --logger tensorboard | wandb
    logs.py         logs that cannot be torn
    checkpoints.py  verified checkpoints for any world size
    export.py       atomic, dated, verified Hugging Face exports
    signals.py      stop signals: every rank stops at the same point, writes a checkpoint, exits
                    STOPPED
    opening.py      a new run, or a resumed one checked against its recipe
"""
# ruff: noqa: F401 (the names below are this package's interface)
from run_folder.agreement import (agree, agreed_failure, agreed_write_failure, broadcast_failure,
                                  failure)
from run_folder.checkpoints import (
                                   ModelAndOptimizer,
                                   crc32,
                                   load_checkpoint,
                                   resume,
                                   save_checkpoint,
                                   verified_checkpoint,
)
from run_folder.console import RunError, plural, quiet_library_bars, say
from run_folder.export import export, export_damage, export_id, export_step, recover_export
from run_folder.files import (
                              FORMAT,
                              LOGS,
                              RESUMABLE,
                              RUN_FILES,
                              again,
                              code_version,
                              complete_steps,
                              continue_command,
                              resumable,
                              write_atomic,
)
from run_folder.live_curves import LOGGERS, Logger, check_logger, open_logger
from run_folder.lock import MOUNTS, Lock, node_local_flock
from run_folder.logs import append, cut_logs, fsync_logs, read_log, write_logs
from run_folder.opening import (finished, finished_read_only, open_run, recipe, recorded_config,
                                resume_changes, write_config)
from run_folder.signals import (
                              INTERRUPTED,
                              STOPPED,
                              Preemption,
                              leave,
                              leave_at_deadline,
                              leave_at_interrupt,
                              stopped,
                              write_stopped,
)
