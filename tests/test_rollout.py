"""rollout.py: the KV-cache sampler (greedy = model.generate, sampled frequencies, dropping rows, stopping early, the
captured decode step) and token-budget micro-batches.
"""
import os
import tempfile
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import model
import rollout
from distributed.sharding import shard_policy
from engines import choice
from fast_decode import cuda_graphs, decode_step
from model import Policy, position_ids_from_mask, tiny_model, tiny_tokenizer
from rollout import INSTRUCTION, Rollout, Sampling, format_prompt, gathered, generate, sample_groups
from tests.sampler_checks import REAL_VOCAB, recomputed_logprobs, toy_prompts, two_processes


# ==================================================================================================================
# rollout.py: the KV-cache sampler
# ==================================================================================================================
def _eos_biased_model(token: int, scale: float = 1.05):
    """The tiny model with EOS's lm_head row set to `scale` x the row of `token`: EOS then wins wherever `token`
    would (with a positive logit), so greedy responses stop at different lengths."""
    lm = tiny_model()
    with torch.no_grad():
        lm.lm_head.weight[2] = scale * lm.lm_head.weight[token]
    return lm


def test_rollout_format_prompt():
    tok = tiny_tokenizer()
    ids = format_prompt(tok, "1+1")
    text = tok.decode(ids)
    assert text == f"<|im_start|>user\n1+1\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(format_prompt(tok, "1+1", chat=False)) == f"1+1\n{INSTRUCTION}"


def test_rollout_greedy_equals_hf_generate():
    """Token-for-token equality with model.generate(do_sample=False), left padding, rows stopping early."""
    lm, prompts = _eos_biased_model(105), toy_prompts()
    r = generate(lm, prompts, Sampling(48, temperature=0, eos_token_id=2, pad_token_id=0))
    lengths = r.response_mask.sum(1)
    assert len({len(p) for p in prompts}) > 1 and len(set(lengths.tolist())) == len(prompts)  # all different
    assert not r.truncated.any() and r.response_ids.shape[1] == lengths.max() < 48  # every row stopped early
    P = r.prompt_ids.shape[1]
    hf = lm.generate(input_ids=r.prompt_ids, attention_mask=r.prompt_mask, max_new_tokens=48, do_sample=False,
                     eos_token_id=2, pad_token_id=0)[:, P:]  # (B, T)
    assert hf.shape == r.response_ids.shape
    assert torch.equal(hf, r.response_ids)


def test_rollout_prefills_each_prompt_once():
    """The G rows of a prompt are prefilled once and decode from copies of its KV cache: the prefill sees the 4
    distinct prompts, the first decode step all 12 rows, and the greedy tokens are model.generate's on the 12 rows
    (which prefills every row)."""
    lm, prompts = _eos_biased_model(105), toy_prompts()
    seen = []
    handle = lm.get_decoder().embed_tokens.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
    r = sample_groups(lm, prompts, 3, Sampling(48, temperature=0, eos_token_id=2, pad_token_id=0))
    handle.remove()
    assert seen[:2] == [4, 12] and len(r) == 12
    P = r.prompt_ids.shape[1]
    hf = lm.generate(input_ids=r.prompt_ids, attention_mask=r.prompt_mask, max_new_tokens=48, do_sample=False,
                     eos_token_id=2, pad_token_id=0)[:, P:]  # (B, T)
    assert torch.equal(hf[:, :r.response_ids.shape[1]], r.response_ids) and (hf[:, r.response_ids.shape[1]:] == 0).all()


