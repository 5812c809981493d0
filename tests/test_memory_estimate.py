"""memory/estimate.py: what a run needs in memory, against the model's own parameter count and a
real KV cache.
"""
import pytest
import torch

from memory.estimate import kv_cache_bytes, memory_estimate


# ==================================================================================================
# memory/estimate.py: parameters, optimizer state, activations, KV cache
# ==================================================================================================
def test_model_memory_estimate_counts_parameters_and_kv_cache():
    """The memory model's parameter count = the model's (tied and untied head), sharded over FSDP
    ranks; its KV term = the bytes of a real DynamicCache after a prefill; checkpointing and the
    token budget move activations only."""
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM
    for tied in (True, False):
        config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=80,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, tie_word_embeddings=tied)
        lm = Qwen3ForCausalLM(config)
        est = memory_estimate(config, world=1, fsdp=False, compute_bytes=4)
        assert est["params"] * 2**30 / 4 == \
            pytest.approx(sum(p.numel() for p in lm.parameters()), abs=0.5)
        assert memory_estimate(config, world=8)["adam"] == pytest.approx(est["adam"] / 8)
    rows, length = 3, 11
    cache = DynamicCache(config=config)
    with torch.no_grad():
        lm.model(input_ids=torch.randint(96, (rows, length)), past_key_values=cache, use_cache=True)
    cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                      for t in (layer.keys, layer.values))
    assert cache_bytes == kv_cache_bytes(config, rows, length, dtype_bytes=4)
    base = memory_estimate(config, tokens=1000)
    double, off = memory_estimate(config, tokens=2000), memory_estimate(config, checkpointing=False)
    assert double["activations"] == pytest.approx(2 * base["activations"]) and \
        off["activations"] > base["activations"]
    assert {k for k in base if base[k] != double[k]} == {"activations", "train_peak", "peak"} - (
        set() if base["train_peak"] >= base["rollout_peak"] else {"peak"})
