"""Attention inside the policy's forward (docs/paper.md, "Deliberate differences": D22 and D23;
docs/memory.md#attention-path): the attention implementation `PACKED_SDPA` that model.Policy and the
plain sampler give their model. For a packed row (`PackedRows`: where each sequence's tokens are)
attention stays within each sequence, the sequences laid out in model.attention_buckets's buckets
for SDPA's causal kernel, or taken directly by flash-attn's variable-length kernel on CUDA; every
other call is transformers' SDPA, over grouped query heads on CPU when a mask is given
(`grouped_sdpa`: no copy of the KV cache per head group). Registered with transformers'
AttentionInterface when this file is imported.
"""
import importlib.util
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "stapo_packed_sdpa"  # the attention implementation `Policy` gives its model


@dataclass
class PackedRows:
    """Where the sequences of a packed row are, for attention. Each bucket (`attention_buckets`) is
    an (S_b, L_b) grid, one sequence (prompt + response of a row) per grid row, `index[s, c]` the
    packed column of its c-th token. Rows that share a prompt read the same packed prompt columns,
    so each owns only some cells: every packed column is owned by exactly one real cell, and
    `unpack` puts the owned cells (bucket by bucket, row-major) back in packed order."""
    index: list[torch.Tensor]  # per bucket (S_b, L_b) long: packed column per cell (0 if not real)
    real: list[torch.Tensor]   # per bucket (S_b, L_b) bool: c < the length of sequence s
    owner: list[torch.Tensor]  # per bucket (S_b, L_b) bool: the cell whose output is its column's
    unpack: torch.Tensor       # (N,) long: where packed column j is among the owned cells


def packed_sdpa_attention(module, query, key, value, attention_mask,
                          packed: PackedRows | None = None, **kwargs):
    """transformers' SDPA attention (`grouped_sdpa` on CPU when a mask is given: the sampler's
    left-padded rows), and for a packed row (`packed` given, batch 1) causal attention within each
    sequence: query (1, H, N, hd), key / value (1, KV, N, hd) of the packed row. The sequences of a
    bucket are laid out as the rows of (S_b, L_b) for SDPA's causal kernel (a row's padding sits
    after its real tokens, so no real token sees it; a shared prompt is read by every row of its
    group, its keys and values thereby serve each response) and the owned cells are packed back:
    padding and a shared prompt's repeats exist only inside attention; every projection, MLP and the
    LM head run on each packed token once."""
    if packed is None:
        if attention_mask is not None and query.device.type == "cpu" and \
                key.shape[1] < query.shape[1]:
            return grouped_sdpa(query, key, value, attention_mask, kwargs.get("scaling")), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if _flash_varlen(query):  # CUDA, half precision, flash-attn: variable-length kernel, no padding
        from flash_attn import flash_attn_varlen_func
        cells = torch.cat([i[r] for i, r in zip(packed.index, packed.real)])  # (M,) real cells
        q, k, v = (x[0][:, cells].transpose(0, 1) for x in (query, key, value))  # (M, heads, hd)
        lengths = torch.cat([r.sum(1) for r in packed.real])  # (S,) sequences, end to end
        cu = nn.functional.pad(lengths.cumsum(0), (1, 0)).int()  # (S+1,)
        L = max(r.shape[1] for r in packed.real)
        out = flash_attn_varlen_func(q, k, v, cu, cu, L, L, softmax_scale=kwargs.get("scaling"),
                                     causal=True)
        owned = torch.cat([o[r] for o, r in zip(packed.owner, packed.real)])  # (M,)
        return out[owned][packed.unpack][None], None  # (M, H, hd) -> (1, N, H, hd)
    outs = []
    for index, owner in zip(packed.index, packed.owner):  # rows: each (S_b, heads, L_b, hd)
        rows = [x[0][:, index].transpose(0, 1) for x in (query, key, value)]
        out, _ = sdpa_attention_forward(module, *rows, None, **kwargs)  # (S_b, L_b, H, hd), causal
        outs.append(out[owner])  # (owned cells, H, hd)
    return torch.cat(outs)[packed.unpack][None], None  # (1, N, H, hd)


def grouped_sdpa(query, key, value, attention_mask, scaling: float | None = None) -> torch.Tensor:
    """SDPA with a mask (R, 1, q, L) over grouped query heads: query (R, H, q, hd), key / value
    (R, KV, L, hd) -> (R, q, H, hd). transformers' SDPA path copies the keys and values once per
    head group (`repeat_kv`) whenever a mask is given, as CUDA's fused kernels need; PyTorch's CPU
    kernel takes the groups as they are (`enable_gqa`), 3-4x faster for the sampler's decode steps
    over a cache of left-padded prompts (docs/rollouts.md; D23)."""
    return nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True).transpose(1, 2)


def _flash_varlen(query) -> bool:
    """Whether packed attention takes flash-attn's variable-length kernel (CUDA, fp16 / bf16,
    package installed)."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and \
        importlib.util.find_spec("flash_attn") is not None


def _packed_sdpa_mask(attention_mask=None, q_length=None, kv_length=None, q_offset=0, **kwargs):
    """The mask of PACKED_SDPA: none for a forward without a padding mask or cache (plain causal, or
    packed rows that `packed_sdpa_attention` keeps apart), else SDPA's (the sampler's padded, cached
    calls)."""
    if attention_mask is None and q_length == kv_length and not q_offset:
        return None
    return sdpa_mask(attention_mask=attention_mask, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, **kwargs)


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, _packed_sdpa_mask)
