"""The S2T threshold the hand-worked cases of test_stapo.py and
tests/test_step_metrics_s2t_diagnostics.py share, and a log-prob on either side of it."""
import math

TAU_P = 0.002
LOW_LP = math.log(0.001)  # p = 0.001 < tau_p
HIGH_LP = math.log(0.5)  # p = 0.5 >= tau_p