def _cache_rows_per_step(lm):
    """Records the running rows at every decode step of lm's backbone (the rows of its one-token embedding calls;
    the prefill embeds whole prompts); returns (list, hook handle)."""
    seen = []

    def hook(module, args):
        if args[0].shape[1] == 1:  # not the prefill
            seen.append(args[0].shape[0])
    return seen, lm.get_decoder().embed_tokens.register_forward_pre_hook(hook)


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_rollout_compaction_same_tokens(temperature, top_p):
    """Dropping finished rows (at any cadence) gives token for token the rollout of the fixed batch (compact=None,
    the sampler before compaction), for the same generator, with rows stopping at very different lengths."""
    lm = _eos_biased_model(73)
    prompts = toy_prompts() * 6  # 24 rows
    sampling = Sampling(40, temperature, top_p, eos_token_id=2, pad_token_id=0,  # greedy: all rows,
                        vocab_size=REAL_VOCAB if temperature else None)  # lengths 9..40
    seen, handle = _cache_rows_per_step(lm)
    runs = {}
    for compact in (None, 0.15, 1e-9):
        seen.clear()
        runs[compact] = generate(lm, prompts, sampling, compact=compact,
                                 generator=torch.Generator().manual_seed(3))
        runs[compact].cache_rows = list(seen)
    handle.remove()
    ref = runs[None]
    lengths = ref.response_mask.sum(1)
    assert lengths.min() <= 12 and ref.truncated.any() and len(set(lengths.tolist())) >= 4  # very different
    assert set(ref.cache_rows) == {24}  # the fixed batch never shrinks
    for compact in (0.15, 1e-9):
        r = runs[compact]
        assert torch.equal(r.response_ids, ref.response_ids) and torch.equal(r.response_mask, ref.response_mask)
        assert torch.equal(r.truncated, ref.truncated) and torch.equal(r.prompt_ids, ref.prompt_ids)
        torch.testing.assert_close(r.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    # The KV cache shrinks as rows finish. compact=1e-9 drops every row right after its EOS: before decoding token
    # t+1 the cache holds the rows longer than t+1; compact=0.15 drops 15% of the running batch or more at a time.
    assert runs[1e-9].cache_rows == [int((lengths > t + 1).sum()) for t in range(39)]
    sizes = sorted(set(runs[0.15].cache_rows), reverse=True)
    assert runs[0.15].cache_rows == sorted(runs[0.15].cache_rows, reverse=True)
    assert len(sizes) > 1 and all(b <= 0.85 * a for a, b in zip(sizes, sizes[1:]))


def test_rollout_in_place_cache_equals_dynamic_cache():
    """Pins the transformers cache interface `decode_step.InPlaceCache` relies on (5.17-5.19: `update` returns what
    attention reads, `get_seq_length` / `get_mask_sizes` give the length): a prefill of left-padded prompts, decode
    steps, a row drop and more steps give the hidden states of transformers' DynamicCache with
    `batch_select_indices`, while the cache is written in place (views of buffers allocated once) and a drop copies
    only the rows moved into freed slots."""
    from transformers import DynamicCache
    lm = tiny_model()
    decoder = lm.get_decoder()
    prompt, prompt_mask = rollout.left_pad(toy_prompts(), 0)  # (4, P), rows of different lengths
    B, P, T = 4, prompt.shape[1], 6
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, T)], 1)  # (B, P+T)
    positions = prompt_mask.sum(1, keepdim=True) + torch.arange(T)  # (B, T)
    tokens = torch.randint(3, REAL_VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    ours, ref = decode_step.InPlaceCache(lm.config, B, P + T), DynamicCache(config=lm.config)
    copied = []
    copy_rows = ours.copy_rows
    ours.copy_rows = lambda dst, src, rows: (copied.append(len(dst)), copy_rows(dst, src, rows))
    rows = torch.arange(B)
    with torch.no_grad():
        for cache in (ours, ref):
            decoder(input_ids=prompt, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                    past_key_values=cache, use_cache=True)
        buffer = ours.layers[0].key_buffer.data_ptr()
        for t in range(T):
            if t == 3:  # rows 0 and 2 finish: row 3 moves into slot 0, row 1 stays; the reference selects [1, 3]
                order = decode_step.drop_finished(torch.tensor([False, True, False, True]), ours)
                assert order.tolist() == [3, 1] and copied == [1]  # one row's cache copied, not both kept rows
                ref.batch_select_indices(torch.tensor([1, 3]))
                rows = rows[order]
            outs = []
            for cache, r in ((ours, rows), (ref, rows.sort().values)):
                outs.append(decoder(input_ids=tokens[r, t:t + 1], attention_mask=mask[r, :P + t + 1],
                                    position_ids=positions[r, t:t + 1], past_key_values=cache,
                                    use_cache=True).last_hidden_state)
            torch.testing.assert_close(outs[0], outs[1][rows.argsort().argsort()], atol=1e-6, rtol=0)
            layer = ours.layers[0]
            assert ours.get_seq_length() == P + t + 1 and layer.keys.shape == ref.layers[0].keys.shape
            assert layer.keys.data_ptr() == buffer  # a view of the buffer allocated at the prefill
    with pytest.raises(NotImplementedError, match="full attention"):
        config = tiny_model().config
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        decode_step.InPlaceCache(config, B, P + T)


def test_rollout_onednn_linears_same_values():
    """Inside `onednn_linears` every linear layer computes x W^T + b through oneDNN's reordered weights (as the
    sampler's head does through `packed`): the values of F.linear up to fp32 rounding; afterwards the layers are
    plain again. The packed path runs only where it applies (CPU, fp32 / bf16, not under autograd here)."""
    lm = tiny_model()
    linear = torch.nn.Linear(64, 48)  # with a bias
    x = torch.randn(5, 1, 64)
    head = lm.lm_head.weight[:REAL_VOCAB]
    with torch.inference_mode():
        ref = linear(x), torch.nn.functional.linear(x[:, 0], head)
        with decode_step.onednn_linears(linear):
            assert "forward" in vars(linear) and torch.backends.mkldnn.is_available()
            torch.testing.assert_close(linear(x), ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decode_step.packed(head)(x[:, 0]), ref[1], atol=1e-5, rtol=1e-5)
    assert "forward" not in vars(linear) and torch.equal(linear(x), ref[0])
    assert not decode_step._packs(torch.zeros(2, 2, dtype=torch.float16)) and decode_step._packs(head)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_rollout_written_out_decode_step(family):
    """`decode_step.DecodeStep` (the decode step written out layer by layer, on CPU) samples what the model's own
    forward samples: greedy token for token and sampled with the same generator, log-probs to 1e-5, on left-padded
    prompts (a padding mask), rows stopping at different lengths, for the three families it writes out (Qwen3's per-head
    q/k norms, Llama, Qwen2's q/k/v biases, given random values here); the backbone's own forward then runs once, for
    the prefill. A model it does not support (fp16 weights) decodes through the model's forward."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
                 initializer_range=0.2)  # at the default 0.02 every prompt gets the same greedy tokens
    torch.manual_seed(0)
    lm = {"qwen3": lambda: tiny_model(),
          "llama": lambda: LlamaForCausalLM(LlamaConfig(**sizes)).float().eval(),
          "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**sizes)).float().eval()}[family]()
    prompts = toy_prompts()
    with torch.no_grad():
        for m in lm.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.1)
        # as _eos_biased_model: EOS wins wherever a token would, the first token for which greedy rows stop apart
        eos_row = lm.lm_head.weight[2].clone()
        for token in range(4, 128):
            lm.lm_head.weight[2] = 1.05 * lm.lm_head.weight[token]
            greedy = Sampling(40, temperature=0, eos_token_id=2, pad_token_id=0,
                              vocab_size=REAL_VOCAB)
            lengths = generate(lm, prompts, greedy, written_out=False).response_mask.sum(1)
            if len(set(lengths.tolist())) > 2 and lengths.max() > 8:
                break
            lm.lm_head.weight[2] = eos_row
    assert decode_step.DecodeStep.supports(lm)
    assert family != "qwen2" or lm.model.layers[0].self_attn.q_proj.bias is not None
    calls = []
    handle = lm.get_decoder().register_forward_pre_hook(lambda module, args: calls.append(1))
    for temperature in (0, 1.0):
        runs = []
        for written_out in (True, False):
            calls.clear()
            sampling = Sampling(40, temperature, eos_token_id=2, pad_token_id=0,
                                vocab_size=REAL_VOCAB)
            runs.append(generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(1),
                                 written_out=written_out))
            steps = int(runs[-1].response_mask.sum(1).max())
            assert len(calls) == (1 if written_out else steps)  # the prefill only; else the prefill and each step
        assert torch.equal(runs[0].response_ids, runs[1].response_ids)
        torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, atol=1e-5, rtol=0)
        assert runs[0].prompt_mask.float().mean() < 1 and steps > 8
        assert temperature or len(set(runs[0].response_mask.sum(1).tolist())) > 2  # greedy rows stop apart
    handle.remove()
    assert not decode_step.DecodeStep.supports(lm.half())


def test_plain_engine_takes_the_weights_once_per_phase(monkeypatch):
    """`PlainEngine.ready` builds one `DecodeStep` (the stacked, reordered weight copies) for every generate call of a
    rollout phase, samples what per-call steps sample, drops the copies at the end of the phase and builds them anew
    from the changed weights in the next (a step kept across phases would sample from the old weights). generate
    refuses the step of another model or vocabulary size."""
    lm, prompts = _eos_biased_model(105), toy_prompts()
    engine = rollout.PlainEngine(lm, 2, 0, REAL_VOCAB)
    built = []
    monkeypatch.setattr(decode_step.DecodeStep, "__init__", lambda self, *a, init=decode_step.DecodeStep.__init__:
                        built.append(1) or init(self, *a))

    def phase():
        built.clear()
        with engine.ready(lm):
            assert isinstance(engine.step, decode_step.DecodeStep)
            r = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)  # four generate calls
        assert len(built) == 1 and engine.step is True
        per_call = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)  # outside a phase: a step per call
        assert len(built) == 1 + len(prompts)
        assert torch.equal(r.response_ids, per_call.response_ids)
        torch.testing.assert_close(r.logprobs, per_call.logprobs, atol=1e-6, rtol=0)
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


def _captured(lm, rows: int, max_len: int, vocab_size=REAL_VOCAB, **kwargs) -> cuda_graphs.CapturedStep:
    """The captured step of `lm` (its CPU stand-in unless kwargs say otherwise), length blocks of 16 positions."""
    return cuda_graphs.CapturedStep(decode_step.DecodeStep(lm, vocab_size), rows, max_len, **{"block": 16, **kwargs})


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_rollout_captured_step_same_tokens_as_eager(monkeypatch, temperature, top_p):
    """The captured step (here its CPU stand-in: the same body, run eagerly on the static buffers) samples what the
    eager sampler samples for the same generator: tokens equal, log-probs to 1e-5, greedy and sampled, on left-padded
    prompts whose rows stop at very different lengths. Each step runs at the smallest batch bucket (powers of two,
    and the phase's 24 rows) that holds the running rows, which shrink as rows finish (compaction), and reads the
    cache up to the written position rounded up to the length block."""
    lm = _eos_biased_model(73)
    prompts = toy_prompts() * 6  # 24 rows
    sampling = Sampling(40, temperature, top_p, eos_token_id=2, pad_token_id=0,  # greedy: all rows,
                        vocab_size=REAL_VOCAB if temperature else None)  # lengths 9..40
    ref = generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(3))
    P = ref.prompt_ids.shape[1]
    captured = _captured(lm, 24, P + 40, sampling.vocab_size)
    assert captured.buckets == [1, 2, 4, 8, 16, 24]
    seen = []
    monkeypatch.setattr(cuda_graphs.CapturedStep, "_body", lambda self, b, L, body=cuda_graphs.CapturedStep._body:
                        seen.append((b, L, self.kv.get_seq_length())) or body(self, b, L))
    r = generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(3),
                 written_out=captured)
    assert torch.equal(r.response_ids, ref.response_ids) and torch.equal(r.response_mask, ref.response_mask)
    assert torch.equal(r.truncated, ref.truncated)
    torch.testing.assert_close(r.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    lengths = ref.response_mask.sum(1)
    assert lengths.min() <= 12 and ref.truncated.any() and len(set(lengths.tolist())) >= 4  # very different
    assert r.prompt_mask.min() == 0  # left padding
    # step t writes token t's keys at position P + t, for the rows still running (those longer than t + 1 tokens)
    running = [int((lengths > t + 1).sum()) for t in range(int(lengths.max()) - 1)]
    assert seen == [(next(b for b in (1, 2, 4, 8, 16, 24) if b >= R), min(P + 40, (P + t) // 16 * 16 + 16), P + t)
                    for t, R in enumerate(running)]
    assert len({L for _, L, _ in seen}) >= 3 and len({b for b, _, _ in seen}) >= (1 if temperature == 1 else 2)


def test_rollout_captured_step_contract(monkeypatch):
    """The captured step's contract: its attention equals SDPA over the key/value heads repeated per head group; its
    static buffers (KV cache, mask, inputs, logits) are allocated once and never again over the generate calls of a
    phase (the prefill writes into them too); each step copies the running rows' inputs in, runs the body on views of
    the static buffers only, and hands back a view of the static logits. With capture on (a recording stand-in for
    the CUDA graph, replaying the body eagerly) each (bucket, length) is captured once, at its first step, and
    replayed at every step, with the stand-in's tokens. A call larger than the static cache, or for another model,
    is refused."""
    assert cuda_graphs.batch_buckets(1) == [1] and cuda_graphs.batch_buckets(16) == [1, 2, 4, 8, 16]
    assert cuda_graphs.batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    g = torch.Generator().manual_seed(0)  # its attention: SDPA over the key/value heads repeated per head group
    q, k, v = (torch.randn(5, heads, length, 16, generator=g) for heads, length in ((8, 1), (2, 37), (2, 37)))
    mask = torch.zeros(5, 1, 1, 37).index_fill_(3, torch.arange(30, 37), float("-inf"))  # unfilled positions
    mask[1, ..., :5] = float("-inf")  # padding
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                           attn_mask=mask, scale=0.3).transpose(1, 2)  # (R, 1, H, hd)
    torch.testing.assert_close(decode_step._grouped_attention(q, k, v, mask, 0.3), ref, atol=1e-6, rtol=1e-5)
    lm, prompts = _eos_biased_model(105), toy_prompts()
    sampling = Sampling(30, eos_token_id=2, pad_token_id=0, vocab_size=REAL_VOCAB)
    P = rollout.left_pad(prompts, 0)[0].shape[1]
    captured = _captured(lm, 8, P + 30)
    static = [captured.mask, captured.token, captured.position, captured.column, captured.logits] + [
        t for layer in captured.kv.layers for t in (layer.key_buffer, layer.value_buffer)]
    pointers = [t.data_ptr() for t in static]
    inputs, outputs = [], []
    step_call = decode_step.DecodeStep.__call__
    monkeypatch.setattr(decode_step.DecodeStep, "__call__", lambda self, token, position, mask, cache, column=None:
                        inputs.append((token, position, mask, cache, column)) or step_call(
                            self, token, position, mask, cache, column))
    call = cuda_graphs.CapturedStep.__call__
    monkeypatch.setattr(cuda_graphs.CapturedStep, "__call__", lambda self, *args: outputs.append(call(self, *args))
                        or outputs[-1])
    first = [generate(lm, prompts * 2, sampling, generator=torch.Generator().manual_seed(s),
                      written_out=captured) for s in (0, 1)]  # two calls of one phase
    assert [t.data_ptr() for t in static] == pointers  # nothing reallocated
    assert captured.kv.layers[0].keys.data_ptr() == pointers[5]  # the prefill wrote into the static buffer
    for token, position, mask, cache, column in inputs:
        assert token.data_ptr() == captured.token.data_ptr() and position.data_ptr() == captured.position.data_ptr()
        assert mask.shape[0] == len(token) and cache is captured.kv and column is captured.column
    assert all(o.data_ptr() == captured.logits.data_ptr() for o in outputs) and len(outputs) == len(inputs) > 20
    # with capture: once per (bucket, length), replayed at every step
    captures, replays = [], []

    class Graph:
        def __init__(self, step, key):
            self.step, self.key = step, key

        def replay(self):
            replays.append(self.key)
            self.step._body(*self.key)
    monkeypatch.setattr(cuda_graphs.CapturedStep, "_capture", lambda self, b, L: captures.append((b, L)) or
                        Graph(self, (b, L)))
    graphs = _captured(lm, 8, P + 30, capture=True)
    inputs.clear()
    again = [generate(lm, prompts * 2, sampling, generator=torch.Generator().manual_seed(s),
                      written_out=graphs) for s in (0, 1)]
    keys = [(len(token), mask.shape[1]) for token, _, mask, _, _ in inputs]
    assert replays == keys and captures == list(dict.fromkeys(keys)) and len(captures) < len(keys)
    assert sorted(graphs.graphs) == sorted(captures)
    for a, b in zip(first, again):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    for rows, tokens in ((9, 30), (8, 31)):
        with pytest.raises(ValueError, match="exceeds the phase's static cache"):
            generate(lm, (prompts * 3)[:rows], replace(sampling, max_new_tokens=tokens),
                     written_out=captured)
    with pytest.raises(ValueError, match="DecodeStep of another model"):
        generate(tiny_model(), prompts, sampling, written_out=captured)


def test_plain_engine_captured_static_cache_once_per_phase(monkeypatch):
    """`PlainEngine` with `captured` (train.py's --cuda-graphs on CUDA; the CPU stand-in here) makes one
    `CapturedStep` per rollout
    phase at its first sample call, for its largest generate call's rows and the run's longest prompt + response
    (`max_len`, which make_engine takes from max_model_len), uses it for every generate call of the phase, samples
    what the eager engine samples, and drops it with the phase; a later call of the phase that needs more rows makes
    a larger one."""
    lm, prompts = _eos_biased_model(105), toy_prompts()
    tok = tiny_tokenizer()
    engine = choice.make_engine("plain", lm, tok, True, max_model_len=200)
    assert engine.max_len == 200 and not engine.captured  # the default: the eager step
    assert choice.make_engine("plain", lm, tok, True, captured=True).captured
    eager = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)
    engine.captured, built = True, []
    monkeypatch.setattr(cuda_graphs.CapturedStep, "__init__", lambda self, *a, init=cuda_graphs.CapturedStep.__init__:
                        built.append(a[1:]) or init(self, *a))
    with engine.ready(lm):
        r = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)  # four generate calls of 2 rows
        held = engine.static
        assert built == [(2, 200)] and isinstance(held, cuda_graphs.CapturedStep)
        engine.sample(prompts[:2], 2, [7], 2, 24, 1.0, 1.0)  # 4 rows: a larger cache
        assert built == [(2, 200), (4, 200)] and engine.static is not held
    assert engine.static is None and engine.step is True
    assert torch.equal(r.response_ids, eager.response_ids)
    torch.testing.assert_close(r.logprobs, eager.logprobs, atol=1e-5, rtol=0)


def test_rollout_grouped_sdpa_no_repeated_cache(monkeypatch):
    """`model.grouped_sdpa` (on CPU, when a mask is given, under model.PACKED_SDPA, which PlainEngine and Policy
    give the model) equals SDPA over the key/value heads repeated per head group; the sampler then samples
    left-padded prompts as under transformers' SDPA (greedy token for token, log-probs to 1e-5) without ever copying
    the cache per head group (transformers' repeat_kv, at the prefill and at every decode step)."""
    from transformers.integrations import sdpa_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, heads, length, 16, generator=g) for heads, length in ((4, 1), (2, 7), (2, 7)))
    mask = torch.ones(5, 1, 1, 7, dtype=torch.bool)
    mask[1, ..., :3] = False
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=mask).transpose(1, 2)  # (R, 1, H, hd)
    torch.testing.assert_close(model.grouped_sdpa(q, k, v, mask), ref, atol=1e-6, rtol=1e-5)
    lm, prompts = _eos_biased_model(105), toy_prompts()  # prompts of different lengths: a padding mask
    assert lm.config.num_key_value_heads < lm.config.num_attention_heads
    sampling = Sampling(48, eos_token_id=2, pad_token_id=0, vocab_size=REAL_VOCAB)
    runs = {}
    for attention in ("sdpa", model.PACKED_SDPA):
        lm.set_attn_implementation(attention)
        calls = []
        monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: calls.append(x.shape[2]) or
                            x.repeat_interleave(n, 1))
        greedy = replace(sampling, temperature=0)
        runs[attention] = generate(lm, prompts, greedy, written_out=False), calls
    (ref, ref_calls), (r, calls) = runs["sdpa"], runs[model.PACKED_SDPA]
    assert torch.equal(r.response_ids, ref.response_ids) and len(set(r.response_mask.sum(1).tolist())) > 1
    torch.testing.assert_close(r.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert calls == [] and len(ref_calls) > 2 * lm.config.num_hidden_layers  # transformers': every step
    sampled = generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(1),
                       written_out=False)
    recomputed = recomputed_logprobs(lm, sampled, 1.0, REAL_VOCAB)
    torch.testing.assert_close(sampled.logprobs[sampled.response_mask.bool()],
                               recomputed[sampled.response_mask.bool()], atol=1e-5, rtol=0)


