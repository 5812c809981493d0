"""What happens before train.py's first step (docs/training.md): the process before torch loads
(early.py: MKL's reproducible sums, a stop signal held until the run can take it, the exit without
teardown) and the run it builds (run.py: the model and its sharding, the optimizer, the rollout
engine, the checkpoint a resume continues from)."""
