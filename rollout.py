"""Rollouts: prompt formatting and a hand-written batched sampler with a KV cache (paper Sec. 1 and 6: G responses
per prompt from the rollout policy pi_old, temperature 1.0 / top-p 1.0 in training, 0.7 / 0.9 in one eval setting).

The sampler is the whole of `generate` below: left-pad the prompts, prefill once, then decode one token per step
with the model's `DynamicCache`, computing logits only for the last position. Per step it does one backbone forward
through `__call__` and one head matmul, exactly as `model.Policy` computes the training forward (so the sampling
distribution and the recomputed pi_old agree by construction), a few tensor ops to sample, and writes into
preallocated (B, T) buffers; no logits processors.

Deliberate differences from the paper's stack (veRL + vLLM) and from `transformers.generate`:
1. The recorded log-prob of a sampled token is taken under the FULL tempered softmax (all real vocabulary rows),
   not under the renormalized top-p nucleus that vLLM reports; the nucleus would bias the ratio pi_theta / pi_old.
2. Vocabulary rows >= `vocab_size` (Qwen's embedding has more rows than its tokenizer has tokens) are removed
   before the softmax, so they are never sampled and do not take probability mass. The recorded log-probs are
   therefore those of the distribution actually sampled from; the training forward must mask the same rows for the
   ratio to be exactly 1 on the first mini-batch.
3. temperature=0 means greedy (argmax); its recorded log-probs are under the temperature-1 softmax.
4. Rows that have emitted EOS keep sampling (attention mask 1) until all rows are done or `max_new_tokens` is
   reached; what they sample after EOS is replaced by pad with response_mask 0. This keeps the batch shape fixed.
5. Sampling draws one uniform per row and searches the CDF (exact; torch.multinomial does the same, slower on CPU).
6. Under FSDP2, `gathered(policy)` unshards every FSDP module once for the whole rollout phase (memory: one full
   copy of the parameters per rank, in the FSDP param dtype, for the duration) and detaches FSDP's forward hooks,
   instead of all-gathering each layer again for every generated token. Inside the decode loop there is then no
   collective at all, so ranks whose rollouts stop at different lengths cannot hang each other.
"""
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import DynamicCache

from model import position_ids_from_mask

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def format_prompt(tokenizer, problem: str, chat: bool = True, instruction: str = INSTRUCTION) -> list[int]:
    """Token ids of `problem` followed by the paper's instruction, as one user turn of the chat template
    (with the assistant header appended) or, with chat=False, as raw text (for base models)."""
    content = f"{problem}\n{instruction}" if instruction else problem
    if not chat:
        return tokenizer(content).input_ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


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

    def select(self, idx) -> "Rollout":
        """The rows `idx` (an int list, slice, or index tensor), e.g. one micro-batch."""
        return Rollout(*(getattr(self, f.name)[idx] for f in fields(self)))

    def lengths(self) -> torch.Tensor:
        """(B,) prompt + response tokens of each row: the columns `model.Policy` feeds for it."""
        return self.prompt_mask.sum(1) + self.response_mask.sum(1)

    def micro_batches(self, max_tokens: int) -> list[torch.Tensor]:
        """Row indices of micro-batches whose padded size, rows x longest row (what `model.Policy` feeds), is at
        most `max_tokens`; a row longer than that is a micro-batch of its own (so max_tokens=1: one row each).
        Rows go longest first (the largest micro-batch runs first, so an out-of-memory shows at once), each
        micro-batch taking as many of the next rows as fit: sorted, they pad little."""
        lengths = self.lengths().tolist()
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their order
        parts, start = [], 0
        while start < len(order):
            longest, end = lengths[order[start]], start + 1
            while end < len(order) and (end + 1 - start) * longest <= max_tokens:
                end += 1
            parts.append(torch.tensor(order[start:end]))
            start = end
        return parts

    def texts(self, tokenizer) -> list[str]:
        """Decoded responses without special tokens (EOS and padding dropped)."""
        return [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                for ids, mask in zip(self.response_ids, self.response_mask)]


def _inverse_cdf(cdf: torch.Tensor, generator) -> torch.Tensor:
    """Index i with probability (cdf[i] - cdf[i-1]) / cdf[-1] per row, from one uniform draw. (B, V') -> (B,)

    x = (1 - u) * total lies in (0, total], so the first index with cdf >= x always has nonzero probability.
    (torch.multinomial does the same search but costs 3-20x more on CPU.)"""
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device)  # (B, 1) in [0, 1)
    return torch.searchsorted(cdf, (1 - u) * cdf[:, -1:]).squeeze(1)  # (B,)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits (B, V') -> (token (B,), its log-prob under the full tempered softmax (B,))."""
    logits = logits.float()
    if temperature == 0:  # greedy; log-probs under the temperature-1 softmax
        logp = torch.log_softmax(logits, dim=-1)  # (B, V')
        token = logits.argmax(dim=-1)  # (B,)
    else:
        logp = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
        probs = logp.exp()  # (B, V') pi(v) = softmax(z / temperature)_v
        if top_p < 1.0:  # nucleus: the smallest set of most likely tokens whose mass is >= top_p
            sorted_p, order = probs.sort(dim=-1, descending=True)  # (B, V')
            keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p  # mass strictly before the token < p; top always kept
            token = order.gather(-1, _inverse_cdf((sorted_p * keep).cumsum(dim=-1), generator)[:, None]).squeeze(1)
        else:
            token = _inverse_cdf(probs.cumsum(dim=-1), generator)  # (B,)
    return token, logp.gather(-1, token[:, None]).squeeze(1)


