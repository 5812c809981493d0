"""The evaluation's machinery below eval.py (docs/paper.md §7): the benchmarks (benchmarks), what
an evaluation counts and writes (results), the checkpoints it scores and their checks
(checkpoints), and train.py's held-out evaluation during a run (heldout), which train.py imports
without eval.py."""
