"""The plain sampler's fast decode step on CPU (docs/paper.md §1; docs/rollouts.md): a KV cache
written in place (`InPlaceCache`), the decoder's linears through oneDNN with reordered weights
(`onednn_linears`), and the decode step of a Llama, Qwen2 or Qwen3 model written out layer by layer
(`DecodeStep`). rollout.generate decodes through them; they compute the model's own equations
(docs/paper.md, "Deliberate differences": D4, D8, D9)."""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.models.llama.modeling_llama import rotate_half

from attention.packed_sdpa import grouped_sdpa


class InPlaceLayer(DynamicLayer):
    """One decoder layer's KV cache for `generate`, allocated once for `rows` x `max_len` tokens and
    written in place (transformers' `DynamicLayer` grows by torch.cat, copying the whole cache at
    every step). The running rows are the first R rows of the buffers; `keys` / `values` are views
    (R, kv_heads, length, head_dim) of what is filled, which attention reads. Relies on
    transformers' cache-layer interface (5.17-5.19): `update` returns the keys and values to attend
    over, `get_seq_length` / `get_mask_sizes` (inherited) give the length; pinned by
    tests/test_rollout.py::test_rollout_in_place_cache_equals_dynamic_cache."""

    def __init__(self, rows: int, max_len: int,
                 buffers: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.capacity, self.length = (rows, max_len), 0
        if buffers is not None:  # a `CapturedStep`'s static buffers, made once per rollout phase
            self.key_buffer, self.value_buffer = buffers
            self.dtype, self.device, self.is_initialized = (self.key_buffer.dtype,
                                                            self.key_buffer.device, True)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, max_len = self.capacity
        self.key_buffer = key_states.new_empty(rows, key_states.shape[1], max_len,
                                               key_states.shape[3])
        self.value_buffer = value_states.new_empty(rows, value_states.shape[1], max_len,
                                                   value_states.shape[3])
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new (R, kv_heads, n, head_dim) states after the filled length; return the
        filled views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, n = key_states.shape[0], key_states.shape[2]
        self.key_buffer[:rows, :, self.length:self.length + n] = key_states
        self.value_buffer[:rows, :, self.length:self.length + n] = value_states
        self.length += n
        self.select_rows(rows)
        return self.keys, self.values

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, column: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured step's write (D10): the new (R, kv_heads, 1, head_dim) states at
        position `column` (a (1,) tensor, no host value: a CUDA graph replays it); returns the R
        rows' first `length` positions (R, kv_heads, length, head_dim), unfilled ones included. The
        caller advances the length (`InPlaceCache.written`)."""
        R = key_states.shape[0]
        keys, values = self.key_buffer[:R, :, :length], self.value_buffer[:R, :, :length]
        keys.index_copy_(2, column, key_states)
        values.index_copy_(2, column, value_states)
        return keys, values

    def select_rows(self, rows: int) -> None:
        """Make the first `rows` rows the running ones (views, no copy)."""
        self.keys = self.key_buffer[:rows, :, :self.length]  # (R, kv_heads, length, head_dim)
        self.values = self.value_buffer[:rows, :, :self.length]

    def get_seq_length(self) -> int:
        return self.length


class InPlaceCache(Cache):
    """The KV cache of `generate`: an `InPlaceLayer` per decoder layer (full attention only), over
    `buffers` (one (keys, values) pair per layer, each (rows, kv_heads, max_len, head_dim)) when
    given."""

    def __init__(self, config, rows: int, max_len: int, buffers: list | None = None):
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise NotImplementedError(f"generate's KV cache takes full attention layers only, not "
                                      f"{sorted(kinds)}")
        super().__init__(layers=[InPlaceLayer(rows, max_len, buffers[i] if buffers else None)
                                 for i in range(config.num_hidden_layers)])

    def written(self) -> None:
        """One more position filled in every layer by the captured step (its writes do not pass
        through `update`)."""
        for layer in self.layers:
            layer.length += 1

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        """Rows `src` of every layer's cache into rows `dst` (the filled length only); then the
        first `rows` rows run."""
        for layer in self.layers:
            for buffer in (layer.key_buffer, layer.value_buffer):
                buffer[dst, :, :layer.length] = buffer[src, :, :layer.length]
            layer.select_rows(rows)


def drop_finished(running: torch.Tensor, cache: InPlaceCache) -> torch.Tensor:
    """Drop the finished rows from the running batch by moving the running rows found past the new
    batch size into the finished rows' slots before it (so only those rows' caches are copied, at
    most as many as finished); running (R,) bool. Returns `order` (R',): slot i now holds the row
    that was in slot order[i]."""
    keep = running.nonzero().squeeze(1)  # (R',) increasing
    R = len(keep)
    holes = (~running[:R]).nonzero().squeeze(1)  # (m,) finished slots below R'
    movers = keep[keep >= R]  # (m,) running slots at or past R'
    cache.copy_rows(holes, movers, R)
    order = torch.arange(R, device=running.device)  # (R',)
    order[holes] = movers
    return order


def _onednn_linear(packed: torch.Tensor, bias: torch.Tensor | None,
                   x: torch.Tensor) -> torch.Tensor:
    """x @ W^T + b with W reordered into oneDNN's blocked layout (`packed`); x (..., in) ->
    (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packs(weight: torch.Tensor) -> bool:
    """Whether `onednn_linears` reorders this weight: a plain fp32 / bf16 tensor on the CPU, oneDNN
    built in."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and type(weight.data) is torch.Tensor and torch.backends.mkldnn.is_available())


def packed(weight: torch.Tensor):
    """x -> x @ weight^T through oneDNN with `weight` reordered once (D8), or the plain
    matmul."""
    if not _packs(weight):
        return lambda x: x @ weight.T
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    return lambda x: _onednn_linear(packed, None, x)


@contextmanager
def onednn_linears(module: torch.nn.Module):
    """For the duration, every `nn.Linear` of `module` whose weight `_packs` computes through oneDNN
    with its weight reordered once into oneDNN's blocked layout (D8): one more copy of
    those weights meanwhile."""
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear) and _packs(m.weight)
               and "forward" not in vars(m)]
    for m in linears:
        packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
        m.forward = partial(_onednn_linear, packed, None if m.bias is None else m.bias.detach())
    try:
        yield module
    finally:
        for m in linears:
            del m.forward


def _packed_cat(linears: list[torch.nn.Linear]):
    """x -> x @ [W_1; W_2; ...]^T + [b_1; b_2; ...] through oneDNN (F.linear where `_packs` does not
    hold, e.g. on CUDA): several projections of the same input as one matmul over their stacked
    weights (D9); a single projection's weight is not copied unless reordered.
    x (..., in) -> (..., sum of out)."""
    weights, biases = [m.weight.detach() for m in linears], [m.bias for m in linears]
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]  # (sum of out, in)
    bias = None if all(b is None for b in biases) else torch.cat(
        [weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach() for m in linears])
    if not _packs(weight):
        return partial(torch.nn.functional.linear, weight=weight, bias=bias)
    return partial(_onednn_linear, torch.ops.mkldnn._reorder_linear_weight(weight), bias)


def _grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of one query position over grouped heads, for the captured step (D10):
    query (R, H, 1, hd), keys / values (R, KV, L, hd), additive mask (R, 1, 1, L) -> (R, 1, H, hd).
    The H / KV query heads that read key head j (h // (H / KV) = j, as transformers' repeat_kv
    arranges them) are taken as that many query positions of head j under the same mask, so SDPA's
    fused kernels, which take no grouped heads with a mask, read each key and value head once (its
    math kernel would copy the cache per group):
        o = softmax(q K^T * scaling + mask) V"""
    R, H, _, hd = query.shape
    KV = keys.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(  # (R, KV, H / KV, hd)
        query.reshape(R, KV, H // KV, hd), keys, values, attn_mask=mask, scale=scaling)
    return o.reshape(R, 1, H, hd)


class DecodeStep:
    """One decode step of a Llama / Qwen2 / Qwen3 decoder (`WRITTEN_OUT`) on the CPU or CUDA (there
    through `CapturedStep`: D10), written out layer by layer (D9):
    token (R,) -> the last hidden state (R, 1, D) after the final norm, as
    `decoder(input_ids=token[:, None], position_ids=..., attention_mask=..., past_key_values=cache)`
    returns it. Per layer, the equations of the model's own forward:
        x = RMSNorm(h);  q, k, v = x [W_q; W_k; W_v]^T (+ b)   one matmul (Qwen3: q, k <- per-head
                                                               RMSNorm)
        q, k = RoPE(q, k, position);  K, V = cache + (k, v)    x cos + rotate_half(x) sin; the
                                                               in-place write
        h = h + softmax(q K^T / sqrt(hd) + mask) V W_o^T       SDPA over grouped heads, padding
                                                               masked (captured:
                                                               `_grouped_attention`, unfilled
                                                               positions masked)
        x = RMSNorm(h);  g, u = x [W_gate; W_up]^T             one matmul
        h = h + (act(g) * u) W_down^T
    The norms, rotary angles and activation are the model's own modules; q and k, adjacent heads of
    one matmul's output, are rotated as one tensor, and the padding mask is made additive once for
    all layers. The weights (and the LM head's real rows, `head`) are stacked and reordered for
    oneDNN when the step is built (the only copy of them meanwhile: the prefill then runs F.linear;
    on CUDA they are stacked, not reordered, and a single projection's weight is the model's own):
    once per rollout phase in `PlainEngine.ready`, once per call in a bare `generate`. A step holds
    copies, so it is valid only until the weights change."""

    def __init__(self, model, vocab_size: int | None = None):
        self.decoder, self.layers, self.vocab_size = model.get_decoder(), [], vocab_size
        for layer in self.decoder.layers:
            attention, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer, _packed_cat([attention.q_proj, attention.k_proj, attention.v_proj]),
                _packed_cat([attention.o_proj]), _packed_cat([mlp.gate_proj, mlp.up_proj]),
                _packed_cat([mlp.down_proj])))
        head = model.get_output_embeddings().weight[:vocab_size]  # (V', D) real rows only
        self.head, self.head_rows = packed(head), head.shape[0]  # (R, D) -> (R, V')

    @staticmethod
    def supports(model) -> bool:
        """A decoder of a family in `WRITTEN_OUT` whose weights all `_packs` (a CPU model in fp32 or
        bf16) or are plain CUDA tensors (D10)."""
        return (model.config.model_type in WRITTEN_OUT and all(
            _packs(p) or (p.is_cuda and type(p.data) is torch.Tensor)
            for p in model.get_decoder().layers.parameters()))

    def __call__(self, token: torch.Tensor, position: torch.Tensor,
                 attention_mask: torch.Tensor | None, cache: InPlaceCache,
                 column: torch.Tensor | None = None) -> torch.Tensor:
        """column None: the cache grows by `update` and attention reads its filled views (the eager
        step); a (1,) tensor: the captured step's static shapes (D10), the new keys and
        values written at `column` and attention over the first attention_mask.shape[1] positions,
        the unfilled ones masked by `attention_mask`."""
        h = self.decoder.embed_tokens(token[:, None])  # (R, 1, D)
        R = h.shape[0]
        # cos, sin: (R, 1, 1, hd) each
        cos, sin = (x[:, :, None] for x in self.decoder.rotary_emb(h, position))
        mask = None if attention_mask is None else (  # (R, 1, 1, L) additive, once for all layers
            h.new_zeros(R, 1, 1, attention_mask.shape[1])
            .masked_fill_(attention_mask[:, None, None, :] == 0, float("-inf")))
        for (layer, qkv, out, gate_up, down), layer_cache in zip(self.layers, cache.layers):
            attention, mlp = layer.self_attn, layer.mlp
            hd = attention.head_dim
            H, KV = attention.q_proj.out_features // hd, attention.k_proj.out_features // hd
            # x: (R, 1, heads of q, k, v, hd)
            x = qkv(layer.input_layernorm(h)).view(R, 1, H + 2 * KV, hd)
            qk = x[:, :, :H + KV]  # (R, 1, H + KV, hd)
            if hasattr(attention, "q_norm"):  # Qwen3
                qk = torch.cat([attention.q_norm(qk[:, :, :H]),
                                attention.k_norm(qk[:, :, H:])], dim=2)
            # RoPE of q and k at once: (R, H + KV, 1, hd)
            qk = (qk * cos + rotate_half(qk) * sin).transpose(1, 2)
            if column is None:
                # keys, values: (R, KV, L, hd)
                keys, values = layer_cache.update(qk[:, H:], x[:, :, H + KV:].transpose(1, 2))
                o = grouped_sdpa(qk[:, :H], keys, values, mask, attention.scaling)  # (R, 1, H, hd)
            else:
                keys, values = layer_cache.write(qk[:, H:], x[:, :, H + KV:].transpose(1, 2),
                                                 column, mask.shape[-1])
                o = _grouped_attention(qk[:, :H], keys, values, mask,
                                       attention.scaling)  # (R, 1, H, hd)
            h += out(o.reshape(R, 1, -1))
            gate, up = gate_up(layer.post_attention_layernorm(h)).chunk(2, dim=-1)  # (R, 1, I) each
            h += down(mlp.act_fn(gate) * up)
        return self.decoder.norm(h)  # (R, 1, D)


# The decoder families `DecodeStep` writes out: pre-norm attention with rotary positions (Qwen2:
# q/k/v biases; Qwen3: per-head q/k norms) and a gated MLP.
WRITTEN_OUT = ("llama", "qwen2", "qwen3")
