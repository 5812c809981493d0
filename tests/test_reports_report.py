"""reports/report.py (and reports/__main__.py): the command line that redraws finished runs
(train.py --plot, python -m reports): where it writes, its one-line errors, RQ1's correlations."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import train
from reports import figures, statistics
from tests.fake_runs import fake_run, token_records
from tests.toy_task import ROOT


def test_plot_gradient_figure_round_trips_from_the_run_folder(tmp_path, capsys):
    """The figure and the correlation line come from the run's tokens.jsonl alone (--plot)."""
    run = Path(fake_run(tmp_path / "run", [0.1, 0.2], [0.1, 0.3]))
    (run / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in token_records()))
    assert train.main(["--plot", str(run)]) == 0
    out = capsys.readouterr().out
    rho = statistics.gradient_analysis(token_records())["rho_p"]
    assert f"{run}: logit-gradient norm vs p: Spearman {rho:+.2f}" in out \
        and (run / "gradient.png").is_file()


def test_plot_cli_output_location_heldout_panel_and_errors(tmp_path, monkeypatch, capsys):
    import matplotlib.pyplot as plt

    a = fake_run(tmp_path / "runs" / "a", [-0.5, 0.0, 0.5], [0.2, 0.4])
    b = fake_run(tmp_path / "runs" / "b", [-0.5, 0.0, 0.5], [0.2, 0.6], algo="justrl")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    # the run folder, not the cwd
    assert train.main(["--plot", a]) == 0 and Path(a, "metrics.png").is_file()
    assert train.main(["--plot", a, b]) == 0 and Path(a, "compare.png").is_file()
    assert train.main(["--out", str(tmp_path / "x.png"), "--plot", a, b]) == 0 \
        and (tmp_path / "x.png").is_file()
    # a folder not yet made
    assert train.main(["--plot", a, "--out", str(tmp_path / "new" / "x.png")]) == 0
    assert (tmp_path / "new" / "x.png").is_file()
    assert list((tmp_path / "cwd").iterdir()) == []
    assert "--plot RUN [RUN ...]" in " ".join(subprocess.run([sys.executable, "train.py", "--help"],
                                                             cwd=ROOT, capture_output=True,
                                                             text=True).stdout.split())
    out = str(tmp_path / "module.png")  # the same figures without train.py
    module = subprocess.run([sys.executable, "-m", "reports", a, b, "--out", out],
                            cwd=ROOT, capture_output=True, text=True)
    assert module.returncode == 0 and (tmp_path / "module.png").is_file(), module.stderr
    # flags before the runs, and its errors named for the module (they once needed the runs first)
    first = subprocess.run([sys.executable, "-m", "reports", "--out", out + "2.png", a],
                           cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0 and Path(out + "2.png").is_file(), first.stderr
    gone = subprocess.run([sys.executable, "-m", "reports", str(tmp_path / "missing")],
                          cwd=ROOT, capture_output=True, text=True)
    assert gone.returncode == 2 and gone.stderr.strip().splitlines()[-1].startswith(
        "python -m reports: error: no run folder"), gone.stderr
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(["--plot", a, str(tmp_path / "missing")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("train.py: error:") \
        and "missing" in err[0]
    # held-out panel: eval.jsonl; integer x ticks; identical curves are named and drawn differently
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    assert figures.plot_metrics([a, b], str(tmp_path / "m.png"))
    fig = closed[0]
    fig.canvas.draw()
    held = next(ax for ax in fig.axes if ax.get_title().startswith("held-out accuracy"))
    assert [list(line.get_data()[1]) for line in held.lines] == [[0.2, 0.4], [0.2, 0.6]]
    assert list(held.lines[0].get_data()[0]) == [0, 2]
    # measured points, no line between them
    assert all(line.get_linestyle() == "None" for line in held.lines)
    assert all(float(t).is_integer() for ax in fig.axes for t in ax.get_xticks())
    reward_ax = next(ax for ax in fig.axes if ax.get_title().startswith("reward"))
    assert "identical: a = b" in [t.get_text() for t in reward_ax.texts] and not held.texts
    assert reward_ax.lines[0].get_linestyle() != reward_ax.lines[1].get_linestyle()
