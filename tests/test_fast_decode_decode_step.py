"""fast_decode/decode_step.py: the plain sampler's fast decode step on CPU: the KV cache written in
place (against transformers' DynamicCache), the linears through oneDNN, and the decode step written
out for Qwen3, Llama and Qwen2 (against the model's own forward).
"""
import pytest
import torch

import rollout
from fast_decode import decode_step
from model import position_ids_from_mask, tiny_model
from rollout import Sampling, generate
from tests.sampler_checks import REAL_VOCAB, toy_prompts


# ==================================================================================================
# fast_decode/decode_step.py: InPlaceCache, onednn_linears, DecodeStep
# ==================================================================================================
def test_rollout_in_place_cache_equals_dynamic_cache():
    """Pins the transformers cache interface `decode_step.InPlaceCache` relies on (5.17-5.19:
    `update` returns what attention reads, `get_seq_length` / `get_mask_sizes` give the length): a
    prefill of left-padded prompts, decode steps, a row drop and more steps give the hidden states
    of transformers' DynamicCache with `batch_select_indices`, while the cache is written in place
    (views of buffers allocated once) and a drop copies only the rows moved into freed slots."""
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
            decoder(input_ids=prompt, attention_mask=prompt_mask,
                    position_ids=position_ids_from_mask(prompt_mask), past_key_values=cache,
                    use_cache=True)
        buffer = ours.layers[0].key_buffer.data_ptr()
        for t in range(T):
            # rows 0 and 2 finish: row 3 moves to slot 0, row 1 stays; the reference selects [1, 3]
            if t == 3:
                order = decode_step.drop_finished(torch.tensor([False, True, False, True]), ours)
                # one row's cache copied, not both kept rows
                assert order.tolist() == [3, 1] and copied == [1]
                ref.batch_select_indices(torch.tensor([1, 3]))
                rows = rows[order]
            outs = []
            for cache, r in ((ours, rows), (ref, rows.sort().values)):
                outs.append(decoder(input_ids=tokens[r, t:t + 1],
                                    attention_mask=mask[r, :P + t + 1],
                                    position_ids=positions[r, t:t + 1], past_key_values=cache,
                                    use_cache=True).last_hidden_state)
            torch.testing.assert_close(outs[0], outs[1][rows.argsort().argsort()],
                                       atol=1e-6, rtol=0)
            layer = ours.layers[0]
            assert ours.get_seq_length() == P + t + 1 and \
                layer.keys.shape == ref.layers[0].keys.shape
            assert layer.keys.data_ptr() == buffer  # a view of the buffer allocated at the prefill
    with pytest.raises(NotImplementedError, match="full attention"):
        config = tiny_model().config
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        decode_step.InPlaceCache(config, B, P + T)


def test_rollout_onednn_linears_same_values():
    """Inside `onednn_linears` every linear layer computes x W^T + b through oneDNN's reordered
    weights (as the sampler's head does through `packed`): the values of F.linear up to fp32
    rounding; afterwards the layers are plain again. The packed path runs only where it applies
    (CPU, fp32 / bf16, not under autograd here)."""
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
    assert not decode_step._packs(torch.zeros(2, 2, dtype=torch.float16)) and \
        decode_step._packs(head)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_rollout_written_out_decode_step(family):
    """`decode_step.DecodeStep` (the decode step written out layer by layer, on CPU) samples what
    the model's own forward samples: greedy token for token and sampled with the same generator,
    log-probs to 1e-5, on left-padded prompts (a padding mask), rows stopping at different lengths,
    for the three families it writes out (Qwen3's per-head q/k norms, Llama, Qwen2's q/k/v biases,
    given random values here); the backbone's own forward then runs once, for the prefill. A model
    it does not support (fp16 weights) decodes through the model's forward."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                 bos_token_id=None, eos_token_id=2, pad_token_id=0,
                 initializer_range=0.2)  # the default 0.02 gives all prompts the same greedy tokens
    torch.manual_seed(0)
    lm = {"qwen3": lambda: tiny_model(),
          "llama": lambda: LlamaForCausalLM(LlamaConfig(**sizes)).float().eval(),
          "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**sizes)).float().eval()}[family]()
    prompts = toy_prompts()
    with torch.no_grad():
        for m in lm.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.1)
        # as eos_biased_model: EOS wins wherever a token would,
        # the first token for which greedy rows stop apart
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
            # the prefill only; else the prefill and each step
            assert len(calls) == (1 if written_out else steps)
        assert torch.equal(runs[0].response_ids, runs[1].response_ids)
        torch.testing.assert_close(runs[0].sampler_logprobs, runs[1].sampler_logprobs, atol=1e-5,
                                   rtol=0)
        assert runs[0].prompt_mask.float().mean() < 1 and steps > 8
        # greedy rows stop apart
        assert temperature or len(set(runs[0].response_mask.sum(1).tolist())) > 2
    handle.remove()
    assert not decode_step.DecodeStep.supports(lm.half())
