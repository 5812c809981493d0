"""run_folder/figures.py: what S2T saw, the gradient analysis, overlaid runs and seeds, live
curves."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import run_folder
import train
from run_folder import figures
from tests.toy_task import EVEN, ROOT, one_thread, patch_toy_task, read_metrics, toy_args, toy_data


# ==================================================================================================
# run_folder/figures.py and the loggers: what S2T saw, overlaid runs, live curves
# ==================================================================================================
def test_train_s2t_figure_and_tokens_file(tmp_path, monkeypatch, capsys):
    """A tiny run whose S2T mask fires (--tau-p 0.5: most tokens of a correct response are
    candidates): tokens.jsonl holds every drawn token with the values metrics.jsonl summarizes,
    s2t.png is drawn from it, `--plot` redraws both figures from the run's files alone, and the
    console's last lines count what was silenced."""
    patch_toy_task(monkeypatch, EVEN)
    out = tmp_path / "run"
    with one_thread():
        assert train.main(toy_args(toy_data(tmp_path), out, steps=2, tau_p=0.5, token_sample=1000,
                                    heldout=4, plots=True, export_hf=False)) == 0
    lines, metrics = run_folder.read_log(out / "tokens.jsonl"), read_metrics(out)
    silenced = [int(m["s2t/silenced"]) for m in metrics]
    assert min(silenced) > 0 and (f"stapo silenced {sum(silenced)} tokens in 2 of 2 steps; S2T "
                                  f"candidates (A > 0, p < tau_p): "
                                  f"{sum(int(m['s2t/candidates']) for m in metrics)} "
                                  f"(metrics.jsonl s2t/*; see spurious.jsonl, s2t.png, "
                                  f"gradient.png)" in capsys.readouterr().out)
    assert [(r["step"], r["mini_batch"]) for r in lines] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for r in lines:
        cols = ("p", "H", "A", "grad_norm", "weight", "correct", "candidate", "silenced")
        # 1000 > tokens: all
        assert len({len(r[c]) for c in cols}) == 1 and r["weight"] == [1.0] * len(r["p"])
        for p, h, a, correct, cand, sil in zip(
                *(r[c] for c in ("p", "H", "A", "correct", "candidate", "silenced"))):
            assert cand == (a > 0 and p < 0.5) \
                and (not sil or (cand and correct and h < r["tau_h"]))
    for m in metrics:
        mine = [r for r in lines if r["step"] == m["step"]]
        silenced = [g for r in mine for g, s in zip(r["grad_norm"], r["silenced"]) if s]
        assert m["s2t/silenced"] > 0 and len(silenced) == m["s2t/silenced"]
        assert sum(sum(r["candidate"]) for r in mine) == m["s2t/candidates"]
        # 4 prompts x G = 4
        assert sum(len(r["p"]) for r in mine) == round(m["response/len_mean"] * 16)
        assert sum(silenced) / len(silenced) == pytest.approx(m["s2t/grad_norm_silenced"],
                                                              rel=1e-3)
    for png in ("metrics.png", "s2t.png", "gradient.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
        (out / png).unlink()
    assert train.main(["--plot", str(out)]) == 0  # redrawn from the files
    assert all((out / png).is_file() for png in ("metrics.png", "s2t.png", "gradient.png"))


def _token_records(n: int = 400, seed: int = 0, sign: float = -1.0) -> list[dict]:
    """tokens.jsonl lines whose gradient norm falls (sign -1) or rises (+1) with log p, and does not
    depend on H."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.rand(n, generator=g) * -6  # p from 1e-6 to 1
    H = torch.rand(n, generator=g) * 3
    # monotone in p, noise
    norm = (1 + sign * logp / 6).clamp(min=0.01) + 0.05 * torch.rand(n, generator=g)
    half = n // 2
    return [{"step": 1, "mini_batch": k, "tau_h": None, "p": (10 ** logp[s]).tolist(),
             "H": H[s].tolist(), "A": [1.0] * half, "grad_norm": norm[s].tolist(),
             "weight": [1.0] * half, "correct": [k % 2] * half, "candidate": [0] * half,
             "silenced": [0] * half}
            for k, s in enumerate((slice(0, half), slice(half, n)))]


def test_plot_gradient_analysis_sign_and_bins():
    """RQ1's numbers on constructed tokens: the Spearman correlation has the sign built in (and ~0
    against an unrelated H), weights count a token as the tokens it stands for, and the bins hold
    the medians of their tokens."""
    falling = figures.gradient_analysis(_token_records())
    rising = figures.gradient_analysis(_token_records(sign=1))
    assert falling["rho_p"] < -0.9 and rising["rho_p"] > 0.9 and abs(falling["rho_h"]) < 0.15
    assert falling["n"] == 400 and falling["correct"]["n"] == falling["incorrect"]["n"] == 200
    # one bin per decade of p below 0.1 (centres -5.5 ... -1.5), finer above
    bins = falling["correct"]["bins_p"]
    assert [b[0] for b in bins][:5] == [-5.5, -4.5, -3.5, -2.5, -1.5] \
        and -1 < bins[5][0] < bins[-1][0] < 0
    assert all(a[1] > b[1] for a, b in zip(bins, bins[1:]))  # medians fall as p rises
    records = _token_records()
    edges = [-6, -3, 0]
    logp = [math.log10(p) for r in records[1:] for p in r["p"]]
    norm = [v for r in records[1:] for v in r["grad_norm"]]
    low = sorted(v for v, x in zip(norm, logp) if x < -3)
    median = low[(len(low) - 1) // 2]
    assert figures.binned(logp, norm, [1.0] * len(norm), edges)[0][1] == median
    # a weight of 3 on a token counts it three times
    assert figures.rank_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1)
    assert figures.rank_correlation([1, 2, 3, 4], [1, 2, 4, 3], [1, 1, 1, 3]) == pytest.approx(
        figures.rank_correlation([1, 2, 3, 4, 4, 4], [1, 2, 4, 3, 3, 3]))
    assert figures.rank_correlation([1, 1, 1], [1, 2, 3]) is None  # a constant column
    zero = _token_records()  # tokens without a gradient (zero advantage or clipped) are left out
    zero[0]["grad_norm"] = [0.0] * 200
    assert figures.gradient_analysis(zero)["n"] == 200
    # at equal p: H tied to p (low p = high H, as in real runs) plus a factor that falls with H at
    # fixed p, and advantages of several sizes: the plain correlation with H is positive, the
    # partial one at equal p negative
    g = torch.Generator().manual_seed(3)
    logp = torch.rand(400, generator=g) * -6
    H = -logp / 2 + torch.rand(400, generator=g)  # (400,)
    A = torch.tensor([0.8, 1.0, 1.25]).repeat(134)[:400]
    factor = 1 - logp / 6 - 0.1 * (H + logp / 2)  # falls with p and, at equal p, with H
    tied = [{"p": (10 ** logp).tolist(), "H": H.tolist(), "A": A.tolist(),
             "grad_norm": (A * factor).tolist(), "weight": [1.0] * 400, "correct": [1] * 400}]
    a = figures.gradient_analysis(tied)
    assert a["rho_h"] > 0.3 and a["rho_h_at_p"] < -0.3, a
    assert figures.partial_rank_correlation([1, 2, 3], [1, 2, 3], [1, 2, 3]) is None  # z gives x


def test_plot_gradient_figure_round_trips_from_the_run_folder(tmp_path, capsys):
    """The figure and the correlation line come from the run's tokens.jsonl alone (--plot)."""
    run = Path(_fake_run(tmp_path / "run", [0.1, 0.2], [0.1, 0.3]))
    (run / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _token_records()))
    assert train.main(["--plot", str(run)]) == 0
    out = capsys.readouterr().out
    rho = figures.gradient_analysis(_token_records())["rho_p"]
    assert f"{run}: logit-gradient norm vs p: Spearman {rho:+.2f}" in out \
        and (run / "gradient.png").is_file()


