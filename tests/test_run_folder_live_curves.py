"""run_folder/live_curves.py: --logger tensorboard | wandb get exactly the keys and values of
metrics.jsonl and eval.jsonl, through a tiny run (each skipped without its package); a missing one
is one line before the model loads.
"""
import importlib.util
import json
from collections import defaultdict

import pytest

import run_folder
import train
from tests.toy_task import EVEN, one_thread, patch_toy_task, read_metrics, toy_args, toy_data


# ==================================================================================================
# run_folder/live_curves.py: the loggers (run_folder.Logger)
# ==================================================================================================
@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_train_logger_gets_the_metrics_keys(tmp_path, monkeypatch, name):
    """--logger receives exactly the keys of metrics.jsonl and eval.jsonl lines, at their steps."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed (optional: pip install {name})")
    patch_toy_task(monkeypatch, EVEN)
    logged = []
    if name == "wandb":
        import wandb

        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_SILENT", "true")
        log = wandb.sdk.wandb_run.Run.log
        monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", lambda self, data, step=None, **kw: (
            logged.append((step, dict(data))), log(self, data, step=step, **kw))[1])
    out = tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), out, steps=2, heldout=4, logger=name,
                                    export_hf=False)) == 0
    lines = read_metrics(out) + [json.loads(x)
                                 for x in (out / "eval.jsonl").read_text().splitlines()]
    expected = {key for line in lines for key in line
                if key != "step" and not isinstance(line[key], list)}
    assert "eval/correct" not in expected  # the per-problem counts stay in eval.jsonl
    if name == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
        events.Reload()
        assert set(events.Tags()["scalars"]) == expected
        logged = [(e.step, {key: e.value}) for key in expected for e in events.Scalars(key)]
    else:
        assert list((out / "wandb").glob("offline-run-*"))
    got = defaultdict(dict)
    for step, data in logged:
        got[step].update(data)
    assert {key for data in got.values() for key in data} == expected
    for line in lines:
        for key, value in line.items():
            if key != "step" and not isinstance(value, list):
                assert got[line["step"]][key] == pytest.approx(value, rel=1e-6), key


def test_train_logger_missing_package_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "tensorboard" else find_spec(n, *a))
    monkeypatch.setattr("startup.run.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", logger="tensorboard")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install tensorboard" in err[0] and not (tmp_path / "run").exists()
    assert train.main(toy_args(toy_data(tmp_path), tmp_path / "run", logger="mlflow")) == 2
    assert "unknown --logger 'mlflow'" in capsys.readouterr().err


def test_a_logger_that_cannot_close_is_a_warning(capsys):
    """A logger whose files cannot be flushed at its close (a full disk) is one warning, so that a
    stop still writes stopped.json and exits with its status. (Its OSError ended the stop with exit
    2 before stopped.json.)"""
    class FullDisk:
        def close(self):
            raise OSError(28, "No space left on device")

    logger = run_folder.Logger.__new__(run_folder.Logger)
    logger.writer = FullDisk()
    logger.close()
    assert capsys.readouterr().err.splitlines() == [
        "train.py: warning: could not close the --logger's files (No space left on device): its "
        "last curves may be missing; metrics.jsonl and eval.jsonl hold them"]
