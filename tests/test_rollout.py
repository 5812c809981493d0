"""rollout.py: the KV-cache sampler (greedy = model.generate, sampled frequencies, dropping rows,
stopping early) and token-budget micro-batches; its fast decode steps: tests/test_fast_decode_*.py;
the plain engine's phases: tests/test_engines_plain_engine.py.
"""
import os
import tempfile
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import rollout
from distributed.sharding import gathered, shard_policy
from model import Policy, position_ids_from_mask, tiny_model, tiny_tokenizer
from rollout import INSTRUCTION, Rollout, Sampling, format_prompt, generate, sample_groups
from tests.sampler_checks import (REAL_VOCAB, eos_biased_model, recomputed_logprobs, toy_prompts,
                                  two_processes)


# ==================================================================================================
# rollout.py: the KV-cache sampler
# ==================================================================================================
def test_rollout_format_prompt():
    tok = tiny_tokenizer()
    ids = format_prompt(tok, "1+1")
    text = tok.decode(ids)
    assert text == f"<|im_start|>user\n1+1\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(format_prompt(tok, "1+1", chat=False)) == f"1+1\n{INSTRUCTION}"


def test_rollout_greedy_equals_hf_generate():
    """Token-for-token equality with model.generate(do_sample=False), left padding, rows stopping
    early."""
    lm, prompts = eos_biased_model(105), toy_prompts()
    r = generate(lm, prompts, Sampling(48, temperature=0, eos_token_id=2, pad_token_id=0))
    lengths = r.response_mask.sum(1)
    # all different
    assert len({len(p) for p in prompts}) > 1 and len(set(lengths.tolist())) == len(prompts)
    # every row stopped early
    assert not r.truncated.any() and r.response_ids.shape[1] == lengths.max() < 48
    P = r.prompt_ids.shape[1]
    hf = lm.generate(input_ids=r.prompt_ids, attention_mask=r.prompt_mask, max_new_tokens=48,
                     do_sample=False, eos_token_id=2, pad_token_id=0)[:, P:]  # (B, T)
    assert hf.shape == r.response_ids.shape
    assert torch.equal(hf, r.response_ids)


def test_rollout_prefills_each_prompt_once():
    """The G rows of a prompt are prefilled once and decode from copies of its KV cache: the prefill
    sees the 4 distinct prompts, the first decode step all 12 rows, and the greedy tokens are
    model.generate's on the 12 rows (which prefills every row)."""
    lm, prompts = eos_biased_model(105), toy_prompts()
    seen = []
    handle = lm.get_decoder().embed_tokens.register_forward_pre_hook(
        lambda module, args: seen.append(len(args[0])))
    r = sample_groups(lm, prompts, 3, Sampling(48, temperature=0, eos_token_id=2, pad_token_id=0))
    handle.remove()
    assert seen[:2] == [4, 12] and len(r) == 12
    P = r.prompt_ids.shape[1]
    hf = lm.generate(input_ids=r.prompt_ids, attention_mask=r.prompt_mask, max_new_tokens=48,
                     do_sample=False, eos_token_id=2, pad_token_id=0)[:, P:]  # (B, T)
    assert torch.equal(hf[:, :r.response_ids.shape[1]], r.response_ids) \
        and (hf[:, r.response_ids.shape[1]:] == 0).all()