def test_rollout_response_mask_and_truncation():
    lm = _eos_biased_model(73)
    r = generate(lm, toy_prompts(), Sampling(40, temperature=0, eos_token_id=2, pad_token_id=0))
    lengths = r.response_mask.sum(1)
    assert lengths.tolist() == [14, 9, 19, 40] and r.truncated.tolist() == [False, False, False, True]
    for ids, mask, n, trunc in zip(r.response_ids, r.response_mask, lengths, r.truncated):
        assert mask[:n].all() and not mask[n:].any()  # contiguous, from the first token
        assert (ids[n - 1] == 2) != bool(trunc)  # the last masked token is the EOS unless truncated
        assert (ids[:n - 1] != 2).all() and (ids[n:] == 0).all()  # no EOS before, only pad after
    assert (r.logprobs[r.response_mask == 0] == 0).all() and (r.logprobs[r.response_mask == 1] < 0).all()
    input_ids, attention_mask = r.training_inputs()
    assert input_ids.shape == attention_mask.shape == (4, r.prompt_ids.shape[1] + 40)
    assert torch.equal(attention_mask.sum(1), r.prompt_mask.sum(1) + lengths)
    sub = r.select([3, 1])
    assert len(sub) == 2 and torch.equal(sub.response_ids[1], r.response_ids[1])
    tok = tiny_tokenizer()
    texts = r.texts(tok)
    assert texts == [tok.decode(ids[:n], skip_special_tokens=True) for ids, n in zip(r.response_ids, lengths)]
    assert "<|im_end|>" in tok.decode(r.response_ids[0]) and "<|im_end|>" not in texts[0]


