"""attention/packed_sdpa.py: the packed rows' attention (flash-attn's layout), grouped SDPA for the
sampler's left-padded prompts.
"""
import sys
from dataclasses import replace
from types import SimpleNamespace

import torch

from attention import packed_sdpa
from model import Policy, tiny_model
from rollout import Sampling, generate
from tests.model_batches import packing_batch
from tests.sampler_checks import REAL_VOCAB, eos_biased_model, recomputed_logprobs, toy_prompts


# ==================================================================================================
# attention/packed_sdpa.py: packed rows, grouped SDPA
# ==================================================================================================
def test_model_packed_attention_flash_varlen_layout(monkeypatch):
    """The flash-attn branch of packed attention (CUDA + fp16/bf16 + flash-attn installed; none of
    them here): a stand-in flash_attn_varlen_func that runs SDPA on each sequence alone gives Policy
    the outputs of the SDPA branch, so the packed row, cu_seqlens and layouts handed to flash-attn
    are right."""
    # q, k, v: (N, heads, hd) each; kw: softmax_scale, causal
    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        softmax_scale, causal = kw.get("softmax_scale"), kw.get("causal", False)
        assert causal and torch.equal(cu_q, cu_k) and max_q == max_k == int(cu_q.diff().max())
        out = [torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=softmax_scale,
            enable_gqa=True)
            for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]  # each (H, l, hd)
        return torch.cat(out, 1).transpose(0, 1)  # (N, H, hd)

    lm = tiny_model()
    policy, batch = Policy(lm), packing_batch()
    want = policy(*batch.training_inputs(), batch.response_mask)
    monkeypatch.setitem(sys.modules, "flash_attn", SimpleNamespace(flash_attn_varlen_func=varlen))
    monkeypatch.setattr(packed_sdpa, "_flash_varlen", lambda query: True)
    got = policy(*batch.training_inputs(), batch.response_mask)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_rollout_grouped_sdpa_no_repeated_cache(monkeypatch):
    """`grouped_sdpa` (on CPU, when a mask is given, under PACKED_SDPA, which PlainEngine and Policy
    give the model) equals SDPA over the key/value heads repeated per head group; the sampler then
    samples left-padded prompts as under transformers' SDPA (greedy token for token, log-probs to
    1e-5) without ever copying the cache per head group (transformers' repeat_kv, at the prefill
    and at every decode step)."""
    from transformers.integrations import sdpa_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, heads, length, 16, generator=g)
               for heads, length in ((4, 1), (2, 7), (2, 7)))
    mask = torch.ones(5, 1, 1, 7, dtype=torch.bool)
    mask[1, ..., :3] = False
    ref = torch.nn.functional.scaled_dot_product_attention(  # ref (R, 1, H, hd)
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(packed_sdpa.grouped_sdpa(q, k, v, mask), ref, atol=1e-6, rtol=1e-5)
    lm, prompts = eos_biased_model(105), toy_prompts()  # prompts of unequal lengths: a padding mask
    assert lm.config.num_key_value_heads < lm.config.num_attention_heads
    sampling = Sampling(48, eos_token_id=2, pad_token_id=0, vocab_size=REAL_VOCAB)
    runs = {}
    for attention in ("sdpa", packed_sdpa.PACKED_SDPA):
        lm.set_attn_implementation(attention)
        calls = []
        monkeypatch.setattr(sdpa_attention, "repeat_kv",
                            lambda x, n: calls.append(x.shape[2]) or x.repeat_interleave(n, 1))
        greedy = replace(sampling, temperature=0)
        runs[attention] = generate(lm, prompts, greedy, written_out=False), calls
    (ref, ref_calls), (r, calls) = runs["sdpa"], runs[packed_sdpa.PACKED_SDPA]
    assert torch.equal(r.response_ids, ref.response_ids) and \
        len(set(r.response_mask.sum(1).tolist())) > 1
    torch.testing.assert_close(r.sampler_logprobs, ref.sampler_logprobs, atol=1e-5, rtol=0)
    # transformers': every step
    assert calls == [] and len(ref_calls) > 2 * lm.config.num_hidden_layers
    sampled = generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(1),
                       written_out=False)
    recomputed = recomputed_logprobs(lm, sampled, 1.0, REAL_VOCAB)
    torch.testing.assert_close(sampled.sampler_logprobs[sampled.response_mask.bool()],
                               recomputed[sampled.response_mask.bool()], atol=1e-5, rtol=0)
