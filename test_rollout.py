"""Tests of rollout.py (the sampler): parity with transformers.generate, sampling distribution, top-p, masking of
padding vocabulary rows, response masks, recorded log-probs, reproducibility, and 2-process FSDP2 == 1 process."""
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from model import Policy, position_ids_from_mask, shard_policy, tiny_model, tiny_tokenizer
from rollout import INSTRUCTION, Rollout, format_prompt, gathered, generate, sample_groups

_PROBLEMS = ["1+1", "What is 12*13?", "x", "abc def"]
_REAL_VOCAB = 104  # len(tiny_tokenizer()); the tiny model has 128 embedding rows


def _prompts() -> list[list[int]]:
    tok = tiny_tokenizer()
    return [format_prompt(tok, p) for p in _PROBLEMS]


def _eos_biased_model(token: int, scale: float = 1.05):
    """The tiny model with EOS's lm_head row set to `scale` x the row of `token`: EOS then wins wherever `token`
    would (with a positive logit), so greedy responses stop at different lengths."""
    lm = tiny_model()
    with torch.no_grad():
        lm.lm_head.weight[2] = scale * lm.lm_head.weight[token]
    return lm


def _recomputed_logprobs(lm, rollout: Rollout, temperature: float, vocab_size: int | None) -> torch.Tensor:
    """log pi(y_t) of every response token from one teacher-forced forward over prompt + response. (B, T)"""
    input_ids, attention_mask = rollout.training_inputs()  # (B, P+T)
    with torch.no_grad():
        logits = lm(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask)).logits  # (B, P+T, V)
    P = rollout.prompt_ids.shape[1]
    logits = logits[:, P - 1:-1, :vocab_size].float() / temperature  # (B, T, V') position P+t-1 predicts token t
    return torch.log_softmax(logits, -1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)  # (B, T)


def test_rollout_format_prompt():
    tok = tiny_tokenizer()
    ids = format_prompt(tok, "1+1")
    text = tok.decode(ids)
    assert text == f"<|im_start|>user\n1+1\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(format_prompt(tok, "1+1", chat=False)) == f"1+1\n{INSTRUCTION}"


def test_rollout_greedy_equals_hf_generate():
    """Token-for-token equality with model.generate(do_sample=False), left padding, rows stopping early."""
    lm, prompts = _eos_biased_model(105), _prompts()
    r = generate(lm, prompts, 48, temperature=0, eos_token_id=2, pad_token_id=0)
    lengths = r.response_mask.sum(1)
    assert len({len(p) for p in prompts}) > 1 and len(set(lengths.tolist())) == len(prompts)  # all different
    assert not r.truncated.any() and r.response_ids.shape[1] == lengths.max() < 48  # every row stopped early
    P = r.prompt_ids.shape[1]
    hf = lm.generate(input_ids=r.prompt_ids, attention_mask=r.prompt_mask, max_new_tokens=48, do_sample=False,
                     eos_token_id=2, pad_token_id=0)[:, P:]  # (B, T)
    assert hf.shape == r.response_ids.shape
    assert torch.equal(hf, r.response_ids)


def test_rollout_response_mask_and_truncation():
    lm = _eos_biased_model(73)
    r = generate(lm, _prompts(), 40, temperature=0, eos_token_id=2, pad_token_id=0)
    lengths = r.response_mask.sum(1)
    assert lengths.tolist() == [14, 9, 19, 40] and r.truncated.tolist() == [False, False, False, True]
    for ids, mask, n, trunc in zip(r.response_ids, r.response_mask, lengths, r.truncated):
        assert mask[:n].all() and not mask[n:].any()  # contiguous, from the first token
        assert (ids[n - 1] == 2) != bool(trunc)  # the last masked token is the EOS unless truncated
        assert (ids[:n - 1] != 2).all() and (ids[n:] == 0).all()  # no EOS before, only pad after
    assert (r.logprobs[r.response_mask == 0] == 0).all() and (r.logprobs[r.response_mask == 1] < 0).all()
    input_ids, attention_mask = r.training_inputs()
    assert input_ids.shape == attention_mask.shape == (4, r.prompt_ids.shape[1] + 40)
    assert torch.equal(attention_mask.sum(1), r.prompt_mask.sum(1) + lengths)
    sub = r.select([3, 1])
    assert len(sub) == 2 and torch.equal(sub.response_ids[1], r.response_ids[1])
    tok = tiny_tokenizer()
    texts = r.texts(tok)
    assert texts == [tok.decode(ids[:n], skip_special_tokens=True) for ids, n in zip(r.response_ids, lengths)]
    assert "<|im_end|>" in tok.decode(r.response_ids[0]) and "<|im_end|>" not in texts[0]


