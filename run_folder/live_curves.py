"""Live curves (--logger tensorboard | wandb; docs/outputs.md): each metrics line also sent to a
logger, which is imported only when chosen."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from command_line.errors import one_line
from run_folder.console import say

# -------------------------------------------------------------------------------------- live curves
# --logger -> the package it needs
LOGGERS = {"": None, "tensorboard": "tensorboard", "wandb": "wandb"}


def check_logger(name: str) -> None:
    """A one-line error for an unknown --logger or one whose package is missing (before anything
    loads)."""
    if name not in LOGGERS:
        raise ValueError(f"unknown --logger {name!r}; valid: '', tensorboard, wandb")
    if name and importlib.util.find_spec(LOGGERS[name]) is None:
        raise ImportError(f"--logger {name} needs the {LOGGERS[name]} package: "
                          f"pip install {LOGGERS[name]}")


class Logger:
    """--logger: live curves in OUT/tensorboard or OUT/wandb of every metrics.jsonl and eval.jsonl
    line, each logged at its `step` with all its other keys. The package is imported only when
    chosen."""

    def __init__(self, name: str, out: Path, config: dict):
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out / "tensorboard"))
        else:
            import wandb

            self.writer = wandb.init(project="stapo", name=out.name, dir=str(out), config=config)

    def log(self, record: dict) -> None:
        # scalars only
        values = {k: v for k, v in record.items() if k != "step" and not isinstance(v, list)}
        if hasattr(self.writer, "add_scalar"):  # tensorboard
            for key, value in values.items():
                self.writer.add_scalar(key, value, record["step"])
        else:
            self.writer.log(values, step=record["step"])

    def close(self) -> None:
        """Flush and close the logger; one that cannot (a full disk) is a warning, so that a stop
        still writes stopped.json and exits with its status."""
        try:  # tensorboard, wandb
            (self.writer.close if hasattr(self.writer, "close") else self.writer.finish)()
        except Exception as e:  # noqa: BLE001 - whatever the logger's package raises
            say(f"could not close the --logger's files ({one_line(e)}): its last curves may be "
                f"missing; metrics.jsonl and eval.jsonl hold them", warning=True)


def open_logger(name: str, out: Path, config: dict) -> Logger | None:
    """The --logger `name` ('' = none) writing into the run folder OUT."""
    return Logger(name, out, config) if name else None