def test_rollout_sampling_frequencies_chi_square():
    """Frequencies of the first sampled token match softmax(z / temperature) over the real rows."""
    lm = tiny_model(vocab_size=8)
    with torch.no_grad():
        lm.lm_head.weight.mul_(8.0)  # spread the logits so a wrong temperature is detectable
    n, temperature, real = 4000, 0.7, 6  # rows 6, 7 are "padding" rows
    sampling = Sampling(1, temperature, eos_token_id=2, pad_token_id=0, vocab_size=real)
    r = generate(lm, [[1, 5, 3]] * n, sampling, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(r.response_ids[:, 0], minlength=8).double()  # (8,)
    assert counts[real:].sum() == 0
    with torch.no_grad():
        logits = lm(torch.tensor([[1, 5, 3]])).logits[0, -1, :real].double()  # (6,)

    def chi2(probs):
        expected = n * probs
        return ((counts[:real] - expected) ** 2 / expected).sum().item()

    critical = 20.52  # chi-square, 5 degrees of freedom, p = 0.001
    assert chi2(torch.softmax(logits / temperature, -1)) < critical
    assert chi2(torch.softmax(logits, -1)) > critical  # the test can tell temperature 0.7 from 1.0
    expected_lp = torch.log_softmax(logits / temperature, -1)[r.response_ids[:, 0]].float()
    assert torch.allclose(r.logprobs[:, 0], expected_lp, atol=1e-5)


def test_rollout_top_p_stays_in_nucleus():
    lm, top_p, temperature = tiny_model(), 0.6, 0.8
    sampling = Sampling(24, temperature, top_p, eos_token_id=2, pad_token_id=0,
                        vocab_size=REAL_VOCAB)
    r = generate(lm, toy_prompts() * 4, sampling, generator=torch.Generator().manual_seed(1))
    input_ids, attention_mask = r.training_inputs()
    with torch.no_grad():
        logits = lm(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask)).logits  # (B, P+T, V)
    P = r.prompt_ids.shape[1]
    probs = torch.softmax(logits[:, P - 1:-1, :REAL_VOCAB] / temperature, -1)  # (B, T, V')
    chosen = probs.gather(-1, r.response_ids[..., None]).squeeze(-1)  # (B, T)
    mass_above = (probs * (probs > chosen[..., None])).sum(-1)  # mass of strictly more likely tokens (B, T)
    in_nucleus = mass_above < top_p
    mask = r.response_mask.bool()
    assert in_nucleus[mask].all()
    sorted_p = torch.sort(probs, -1, descending=True).values  # (B, T, V')
    nucleus_mass = (sorted_p * ((sorted_p.cumsum(-1) - sorted_p) < top_p)).sum(-1)  # (B, T)
    assert (1 - nucleus_mass[mask]).mean() > 0.3  # sampling from the full softmax would leave the nucleus often


