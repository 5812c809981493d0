"""fast_decode/cuda_graphs.py: the captured decode step (its CPU stand-in here): the eager sampler's
tokens, static buffers allocated once, one capture per (bucket, length) replayed at every step.
"""
from dataclasses import replace

import pytest
import torch

import rollout
from fast_decode import cuda_graphs, decode_step
from model import tiny_model
from rollout import Sampling, generate
from tests.sampler_checks import REAL_VOCAB, eos_biased_model, toy_prompts


# ==================================================================================================
# fast_decode/cuda_graphs.py: CapturedStep
# ==================================================================================================
def _captured(lm, rows: int, max_len: int, vocab_size=REAL_VOCAB,
              **kwargs) -> cuda_graphs.CapturedStep:
    """The captured step of `lm` (its CPU stand-in unless kwargs say otherwise), length blocks
    of 16 positions."""
    return cuda_graphs.CapturedStep(decode_step.DecodeStep(lm, vocab_size), rows, max_len,
                                    **{"block": 16, **kwargs})


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_rollout_captured_step_same_tokens_as_eager(monkeypatch, temperature, top_p):
    """The captured step (here its CPU stand-in: the same body, run eagerly on the static buffers)
    samples what the eager sampler samples for the same generator: tokens equal, log-probs to 1e-5,
    greedy and sampled, on left-padded prompts whose rows stop at very different lengths. Each step
    runs at the smallest batch bucket (powers of two, and the phase's 24 rows) that holds the
    running rows, which shrink as rows finish (compaction), and reads the cache up to the written
    position rounded up to the length block."""
    lm = eos_biased_model(73)
    prompts = toy_prompts() * 6  # 24 rows
    sampling = Sampling(40, temperature, top_p, eos_token_id=2, pad_token_id=0,  # greedy: all rows,
                        vocab_size=REAL_VOCAB if temperature else None)  # lengths 9..40
    ref = generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(3))
    P = ref.prompt_ids.shape[1]
    captured = _captured(lm, 24, P + 40, sampling.vocab_size)
    assert captured.buckets == [1, 2, 4, 8, 16, 24]
    seen = []
    monkeypatch.setattr(cuda_graphs.CapturedStep, "_body",
                        lambda self, b, L, body=cuda_graphs.CapturedStep._body:
                        seen.append((b, L, self.kv.get_seq_length())) or body(self, b, L))
    r = generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(3),
                 written_out=captured)
    assert torch.equal(r.response_ids, ref.response_ids) and \
        torch.equal(r.response_mask, ref.response_mask)
    assert torch.equal(r.truncated, ref.truncated)
    torch.testing.assert_close(r.sampler_logprobs, ref.sampler_logprobs, atol=1e-5, rtol=0)
    lengths = ref.response_mask.sum(1)
    # very different lengths
    assert lengths.min() <= 12 and ref.truncated.any() and len(set(lengths.tolist())) >= 4
    assert r.prompt_mask.min() == 0  # left padding
    # step t writes token t's keys at position P + t for the running rows (longer than t + 1 tokens)
    running = [int((lengths > t + 1).sum()) for t in range(int(lengths.max()) - 1)]
    assert seen == [(next(b for b in (1, 2, 4, 8, 16, 24) if b >= R),
                     min(P + 40, (P + t) // 16 * 16 + 16), P + t)
                    for t, R in enumerate(running)]
    assert len({L for _, L, _ in seen}) >= 3 and \
        len({b for b, _, _ in seen}) >= (1 if temperature == 1 else 2)


def test_rollout_captured_step_contract(monkeypatch):
    """The captured step's contract: its attention equals SDPA over the key/value heads repeated per
    head group; its static buffers (KV cache, mask, inputs, logits) are allocated once and never
    again over the generate calls of a phase (the prefill writes into them too); each step copies
    the running rows' inputs in, runs the body on views of the static buffers only, and hands back a
    view of the static logits. With capture on (a recording stand-in for the CUDA graph, replaying
    the body eagerly) each (bucket, length) is captured once, at its first step, and replayed at
    every step, with the stand-in's tokens. A call larger than the static cache, or for another
    model, is refused."""
    assert cuda_graphs.batch_buckets(1) == [1] and cuda_graphs.batch_buckets(16) == [1, 2, 4, 8, 16]
    assert cuda_graphs.batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    # its attention: SDPA over the key/value heads repeated per head group
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, heads, length, 16, generator=g)
               for heads, length in ((8, 1), (2, 37), (2, 37)))
    mask = torch.zeros(5, 1, 1, 37).index_fill_(3, torch.arange(30, 37), float("-inf"))  # unfilled
    mask[1, ..., :5] = float("-inf")  # padding
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask,
        scale=0.3).transpose(1, 2)  # (R, 1, H, hd)
    torch.testing.assert_close(decode_step._grouped_attention(q, k, v, mask, 0.3), ref,
                               atol=1e-6, rtol=1e-5)
    lm, prompts = eos_biased_model(105), toy_prompts()
    sampling = Sampling(30, eos_token_id=2, pad_token_id=0, vocab_size=REAL_VOCAB)
    P = rollout.left_pad(prompts, 0)[0].shape[1]
    captured = _captured(lm, 8, P + 30)
    static = [captured.mask, captured.token, captured.position, captured.column, captured.logits] \
        + [t for layer in captured.kv.layers for t in (layer.key_buffer, layer.value_buffer)]
    pointers = [t.data_ptr() for t in static]
    inputs, outputs = [], []
    step_call = decode_step.DecodeStep.__call__
    monkeypatch.setattr(decode_step.DecodeStep, "__call__",
                        lambda self, token, position, mask, cache, column=None:
                        inputs.append((token, position, mask, cache, column)) or step_call(
                            self, token, position, mask, cache, column))
    call = cuda_graphs.CapturedStep.__call__
    monkeypatch.setattr(cuda_graphs.CapturedStep, "__call__",
                        lambda self, *args: outputs.append(call(self, *args)) or outputs[-1])
    first = [generate(lm, prompts * 2, sampling, generator=torch.Generator().manual_seed(s),
                      written_out=captured) for s in (0, 1)]  # two calls of one phase
    assert [t.data_ptr() for t in static] == pointers  # nothing reallocated
    # the prefill wrote into the static buffer
    assert captured.kv.layers[0].keys.data_ptr() == pointers[5]
    for token, position, mask, cache, column in inputs:
        assert token.data_ptr() == captured.token.data_ptr() and \
            position.data_ptr() == captured.position.data_ptr()
        assert mask.shape[0] == len(token) and cache is captured.kv and column is captured.column
    assert all(o.data_ptr() == captured.logits.data_ptr() for o in outputs) and \
        len(outputs) == len(inputs) > 20
    # with capture: once per (bucket, length), replayed at every step
    captures, replays = [], []

    class Graph:
        def __init__(self, step, key):
            self.step, self.key = step, key

        def replay(self):
            replays.append(self.key)
            self.step._body(*self.key)
    monkeypatch.setattr(cuda_graphs.CapturedStep, "_capture",
                        lambda self, b, L: captures.append((b, L)) or Graph(self, (b, L)))
    graphs = _captured(lm, 8, P + 30, capture=True)
    inputs.clear()
    again = [generate(lm, prompts * 2, sampling, generator=torch.Generator().manual_seed(s),
                      written_out=graphs) for s in (0, 1)]
    keys = [(len(token), mask.shape[1]) for token, _, mask, _, _ in inputs]
    assert replays == keys and captures == list(dict.fromkeys(keys)) and len(captures) < len(keys)
    assert sorted(graphs.graphs) == sorted(captures)
    for a, b in zip(first, again):
        assert torch.equal(a.response_ids, b.response_ids) and \
            torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    for rows, tokens in ((9, 30), (8, 31)):
        with pytest.raises(ValueError, match="exceeds the phase's static cache"):
            generate(lm, (prompts * 3)[:rows], replace(sampling, max_new_tokens=tokens),
                     written_out=captured)
    with pytest.raises(ValueError, match="DecodeStep of another model"):
        generate(tiny_model(), prompts, sampling, written_out=captured)