def _cache_rows_per_step(lm):
    """Records the running rows at every decode step of lm's backbone (the rows of its one-token
    embedding calls; the prefill embeds whole prompts); returns (list, hook handle)."""
    seen = []

    def hook(module, args):
        if args[0].shape[1] == 1:  # not the prefill
            seen.append(args[0].shape[0])
    return seen, lm.get_decoder().embed_tokens.register_forward_pre_hook(hook)


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_rollout_compaction_same_tokens(temperature, top_p):
    """Dropping finished rows (at any cadence) gives token for token the rollout of the fixed batch
    (compact=None, the sampler before compaction), for the same generator, with rows stopping at
    very different lengths."""
    lm = eos_biased_model(73)
    prompts = toy_prompts() * 6  # 24 rows
    sampling = Sampling(40, temperature, top_p, eos_token_id=2, pad_token_id=0,  # greedy: all rows,
                        vocab_size=REAL_VOCAB if temperature else None)  # lengths 9..40
    seen, handle = _cache_rows_per_step(lm)
    runs = {}
    for compact in (None, 0.15, 1e-9):
        seen.clear()
        runs[compact] = generate(lm, prompts, sampling, compact=compact,
                                 generator=torch.Generator().manual_seed(3))
        runs[compact].cache_rows = list(seen)
    handle.remove()
    ref = runs[None]
    lengths = ref.response_mask.sum(1)
    # very different
    assert lengths.min() <= 12 and ref.truncated.any() and len(set(lengths.tolist())) >= 4
    assert set(ref.cache_rows) == {24}  # the fixed batch never shrinks
    for compact in (0.15, 1e-9):
        r = runs[compact]
        assert torch.equal(r.response_ids, ref.response_ids) \
            and torch.equal(r.response_mask, ref.response_mask)
        assert torch.equal(r.truncated, ref.truncated) and torch.equal(r.prompt_ids, ref.prompt_ids)
        torch.testing.assert_close(r.sampler_logprobs, ref.sampler_logprobs, atol=1e-5, rtol=0)
    # The KV cache shrinks as rows finish. compact=1e-9 drops every row right after its EOS: before
    # decoding token t+1 the cache holds the rows longer than t+1; compact=0.15 drops 15% of the
    # running batch or more at a time.
    assert runs[1e-9].cache_rows == [int((lengths > t + 1).sum()) for t in range(39)]
    sizes = sorted(set(runs[0.15].cache_rows), reverse=True)
    assert runs[0.15].cache_rows == sorted(runs[0.15].cache_rows, reverse=True)
    assert len(sizes) > 1 and all(b <= 0.85 * a for a, b in zip(sizes, sizes[1:]))


def test_rollout_response_mask_and_truncation():
    lm = eos_biased_model(73)
    r = generate(lm, toy_prompts(), Sampling(40, temperature=0, eos_token_id=2, pad_token_id=0))
    lengths = r.response_mask.sum(1)
    assert lengths.tolist() == [14, 9, 19, 40] \
        and r.truncated.tolist() == [False, False, False, True]
    for ids, mask, n, trunc in zip(r.response_ids, r.response_mask, lengths, r.truncated):
        assert mask[:n].all() and not mask[n:].any()  # contiguous, from the first token
        assert (ids[n - 1] == 2) != bool(trunc)  # the last masked token is the EOS unless truncated
        assert (ids[:n - 1] != 2).all() and (ids[n:] == 0).all()  # no EOS before, only pad after
    assert (r.sampler_logprobs[r.response_mask == 0] == 0).all() \
        and (r.sampler_logprobs[r.response_mask == 1] < 0).all()
    input_ids, attention_mask = r.training_inputs()
    assert input_ids.shape == attention_mask.shape == (4, r.prompt_ids.shape[1] + 40)
    assert torch.equal(attention_mask.sum(1), r.prompt_mask.sum(1) + lengths)
    sub = r.select([3, 1])
    assert len(sub) == 2 and torch.equal(sub.response_ids[1], r.response_ids[1])
    tok = tiny_tokenizer()
    texts = r.texts(tok)
    assert texts == [tok.decode(ids[:n], skip_special_tokens=True)
                     for ids, n in zip(r.response_ids, lengths)]
    assert "<|im_end|>" in tok.decode(r.response_ids[0]) and "<|im_end|>" not in texts[0]