def test_rollout_padding_rows_never_sampled():
    lm = tiny_model()
    with torch.no_grad():
        lm.lm_head.weight[REAL_VOCAB:] = 20 * lm.lm_head.weight[REAL_VOCAB:]  # padding rows now dominate
    prompts = toy_prompts()
    sampling = Sampling(16, eos_token_id=2, pad_token_id=0)
    r = generate(lm, prompts, replace(sampling, vocab_size=REAL_VOCAB),
                 generator=torch.Generator().manual_seed(0))
    assert r.response_ids.max() < REAL_VOCAB
    unmasked = generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(0))
    assert (unmasked.response_ids >= REAL_VOCAB).float().mean() > 0.5  # without vocab_size they would be


def test_rollout_logprobs_equal_recomputed_forward():
    lm = _eos_biased_model(73)
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)]:
        sampling = Sampling(30, temperature, top_p, eos_token_id=2, pad_token_id=0,
                            vocab_size=REAL_VOCAB)
        r = sample_groups(lm, toy_prompts(), 3, sampling,
                          generator=torch.Generator().manual_seed(2))
        assert len(r) == 12 and r.truncated.any() and not r.truncated.all()
        mask = r.response_mask.bool()
        recomputed = recomputed_logprobs(lm, r, temperature, REAL_VOCAB)
        torch.testing.assert_close(r.logprobs[mask], recomputed[mask], atol=1e-5, rtol=0)


