"""The rollout engine by name (train.py's and eval.py's --rollout): 'plain' (rollout.PlainEngine, the reference
sampler) or 'vllm' (VLLMEngine, imported only when chosen). It sits above both, so that neither imports the other."""
from __future__ import annotations

from typing import Callable

from fast_decode.vllm_engine import VLLMEngine
from model import lm_vocab_size
from rollout import PlainEngine, StopText, eos_ids


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
