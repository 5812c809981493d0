"""The one seam through which instruments watch a training step (train.train_step, the paper's
Algorithm 1): the step tells a `Watch` its decisions at four named moments, in this order, and
never asks anything back. The metrics line with --gradient-share and --entropy-change
(step_log.StepLog) and the counterfactual's replay (tools/counterfactual.py) are watches: each reads
the step's own decisions and recomputes none of them.

    rolled_out  parts 1-3 are done: the rollout, its rewards and advantages, pi_old
    weighed     mini-batch k: pi_theta, its token weights I and the global N, before its gradient
    backward    its gradient is accumulated (update None: nothing to learn, no gradient made)
    updated     its optimizer step (grad_norm None: none was made)
"""
from __future__ import annotations


class Watch:
    """An instrument: every moment does nothing unless it is overridden. Arguments: batch (the
    step's rollout.Rollout on this rank), texts and prompt_rows (each response's text, each prompt's
    training row), rewards and advantages (B,), pi_old and pi_theta (model.TokenStats), k (the
    mini-batch), mb (train.MiniBatch), weights (stapo.TokenWeights), N (the global denominator),
    update (train.Update or None), grad_norm (float or None)."""

    def rolled_out(self, batch, texts, prompt_rows, rewards, advantages, pi_old) -> None:
        pass

    def weighed(self, k, mb, pi_theta, weights, N) -> None:
        pass

    def backward(self, k, mb, pi_theta, weights, update) -> None:
        pass

    def updated(self, k, mb, pi_theta, weights, grad_norm) -> None:
        pass


class Watches(Watch):
    """Several watches, told each moment in the order given."""

    def __init__(self, *watches: Watch):
        self.watches = watches

    def rolled_out(self, *args) -> None:
        for watch in self.watches:
            watch.rolled_out(*args)

    def weighed(self, *args) -> None:
        for watch in self.watches:
            watch.weighed(*args)

    def backward(self, *args) -> None:
        for watch in self.watches:
            watch.backward(*args)

    def updated(self, *args) -> None:
        for watch in self.watches:
            watch.updated(*args)
