"""reports/figures.py: what S2T saw, the gradient figure, overlaid runs and seeds, the entropy
change, and no figure without matplotlib."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import run_folder
import train
from reports import figures, statistics, summary
from tests.fake_runs import fake_run
from tests.toy_task import EVEN, one_thread, patch_toy_task, read_metrics, toy_args, toy_data


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
    assert min(silenced) > 0 and (f"stapo silenced {sum(silenced)} tokens in 2 of 2 steps, of "
                                  f"{sum(int(m['s2t/candidates']) for m in metrics)} candidates "
                                  f"(tokens of correct answers with p < tau_p); see "
                                  f"spurious.jsonl, s2t.png, gradient.png"
                                  in capsys.readouterr().out)
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
    run = Path(fake_run(tmp_path / "run", [0.1, 0.2], [0.1, 0.8]))
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
    a = statistics.gradient_analysis(records)
    assert a["rho_p"] < -0.3 and abs(a["rho_p_low"]) < 0.15, a  # the fall is above p = 0.1 only
    assert f"({a['rho_p_low']:+.2f} below p = 0.1)" in summary.correlation_line(str(run))

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


def test_plot_seeds_of_one_algorithm_share_a_colour_under_their_mean(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    a0 = fake_run(tmp_path / "a0", [-0.5, 0.0, 0.5], [0.2, 0.4])
    # one step more: the mean is over 3 steps
    a1 = fake_run(tmp_path / "a1", [-0.3, 0.2, 0.1, 0.9], [0.3, 0.8])
    # a seed without metrics lines: not in the reward mean
    a2 = fake_run(tmp_path / "a2", [], [0.5, 0.5])
    b = fake_run(tmp_path / "b", [-0.5, 0.5, 0.5], [0.1, 0.2], algo="justrl")
    # another setting of stapo: not a seed of a0
    c = fake_run(tmp_path / "c", [0.0, 0.0, 0.0], [0.1, 0.1])
    c_config = json.loads(Path(c, "config.json").read_text())
    Path(c, "config.json").write_text(json.dumps({**c_config, "lr": 1e-3}))
    for run, seed in ((a1, 1), (a2, 2)):
        Path(run, "config.json").write_text(json.dumps(
            {**json.loads(Path(run, "config.json").read_text()), "seed": seed, "out_dir": run}))
    assert summary.seed_groups([a0, b, a1, a2, c, a0]) == {f"stapo ({a0})": [a0, a1, a2],
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
    lone = fake_run(tmp_path / "lone", [0.5], [0.5])
    late = fake_run(tmp_path / "late", [], [0.5])
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

    a0 = tokens(fake_run(tmp_path / "a0", [0.0], [0.2]), [True, False])
    a1 = tokens(fake_run(tmp_path / "a1", [0.0], [0.2]), [True, True, False])
    b = tokens(fake_run(tmp_path / "b", [0.0], [0.2], algo="fullmask"), [False], tau_h=None)
    bare = tokens(fake_run(tmp_path / "bare", [0.0], [0.2]), [False])
    Path(bare, "config.json").unlink()  # no config.json, and given twice: its own row, once
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    assert figures.plot_tokens([a0, a1, b, bare, bare], str(tmp_path / "s.png"))
    titles = [ax.get_title() for ax in closed[0].axes if ax.get_ylabel() == "entropy H"]
    assert titles[0] == "2 runs of stapo:\n5 drawn tokens (5 with a gradient), 2 mini-batches"
    for title, who in zip(titles[1:], (f"{b} (fullmask, seed 0)", bare)):  # a long one: its end
        assert title.endswith(f"{who[-77:]}:\n1 drawn token (1 with a gradient), 1 mini-batch")
    assert len(titles) == 3
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
        path = Path(fake_run(tmp_path / name, [0.0] * 3, [0.1, 0.2], algo=algo))
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
    table = summary.summary_table([*stapo, justrl]).splitlines()
    head = [c.strip() for c in table[0].split("|")]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")] for r in table[2:]}
    at = head.index("entropy change per update, silenced")
    assert rows["stapo"][at] == "+0.233 (+0.200-+0.300)" and rows["justrl"][at] == "-"
    assert rows["justrl"][head.index("entropy change per update, kept candidates")] == "+0.200"
    closed.clear()
    # made without --entropy-change: no such figure
    plain = fake_run(tmp_path / "plain", [0.0, 0.5], [0.1, 0.2])
    written = figures.figures([plain], str(tmp_path / "plain.png"))
    assert [Path(x).name for x in written] == ["plain.png"]


def test_plot_without_matplotlib_is_a_message(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path / "a", [0.0, 1.0], [0.5])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert train.main(["--plot", run]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib is not installed" in err[0]
    assert figures.figures([run], str(tmp_path / "a" / "metrics.png")) == []
    assert not (tmp_path / "a" / "metrics.png").exists()


def _tokens(run: Path, seed: int, low: float = -6.0, high: float = 0.999,
            with_tau: int = 3) -> None:
    """tokens.jsonl of 3 mini-batches of 200 tokens, p from 10^low to `high`; the first `with_tau`
    of them had candidates (a tau_h)."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.rand(600, generator=g) * (low - math.log10(high)) + math.log10(high)
    records = []
    for k in range(3):
        p = (10 ** logp[200 * k:200 * k + 200]).tolist()
        records.append({"step": 1, "mini_batch": k, "tau_h": 1.0 + k if k < with_tau else None,
                        "p": p, "H": [-math.log10(x) / 2 for x in p], "A": [1.0] * 200,
                        "grad_norm": [1.0 - x for x in p], "weight": [1.0] * 200,
                        "correct": [1] * 100 + [0] * 100,
                        "candidate": [int(x < 0.002) for x in p],
                        "silenced": [int(x < 1e-4) for x in p]})
    (run / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_gradient_labels_apart_legend_inside_and_s2t_counts_agree(tmp_path, monkeypatch):
    """gradient.png and compare_gradient.png: no two x tick labels of the p axis touch (the logit
    axis labelled its minor ticks, "2·10^-2 3·10^-2", into each other) and the legend lies inside
    the figure whatever the settings' names (two settings of one algorithm are named by their
    folders, and four long entries in a row were cut at both edges); s2t.png's legend counts the
    mini-batches its title counts (title 24, legend 16: the legend counted those with a tau_h)."""
    import matplotlib.pyplot as plt

    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    runs = []
    for k, lr in enumerate((1e-6, 2e-6, 3e-6)):
        runs.append(fake_run(tmp_path / f"out-{k}" / f"a-long-folder-name-for-stapo-{k}", [0.1],
                             [0.1]))
        config = json.loads(Path(runs[-1], "config.json").read_text())
        Path(runs[-1], "config.json").write_text(json.dumps({**config, "lr": lr}))
        _tokens(Path(runs[-1]), k, *((-2.5, 0.3) if k == 0 else (-6.0, 0.999)), with_tau=2)
    for drawn in (runs[:1], runs[1:], runs):
        assert figures.plot_gradient(drawn, str(tmp_path / "g.png"))
        fig = closed[-1]
        fig.canvas.draw()
        ax_p = fig.axes[0]
        low, high = ax_p.get_xlim()  # the labels shown, the minor ticks' included
        labels = [t for t in ax_p.get_xticklabels(which="both")
                  if t.get_text() and t.get_visible() and low <= t.get_position()[0] <= high]
        boxes = sorted((t.get_window_extent() for t in labels), key=lambda b: b.x0)
        # 2 pixels apart read as one label
        assert len(boxes) >= 2 and all(a.x1 + 4 <= b.x0 for a, b in zip(boxes, boxes[1:])), \
            (drawn, [t.get_text() for t in labels])
        legend, whole = fig.legends[0].get_window_extent(), fig.bbox
        assert whole.x0 <= legend.x0 and legend.x1 <= whole.x1 and whole.y0 <= legend.y0, \
            (drawn, legend, whole)
        assert not any(legend.overlaps(ax.get_window_extent()) for ax in fig.axes)
        assert not any(legend.overlaps(t.get_window_extent()) for ax in fig.axes
                       for t in ax.get_xticklabels() + [ax.xaxis.label] if t.get_text())
    assert figures.plot_tokens(runs[:1], str(tmp_path / "s.png"))
    fig = closed[-1]
    fig.canvas.draw()
    ax_h, ax_g = fig.axes
    titles = [ax.title.get_window_extent() for ax in (ax_h, ax_g)]  # apart, inside the figure
    assert not titles[0].overlaps(titles[1]) and titles[0].x0 >= 0 and \
        max(t.x1 for t in titles) <= fig.bbox.x1 and ax_g.get_legend().get_window_extent().x1 <= \
        fig.bbox.x1
    assert ax_h.get_title().endswith("3 mini-batches")
    assert [c.get_label() for c in ax_h.containers] == [
        "tau_h of 2 of the 3 mini-batches (those with candidates): median 2.00, 1.00-2.00"]


def test_a_font_cache_without_the_math_fonts_says_nothing(tmp_path, monkeypatch, caplog):
    """A font cache another matplotlib wrote (~/.cache/matplotlib) that lacks the math fonts printed
    20 "findfont: Font family ['STIXGeneral'] not found" lines in a fresh clone's `make run`; the
    figure is drawn in DejaVu Sans, without a line."""
    import logging

    plt = figures._pyplot()
    from matplotlib import font_manager

    manager = font_manager.fontManager
    monkeypatch.setattr(manager, "ttflist", [f for f in manager.ttflist if f.name == "DejaVu Sans"])
    font_manager.FontManager._findfont_cached.cache_clear()
    try:
        with caplog.at_level(logging.DEBUG, logger="matplotlib"):
            fig, ax = plt.subplots()
            ax.set_xlabel(figures.GRADIENT_NORM)
            fig.savefig(tmp_path / "f.png")
            plt.close(fig)
    finally:
        font_manager.FontManager._findfont_cached.cache_clear()
    assert (tmp_path / "f.png").stat().st_size > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