def test_rollout_logprobs_equal_policy_forward():
    """With all vocabulary rows (vocab_size=None) the sampler's log-probs are model.Policy's (the training forward);
    with vocab_size set, the Policy must mask the same rows for the two to agree."""
    lm = _eos_biased_model(73)
    sampling = Sampling(30, temperature=0.7, eos_token_id=2, pad_token_id=0)
    r = generate(lm, toy_prompts(), sampling, generator=torch.Generator().manual_seed(4))
    assert not any(x.is_inference() for x in (r.response_ids, r.response_mask, r.logprobs, r.truncated))
    logprobs = Policy(lm)(*r.training_inputs(), r.response_mask, temperature=0.7)[0]  # (B, T), with autograd
    logprobs.sum().backward()  # the rollout's tensors are usable in training
    torch.testing.assert_close(r.logprobs, logprobs.detach(), atol=1e-5, rtol=0)
    # The sampler drops rows >= vocab_size from its softmax; Policy(vocab_size=...) must drop the same rows.
    r = generate(lm, toy_prompts(), replace(sampling, vocab_size=REAL_VOCAB),
                 generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        masked = Policy(lm, vocab_size=REAL_VOCAB)(*r.training_inputs(), r.response_mask, temperature=0.7)[0]
        unmasked = Policy(lm)(*r.training_inputs(), r.response_mask, temperature=0.7)[0]
    torch.testing.assert_close(r.logprobs, masked, atol=1e-5, rtol=0)
    assert (r.logprobs - unmasked).abs().max() > 1e-3  # the extra rows do carry mass in the tiny model


def test_rollout_eos_ids_end_chat_turns_of_base_models():
    """A base model's tokenizer and generation config end on <|endoftext|>; chat prompts must also stop at the
    ChatML end of turn <|im_end|>, raw prompts must not."""
    from rollout import eos_ids
    tok, lm = tiny_tokenizer(), tiny_model()
    tok.eos_token = "<|endoftext|>"  # like Qwen3-Base: EOS id 0, <|im_end|> is id 2
    lm.generation_config.eos_token_id = 0
    assert eos_ids(lm, tok, chat=True) == [0, 2]
    assert eos_ids(lm, tok, chat=False) == [0]
    lm.generation_config.eos_token_id = [0, 5]
    assert eos_ids(lm, tok, chat=False) == [0, 5]


def test_rollout_same_seed_same_rollout():
    lm, prompts = tiny_model(), toy_prompts()

    def run(seed):
        sampling = Sampling(20, eos_token_id=2, pad_token_id=0, vocab_size=REAL_VOCAB)
        return generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(seed))

    with gathered(Policy(lm)):  # a no-op without FSDP
        a = run(7)
    b, c = run(7), run(8)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    groups = sample_groups(lm, prompts[:2], 4, Sampling(20, eos_token_id=2, pad_token_id=0),
                           generator=torch.Generator().manual_seed(7))
    assert torch.equal(groups.prompt_ids[0], groups.prompt_ids[3]) and not torch.equal(groups.prompt_ids[3],
                                                                                     groups.prompt_ids[4])
    assert not torch.equal(groups.response_ids[0], groups.response_ids[1])  # samples in a group differ


_FSDP_SEEDS = (15, 3)  # rank r samples with seed _FSDP_SEEDS[r]: all rows stop after 25 tokens / run to 40


def _fsdp_model():
    lm = _eos_biased_model(73)
    with torch.no_grad():
        lm.lm_head.weight.mul_(4.0)  # a peaked distribution: EOS gets sampled
    return lm


def _fsdp_generate(lm, seed):
    sampling = Sampling(40, eos_token_id=2, pad_token_id=0, vocab_size=REAL_VOCAB)
    return generate(lm, toy_prompts(), sampling, generator=torch.Generator().manual_seed(seed))


