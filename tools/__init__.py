"""The tools beside training, each run as `python -m tools.NAME` from the repository: bench (benchmarks),
counterfactual and collapse and confirm (analyses of finished runs), plots (the figures, also drawn by train.py)."""
