"""The rollout engine by name (train.py's and eval.py's --rollout): 'plain' (PlainEngine, the
reference sampler) or 'vllm' (VLLMEngine, imported only when chosen), and a training run's
engine sized for its KV-cache budget (`rollout_engine`). It sits above both engines, so that neither
imports the other."""
from __future__ import annotations

from typing import Callable

import torch

import config
from engines.plain_engine import PlainEngine
from engines.vllm_engine import VLLMEngine, VLLMSettings
from memory.estimate import kv_cache_bytes
from model import lm_vocab_size
from rollout import StopText, eos_ids
from run_folder.console import plural


def make_engine(name: str, lm, tokenizer, chat: bool, stop: Callable[[], bool] | None = None,
                captured: bool = False, stop_text: list[str] | None = None, **vllm_kwargs):
    """The rollout engine `name` ('plain' or 'vllm') for the HF model `lm`; vLLM is imported only
    for 'vllm' (D45).
    stop: the plain sampler's early end (a vLLM generate call always finishes); captured: the plain
    engine decodes through CUDA graphs (D10); stop_text: texts that also end a response
    (--stop-text, `StopText`); vllm_kwargs: VLLMSettings's max_model_len (also the plain engine's
    static cache length), kv_cache_memory_bytes, dtype, seed."""
    args = (lm, eos_ids(lm, tokenizer, chat), tokenizer.pad_token_id, lm_vocab_size(tokenizer))
    texts = StopText(tokenizer, stop_text) if stop_text else None
    if name == "plain":
        return PlainEngine(*args, stop=stop, max_len=vllm_kwargs.get("max_model_len"),
                           captured=captured, stop_text=texts)
    if name == "vllm":
        return VLLMEngine(*args, VLLMSettings(**vllm_kwargs), stop_text=texts)
    raise ValueError(f"unknown rollout engine {name!r}; valid: plain, vllm")


def prompts_per_call(cfg: config.Config, n: int, lm_config, dtype_bytes: int) -> int:
    """Prompts per generate call for n prompts on a rank: --rollout-chunk, or the most whose
    worst-case KV cache (G rows x (max prompt + response) tokens each) fits --kv-cache-gb."""
    per_prompt = kv_cache_bytes(lm_config, cfg.group_size,
                                cfg.max_prompt_len + cfg.max_response_len, dtype_bytes)
    return min(n, cfg.rollout_chunk or max(1, int(cfg.kv_cache_gb * 1e9 // per_prompt)))


def compute_dtype(cfg: config.Config, device) -> torch.dtype:
    """FSDP2's compute dtype (bf16 with mixed precision on CUDA, else fp32): the sampler's weights
    and KV cache, and the exported model's."""
    return torch.bfloat16 if device.type == "cuda" and cfg.mixed_precision else torch.float32


def rollout_engine(cfg: config.Config, lm, tokenizer, prompts: list[list[int]], rank: int,
                   world: int, device, stop=None):
    """The --rollout engine (`make_engine`), made once (vllm: on every rank at the same time), sized
    for the longest of `prompts`; prints its KV-cache budget. stop: the plain sampler's early end (a
    stop signal)."""
    n, G, dtype = cfg.prompts_per_step // world, cfg.group_size, compute_dtype(cfg, device)
    chunk, tokens = (prompts_per_call(cfg, n, lm.config, dtype.itemsize),
                     cfg.max_prompt_len + cfg.max_response_len)
    kv_vllm = min(kv_cache_bytes(lm.config, n * G, tokens, dtype.itemsize),
                  int(cfg.kv_cache_gb * 1e9))
    budget = f"--kv-cache-gb {cfg.kv_cache_gb:g} = {cfg.kv_cache_gb * 1e9 / 2**30:.2f} GiB"
    if rank == 0:  # the plain sampler's KV cache is in the memory line; vLLM's is reserved
        print(f"rollout ({cfg.rollout}): " + (
            f"vLLM reserves a KV cache of {kv_vllm / 2**30:.2f} GiB per rank ({budget})"
            if cfg.rollout == "vllm" else
            f"{plural(chunk, 'prompt')} x G {G} per generate call on each rank ("
            + (f"--rollout-chunk {cfg.rollout_chunk})" if cfg.rollout_chunk else
               f"{budget} holds their KV cache at --max-prompt-len)")), flush=True)
    longest = max(map(len, prompts)) + cfg.max_response_len  # train and held-out prompts
    return make_engine(cfg.rollout, lm, tokenizer, cfg.chat, stop, max_model_len=longest,
                               kv_cache_memory_bytes=kv_vllm, dtype=dtype, seed=cfg.seed,
                               captured=cfg.cuda_graphs and device.type == "cuda",
                               stop_text=cfg.stop_text)