def _fsdp_worker(rank: int, init_file: str, out_dir: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    full = _fsdp_model()
    policy = shard_policy(Policy(_fsdp_model()))  # FSDP2: each decoder layer, then the Policy root
    assert all(isinstance(p, DTensor) for p in policy.parameters())
    with gathered(policy):
        for (name, p), q in zip(policy.lm.named_parameters(), full.parameters()):
            assert not isinstance(p, DTensor) and torch.equal(p, q), name  # the full parameters, as plain tensors
        rollout = _fsdp_generate(policy.lm, _FSDP_SEEDS[rank])  # the HF model itself, not through the root
    assert all(isinstance(p, DTensor) for p in policy.parameters())  # resharded
    logprobs = policy(*rollout.training_inputs(), rollout.response_mask)[0]  # FSDP training works afterwards
    logprobs.sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in policy.parameters())  # sharded gradients, reduce-scattered
    logprobs = logprobs.detach()
    with gathered(policy):  # and so does a second rollout phase
        again = _fsdp_generate(policy.lm, _FSDP_SEEDS[rank])
    assert torch.equal(again.response_ids, rollout.response_ids)
    torch.save({"rollout": rollout, "policy_logprobs": logprobs}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # as train.py does: no interpreter teardown racing torch's gloo threads


def test_rollout_fsdp2_two_processes_equal_one():
    with tempfile.TemporaryDirectory() as tmp:
        two_processes(_fsdp_worker, tmp, "2-process rollout hung")
        results = [torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=False) for rank in range(2)]
    lm = _fsdp_model()
    lengths = set()
    for seed, result in zip(_FSDP_SEEDS, results):
        expected = _fsdp_generate(lm, seed)
        got = result["rollout"]
        assert torch.equal(got.response_ids, expected.response_ids)
        torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-6, rtol=0)
        lengths.add(got.response_ids.shape[1])
        with torch.no_grad():
            policy_logprobs = Policy(lm)(*got.training_inputs(), got.response_mask)[0]
        torch.testing.assert_close(result["policy_logprobs"], policy_logprobs)
    assert lengths == {25, 40}  # the ranks stopped decoding at different steps and neither hung


# ---------------------------------------------------------------- token-budget micro-batches (Rollout.micro_batches)

def _rows_of_lengths(lengths: list[int]) -> Rollout:
    """A Rollout whose rows have these prompt + response lengths (prompt 1 token, the rest response)."""
    B, T = len(lengths), max(lengths)
    response_mask = (torch.arange(T) < torch.tensor(lengths)[:, None] - 1).long()  # (B, T)
    return Rollout(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long),
                   torch.zeros(B, T, dtype=torch.long), response_mask, torch.zeros(B, T),
                   torch.zeros(B, dtype=torch.bool))


def _group_order(lengths: list[int], groups: list[int]) -> list[int]:
    """The row order micro_batches promises: rows of one prompt together, groups by their longest row (ties: the
    group first seen first), longest first within a group."""
    longest = {g: max(n for n, h in zip(lengths, groups) if h == g) for g in groups}
    seen = {g: groups.index(g) for g in groups}
    return sorted(range(len(lengths)), key=lambda i: (-longest[groups[i]], seen[groups[i]], -lengths[i]))


def _grouped_rows(lengths: list[int], groups: list[int]) -> Rollout:
    """A Rollout whose rows have these prompt + response lengths and prompts (group g: a 1-token prompt id g + 4)."""
    base = _rows_of_lengths(lengths)
    return replace(base, prompt_ids=torch.tensor(groups)[:, None] + 4)


