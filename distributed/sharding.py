"""FSDP2 sharding of the policy (docs/model.md): every decoder layer and the whole model sharded
over the ranks, mixed precision on CUDA, the weights loaded on rank 0 only and broadcast while
sharding (`from_rank0`), and the gathered copy the rollout decodes (`gathered`)."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

from model import Policy


def from_rank0(load):
    """`load()` (e.g. `load_model(name)` on the CPU) called on rank 0 only, its `(lm, tokenizer)` on
    every rank of the process group: the other ranks receive its config, generation config and
    tokenizer and build the model on the meta device, without memory;
    `shard_policy(..., from_rank0=True)` then gives every rank its shards of rank 0's weights.
    (Every rank reading the full fp32 model holds 8 x 32 GB of host memory on an 8-GPU node for
    Qwen3-8B.) An exception of `load` is raised on every rank."""
    lm = tokenizer = None
    if dist.get_rank() == 0:
        try:
            lm, tokenizer = load()
            shared = [(lm.config, lm.generation_config, tokenizer)]
        except Exception as e:  # noqa: BLE001 - the other ranks raise it too instead of waiting for weights
            shared = [e]
    else:
        shared = [None]
    dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], Exception):
        raise shared[0]
    if dist.get_rank() == 0:
        return lm, tokenizer
    config, generation_config, tokenizer = shared[0]
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm.generation_config = generation_config
    return lm, tokenizer


def shard_policy(policy: Policy, mixed_precision: bool = True, from_rank0: bool = False,
                 device=None) -> Policy:
    """FSDP2: `fully_shard` each decoder layer, then the Policy root (embeddings, final norm, LM
    head).

    Needs an initialized process group. With `mixed_precision` on CUDA, parameters are all-gathered
    and computed in bf16 and gradients reduced in fp32 (the sharded master weights stay in their own
    dtype, fp32 by default); on CPU (gloo) everything is fp32. Call it on a Policy whose parameters
    are already on this rank's `device`, or with `from_rank0` on the models of `from_rank0()`: the
    weights are then broadcast from rank 0 (which holds them on the CPU) shard by shard
    (`set_model_state_dict(..., broadcast_from_rank0=True)`, as verl and torchtitan do), and so are
    the buffers (rotary inv_freq is not in the state dict).
    """
    device = torch.device(device) if device is not None else next(policy.parameters()).device
    # rank 0: the full CPU weights
    full = policy.state_dict() if from_rank0 and dist.get_rank() == 0 else {}
    if mixed_precision and device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()  # no casting: fp32 compute and reductions (CPU / gloo)
    for layer in policy.lm.get_decoder().layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(policy, mp_policy=mp)  # the root last: embeddings, norm, head (D18)
    if from_rank0:
        if dist.get_rank() == 0:
            policy.to(device)
        else:
            # (meta) shards -> uninitialized memory on this rank's device
            policy.to_empty(device=device)
        set_model_state_dict(policy, full, options=StateDictOptions(full_state_dict=True,
                                                                    broadcast_from_rank0=True))
        for buffer in policy.buffers():
            dist.broadcast(buffer, src=0)
    return policy


@contextmanager
def gathered(policy: torch.nn.Module):  # D6
    """Under FSDP2, hold every FSDP module of `policy` unsharded for the duration (one all-gather
    per module at entry, one reshard at exit) with FSDP's forward hooks detached, so decoding
    `policy.lm` is a plain model: no collective and no FSDP bookkeeping per token. A no-op without
    FSDP.

    Memory: a full copy of the parameters on every rank while inside (e.g. 3.4 GB for 1.7B params in
    bf16), plus the KV cache. Uses FSDP2 internals (the state's forward hooks; torch 2.11-2.13, 2.11
    in the GPU run of docs/gpu.md), as no public API detaches them.
    """
    modules = [m for m in policy.modules() if isinstance(m, FSDPModule)]
    states = [m._get_fsdp_state() for m in modules]
    for m in modules:
        m.unshard()  # all-gather: every rank enters `gathered` in the same order
    # each hook would otherwise cost ~0.3 ms per layer and token (and reshard after forward)
    for state in states:
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
    try:
        yield policy
    finally:
        for m, state in zip(modules, states):  # re-attach the hooks exactly as fully_shard does
            state._pre_forward_hook_handle = m.register_forward_pre_hook(
                state._pre_forward, prepend=True, with_kwargs=True)
            state._post_forward_hook_handle = m.register_forward_hook(state._post_forward,
                                                                      prepend=False)
            m.reshard()