def test_plot_figures_say_what_the_numbers_say(tmp_path, monkeypatch):
    """What a reader sees matches the numbers: held-out accuracy is points at the evaluated steps
    with their values (a line from step 0 to 10 suggested a measured trend); s2t.png keeps its
    legend off the (p, H) plane, shows the mini-batch thresholds as one bar on the tau_p line (their
    range, a tick at the median) instead of lines across it or a ladder of ticks, labels the norm in
    math notation and counts the drawn tokens with a gradient as the console does; gradient.png
    states the correlation with p over all tokens and below p = 0.1, where its curve is flat, in the
    panel title instead of a legend entry; legends are 9 pt or more (they were ~6 pt), and
    metrics.png names every run under all its panels."""
    import matplotlib.pyplot as plt

    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    run = Path(_fake_run(tmp_path / "run", [0.1, 0.2], [0.1, 0.8]))
    g = torch.Generator().manual_seed(0)
    logp = torch.rand(600, generator=g) * -6  # p from 1e-6 to 1
    # flat below 0.1
    norm = torch.where(logp < -1, 1.0, -logp).clamp(min=0.01) + 0.05 * torch.rand(600, generator=g)
    records = []
    for k in range(3):
        s = slice(200 * k, 200 * k + 200)
        p = (10 ** logp[s]).tolist()
        records.append({"step": 1, "mini_batch": k, "tau_h": 1.0 + k, "p": p,
                        "H": (-logp[s] / 2).tolist(), "A": [1.0] * 199 + [0.0],
                        "grad_norm": norm[s].tolist(), "weight": [1.0] * 200,
                        "correct": [1] * 100 + [0] * 100, "candidate": [int(x < 0.002) for x in p],
                        "silenced": [int(x < 1e-4) for x in p]})
    (run / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    a = figures.gradient_analysis(records)
    assert a["rho_p"] < -0.3 and abs(a["rho_p_low"]) < 0.15, a  # the fall is above p = 0.1 only
    assert f"({a['rho_p_low']:+.2f} below p = 0.1)" in figures.correlation_line(str(run))

    assert figures.plot_metrics([str(run)], str(tmp_path / "m.png"))
    held = next(ax for ax in closed[-1].axes if ax.get_title().startswith("held-out accuracy"))
    assert held.lines[0].get_linestyle() == "None" \
        and [t.get_text() for t in held.texts] == ["0.100", "0.800"]
    fig = closed[-1]
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    assert all(ax.get_legend() is None and not legend.overlaps(ax.get_window_extent())
               for ax in fig.axes)

    assert figures.plot_tokens([str(run)], str(tmp_path / "s.png"))
    fig = closed[-1]
    fig.canvas.draw()
    ax_h, ax_g = fig.axes
    legend = ax_g.get_legend()
    box = legend.get_window_extent()
    assert not box.overlaps(ax_h.get_window_extent()) \
        and not box.overlaps(ax_g.get_window_extent())
    # 4 kinds of tokens, 1 bar
    assert len(ax_h.collections) == 5 and [c.get_label() for c in ax_h.containers] == [
        "tau_h of 3 mini-batches: median 2.00, 1.00-3.00"]
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 9
    assert "$" in ax_g.get_ylabel() and "sum p^2" not in ax_g.get_ylabel()
    assert f"600 drawn tokens ({a['n']} with a gradient)" in ax_h.get_title() and a["n"] == 597

    assert figures.plot_gradient([str(run)], str(tmp_path / "g.png"))
    ax_p, ax_H = closed[-1].axes
    assert f"Spearman {a['rho_p']:+.2f} over all tokens, {a['rho_p_low']:+.2f} below p = 0.1" \
        in ax_p.get_title()
    assert ax_p.get_xscale() == "logit" and ax_p.get_legend() is None
    assert not any("Spearman" in t.get_text() for t in closed[-1].legends[0].get_texts())
    assert min(t.get_fontsize() for t in closed[-1].legends[0].get_texts()) >= 9


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
    one = figures.run_summary(runs[0])
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


def _fake_run(path: Path, rewards: list[float], acc: list[float], algo: str = "stapo") -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"algo": algo, "tau_p": 0.002}))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": r,
                                                            "entropy/mean": 1.0 - i / 10,
                                                            "s2t/silenced_frac": 1e-3}) + "\n"
                                                for i, r in enumerate(rewards)))
    (path / "eval.jsonl").write_text("".join(json.dumps({"step": 2 * i, "eval/acc": a}) + "\n"
                                             for i, a in enumerate(acc)))
    return str(path)