def test_rollout_stop_ends_a_call_at_the_next_check():
    """generate(stop=...): asked at every stop check (each decode step on CPU), a true answer ends
    the call there, so a stop signal during a long rollout does not wait for it; without it the same
    call runs to its end."""
    lm, prompts, asked = tiny_model(), toy_prompts(), []

    def stop():
        asked.append(1)
        return len(asked) >= 3

    whole = generate(lm, prompts, Sampling(30, 1.0), generator=torch.Generator().manual_seed(0))
    cut = generate(lm, prompts, Sampling(30, 1.0), generator=torch.Generator().manual_seed(0),
                   stop=stop)
    assert whole.response_ids.shape[1] > 10 and cut.response_ids.shape[1] == 3 and len(asked) == 3
    assert torch.equal(cut.response_ids,
                       whole.response_ids[:, :3].masked_fill(cut.response_mask == 0, 0))


def test_rollout_sampling_frequencies_chi_square():
    """Frequencies of the first sampled token match softmax(z / temperature) over the real rows."""
    lm = tiny_model(vocab_size=8)
    with torch.no_grad():
        lm.lm_head.weight.mul_(8.0)  # spread the logits so a wrong temperature is detectable
    n, temperature, real = 4000, 0.7, 6  # rows 6, 7 are "padding" rows
    sampling = Sampling(1, temperature, eos_token_id=2, pad_token_id=0, vocab_size=real)
    r = generate(lm, [[1, 5, 3]] * n, sampling, generator=torch.Generator().manual_seed(0))
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
    assert torch.allclose(r.sampler_logprobs[:, 0], expected_lp, atol=1e-5)


def test_rollout_top_p_stays_in_nucleus():
    lm, top_p, temperature = tiny_model(), 0.6, 0.8
    sampling = Sampling(24, temperature, top_p, eos_token_id=2, pad_token_id=0,
                        vocab_size=REAL_VOCAB)
    r = generate(lm, toy_prompts() * 4, sampling, generator=torch.Generator().manual_seed(1))
    input_ids, attention_mask = r.training_inputs()
    with torch.no_grad():
        logits = lm(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask)).logits  # (B, P+T, V)
    P = r.prompt_ids.shape[1]
    probs = torch.softmax(logits[:, P - 1:-1, :REAL_VOCAB] / temperature, -1)  # (B, T, V')
    chosen = probs.gather(-1, r.response_ids[..., None]).squeeze(-1)  # (B, T)
    # mass of strictly more likely tokens (B, T)
    mass_above = (probs * (probs > chosen[..., None])).sum(-1)
    in_nucleus = mass_above < top_p
    mask = r.response_mask.bool()
    assert in_nucleus[mask].all()
    sorted_p = torch.sort(probs, -1, descending=True).values  # (B, T, V')
    nucleus_mass = (sorted_p * ((sorted_p.cumsum(-1) - sorted_p) < top_p)).sum(-1)  # (B, T)
    # sampling from the full softmax would leave the nucleus often
    assert (1 - nucleus_mass[mask]).mean() > 0.3


def test_rollout_padding_rows_never_sampled():
    lm = tiny_model()
    with torch.no_grad():
        # padding rows now dominate
        lm.lm_head.weight[REAL_VOCAB:] = 20 * lm.lm_head.weight[REAL_VOCAB:]
    prompts = toy_prompts()
    sampling = Sampling(16, eos_token_id=2, pad_token_id=0)
    r = generate(lm, prompts, replace(sampling, vocab_size=REAL_VOCAB),
                 generator=torch.Generator().manual_seed(0))
    assert r.response_ids.max() < REAL_VOCAB
    unmasked = generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(0))
    # without vocab_size they would be
    assert (unmasked.response_ids >= REAL_VOCAB).float().mean() > 0.5


def test_rollout_logprobs_equal_recomputed_forward():
    lm = eos_biased_model(73)
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)]:
        sampling = Sampling(30, temperature, top_p, eos_token_id=2, pad_token_id=0,
                            vocab_size=REAL_VOCAB)
        r = sample_groups(lm, toy_prompts(), 3, sampling,
                          generator=torch.Generator().manual_seed(2))
        assert len(r) == 12 and r.truncated.any() and not r.truncated.all()
        mask = r.response_mask.bool()
        recomputed = recomputed_logprobs(lm, r, temperature, REAL_VOCAB)
        torch.testing.assert_close(r.sampler_logprobs[mask], recomputed[mask], atol=1e-5, rtol=0)