def test_rollout_sampling_frequencies_chi_square():
    """Frequencies of the first sampled token match softmax(z / temperature) over the real rows."""
    lm = tiny_model(vocab_size=8)
    with torch.no_grad():
        lm.lm_head.weight.mul_(8.0)  # spread the logits so a wrong temperature is detectable
    n, temperature, real = 4000, 0.7, 6  # rows 6, 7 are "padding" rows
    r = generate(lm, [[1, 5, 3]] * n, 1, temperature=temperature, eos_token_id=2, pad_token_id=0,
                 generator=torch.Generator().manual_seed(0), vocab_size=real)
    counts = torch.bincount(r.response_ids[:, 0], minlength=8).double()  # (8,)
    assert counts[real:].sum() == 0
    with torch.no_grad():
        logits = lm(torch.tensor([[1, 5, 3]])).logits[0, -1, :real].double()  # (6,)

    def chi2(probs):
        expected = n * probs
        return ((counts[:real] - expected) ** 2 / expected).sum().item()

    critical = 20.52  # chi-square, 5 degrees of freedom, p = 0.001
    assert chi2(torch.softmax(logits / temperature, -1)) < critical
    assert chi2(torch.softmax(logits, -1)) > critical  # the test can tell temperature 0.7 from 1.0
    expected_lp = torch.log_softmax(logits / temperature, -1)[r.response_ids[:, 0]].float()
    assert torch.allclose(r.logprobs[:, 0], expected_lp, atol=1e-5)


def test_rollout_top_p_stays_in_nucleus():
    lm, top_p, temperature = tiny_model(), 0.6, 0.8
    r = generate(lm, _prompts() * 4, 24, temperature=temperature, top_p=top_p, eos_token_id=2, pad_token_id=0,
                 generator=torch.Generator().manual_seed(1), vocab_size=_REAL_VOCAB)
    input_ids, attention_mask = r.training_inputs()
    with torch.no_grad():
        logits = lm(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask)).logits  # (B, P+T, V)
    P = r.prompt_ids.shape[1]
    probs = torch.softmax(logits[:, P - 1:-1, :_REAL_VOCAB] / temperature, -1)  # (B, T, V')
    chosen = probs.gather(-1, r.response_ids[..., None]).squeeze(-1)  # (B, T)
    mass_above = (probs * (probs > chosen[..., None])).sum(-1)  # mass of strictly more likely tokens (B, T)
    in_nucleus = mass_above < top_p
    mask = r.response_mask.bool()
    assert in_nucleus[mask].all()
    sorted_p = torch.sort(probs, -1, descending=True).values  # (B, T, V')
    nucleus_mass = (sorted_p * ((sorted_p.cumsum(-1) - sorted_p) < top_p)).sum(-1)  # (B, T)
    assert (1 - nucleus_mass[mask]).mean() > 0.3  # sampling from the full softmax would leave the nucleus often


def test_rollout_padding_rows_never_sampled():
    lm = tiny_model()
    with torch.no_grad():
        lm.lm_head.weight[_REAL_VOCAB:] = 20 * lm.lm_head.weight[_REAL_VOCAB:]  # padding rows now dominate
    prompts = _prompts()
    r = generate(lm, prompts, 16, eos_token_id=2, pad_token_id=0, generator=torch.Generator().manual_seed(0),
                 vocab_size=_REAL_VOCAB)
    assert r.response_ids.max() < _REAL_VOCAB
    unmasked = generate(lm, prompts, 16, eos_token_id=2, pad_token_id=0, generator=torch.Generator().manual_seed(0))
    assert (unmasked.response_ids >= _REAL_VOCAB).float().mean() > 0.5  # without vocab_size they would be


def test_rollout_logprobs_equal_recomputed_forward():
    lm = _eos_biased_model(73)
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)]:
        r = sample_groups(lm, _prompts(), 3, max_new_tokens=30, temperature=temperature, top_p=top_p,
                          eos_token_id=2, pad_token_id=0, generator=torch.Generator().manual_seed(2),
                          vocab_size=_REAL_VOCAB)
        assert len(r) == 12 and r.truncated.any() and not r.truncated.all()
        mask = r.response_mask.bool()
        recomputed = _recomputed_logprobs(lm, r, temperature, _REAL_VOCAB)
        torch.testing.assert_close(r.logprobs[mask], recomputed[mask], atol=1e-5, rtol=0)


