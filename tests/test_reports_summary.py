"""reports/summary.py: a run's summary, the runs side by side (--table) and the (tau_p, quantile)
grid (--sensitivity)."""
from pathlib import Path

import pytest

import train
from reports import summary
from tests.toy_task import EVEN, one_thread, patch_toy_task, read_metrics, toy_args, toy_data


def test_plot_tables_side_by_side_and_sensitivity_grid(tmp_path, monkeypatch, capsys):
    """Tiny runs on a 2 x 2 grid of (tau_p, quantile), one cell with two seeds: --sensitivity puts
    each run in its cell with the seed count, and the silenced shares are the runs' own sums;
    --table puts one row per setting."""
    patch_toy_task(monkeypatch, EVEN)
    data, runs = toy_data(tmp_path), []
    with one_thread():
        for tau, q, seed in ((0.2, 0.5, 0), (0.2, 0.9, 0), (0.5, 0.5, 0), (0.5, 0.9, 0),
                             (0.5, 0.9, 1)):
            runs.append(str(tmp_path / f"t{tau}-q{q}-s{seed}"))
            assert train.main(toy_args(data, Path(runs[-1]), tau_p=tau, quantile=q, seed=seed,
                                        heldout=4, export_hf=False)) == 0
    capsys.readouterr()
    assert train.main(["--plot", *runs, "--sensitivity", "--out", str(tmp_path / "grid.png")]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split("|")[1:3]): line.split("|")[3:-1] for line in table
            if line.startswith("| 0.")}
    assert list(rows) == [(" 0.2 ", " 0.5 "), (" 0.2 ", " 0.9 "), (" 0.5 ", " 0.5 "),
                          (" 0.5 ", " 0.9 ")]
    assert [int(r[0]) for r in rows.values()] == [1, 1, 1, 2]  # seeds per cell
    one = summary.run_summary(runs[0])
    steps = read_metrics(Path(runs[0]))
    assert one["silenced"] == sum(m["s2t/silenced"] for m in steps) and one["tau_p"] == 0.2
    assert one["silenced_of_candidates"] == \
        pytest.approx(one["silenced"] / sum(m["s2t/candidates"] for m in steps))
    assert rows[(" 0.2 ", " 0.5 ")][5].strip() == format(one["silenced_of_tokens"], ".4%")
    assert rows[(" 0.2 ", " 0.5 ")][3].strip() == format(steps[-1]["reward/acc"], ".2f")
    assert "entropy change" not in table[0]  # no run logged it
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"
    # four settings (the last two runs are seeds of one)
    assert train.main(["--plot", *runs, "--table"]) == 0
    assert sum(line.startswith("| stapo (") for line in capsys.readouterr().out.splitlines()) == 4


def test_closing_lines_count_one_in_the_singular():
    """One token, one step: "silenced 1 token in 1 of 1 step" (it said "1 tokens ... 1 steps")."""
    line = summary.silenced_summary("stapo", [{"s2t/silenced": 1, "s2t/candidates": 1}], [])
    assert line.startswith("stapo silenced 1 token in 1 of 1 step, of 1 candidate (tokens"), line
