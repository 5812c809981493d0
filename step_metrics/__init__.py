"""A step's metrics: the metrics.jsonl line and its records (step_log), and what S2T saw and did
(s2t_diagnostics)."""
