"""train.py's checks that need neither the model nor the run folder, made first on every rank: the number
of processes, the logger, the data and its size against --prompts-per-step."""
from __future__ import annotations

import sys

import torch.distributed as dist

import config
import run_folder
from data import load_rows, repeated_note


# ------------------------------------------------------------------------------------------------- setup
def read_inputs(cfg: config.Config, world: int) -> tuple[list[dict], list[dict]]:
    """The checks that need neither the model nor the run folder, made first (every rank): the number of processes,
    the logger, the data -> (training rows, held-out rows) of data.load_rows."""
    if cfg.prompts_per_step % world or cfg.mini_batch_prompts % world:
        raise ValueError(f"--prompts-per-step and --mini-batch-prompts must be multiples of the {world} ranks")
    run_folder.check_logger(cfg.logger)
    train_rows, test_rows, repeated = load_rows(cfg)
    if repeated and dist.get_rank() == 0:
        print(f"train.py: note: {repeated_note(cfg.data, repeated, len(train_rows) + len(test_rows))}",
              file=sys.stderr, flush=True)
    too_few(cfg, len(train_rows))
    return train_rows, test_rows


def too_few(cfg: config.Config, n_rows: int) -> None:
    """A step takes each training problem at most once: refuse --prompts-per-step above the problems there are."""
    if cfg.prompts_per_step > n_rows:
        raise ValueError(f"--prompts-per-step {cfg.prompts_per_step} is more than the {n_rows} training problems of "
                         f"{cfg.data or 'the built-in task'} (a step takes each at most once): lower it")
