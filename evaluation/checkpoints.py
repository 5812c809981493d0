"""The checkpoints eval.py scores (docs/paper.md §7; docs/evaluation.md), checked before any model
loads: a train.py output folder and its config.json (`train_run`), whose prompt format and
sampling eval.py --run takes; an export older than the run's newest checkpoint (`stale_export`);
the command that exports a run made without one (`export_command`); a model folder's weights
against its export's checksums and its safetensors headers (`check_weights`); a LABEL=NAME spec
(`label_name`)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def train_run(folder: str | Path) -> dict | None:
    """The config of a train.py output folder (its config.json), or None when `folder` is
    not one."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    values = json.loads(path.read_text())
    return values if isinstance(values, dict) and "max_response_len" in values else None


def stale_export(run: Path) -> str | None:
    """The warning when a run's export RUN/hf holds fewer steps than its newest checkpoint
    (run_folder/), else None."""
    import run_folder

    exported, kept = run_folder.export_step(run / "hf"), run_folder.complete_steps(run)
    if exported is not None and kept and kept[0] > exported:
        return (f"{run / 'hf'} holds the model after {run_folder.plural(exported, 'step')}, but "
                f"the run's newest checkpoint is after {kept[0]} "
                f"(python train.py --resume {run} --export-hf exports it)")
    return None


def export_command(run: Path, recorded: dict) -> str:
    """What exports a run's model without training (for a run made with --no-export-hf): its newest
    checkpoint."""
    import run_folder

    kept = run_folder.complete_steps(run)
    if not kept:
        return "the run has no checkpoint to export"
    # a run stopped early: its checkpoint
    steps = "" if kept[0] == recorded["steps"] else f" --steps {kept[0]}"
    return (f"export its checkpoint after {run_folder.plural(kept[0], 'step')} with: "
            f"python train.py --resume {run}{steps} --export-hf")


def label_name(spec: str) -> tuple[str, str]:
    """LABEL=NAME -> (LABEL, NAME); NAME alone -> (NAME, NAME)."""
    label, _, name = (spec.partition("=") if "=" in spec and not os.path.exists(spec)
                      else (spec, "", spec))
    return label or name, name


def check_weights(name: str) -> None:
    """Raise ValueError when a file of the model folder `name` differs from the checksums of its
    export.json (a train.py export: run_folder.export_damage) or a .safetensors file cannot be read
    (truncated by an interrupted copy or export): its header must describe the whole file. Other
    names pass."""
    if not os.path.isdir(name):
        return
    import run_folder
    damage = run_folder.export_damage(Path(name))
    if damage:
        raise ValueError(f"{name}: {damage} differs from its export.json checksums; copy or export "
                         f"it again (python train.py --resume RUN --export-hf)")
    from safetensors import SafetensorError, safe_open
    for path in sorted(Path(name).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: not a complete safetensors file ({str(e).strip()}); "
                             f"copy or export it again") from None
