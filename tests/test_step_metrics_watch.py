"""step_metrics/watch.py: the seam through which instruments see a step, its moments in the order
train.train_step tells them, each watch of `Watches` told each moment in turn."""
import torch
import torch.distributed as dist

import train
from step_metrics.watch import Watch, Watches
from tests.toy_task import one_thread, toy_run


class Recorder(Watch):
    """Every moment it is told, with its mini-batch (or None) and what the step had decided."""

    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def rolled_out(self, batch, texts, prompt_rows, rewards, advantages, pi_old):
        assert len(texts) == len(batch) == len(rewards) == len(advantages) == \
            pi_old.logprobs.shape[0]
        self.seen.append((self.name, "rolled_out", None))

    def weighed(self, k, mb, pi_theta, weights, N):
        assert N == float(weights.share)  # one process: N is this rank's share
        self.seen.append((self.name, "weighed", k))

    def backward(self, k, mb, pi_theta, weights, update):
        self.seen.append((self.name, "backward", k))

    def updated(self, k, mb, pi_theta, weights, grad_norm):
        assert grad_norm is None or grad_norm >= 0
        self.seen.append((self.name, "updated", k))


def test_watches_tell_each_moment_to_each_watch_in_turn():
    seen = []
    both = Watches(Recorder("a", seen), Recorder("b", seen))
    both.backward(0, None, None, None, None)
    both.updated(1, None, None, None, None)
    assert seen == [("a", "backward", 0), ("b", "backward", 0), ("a", "updated", 1),
                    ("b", "updated", 1)]


def test_train_step_tells_its_moments_in_order(tmp_path, monkeypatch):
    """One step of 2 mini-batches: rolled_out once, then weighed, backward, updated for each
    mini-batch in order; a step dropped by a stop signal during its rollout tells nothing."""
    seen = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with one_thread():
            run = toy_run(tmp_path, monkeypatch)
            assert train.train_step(run, 1, Recorder("r", seen))
            assert [moment[1:] for moment in seen] == [
                ("rolled_out", None), ("weighed", 0), ("backward", 0), ("updated", 0),
                ("weighed", 1), ("backward", 1), ("updated", 1)]
            seen.clear()
            monkeypatch.setattr(run.preemption, "agreed", lambda: True)
            assert not train.train_step(run, 2, Recorder("r", seen)) and seen == []
    finally:
        dist.destroy_process_group()
    assert torch.is_grad_enabled()
