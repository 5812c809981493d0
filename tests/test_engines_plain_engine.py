"""engines/plain_engine.py: the plain engine's rollout phases (one written-out decode step per
phase, or one captured static cache).
"""
import pytest
import torch

from engines import choice
from engines.plain_engine import PlainEngine
from fast_decode import cuda_graphs, decode_step
from model import tiny_model, tiny_tokenizer
from rollout import Sampling, generate
from tests.sampler_checks import REAL_VOCAB, eos_biased_model, toy_prompts


# ==================================================================================================
# engines/plain_engine.py: rollout phases
# ==================================================================================================
def test_plain_engine_takes_the_weights_once_per_phase(monkeypatch):
    """`PlainEngine.ready` builds one `DecodeStep` (the stacked, reordered weight copies) for every
    generate call of a rollout phase, samples what per-call steps sample, drops the copies at the
    end of the phase and builds them anew from the changed weights in the next (a step kept across
    phases would sample from the old weights). generate refuses the step of another model or
    vocabulary size."""
    lm, prompts = eos_biased_model(105), toy_prompts()
    engine = PlainEngine(lm, 2, 0, REAL_VOCAB)
    built = []
    monkeypatch.setattr(decode_step.DecodeStep, "__init__",
                        lambda self, *a, init=decode_step.DecodeStep.__init__:
                        built.append(1) or init(self, *a))

    def phase():
        built.clear()
        with engine.ready(lm):
            assert isinstance(engine.step, decode_step.DecodeStep)
            r = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)  # four generate calls
        assert len(built) == 1 and engine.step is True
        # outside a phase: a step per call
        per_call = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)
        assert len(built) == 1 + len(prompts)
        assert torch.equal(r.response_ids, per_call.response_ids)
        torch.testing.assert_close(r.sampler_logprobs, per_call.sampler_logprobs, atol=1e-6, rtol=0)
        return r

    before = phase()
    with torch.no_grad():
        lm.lm_head.weight.mul_(3.0)  # the update between two phases
    after = phase()
    assert not torch.equal(before.response_ids, after.response_ids)
    step = decode_step.DecodeStep(lm, REAL_VOCAB)
    for other in (dict(model=tiny_model(), vocab_size=REAL_VOCAB), dict(model=lm, vocab_size=None)):
        with pytest.raises(ValueError, match="DecodeStep of another model or vocab_size"):
            sampling = Sampling(4, eos_token_id=2, pad_token_id=0, vocab_size=other["vocab_size"])
            generate(other["model"], prompts, sampling, written_out=step)


def test_plain_engine_captured_static_cache_once_per_phase(monkeypatch):
    """`PlainEngine` with `captured` (train.py's --cuda-graphs on CUDA; the CPU stand-in here) makes
    one `CapturedStep` per rollout phase at its first sample call, for its largest generate call's
    rows and the run's longest prompt + response (`max_len`, which make_engine takes from
    max_model_len), uses it for every generate call of the phase, samples what the eager engine
    samples, and drops it with the phase; a later call of the phase that needs more rows makes a
    larger one."""
    lm, prompts = eos_biased_model(105), toy_prompts()
    tok = tiny_tokenizer()
    engine = choice.make_engine("plain", lm, tok, True, max_model_len=200)
    assert engine.max_len == 200 and not engine.captured  # the default: the eager step
    assert choice.make_engine("plain", lm, tok, True, captured=True).captured
    eager = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)
    engine.captured, built = True, []
    monkeypatch.setattr(cuda_graphs.CapturedStep, "__init__",
                        lambda self, *a, init=cuda_graphs.CapturedStep.__init__:
                        built.append(a[1:]) or init(self, *a))
    with engine.ready(lm):
        r = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)  # 4 generate calls of 2 rows
        held = engine.static
        assert built == [(2, 200)] and isinstance(held, cuda_graphs.CapturedStep)
        engine.sample(prompts[:2], 2, [7], 2, 24, 1.0, 1.0)  # 4 rows: a larger cache
        assert built == [(2, 200), (4, 200)] and engine.static is not held
    assert engine.static is None and engine.step is True
    assert torch.equal(r.response_ids, eager.response_ids)
    torch.testing.assert_close(r.sampler_logprobs, eager.sampler_logprobs, atol=1e-5, rtol=0)