def test_plot_cli_output_location_heldout_panel_and_errors(tmp_path, monkeypatch, capsys):
    import matplotlib.pyplot as plt

    a = _fake_run(tmp_path / "runs" / "a", [-0.5, 0.0, 0.5], [0.2, 0.4])
    b = _fake_run(tmp_path / "runs" / "b", [-0.5, 0.0, 0.5], [0.2, 0.6], algo="justrl")
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
    module = subprocess.run([sys.executable, "-m", "run_folder.figures", a, b, "--out", out],
                            cwd=ROOT, capture_output=True, text=True)
    assert module.returncode == 0 and (tmp_path / "module.png").is_file(), module.stderr
    # flags before the runs, and its errors named for the module (they once needed the runs first)
    first = subprocess.run([sys.executable, "-m", "run_folder.figures", "--out", out + "2.png", a],
                           cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0 and Path(out + "2.png").is_file(), first.stderr
    gone = subprocess.run([sys.executable, "-m", "run_folder.figures", str(tmp_path / "missing")],
                          cwd=ROOT, capture_output=True, text=True)
    assert gone.returncode == 2 and gone.stderr.strip().splitlines()[-1].startswith(
        "python -m run_folder.figures: error: no run folder"), gone.stderr
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


def test_plot_seeds_of_one_algorithm_share_a_colour_under_their_mean(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    a0 = _fake_run(tmp_path / "a0", [-0.5, 0.0, 0.5], [0.2, 0.4])
    # one step more: the mean is over 3 steps
    a1 = _fake_run(tmp_path / "a1", [-0.3, 0.2, 0.1, 0.9], [0.3, 0.8])
    # a seed without metrics lines: not in the reward mean
    a2 = _fake_run(tmp_path / "a2", [], [0.5, 0.5])
    b = _fake_run(tmp_path / "b", [-0.5, 0.5, 0.5], [0.1, 0.2], algo="justrl")
    # another setting of stapo: not a seed of a0
    c = _fake_run(tmp_path / "c", [0.0, 0.0, 0.0], [0.1, 0.1])
    c_config = json.loads(Path(c, "config.json").read_text())
    Path(c, "config.json").write_text(json.dumps({**c_config, "lr": 1e-3}))
    for run, seed in ((a1, 1), (a2, 2)):
        Path(run, "config.json").write_text(json.dumps(
            {**json.loads(Path(run, "config.json").read_text()), "seed": seed, "out_dir": run}))
    assert figures.seed_groups([a0, b, a1, a2, c, a0]) == {f"stapo ({a0})": [a0, a1, a2],
                                                           "justrl": [b], f"stapo ({c})": [c]}
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    assert figures.plot_metrics([a0, b, a1, a2, c], str(tmp_path / "m.png"))
    reward = next(ax for ax in closed[0].axes if ax.get_title().startswith("reward"))
    lines = {line.get_label(): line for line in reward.lines}
    mean = lines[f"stapo ({a0}): mean of 2 runs (thin: each)"]
    assert list(mean.get_data()[0]) == [0, 1, 2] \
        and list(mean.get_data()[1]) == pytest.approx([-0.4, 0.1, 0.3])
    assert lines["_" + a0].get_color() == lines["_" + a1].get_color() == mean.get_color()
    assert lines[f"{b} (justrl, seed 0)"].get_color() != mean.get_color() \
        and "justrl: mean" not in " ".join(lines)
    assert lines[f"{c} (stapo, seed 0)"].get_color() not in \
        (mean.get_color(), lines[f"{b} (justrl, seed 0)"].get_color())
    assert lines["_" + a0].get_linewidth() < mean.get_linewidth()
    held = next(ax for ax in closed[0].axes if ax.get_title().startswith("held-out"))
    held_mean = next(line for line in held.lines
                     if line.get_label().startswith(f"stapo ({a0}): mean of 3 runs"))
    assert list(held_mean.get_data()[1]) == pytest.approx([1 / 3, 1.7 / 3])
    # one seed with data and one without common steps: each is drawn and named, no mean
    lone = _fake_run(tmp_path / "lone", [0.5], [0.5])
    late = _fake_run(tmp_path / "late", [], [0.5])
    Path(late, "metrics.jsonl").write_text(json.dumps({"step": 7, "reward/mean": 0.1}) + "\n")
    closed.clear()
    assert figures.plot_metrics([lone, late], str(tmp_path / "n.png"))
    reward = next(ax for ax in closed[0].axes if ax.get_title().startswith("reward"))
    assert sorted(line.get_label() for line in reward.lines) == [f"{late} (stapo, seed 0)",
                                                                 f"{lone} (stapo, seed 0)"]


def test_plot_tokens_pools_the_seeds_of_an_algorithm(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    def tokens(run, silenced, tau_h=1.0):
        n = len(silenced)
        rec = {"step": 1, "tau_h": tau_h, "p": [1e-3] * n, "H": [0.5] * n, "A": [1.0] * n,
               "correct": [True] * n, "candidate": silenced, "silenced": silenced,
               "grad_norm": [1.0] * n, "weight": [1.0] * n}
        Path(run, "tokens.jsonl").write_text(json.dumps(rec) + "\n")
        return run

    a0 = tokens(_fake_run(tmp_path / "a0", [0.0], [0.2]), [True, False])
    a1 = tokens(_fake_run(tmp_path / "a1", [0.0], [0.2]), [True, True, False])
    b = tokens(_fake_run(tmp_path / "b", [0.0], [0.2], algo="fullmask"), [False], tau_h=None)
    bare = tokens(_fake_run(tmp_path / "bare", [0.0], [0.2]), [False])
    Path(bare, "config.json").unlink()  # no config.json, and given twice: its own row, once
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    assert figures.plot_tokens([a0, a1, b, bare, bare], str(tmp_path / "s.png"))
    titles = [ax.get_title() for ax in closed[0].axes if ax.get_ylabel() == "entropy H"]
    assert titles == [
        "2 runs of stapo:\n5 drawn tokens (5 with a gradient), 2 mini-batches",
        f"{b} (fullmask, seed 0):\n1 drawn tokens (1 with a gradient), 1 mini-batches",
        f"{bare}:\n1 drawn tokens (1 with a gradient), 1 mini-batches"]
    legend = [t.get_text() for t in closed[0].axes[1].get_legend().get_texts()]  # right panel's
    assert "silenced (3)" in legend and "tau_h of 2 mini-batches: median 1.00, 1.00-1.00" in legend
    legend = [t.get_text() for t in closed[0].axes[3].get_legend().get_texts()]  # no tau_h
    assert "candidate, kept (0)" in legend and not any("tau_h" in t for t in legend)


def test_plot_entropy_change_per_kind_skips_steps_without_such_tokens(tmp_path, monkeypatch):
    """Runs made with --entropy-change get entropy_change.png: a panel per kind of token, where a
    step's 0.0 (train.py's value for a kind the step did not have) is no point, the seeds' mean is
    over the runs with a value at each step, and a dashed line marks 0; the side-by-side table gains
    the mean change per kind over the steps that had it."""
    import matplotlib.pyplot as plt

    def run(name, algo, seed, silenced, candidate):
        path = Path(_fake_run(tmp_path / name, [0.0] * 3, [0.1, 0.2], algo=algo))
        Path(path, "config.json").write_text(
            json.dumps({"algo": algo, "tau_p": 0.002, "seed": seed}))
        Path(path, "metrics.jsonl").write_text("".join(json.dumps(
            {"step": i + 1, "reward/mean": 0.0, "entropy/mean": 1.0, "response/len_mean": 5.0,
             "entropy_change/silenced": s,
             "entropy_change/candidate": c, "entropy_change/other": -0.01}) + "\n"
            for i, (s, c) in enumerate(zip(silenced, candidate))))
        return str(path)

    stapo = [run("s0", "stapo", 0, [0.3, 0.1, 0.2], [0.1] * 3),
             run("s1", "stapo", 1, [0.1, 0.3, 0.0], [0.1] * 3),
             run("s2", "stapo", 2, [0.2, 0.0, 0.4], [0.1] * 3)]
    justrl = run("j0", "justrl", 0, [0.0] * 3, [0.2, 0.0, 0.0])
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    written = figures.figures([*stapo, justrl], str(tmp_path / "both.png"))
    assert str(tmp_path / "both_entropy_change.png") in written
    axes = {ax.get_title(): ax for ax in closed[-1].axes}
    silenced = axes["entropy change per update: silenced tokens"]
    lines = {line.get_label(): line for line in silenced.lines}
    mean = lines["stapo: mean of the 2-3 runs with a value (thin: each)"]
    assert list(mean.get_data()[0]) == [1, 2, 3] \
        and list(mean.get_data()[1]) == pytest.approx([0.2, 0.2, 0.3])
    # JustRL silenced nothing: no point, not a line at 0
    assert not any("justrl" in label for label in lines)
    assert list(lines["_" + stapo[1]].get_data()[0]) == [1, 2]
    candidate = {line.get_label(): line
                 for line in axes["entropy change per update: kept candidates"].lines}
    assert list(candidate[f"{justrl} (justrl, seed 0)"].get_data()[0]) == [1]
    # under the panels: JustRL has points in one
    legend = [t.get_text() for t in closed[-1].legends[0].get_texts()]
    assert f"{justrl} (justrl, seed 0)" in legend \
        and "stapo: mean of the 2-3 runs with a value (thin: each)" in legend
    assert any(line.get_linestyle() == "--" and list(line.get_ydata()) == [0, 0]
               for line in silenced.lines)
    table = figures.summary_table([*stapo, justrl]).splitlines()
    head = [c.strip() for c in table[0].split("|")]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")] for r in table[2:]}
    at = head.index("entropy change per update, silenced")
    assert rows["stapo"][at] == "+0.233 (+0.200-+0.300)" and rows["justrl"][at] == "-"
    assert rows["justrl"][head.index("entropy change per update, kept candidates")] == "+0.200"
    closed.clear()
    # made without --entropy-change: no such figure
    plain = _fake_run(tmp_path / "plain", [0.0, 0.5], [0.1, 0.2])
    written = figures.figures([plain], str(tmp_path / "plain.png"))
    assert [Path(x).name for x in written] == ["plain.png"]


def test_plot_without_matplotlib_is_a_message(tmp_path, monkeypatch, capsys):
    run = _fake_run(tmp_path / "a", [0.0, 1.0], [0.5])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert train.main(["--plot", run]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib is not installed" in err[0]
    assert figures.figures([run], str(tmp_path / "a" / "metrics.png")) == []
    assert not (tmp_path / "a" / "metrics.png").exists()