def test_rollout_logprobs_equal_policy_forward():
    """With all vocabulary rows (vocab_size=None) the sampler's log-probs are model.Policy's (the
    training forward); with vocab_size set, the Policy must mask the same rows for the two to
    agree."""
    lm = eos_biased_model(73)
    sampling = Sampling(30, temperature=0.7, eos_token_id=2, pad_token_id=0)
    r = generate(lm, toy_prompts(), sampling, generator=torch.Generator().manual_seed(4))
    assert not any(x.is_inference()
                   for x in (r.response_ids, r.response_mask, r.sampler_logprobs, r.truncated))
    # (B, T), with autograd
    logprobs = Policy(lm)(*r.training_inputs(), r.response_mask, temperature=0.7)[0]
    logprobs.sum().backward()  # the rollout's tensors are usable in training
    torch.testing.assert_close(r.sampler_logprobs, logprobs.detach(), atol=1e-5, rtol=0)
    # The sampler drops rows >= vocab_size from its softmax; Policy(vocab_size=...) must drop the
    # same rows.
    r = generate(lm, toy_prompts(), replace(sampling, vocab_size=REAL_VOCAB),
                 generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        masked = Policy(lm, vocab_size=REAL_VOCAB)(*r.training_inputs(), r.response_mask,
                                                   temperature=0.7)[0]
        unmasked = Policy(lm)(*r.training_inputs(), r.response_mask, temperature=0.7)[0]
    torch.testing.assert_close(r.sampler_logprobs, masked, atol=1e-5, rtol=0)
    # the extra rows do carry mass in the tiny model
    assert (r.sampler_logprobs - unmasked).abs().max() > 1e-3


def test_rollout_eos_ids_end_chat_turns_of_base_models():
    """A base model's tokenizer and generation config end on <|endoftext|>; chat prompts must also
    stop at the ChatML end of turn <|im_end|>, raw prompts must not."""
    from rollout import eos_ids
    tok, lm = tiny_tokenizer(), tiny_model()
    tok.eos_token = "<|endoftext|>"  # like Qwen3-Base: EOS id 0, <|im_end|> is id 2
    lm.generation_config.eos_token_id = 0
    assert eos_ids(lm, tok, chat=True) == [0, 2]
    assert eos_ids(lm, tok, chat=False) == [0]
    lm.generation_config.eos_token_id = [0, 5]
    assert eos_ids(lm, tok, chat=False) == [0, 5]


def test_rollout_same_seed_same_rollout():
    lm, prompts = tiny_model(), toy_prompts()

    def run(seed):
        sampling = Sampling(20, eos_token_id=2, pad_token_id=0, vocab_size=REAL_VOCAB)
        return generate(lm, prompts, sampling, generator=torch.Generator().manual_seed(seed))

    with gathered(Policy(lm)):  # a no-op without FSDP
        a = run(7)
    b, c = run(7), run(8)
    assert torch.equal(a.response_ids, b.response_ids) and \
        torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    groups = sample_groups(lm, prompts[:2], 4, Sampling(20, eos_token_id=2, pad_token_id=0),
                           generator=torch.Generator().manual_seed(7))
    assert torch.equal(groups.prompt_ids[0], groups.prompt_ids[3]) \
        and not torch.equal(groups.prompt_ids[3], groups.prompt_ids[4])
    # samples in a group differ
    assert not torch.equal(groups.response_ids[0], groups.response_ids[1])


# rank r samples with seed _FSDP_SEEDS[r]: all rows stop after 25 tokens / run to 40
_FSDP_SEEDS = (15, 3)


def _fsdp_model():
    lm = eos_biased_model(73)
    with torch.no_grad():
        lm.lm_head.weight.mul_(4.0)  # a peaked distribution: EOS gets sampled
    return lm


def _fsdp_generate(lm, seed):
    sampling = Sampling(40, eos_token_id=2, pad_token_id=0, vocab_size=REAL_VOCAB)
    return generate(lm, toy_prompts(), sampling, generator=torch.Generator().manual_seed(seed))


def _fsdp_worker(rank: int, init_file: str, out_dir: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    full = _fsdp_model()
    policy = shard_policy(Policy(_fsdp_model()))  # FSDP2: each decoder layer, then the Policy root
    assert all(isinstance(p, DTensor) for p in policy.parameters())
    with gathered(policy):
        for (name, p), q in zip(policy.lm.named_parameters(), full.parameters()):
            # the full parameters, as plain tensors
            assert not isinstance(p, DTensor) and torch.equal(p, q), name
        # the HF model itself, not through the root
        rollout = _fsdp_generate(policy.lm, _FSDP_SEEDS[rank])
    assert all(isinstance(p, DTensor) for p in policy.parameters())  # resharded
    # FSDP training works afterwards
    logprobs = policy(*rollout.training_inputs(), rollout.response_mask)[0]
    logprobs.sum().backward()
    # sharded gradients, reduce-scattered
    assert all(isinstance(p.grad, DTensor) for p in policy.parameters())
    logprobs = logprobs.detach()
    with gathered(policy):  # and so does a second rollout phase
        again = _fsdp_generate(policy.lm, _FSDP_SEEDS[rank])
    assert torch.equal(again.response_ids, rollout.response_ids)
    torch.save({"rollout": rollout, "policy_logprobs": logprobs},
               os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # as train.py does: no interpreter teardown racing torch's gloo threads


def test_rollout_fsdp2_two_processes_equal_one():
    with tempfile.TemporaryDirectory() as tmp:
        two_processes(_fsdp_worker, tmp, "2-process rollout hung")
        results = [torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=False)
                   for rank in range(2)]
    lm = _fsdp_model()
    lengths = set()
    for seed, result in zip(_FSDP_SEEDS, results):
        expected = _fsdp_generate(lm, seed)
        got = result["rollout"]
        assert torch.equal(got.response_ids, expected.response_ids)
        torch.testing.assert_close(got.sampler_logprobs, expected.sampler_logprobs, atol=1e-6,
                                   rtol=0)
        lengths.add(got.response_ids.shape[1])
        with torch.no_grad():
            policy_logprobs = Policy(lm)(*got.training_inputs(), got.response_mask)[0]
        torch.testing.assert_close(result["policy_logprobs"], policy_logprobs)
    assert lengths == {25, 40}  # the ranks stopped decoding at different steps and neither hung


# ----------------------------------------------- token-budget micro-batches (Rollout.micro_batches)

def _rows_of_lengths(lengths: list[int]) -> Rollout:
    """A Rollout whose rows have these prompt + response lengths (prompt 1 token, the rest
    response)."""
    B, T = len(lengths), max(lengths)
    response_mask = (torch.arange(T) < torch.tensor(lengths)[:, None] - 1).long()  # (B, T)
    return Rollout(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long),
                   torch.zeros(B, T, dtype=torch.long), response_mask, torch.zeros(B, T),
                   torch.zeros(B, dtype=torch.bool))


def _group_order(lengths: list[int], groups: list[int]) -> list[int]:
    """The row order micro_batches promises: rows of one prompt together, groups by their longest
    row (ties: the group first seen first), longest first within a group."""
    longest = {g: max(n for n, h in zip(lengths, groups) if h == g) for g in groups}
    seen = {g: groups.index(g) for g in groups}
    return sorted(range(len(lengths)),
                  key=lambda i: (-longest[groups[i]], seen[groups[i]], -lengths[i]))


def _grouped_rows(lengths: list[int], groups: list[int]) -> Rollout:
    """A Rollout whose rows have these prompt + response lengths and prompts (group g: a 1-token
    prompt id g + 4)."""
    base = _rows_of_lengths(lengths)
    return replace(base, prompt_ids=torch.tensor(groups)[:, None] + 4)


def test_rollout_micro_batches_respect_the_token_budget():
    """Token-budget micro-batches: a partition of the rows in group order (the rows of one prompt
    together, groups longest row first, longest first within a group); the rows' prompt + response
    tokens <= budget unless a single row is longer; as few micro-batches as the budget allows for
    that order (one more row would not fit)."""
    g = torch.Generator().manual_seed(0)
    B, P, T, G = 40, 6, 30, 4
    prompt_len, response_len = (torch.randint(1, P + 1, (B // G,), generator=g),
                                torch.randint(1, T + 1, (B,), generator=g))
    prompt_len = prompt_len.repeat_interleave(G)  # (B,) G rows per prompt
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()  # (B, P) left-padded
    prompt_ids = torch.randint(4, 100, (B // G, P), generator=g).repeat_interleave(G, 0) \
        * prompt_mask
    response_mask = (torch.arange(T) < response_len[:, None]).long()  # (B, T) right-padded
    batch = Rollout(prompt_ids, prompt_mask, torch.zeros(B, T, dtype=torch.long), response_mask,
                    torch.zeros(B, T), torch.zeros(B, dtype=torch.bool))
    lengths = (prompt_len + response_len).tolist()
    assert batch.lengths().tolist() == lengths
    want = _group_order(lengths, [i // G for i in range(B)])
    for budget in (1, 20, 35, 100, 10**6):  # 20, 35 < the longest row (up to 36)
        parts = [p.tolist() for p in batch.micro_batches(budget)]
        assert [i for p in parts for i in p] == want
        for p in parts:
            assert sum(lengths[i] for i in p) <= budget or len(p) == 1
        srt, fewest, s = [lengths[i] for i in want], 0, 0
        while s < B:  # the fewest: fill each micro-batch while one more row fits
            e = s + 1
            while e < B and sum(srt[s:e + 1]) <= budget:
                e += 1
            fewest, s = fewest + 1, e
        assert len(parts) == fewest
    assert len(batch.micro_batches(1)) == B and len(batch.micro_batches(10**6)) == 1


def test_rollout_micro_batches_agreed_count_is_balanced_and_within_budget():
    """With agree(): exactly the agreed number of micro-batches (at least what the rows need), a
    partition of the rows in group order, every micro-batch within the budget unless it is one
    over-long row, and the largest padded size as small as any split of the ordered rows into that
    many consecutive runs allows (brute force)."""
    import itertools

    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lengths = torch.randint(2, 40, (n,), generator=g).tolist()
        # 1 to 4 prompts, rows in any order
        groups = torch.randint(0, 1 + trial % 4, (n,), generator=g).tolist()
        batch = _grouped_rows(lengths, groups)
        budget = int(torch.randint(1, 120, (1,), generator=g))
        need = len(batch.micro_batches(budget))
        srt = [lengths[i] for i in _group_order(lengths, groups)]
        for count in range(need, n + 1):
            parts = [p.tolist() for p in batch.micro_batches(budget, agree=lambda own: count)]
            assert len(parts) == count and all(parts)
            assert [i for p in parts for i in p] == _group_order(lengths, groups)
            cost = [sum(lengths[i] for i in p) for p in parts]
            assert all(c <= budget or len(p) == 1 for c, p in zip(cost, parts)), \
                (lengths, budget, count, parts)
            best = min(max(sum(srt[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
                       for cuts in itertools.combinations(range(1, n), count - 1)
                       if all(sum(srt[a:b]) <= budget or b - a == 1
                              for a, b in zip((0, *cuts), (*cuts, n))))
            assert max(cost) == best, (lengths, groups, budget, count, parts)
    with pytest.raises(ValueError, match="cannot cut 3 rows into 4 micro-batches"):
        _rows_of_lengths([5, 4, 3]).micro_batches(100, agree=lambda own: 4)
    # a count below what the rows need would break the budget: refused
    with pytest.raises(ValueError, match="cannot cut 3 rows into 1 micro-batches"):
        _rows_of_lengths([5, 4, 3]).micro_batches(5, agree=lambda own: 1)


# ==================================================================================================
# rollout.py: --stop-text
# ==================================================================================================
def _piece_tokenizer():
    """A tokenizer of multi-character pieces (ids 0-3 special, as tiny_tokenizer's), so that a stop
    text can be spelled inside one token or across several: "\\n\\n" is one piece, "a\\n" + "\\nb"
    another spelling of it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "a", "b", "\n", "a\n", "\nb",
              "\n\n", " ", "x", "ab", "b\n", "é"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>"])


def test_rollout_stop_text_ends_rows_where_the_text_first_appears():
    """Against the unstopped sampler with the same seed, decoded naively: each row is the unstopped
    row cut after the first token at which a stop text appears in the whole decoded response
    (special tokens skipped, as Rollout.texts), or at its EOS if that comes first; the tokens before
    are the same. Matches inside one token and across token boundaries (and across special tokens)
    both occur."""
    tok = _piece_tokenizer()
    V, texts = len(tok), ["\n\n", "ab"]
    lm = tiny_model(vocab_size=V)
    stop = rollout.StopText(tok, texts)
    prompts = [[4, 5, 6], [7, 8], [9], [10, 11, 4]] * 4
    kinds = set()
    for seed in range(6):
        for compact in (0.0, None):  # dropping finished rows changes no token
            full, cut = (generate(lm, prompts, Sampling(30, 1.0, eos_token_id=2, pad_token_id=0,
                                                        vocab_size=V, stop_text=s),
                                  generator=torch.Generator().manual_seed(seed), compact=compact)
                         for s in (None, stop))
            for i in range(len(prompts)):
                ids = full.response_ids[i][full.response_mask[i].bool()].tolist()
                end = next((t + 1 for t in range(len(ids))
                            if any(s in tok.decode(ids[:t + 1], skip_special_tokens=True)
                                   for s in texts)), None)
                got = cut.response_ids[i][cut.response_mask[i].bool()].tolist()
                assert got == ids[:end or len(ids)], (seed, i)
                assert torch.equal(cut.sampler_logprobs[i, :len(got)],
                                   full.sampler_logprobs[i, :len(got)])
                assert bool(cut.truncated[i]) == (end is None and bool(full.truncated[i]))
                if end:
                    alone = tok.decode(ids[end - 1:end])
                    kinds.add("inside" if any(s in alone for s in texts) else "across")
                    kinds.add("special" if any(t in (0, 1) for t in ids[max(0, end - 3):end])
                              else "plain")
    assert kinds == {"inside", "across", "special", "plain"}, kinds


def test_rollout_stop_text_window_and_vocabulary_filter():
    """A text of n bytes is looked for in the last n + 1 tokens that are not special; a token can
    end a match only if it spells the text's last character or no whole character (a byte of a
    multi-byte one); a special token, which the decoded text skips, never ends one."""
    tok = tiny_tokenizer()
    stop = rollout.StopText(tok, ["ab", "é"])
    assert stop.window == 3  # "é" is 2 bytes in UTF-8
    ids = tok("xab").input_ids
    # special tokens do not count towards the window
    assert stop.tail([0, *ids, 1, 0]) == [*ids, 1, 0]
    may = {tok.convert_ids_to_tokens(i): bool(stop.may_end[i]) for i in range(len(tok))}
    assert may["b"] and not may["a"] and not may["<|im_end|>"]
    rows = torch.tensor([tok("xxab").input_ids, tok("abxx").input_ids,
                         tok("xxxx").input_ids])  # (3, 4)
    assert stop.ends(rows, 0).tolist() == [3, 1, -1] and stop.ends(rows, 2).tolist() == [3, -1, -1]
    with pytest.raises(ValueError, match="non-empty"):
        rollout.StopText(tok, [""])
