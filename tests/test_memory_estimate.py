"""memory/estimate.py: what a run needs in memory, against the model's own parameter count and a
real KV cache.
"""
import re

import pytest
import torch

from memory.estimate import kv_cache_bytes, memory_estimate, memory_line


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


def test_memory_line_totals_add_up_and_name_no_function():
    """The start-of-run line: each total is the sum of the terms shown under it (they said
    "2.0, activations 3.8" under a total of 6.3 and left the rest out), its one KV cache says whose
    it is, and it ends with no module path (it ended "memory.estimate.memory_estimate")."""
    from transformers import LlamaConfig
    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                          tie_word_embeddings=True)
    qwen = LlamaConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, tie_word_embeddings=True)
    for est in (memory_estimate(smollm2, fsdp=False, compute_bytes=4),
                memory_estimate(qwen, world=8)):
        line = memory_line(est, 128, 44)
        totals = re.findall(r"(training|sampling) ([\d.]+) GiB = ([^;]+)", line)  # 1 GiB or more
        assert [t[0] for t in totals] == ["training", "sampling"], line
        for name, total, parts in totals:
            shown = [float(x) for x in re.findall(r" (\d+\.\d)(?= \+|$)", " " + parts)]
            assert sum(shown) == pytest.approx(float(total)), line
            peak = {"training": est["train_peak"], "sampling": est["rollout_peak"]}[name]
            assert float(total) == pytest.approx(peak, abs=0.05)
        assert line.count("KV cache") == 1 and "memory.estimate" not in line
        assert "KV cache (128 rows x 44 tokens per generate call)" in line
