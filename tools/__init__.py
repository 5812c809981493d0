"""The tools beside training, each run as `python -m tools.NAME` from the repository: bench
(benchmarks), counterfactual and collapse and confirm (analyses of finished runs). The figures of a
run are reports/figures.py (train.py draws them, `train.py --plot` redraws them)."""