def test_rollout_logprobs_equal_policy_forward():
    """With all vocabulary rows (vocab_size=None) the sampler's log-probs are model.Policy's (the training forward);
    with vocab_size set, the Policy must mask the same rows for the two to agree."""
    lm = _eos_biased_model(73)
    r = generate(lm, _prompts(), 30, temperature=0.7, eos_token_id=2, pad_token_id=0,
                 generator=torch.Generator().manual_seed(4))
    assert not any(x.is_inference() for x in (r.response_ids, r.response_mask, r.logprobs, r.truncated))
    logprobs = Policy(lm)(*r.training_inputs(), r.response_mask, temperature=0.7)[0]  # (B, T), with autograd
    logprobs.sum().backward()  # the rollout's tensors are usable in training
    torch.testing.assert_close(r.logprobs, logprobs.detach(), atol=1e-5, rtol=0)
    # The sampler drops rows >= vocab_size from its softmax; Policy(vocab_size=...) must drop the same rows.
    r = generate(lm, _prompts(), 30, temperature=0.7, eos_token_id=2, pad_token_id=0, vocab_size=_REAL_VOCAB,
                 generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        masked = Policy(lm, vocab_size=_REAL_VOCAB)(*r.training_inputs(), r.response_mask, temperature=0.7)[0]
        unmasked = Policy(lm)(*r.training_inputs(), r.response_mask, temperature=0.7)[0]
    torch.testing.assert_close(r.logprobs, masked, atol=1e-5, rtol=0)
    assert (r.logprobs - unmasked).abs().max() > 1e-3  # the extra rows do carry mass in the tiny model


def test_rollout_same_seed_same_rollout():
    lm, prompts = tiny_model(), _prompts()

    def run(seed):
        return generate(lm, prompts, 20, eos_token_id=2, pad_token_id=0, vocab_size=_REAL_VOCAB,
                        generator=torch.Generator().manual_seed(seed))

    with gathered(Policy(lm)):  # a no-op without FSDP
        a = run(7)
    b, c = run(7), run(8)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    groups = sample_groups(lm, prompts[:2], 4, max_new_tokens=20, eos_token_id=2, pad_token_id=0,
                           generator=torch.Generator().manual_seed(7))
    assert torch.equal(groups.prompt_ids[0], groups.prompt_ids[3]) and not torch.equal(groups.prompt_ids[3],
                                                                                     groups.prompt_ids[4])
    assert not torch.equal(groups.response_ids[0], groups.response_ids[1])  # samples in a group differ


_FSDP_SEEDS = (15, 3)  # rank r samples with seed _FSDP_SEEDS[r]: all rows stop after 25 tokens / run to 40


def _fsdp_model():
    lm = _eos_biased_model(73)
    with torch.no_grad():
        lm.lm_head.weight.mul_(4.0)  # a peaked distribution: EOS gets sampled
    return lm


def _fsdp_generate(lm, seed):
    return generate(lm, _prompts(), 40, eos_token_id=2, pad_token_id=0, vocab_size=_REAL_VOCAB,
                    generator=torch.Generator().manual_seed(seed))


def _fsdp_worker(rank: int, init_file: str, out_dir: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    full = _fsdp_model()
    policy = shard_policy(Policy(_fsdp_model()))  # FSDP2: each decoder layer, then the Policy root
    assert all(isinstance(p, DTensor) for p in policy.parameters())
    with gathered(policy):
        for (name, p), q in zip(policy.lm.named_parameters(), full.parameters()):
            assert not isinstance(p, DTensor) and torch.equal(p, q), name  # the full parameters, as plain tensors
        rollout = _fsdp_generate(policy.lm, _FSDP_SEEDS[rank])  # the HF model itself, not through the root
    assert all(isinstance(p, DTensor) for p in policy.parameters())  # resharded
    logprobs = policy(*rollout.training_inputs(), rollout.response_mask)[0]  # FSDP training works afterwards
    logprobs.sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in policy.parameters())  # sharded gradients, reduce-scattered
    logprobs = logprobs.detach()
    with gathered(policy):  # and so does a second rollout phase
        again = _fsdp_generate(policy.lm, _FSDP_SEEDS[rank])
    assert torch.equal(again.response_ids, rollout.response_ids)
    torch.save({"rollout": rollout, "policy_logprobs": logprobs}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_rollout_fsdp2_two_processes_equal_one():
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_fsdp_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + 120
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for process in ctx.processes:
                    process.kill()
                raise AssertionError("2-process rollout hung")
        results = [torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=False) for rank in range(2)]
    lm = _fsdp_model()
    lengths = set()
    for seed, result in zip(_FSDP_SEEDS, results):
        expected = _fsdp_generate(lm, seed)
        got = result["rollout"]
        assert torch.equal(got.response_ids, expected.response_ids)
        torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-6, rtol=0)
        lengths.add(got.response_ids.shape[1])
        with torch.no_grad():
            policy_logprobs = Policy(lm)(*got.training_inputs(), got.response_mask)[0]
        torch.testing.assert_close(result["policy_logprobs"], policy_logprobs)
    assert lengths == {25, 40}  # the ranks stopped decoding at different steps and neither hung
