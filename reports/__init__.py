"""Reports on training runs, drawn and counted from the files train.py writes into a run folder
(docs/outputs.md; the paper's research questions, docs/paper.md §8), redrawn later from those files
alone (no model); none of it is what a run keeps on disk (that is run_folder/). One concept per
file:

    statistics.py   weighted rank statistics; RQ1's gradient analysis (`gradient_analysis`)
    summary.py      what runs did: seeds of one setting, a run's summary, the table over runs, the
                    lines a run closes with
    figures.py      the figures (metrics.png, s2t.png, gradient.png, entropy_change.png, the
                    sensitivity grid, counterfactual.png)
    report.py       a run's figures and closing lines at its end (`closing_lines`), and the command
                    line that redraws finished runs (`main`: train.py --plot, python -m reports)
    __main__.py     python -m reports RUN [RUN ...]
"""
