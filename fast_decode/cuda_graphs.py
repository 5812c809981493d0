"""The plain sampler's decode step captured in CUDA graphs (train.py's --cuda-graphs; docs/gpu.md):
the written-out step (`DecodeStep`) with static shapes, one graph per batch bucket and length block
of a static KV cache, replayed with its inputs copied into static buffers, as nano-vllm and gpt-fast
do (docs/paper.md, "Deliberate differences": D10). On the CPU the same class runs the step
eagerly on the same buffers (the tests)."""
from __future__ import annotations

from functools import partial

import torch

from fast_decode.decode_step import DecodeStep, InPlaceCache

# The captured step's attention reads the cache up to the filled length rounded up to this many
# positions: a graph per length block that a phase reaches (D10), at most this many
# unfilled positions read per row.
LENGTH_BLOCK = 256


def batch_buckets(rows: int) -> list[int]:
    """The batch sizes the captured step runs at for a phase of `rows` rows: the powers of two below
    it, and it."""
    return [1 << i for i in range(rows.bit_length()) if 1 << i < rows] + [rows]


class CapturedStep:
    """The decode step (`DecodeStep`) and the LM head with static shapes for one rollout phase
    (D10). The KV cache (rows x max_len tokens per layer), the attention mask and the
    step's inputs and logits are allocated once; generate calls `cache(B, P + T)` once per call (the
    prefill writes into the same buffers), then once per step:
        copy in:  token[:R], position[:R], mask[:R] <- the R running rows';
                  column <- the filled length P + t
        replay:   for b = the smallest bucket >= R, L = column rounded up to LENGTH_BLOCK
                  (at most max_len):
                  logits[:b] = head(step(token[:b], position[:b],
                                         mask[:b, :L] * (positions <= column), column))
        copy out: logits[:R], a view valid until the next call
    The rows b - R past the running ones compute on stale inputs and are never read. On CUDA
    (`capture`) each (b, L) is captured in a CUDA graph the first time it runs: a warm-up on a side
    stream, then `torch.cuda.graph`, every graph in one memory pool (as nano-vllm captures per batch
    size; the body writes the same cache entries whenever it runs, so the warm-up before a capture
    changes nothing); later calls replay it. Without `capture` (the CPU stand-in) the same body runs
    eagerly on the same buffers. Valid until the step's weights change."""

    def __init__(self, step: DecodeStep, rows: int, max_len: int, capture: bool | None = None,
                 block: int = LENGTH_BLOCK):
        weight = step.decoder.embed_tokens.weight
        device, dtype, config = weight.device, weight.dtype, step.decoder.config
        self.step, self.rows, self.max_len, self.block = step, rows, max_len, block
        self.capture = device.type == "cuda" if capture is None else capture
        self.buckets = batch_buckets(rows)
        zeros = partial(torch.zeros, device=device)
        # (rows, KV, max_len, hd) keys and values per layer
        self.kv = InPlaceCache(config, rows, max_len, [
            tuple(zeros(rows, a.k_proj.out_features // a.head_dim, max_len, a.head_dim, dtype=dtype)
                  for _ in "kv")
            for a in (layer.self_attn for layer in step.decoder.layers)])
        # (rows, max_len) 0 at padding, ones at first: unused rows past the running ones stay finite
        self.mask = torch.ones(rows, max_len, dtype=torch.long, device=device)
        self.token = zeros(rows, dtype=torch.long)  # (rows,)
        self.position = zeros(rows, 1, dtype=torch.long)  # (rows, 1) rotary positions
        self.column = zeros(1, dtype=torch.long)  # (1,) the cache position written by this step
        self.positions = torch.arange(max_len, device=device)  # (max_len,)
        self.logits = zeros(rows, step.head_rows, dtype=dtype)  # (rows, V')
        self.graphs, self.pool = {}, None

    def cache(self, rows: int, length: int) -> InPlaceCache:
        """The static cache emptied for a generate call of `rows` rows and prompt + new tokens
        `length`."""
        if rows > self.rows or length > self.max_len:
            raise ValueError(f"a generate call of {rows} rows x {length} tokens exceeds the "
                             f"phase's static cache of {self.rows} x {self.max_len}")
        for layer in self.kv.layers:
            layer.length = 0
        return self.kv

    def __call__(self, token: torch.Tensor, position: torch.Tensor,
                 attention_mask: torch.Tensor) -> torch.Tensor:
        """token (R,), position (R, 1), attention_mask (R, P+T) of the running rows -> logits
        (R, V')."""
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
        """One decode step of b rows over cache positions [0, L): reads and writes only the static
        buffers."""
        # visible (b, L): the prompt and written positions; hidden (b, 1, D)
        visible = self.mask[:b, :L] * (self.positions[:L] <= self.column)
        hidden = self.step(self.token[:b], self.position[:b], visible, self.kv, self.column)
        self.logits[:b] = self.step.head(hidden[:, -1])  # (b, V')

    def _capture(self, b: int, L: int) -> "torch.cuda.CUDAGraph":
        main = torch.cuda.current_stream(self.logits.device)
        side = torch.cuda.Stream(self.logits.device)
        side.wait_stream(main)
        # warm-up outside the capture: lazy initializations, cuBLAS workspaces
        with torch.cuda.stream(side):
            self._body(b, L)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._body(b, L)
        self.pool = graph.pool()
        return graph