def generate(model, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             generator: torch.Generator | None = None, vocab_size: int | None = None) -> Rollout:
    """Sample one response per prompt from the HF causal LM `model` (under FSDP2: `policy.lm` inside `gathered`).

    eos_token_id/pad_token_id default to the model config's. vocab_size = number of real token ids (rows >= it are
    never sampled; None = all rows). temperature=0 is greedy. `generator` (on the model's device) makes the rollout
    reproducible. The KV cache goes in as `past_key_values` (transformers 5.17-5.19; later 5.x also call it `cache`).
    """
    device = next(model.parameters()).device
    eos_ids = eos_token_id if eos_token_id is not None else model.config.eos_token_id
    eos = torch.tensor([eos_ids] if isinstance(eos_ids, int) else list(eos_ids), device=device)
    pad = pad_token_id if pad_token_id is not None else model.config.pad_token_id
    B, P, T = len(prompt_ids), max(len(p) for p in prompt_ids), max_new_tokens

    prompt = torch.full((B, P), pad, dtype=torch.long)  # (B, P) left-padded
    prompt_mask = torch.zeros(B, P, dtype=torch.long)  # (B, P)
    for i, ids in enumerate(prompt_ids):
        prompt[i, P - len(ids):] = torch.tensor(ids, dtype=torch.long)
        prompt_mask[i, P - len(ids):] = 1
    prompt, prompt_mask = prompt.to(device), prompt_mask.to(device)
    with torch.inference_mode():  # cheaper per op than no_grad; every returned tensor is made outside it
        # Everything the loop needs is preallocated and sliced per step. Generated positions are always attended
        # (difference 4), so response token t sits at position len(prompt) + t, as position_ids_from_mask gives.
        attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, T)], dim=1)  # (B, P+T)
        positions = prompt_mask.sum(dim=1, keepdim=True) + torch.arange(T, device=device)  # (B, T)
        response_ids = torch.full((B, T), pad, dtype=torch.long, device=device)  # (B, T)
        logprobs = torch.zeros(B, T, dtype=torch.float32, device=device)  # (B, T)
        done = torch.zeros(B, dtype=torch.bool, device=device)  # (B,) row has emitted EOS
        # Checking "all done" reads a value back to the host: free on CPU, a stall on a GPU, so check less often there.
        check_every = 1 if device.type == "cpu" else 8

        # The backbone and the LM head are called as Policy.forward calls them, so the sampler and the training
        # forward compute the same distribution by construction (and the head only sees the last position).
        decoder, head = model.get_decoder(), model.get_output_embeddings().weight[:vocab_size]  # head: (V', D)
        cache = DynamicCache(config=model.config)
        hidden = decoder(input_ids=prompt, attention_mask=prompt_mask, past_key_values=cache, use_cache=True,
                         position_ids=position_ids_from_mask(prompt_mask)).last_hidden_state  # prefill (B, P, D)
        for t in range(T):
            logits = hidden[:, -1] @ head.T  # (B, V') real vocabulary rows only (difference 2)
            response_ids[:, t], logprobs[:, t] = _sample(logits, temperature, top_p, generator)
            done |= torch.isin(response_ids[:, t], eos)
            if t + 1 == T or ((t + 1) % check_every == 0 and bool(done.all())):
                break
            hidden = decoder(input_ids=response_ids[:, t:t + 1], attention_mask=attention_mask[:, :P + t + 1],
                             position_ids=positions[:, t:t + 1], past_key_values=cache,
                             use_cache=True).last_hidden_state  # (B, 1, D)

    # Rows keep sampling after their EOS (difference 4); mask and blank that afterwards.
    is_eos = torch.isin(response_ids, eos)  # (B, T)
    response_mask = ((is_eos.cumsum(dim=1) - is_eos.long()) == 0).long()  # (B, T) 1 up to and including the first EOS
    T = int(response_mask.sum(dim=1).max())  # drop all-pad columns
    response_mask = response_mask[:, :T]
    response_ids = response_ids[:, :T].masked_fill(response_mask == 0, pad)
    logprobs = logprobs[:, :T] * response_mask
    return Rollout(prompt, prompt_mask, response_ids, response_mask, logprobs, ~done)


def sample_groups(model, prompt_ids: list[list[int]], group_size: int, **kwargs) -> Rollout:
    """G = group_size responses per prompt in one batch; group i is rows i*G .. i*G+G-1."""
    return generate(model, [p for p in prompt_ids for _ in range(group_size)], **kwargs)


@contextmanager
def gathered(policy: torch.nn.Module):
    """Under FSDP2, hold every FSDP module of `policy` unsharded for the duration (one all-gather per module at
    entry, one reshard at exit) with FSDP's forward hooks detached, so decoding `policy.lm` is a plain model: no
    collective and no FSDP bookkeeping per token. A no-op without FSDP.

    Memory: a full copy of the parameters on every rank while inside (e.g. 3.4 GB for 1.7B params in bf16), plus the
    KV cache. Uses FSDP2 internals (the state's forward hooks; torch 2.13), as no public API detaches them.
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
