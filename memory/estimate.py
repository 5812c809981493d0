"""What a run needs in memory (docs/memory.md): the KV cache of a rollout, and the parameters,
gradients, optimizer state, activations and logits of an update per rank, before anything is
allocated."""
from __future__ import annotations

from dataclasses import dataclass


def kv_cache_bytes(config, rows: int, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of a KV cache holding `tokens` positions for `rows` sequences of a decoder with HF
    `config`: rows x tokens x layers x 2 (K and V) x kv_heads x head_dim x dtype_bytes (e.g. 112 KiB
    per token for Qwen3-1.7B in bf16)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return rows * tokens * config.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class RolloutCall:
    """The largest generate call of a rollout phase: `rows` sequences of `prompt_len` +
    `response_len` positions."""
    rows: int = 64
    prompt_len: int = 1024
    response_len: int = 15360


def memory_estimate(config, world: int = 1, tokens: int = 32768, checkpointing: bool = True,
                    rollout_call: RolloutCall = RolloutCall(), fsdp: bool = True,
                    compute_bytes: int = 2, chunk_size: int = 1024) -> dict[str, float]:
    """Estimated peak memory per rank, in GiB, term by term, of a Qwen3/Llama-shaped model (HF
    `config`: hidden, intermediate and head sizes, layers, heads, KV heads, vocabulary, tied
    embeddings) trained as train.py does.

    Parameters are fp32 master weights; with `fsdp` they, their gradients and AdamW's two states are
    sharded over `world` ranks. compute_bytes: 2 for bf16 mixed precision (CUDA), 4 for fp32.
    tokens: prompt + response tokens of one training micro-batch (--max-tokens-per-micro-batch). The
    rollout phase holds the sharded parameters and AdamW states (gradients are freed after each
    step), the gathered full copy (FSDP2, `distributed.sharding.gathered`), the KV cache of one
    generate call (`rollout_call`: its rows at prompt_len + response_len positions), and the
    prefill's activations. Returned keys: the terms, "train_peak", "rollout_peak" and "peak" (their
    max).
    """
    D, I, layers, V = (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                       config.vocab_size)
    H, KV = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or D // H
    b, shards, GiB, call = compute_bytes, world if fsdp else 1, 2**30, rollout_call
    # q, o, k, v, MLP, norms
    layer_params = 2 * D * H * hd + 2 * D * KV * hd + 3 * D * I + 2 * D + 2 * hd
    # embeddings, LM head, final norm
    root_params = V * D * (1 if config.tie_word_embeddings else 2) + D
    n = layers * layer_params + root_params
    # values saved per token and layer for the backward: RMSNorm inputs / outputs (6 D), q and k
    # through their norms and rotary (5 each), v, the attention output and its copy, and the MLP's
    # gate, up, silu(gate) and product (4 I)
    per_layer = 6 * D + 7 * H * hd + 6 * KV * hd + 4 * I
    # checkpointing keeps each layer's input and, in the backward, one layer's recomputed
    # activations; the backward's gradient temporaries fit in the memory it frees (measured on CPU,
    # docs/memory.md)
    saved = layers * D + per_layer if checkpointing else layers * per_layer
    terms = {
        "params": 4 * n / shards / GiB,
        "grads": 4 * n / shards / GiB,
        "adam": 8 * n / shards / GiB,
        # FSDP2 while training: root (gathered for the whole pass) and two layers
        # (current + prefetched) in the compute dtype, and their unsharded fp32 gradients before the
        # reduce-scatter
        "train_gathered": (root_params + 2 * layer_params) * b / GiB
                          + (root_params + layer_params) * 4 / GiB if fsdp else 0.0,
        # + the head's input, the final norm's values and the input gradient (4 D)
        "activations": tokens * (saved + 4 * D) * b / GiB,
        # two fp32 (C, V) logit buffers, fp32 head gradient
        "head": (2 * chunk_size * V + V * D) * 4 / GiB,
        "rollout_gathered": n * b / GiB if fsdp else 0.0,
        "kv_cache": kv_cache_bytes(config, call.rows, call.prompt_len + call.response_len, b) / GiB,
        # prefill: one layer's MLP and norm values for every prompt token; sampling: 4 fp32
        # (rows, V) buffers
        "rollout_work": (call.rows * call.prompt_len * (2 * I + 4 * D) * b
                         + 16 * call.rows * V) / GiB,
    }
    states = terms["params"] + terms["adam"]
    terms["train_peak"] = states + sum(terms[k]
                                       for k in ("grads", "train_gathered", "activations", "head"))
    terms["rollout_peak"] = states + sum(terms[k]
                                         for k in ("rollout_gathered", "kv_cache", "rollout_work"))
    terms["peak"] = max(terms["train_peak"], terms["rollout_peak"])
    return terms


def added_up(total_label: str, parts: dict[str, float], unit: str = "GiB") -> str:
    """"LABEL T GiB = a x + b y + ..." of `parts` in GiB, shown in `unit` (GiB or MiB) to one
    decimal, rounded so that the parts shown add up to the total shown (cumulative rounding);
    parts that round to 0.0 are left out."""
    scale = 1024 if unit == "MiB" else 1
    shown, before, running = [], 0.0, 0.0
    for name, value in parts.items():
        running += value * scale
        rounded = round(running, 1) - round(before, 1)
        before = running
        if round(rounded, 1) > 0:
            shown.append(f"{name} {rounded:.1f}")
    return f"{total_label} {round(running, 1):.1f} {unit} = " + " + ".join(shown or ["0.0"])


def memory_line(est: dict[str, float], rows: int, tokens: int) -> str:
    """One line for the start of a run: the estimated peak per rank, in training and in sampling,
    each the sum of its terms (in MiB below 1 GiB); the KV cache is that of one generate call of
    `rows` rows of `tokens` positions."""
    training = {"weights + gradients + AdamW": est["params"] + est["grads"] + est["adam"],
                "activations": est["activations"], "logits": est["head"],
                "gathered layers": est["train_gathered"]}
    sampling = {"weights + AdamW": est["params"] + est["adam"],
                "gathered copy": est["rollout_gathered"],
                f"KV cache ({rows} rows x {tokens} tokens per generate call)": est["kv_cache"],
                "sampling buffers": est["rollout_work"]}
    unit = "GiB" if est["peak"] >= 1 else "MiB"
    return (f"memory per rank, estimated with every row at its longest (an upper bound): "
            f"{added_up('training', training, unit)}; {added_up('sampling', sampling, unit)}")


def run_estimate(cfg, lm_config, world: int, prompt_len: int, per_call: int) -> dict:
    """memory_estimate for train.py's settings `cfg` (a config.Config) on `world` ranks: its
    micro-batches by --max-tokens-per-micro-batch, its generate calls of `per_call` prompts x G,
    every row at its longest (`prompt_len` + --max-response-len)."""
    row = prompt_len + cfg.max_response_len
    n_rows = cfg.mini_batch_prompts // world * cfg.group_size
    rollout_call = RolloutCall(per_call * cfg.group_size, prompt_len, cfg.max_response_len)
    return memory_estimate(
        lm_config, world, min(max(cfg.max_tokens_per_micro_batch, row), n_rows * row),
        cfg.grad_checkpointing, rollout_call,
        fsdp=cfg.fsdp, compute_bytes=2 if cfg.fsdp and cfg.mixed_precision else 4,  # as in effect
        chunk_size=cfg.chunk_size)