def test_rollout_micro_batches_respect_the_token_budget():
    """Token-budget micro-batches: a partition of the rows in group order (the rows of one prompt together, groups
    longest row first, longest first within a group); the rows' prompt + response tokens <= budget unless a single
    row is longer; as few micro-batches as the budget allows for that order (one more row would not fit)."""
    g = torch.Generator().manual_seed(0)
    B, P, T, G = 40, 6, 30, 4
    prompt_len, response_len = torch.randint(1, P + 1, (B // G,), generator=g), torch.randint(1, T + 1, (B,),
                                                                                             generator=g)
    prompt_len = prompt_len.repeat_interleave(G)  # (B,) G rows per prompt
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()  # (B, P) left-padded
    prompt_ids = torch.randint(4, 100, (B // G, P), generator=g).repeat_interleave(G, 0) * prompt_mask
    response_mask = (torch.arange(T) < response_len[:, None]).long()  # (B, T) right-padded
    batch = Rollout(prompt_ids, prompt_mask, torch.zeros(B, T, dtype=torch.long), response_mask, torch.zeros(B, T),
                    torch.zeros(B, dtype=torch.bool))
    lengths = (prompt_len + response_len).tolist()
    assert batch.lengths().tolist() == lengths
    want = _group_order(lengths, [i // G for i in range(B)])
    for budget in (1, 20, 35, 100, 10**6):  # 20, 35 < the longest row (up to 36)
        parts = [p.tolist() for p in batch.micro_batches(budget)]
        assert [i for p in parts for i in p] == want
        for p in parts:
            assert sum(lengths[i] for i in p) <= budget or len(p) == 1
        srt, fewest, s = [lengths[i] for i in want], 0, 0
        while s < B:  # the fewest: fill each micro-batch while one more row fits
            e = s + 1
            while e < B and sum(srt[s:e + 1]) <= budget:
                e += 1
            fewest, s = fewest + 1, e
        assert len(parts) == fewest
    assert len(batch.micro_batches(1)) == B and len(batch.micro_batches(10**6)) == 1


def test_rollout_micro_batches_agreed_count_is_balanced_and_within_budget():
    """With agree(): exactly the agreed number of micro-batches (at least what the rows need), a partition of the
    rows in group order, every micro-batch within the budget unless it is one over-long row, and the largest padded
    size as small as any split of the ordered rows into that many consecutive runs allows (brute force)."""
    import itertools

    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lengths = torch.randint(2, 40, (n,), generator=g).tolist()
        groups = torch.randint(0, 1 + trial % 4, (n,), generator=g).tolist()  # 1 to 4 prompts, rows in any order
        batch = _grouped_rows(lengths, groups)
        budget = int(torch.randint(1, 120, (1,), generator=g))
        need = len(batch.micro_batches(budget))
        srt = [lengths[i] for i in _group_order(lengths, groups)]
        for count in range(need, n + 1):
            parts = [p.tolist() for p in batch.micro_batches(budget, agree=lambda own: count)]
            assert len(parts) == count and all(parts)
            assert [i for p in parts for i in p] == _group_order(lengths, groups)
            cost = [sum(lengths[i] for i in p) for p in parts]
            assert all(c <= budget or len(p) == 1 for c, p in zip(cost, parts)), (lengths, budget, count, parts)
            best = min(max(sum(srt[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
                       for cuts in itertools.combinations(range(1, n), count - 1)
                       if all(sum(srt[a:b]) <= budget or b - a == 1 for a, b in zip((0, *cuts), (*cuts, n))))
            assert max(cost) == best, (lengths, groups, budget, count, parts)
    with pytest.raises(ValueError, match="cannot cut 3 rows into 4 micro-batches"):
        _rows_of_lengths([5, 4, 3]).micro_batches(100, agree=lambda own: 4)
    # a count below what the rows need would break the budget: refused
    with pytest.raises(ValueError, match="cannot cut 3 rows into 1 micro-batches"):
        _rows_of_lengths([5, 4, 3]).micro_batches(5, agree=lambda own: 1)


# ==================================================================================================================
# rollout.py: --stop-text
# ==================================================================================================================
def _piece_tokenizer():
    """A tokenizer of multi-character pieces (ids 0-3 special, as tiny_tokenizer's), so that a stop text can be
    spelled inside one token or across several: "\\n\\n" is one piece, "a\\n" + "\\nb" another spelling of it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "a", "b", "\n", "a\n", "\nb", "\n\n", " ",
              "x", "ab", "b\n", "é"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>"])


def test_rollout_stop_text_ends_rows_where_the_text_first_appears():
    """Against the unstopped sampler with the same seed, decoded naively: each row is the unstopped row cut after
    the first token at which a stop text appears in the whole decoded response (special tokens skipped, as
    Rollout.texts), or at its EOS if that comes first; the tokens before are the same. Matches inside one token and
    across token boundaries (and across special tokens) both occur."""
    tok = _piece_tokenizer()
    V, texts = len(tok), ["\n\n", "ab"]
    lm = tiny_model(vocab_size=V)
    stop = rollout.StopText(tok, texts)
    prompts = [[4, 5, 6], [7, 8], [9], [10, 11, 4]] * 4
    kinds = set()
    for seed in range(6):
        for compact in (0.0, None):  # dropping finished rows changes no token
            full, cut = (generate(lm, prompts, Sampling(30, 1.0, eos_token_id=2, pad_token_id=0,
                                                        vocab_size=V, stop_text=s),
                                  generator=torch.Generator().manual_seed(seed), compact=compact)
                         for s in (None, stop))
            for i in range(len(prompts)):
                ids = full.response_ids[i][full.response_mask[i].bool()].tolist()
                end = next((t + 1 for t in range(len(ids))
                            if any(s in tok.decode(ids[:t + 1], skip_special_tokens=True) for s in texts)), None)
                got = cut.response_ids[i][cut.response_mask[i].bool()].tolist()
                assert got == ids[:end or len(ids)], (seed, i)
                assert torch.equal(cut.logprobs[i, :len(got)], full.logprobs[i, :len(got)])
                assert bool(cut.truncated[i]) == (end is None and bool(full.truncated[i]))
                if end:
                    alone = tok.decode(ids[end - 1:end])
                    kinds.add("inside" if any(s in alone for s in texts) else "across")
                    kinds.add("special" if any(t in (0, 1) for t in ids[max(0, end - 3):end]) else "plain")
    assert kinds == {"inside", "across", "special", "plain"}, kinds


def test_rollout_stop_text_window_and_vocabulary_filter():
    """A text of n bytes is looked for in the last n + 1 tokens that are not special; a token can end a match only if
    it spells the text's last character or no whole character (a byte of a multi-byte one); a special token, which
    the decoded text skips, never ends one."""
    tok = tiny_tokenizer()
    stop = rollout.StopText(tok, ["ab", "é"])
    assert stop.window == 3  # "é" is 2 bytes in UTF-8
    ids = tok("xab").input_ids
    assert stop.tail([0, *ids, 1, 0]) == [*ids, 1, 0]  # special tokens do not count towards the window
    may = {tok.convert_ids_to_tokens(i): bool(stop.may_end[i]) for i in range(len(tok))}
    assert may["b"] and not may["a"] and not may["<|im_end|>"]
    rows = torch.tensor([tok("xxab").input_ids, tok("abxx").input_ids, tok("xxxx").input_ids])  # (3, 4)
    assert stop.ends(rows, 0).tolist() == [3, 1, -1] and stop.ends(rows, 2).tolist() == [3, -1, -1]
    with pytest.raises(ValueError, match="non-empty"):
        rollout.StopText(tok, [""])


def test_plain_engine_passes_the_stop_text():
    """make_engine(stop_text=...) gives the plain engine the texts; its rows end where `generate`'s do."""
    tok = tiny_tokenizer()
    lm = tiny_model()
    prompts = [format_prompt(tok, p, chat=False, instruction="") for p in ("12", "ab", "x y")]
    engine = choice.make_engine("plain", lm, tok, chat=False, stop_text=["e", " t"])
    with engine.ready(lm):
        got = engine.sample(prompts, 2, [7], 3, 20, 1.0, 1.0)
    sampling = Sampling(20, eos_token_id=engine.eos, pad_token_id=engine.pad, vocab_size=REAL_VOCAB,
                        stop_text=rollout.StopText(tok, ["e", " t"]))
    want = sample_groups(lm, prompts, 2, sampling, generator=torch.Generator().manual_seed(7))
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
    assert any("e" in t or " t" in t for t in got.texts(tok))
