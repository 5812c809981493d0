"""The paper's core under test: stapo.py and s2t.py (group advantages, policy_loss, the S2T mask,
the algorithms, the paper's worked examples) against hand-worked equations. CPU only, tiny random
models built in code, no network. Run the whole suite: python -m pytest -q

The other tests follow the files they test, one test file per code file, in tests/ (the rule and
the list: docs/tests.md); helpers more than one test file uses are modules named for them in
tests/ (toy_task.py, sampler_checks.py, model_batches.py, s2t_threshold.py, run_hooks.py).
Data-dependent tests read testdata/; nothing outside the repository is read, and no test depends on
another's order.
"""
import math
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

import s2t
import stapo
from distributed.process_group import all_gather_cat
from tests.s2t_threshold import HIGH_LP, LOW_LP, TAU_P
from tests.sampler_checks import two_processes

# ==================================================================================================
# stapo.py and s2t.py: advantages, the objective, the S2T mask, the baselines
# ==================================================================================================


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
    # group 1: [1, -1] -> mean 0, unbiased std sqrt(2) -> +-0.7071; group 2 all equal -> 0;
    # group 3: [2, 0] -> same
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
    loss, stats = stapo.policy_loss(logprobs, old, adv, torch.ones(1, 5), clip_low=0.2,
                                    clip_high=0.28)
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
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad
               for v in stats.values())


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
    # dual clip bounds A<0 tokens by -3 A: min(5, 3) = 3, min(1.5, 3) = 1.5, min(8, 6) = 6;
    # A>0 untouched: -1.28
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
    # r = exp(20) for the first token (A < 0, unclipped: loss e^20),
    # exp(-20) for the second (A > 0: -e^-20)
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
    """w = min(pi_old / pi_sampler, C), and weighting the loss by it gives sum_t w_t l_t / N with
    the clipped surrogate l_t, computed here by hand."""
    old = torch.log(torch.tensor([[0.6, 0.2, 0.9, 0.3]]))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.1, 0.3]]))
    w = stapo.tis_weight(old, sampler, cap=2.0)
    # 2.4 and 9 are truncated to C = 2
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.0, 1.0]]))
    logprobs = (old + torch.tensor([[0.5, -0.3, 0.0, 0.1]])).requires_grad_()
    adv, mask = torch.tensor([[1.0, 1.0, -1.0, 1.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, _ = stapo.policy_loss(logprobs, old, adv, mask * w, denominator=3.0)
    ratio = (logprobs - old).exp()
    naive = -(mask * w * torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)).sum() / 3.0
    torch.testing.assert_close(loss, naive)
    loss.backward()
    # r = 1.65 > 1.28 with A > 0: clipped
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] != 0


# ---------------------------------------------------------------- S2T

def test_s2t_truth_table():
    # 8 combinations of (A > 0, p < tau_p, H < tau_h), tau_h fixed at 1.0, plus one padding token
    rows = []
    for pos in (False, True):
        for low_p in (False, True):
            for low_h in (False, True):
                rows.append((1.0 if pos else -1.0, LOW_LP if low_p else HIGH_LP,
                             0.5 if low_h else 2.0, 1.0))
    rows.append((1.0, LOW_LP, 0.5, 0.0))  # all three hold but it is not a response token
    adv, lp, ent, mask = (torch.tensor([[r[i] for r in rows]]) for i in range(4))
    # tau_h = 1.0
    silenced = s2t.spurious_mask(lp, ent, adv, mask, TAU_P, 0.75, gather=lambda v: _at(v, 1.0))[0]
    expected = torch.zeros(1, 9, dtype=torch.bool)
    expected[0, 7] = True  # only (A > 0, p < tau_p, H < tau_h)
    assert torch.equal(silenced, expected)
    # A = 0 is not "better than average"; p exactly tau_p is not below it
    zero_adv = s2t.candidates(torch.tensor([[LOW_LP, math.log(TAU_P)]]), torch.tensor([[0.0, 1.0]]),
                              torch.ones(1, 2), TAU_P)
    assert not zero_adv.any()


def test_s2t_quantile_boundary():
    # 5 candidates with H = 0.1..0.5: tau_h = 0.75-quantile = value at rank 3 = 0.4;
    # H < 0.4 strict -> 3 silenced
    ent = torch.tensor([[0.3, 0.1, 0.5, 0.4, 0.2, 0.0, 0.05]])
    lp = torch.tensor([[LOW_LP] * 5 + [LOW_LP, HIGH_LP]])
    # the two low-entropy extra tokens are not candidates
    adv = torch.tensor([[1.0] * 5 + [-1.0, 1.0]])
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


def test_s2t_quantile_window_pools_earlier_candidates():
    """--quantile-window, worked by hand: a lone candidate (H = 0.25) is kept by the paper's rule;
    with the window's earlier entropies 0.1, 0.2, 0.3 tau_h = the 0.75-quantile of
    {0.1, 0.2, 0.25, 0.3} = 0.25 + 0.25 x 0.05 = 0.2625, so it is silenced. An empty window is the
    paper's rule; a mini-batch without candidates silences nothing. The window keeps the last N,
    oldest first, whatever the pieces it is fed in."""
    lp, ent, one = torch.full((1, 1), LOW_LP), torch.full((1, 1), 0.25), torch.ones(1, 1)
    assert not s2t.spurious_mask(lp, ent, one, one)[0].any()
    silenced, tau_h = s2t.spurious_mask(lp, ent, one, one, earlier=torch.tensor([0.1, 0.2, 0.3]))
    assert silenced.all() and tau_h == pytest.approx(0.2625)
    assert s2t.spurious_mask(lp, ent, one, one, earlier=torch.zeros(0))[1] == pytest.approx(0.25)
    none = s2t.spurious_mask(torch.full((1, 1), HIGH_LP), ent, one, one,
                             earlier=torch.tensor([0.9]))
    assert not none[0].any() and none[1] is None
    window = s2t.QuantileWindow(4)
    for piece in ([1.0, 2.0], [], [3.0], [4.0, 5.0, 6.0]):
        window.add(torch.tensor(piece))
    assert window.values.tolist() == [3.0, 4.0, 5.0, 6.0]
    # stapo.token_weights hands the window to the rule (S2T and its controls), and the
    # mini-batch's candidates then join it
    window = s2t.QuantileWindow(4, torch.tensor([0.1, 0.2, 0.3]))
    weights = stapo.token_weights("stapo", lp, ent, one, one,
                                  context=stapo.MiniBatchContext(window=window))
    assert weights.silenced.all() and weights.threshold == pytest.approx(0.2625)
    assert window.values.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.25])


def test_s2t_no_candidates():
    lp = torch.full((2, 3), HIGH_LP)
    ent = torch.rand(2, 3)
    adv = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
    gathered = []
    silenced, tau_h = s2t.spurious_mask(lp, ent, adv, torch.ones(2, 3),
                                        gather=lambda v: gathered.append(v) or v)
    # an empty share still gathers
    assert not silenced.any() and tau_h is None and gathered[0].numel() == 0


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
    # reverse-sorted input (quadratic for CPU kthvalue): the values n-1 .. 0,
    # whose 0.8-quantile is 0.8 (n - 1)
    n = 10 ** 6
    assert s2t.quantile_of(torch.arange(n, dtype=torch.float64).flip(0), 0.8) == \
        pytest.approx(0.8 * (n - 1))


def test_s2t_grad_norm_matches_autograd():
    g = torch.Generator().manual_seed(1)
    T, V = 6, 50
    logits = (torch.randn(T, V, generator=g) * 2).requires_grad_(True)  # (T, V)
    k = torch.randint(0, V, (T,), generator=g)
    logprobs = torch.log_softmax(logits, -1).gather(1, k[:, None])[:, 0][None]  # (1, T)
    collision = torch.softmax(logits, -1).pow(2).sum(-1)[None].detach()  # (1, T)
    # (A, r): inside the clip, upper clip active, lower clip active, A<0 above range (unclipped),
    # dual clip active
    adv = torch.tensor([[1.5, 1.0, -1.0, -0.7, -1.0, 2.0]])
    ratio = torch.tensor([[1.1, 1.5, 0.5, 1.6, 4.0, 0.9]])
    old = logprobs.detach() - ratio.log()
    loss, _ = stapo.policy_loss(logprobs, old, adv, torch.ones(1, T), dual_clip=3.0,
                                denominator=1.0)
    loss.backward()  # loss = sum of per-token losses; row t of the logits only affects token t
    autograd_norm = logits.grad.norm(dim=-1)  # (T,)
    w = stapo.surrogate_weight(logprobs, old, adv, dual_clip=3.0)
    closed = s2t.grad_norm_logits(w, logprobs, collision)[0]
    assert torch.allclose(closed, autograd_norm, atol=1e-5)
    assert (closed[[1, 2, 4]] == 0).all() and (closed[[0, 3, 5]] > 0).all()  # clipped tokens: zero


# ---------------------------------------------------------------- the five algorithms

def _batch(seed=0):
    """6 sequences (2 groups of 3), T = 8, ragged lengths; about a third of the tokens have
    p < tau_p."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 8
    lengths = torch.tensor([8, 5, 3, 8, 6, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # (B, T)
    logprobs = torch.empty(B, T).uniform_(math.log(1e-4), math.log(0.9), generator=g) * mask
    entropy = torch.rand(B, T, generator=g) * 3 * mask
    old = logprobs + 0.3 * torch.randn(B, T, generator=g) * mask
    ref = logprobs + 0.2 * torch.randn(B, T, generator=g) * mask
    adv = stapo.group_advantages(
        torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0, -1.0]), 3)[:, None].expand(B, T)
    return logprobs, entropy, old, ref, adv, mask


def _at(values, threshold):
    """A `gather` that replaces the gathered entropies by one value, so the q-quantile is
    `threshold`."""
    return torch.tensor([threshold])


def _rows(chunk):
    """These rows' places in the whole mini-batch (randmask's keys)."""
    return range(int(chunk[0]), int(chunk[-1]) + 1)


def _ranks(algo, batch, chunks, seed=5):
    """stapo.token_weights on each chunk of rows as on a rank of its own, with its all-gathers
    simulated: a pass records each chunk's j-th gathered values, the next hands every chunk all
    chunks' j-th values of the pass before, until nothing changes (the values of a later gather may
    depend on an earlier one: randmask's count)."""
    logprobs, entropy, old, ref, adv, mask = batch
    every = None
    # token_weights gathers at most 3 times: entropies, randmask's count, randmask's keys
    for _ in range(4):
        seen = [[] for _ in chunks]

        def gather(values, i):
            seen[i].append(values)
            return values if every is None else every[len(seen[i]) - 1]
        contexts = [stapo.MiniBatchContext(lambda v, i=i: gather(v, i), seed, _rows(c), 8)
                    for i, c in enumerate(chunks)]
        parts = [stapo.token_weights(algo, logprobs[c], entropy[c], adv[c], mask[c], TAU_P, 0.75,
                                     context) for c, context in zip(chunks, contexts)]
        every = [torch.cat(values) for values in zip(*seen)]
    return parts


def _update(algo, batch, sizes, beta=0.04):
    """One mini-batch's update, its rows split over ranks (`sizes` rows each), each rank's rows one
    micro-batch, with the calls of train.accumulate_gradients (token_weights, policy_loss, kl_term)
    and the ranks' gathers simulated: returns (summed loss, grad, weights)."""
    logprobs, entropy, old, ref, adv, mask = batch
    param = torch.nn.Parameter(logprobs.clone())
    chunks = torch.arange(len(logprobs)).split(sizes)
    parts = _ranks(algo, batch, chunks)
    den = sum(p.share for p in parts)  # all_sum over ranks
    total = 0.0
    for p, c in zip(parts, chunks):
        loss, _ = stapo.policy_loss(param[c], old[c], adv[c], p.weights,
                                    *stapo.ALGORITHMS[algo].clip, denominator=den)
        if algo == "grpo":
            loss = loss + beta * stapo.kl_term(param[c], ref[c], p.weights, den)
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
    naive = sum(stapo.policy_loss(logprobs[c], old[c], adv[c], weights[c],
                                  *stapo.ALGORITHMS[algo].clip)[0].item()
                for c in torch.arange(6).split([1, 2, 3]))
    assert abs(naive - loss) > 1e-3


def test_algo_stapo_silences_and_renormalizes():
    logprobs, entropy, old, ref, adv, mask = _batch()
    weights, silenced, tau, den, _ = stapo.token_weights("stapo", logprobs, entropy, adv, mask,
                                                         TAU_P, 0.75)
    n_cand = s2t.candidates(logprobs, adv, mask, TAU_P).sum().item()
    assert 0 < silenced.sum().item() < n_cand  # the fixture silences some but not all candidates
    assert torch.equal(silenced, s2t.spurious_mask(logprobs, entropy, adv, mask, TAU_P, 0.75)[0])
    # silenced tokens leave the denominator
    assert den.item() == mask.sum().item() - silenced.sum().item()
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
    weights, silenced, tau, den, _ = stapo.token_weights("fullmask", logprobs, entropy, adv, mask,
                                                         TAU_P)
    assert torch.equal(silenced, s2t.candidates(logprobs, adv, mask, TAU_P)) and tau is None
    assert den.item() == mask.sum().item() - silenced.sum().item()


def test_algo_randmask_silences_s2t_count_at_random():
    """RandMask silences exactly as many candidates as S2T, at positions its seed decides; the same
    positions for any split of the mini-batch's rows over ranks."""
    batch = _batch()
    logprobs, entropy, old, ref, adv, mask = batch
    cand = s2t.candidates(logprobs, adv, mask, TAU_P)
    n = s2t.spurious_mask(logprobs, entropy, adv, mask, TAU_P, 0.75)[0].sum().item()
    assert 0 < n < cand.sum().item()
    chosen = []
    for seed in range(40):
        context = stapo.MiniBatchContext(seed=seed, length=8)
        weights, silenced, tau, den, _ = \
            stapo.token_weights("randmask", logprobs, entropy, adv, mask, TAU_P, 0.75, context)
        # S2T's count, candidates only
        assert silenced.sum().item() == n and not (silenced & ~cand).any()
        assert den.item() == mask.sum().item() - n and \
            torch.equal(weights, (mask > 0).float() * ~silenced)
        for sizes in ([1, 2, 3], [3, 3]):  # the same tokens when the rows are split over ranks
            parts = _ranks("randmask", batch, torch.arange(6).split(sizes), seed)
            assert torch.equal(torch.cat([p.silenced for p in parts]), silenced)
        chosen.append(silenced)
    assert len({tuple(c.flatten().tolist()) for c in chosen}) > 1  # another seed, other tokens
    assert (torch.stack(chosen).sum(0)[cand] > 0).all()  # every candidate is chosen under some seed


_PERM = [0, 3, 4, 1, 2, 5]  # _batch's rows reordered: lengths 8, 8, 6 on rank 0, 5, 3, 2 on rank 1


def _randmask_worker(rank: int, init_file: str, out_dir: str):
    """One of 2 gloo ranks: randmask, highmask and S2T on its half of the mini-batch, its rows
    padded to its own T, gathers through train's."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rows = _PERM[3 * rank:3 * rank + 3]
    logprobs, entropy, old, ref, adv, mask = (x[rows] for x in _batch())
    T = int(mask.sum(1).max())  # 8 on rank 0, 5 on rank 1
    out = {}
    for algo in ("randmask", "highmask", "stapo"):
        context = stapo.MiniBatchContext(all_gather_cat, 5, range(3 * rank, 3 * rank + 3), 8)
        w = stapo.token_weights(algo, logprobs[:, :T], entropy[:, :T], adv[:, :T], mask[:, :T],
                                TAU_P, 0.75, context)
        out[algo] = torch.nn.functional.pad(w.silenced, (0, 8 - T))
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)


def test_algo_controls_two_processes_equal_one():
    """randmask and highmask on 2 gloo processes (each half of the rows, padded to its own
    length) = 1 process."""
    with tempfile.TemporaryDirectory() as tmp:
        two_processes(_randmask_worker, tmp, "2-process token_weights hung")
        parts = [torch.load(os.path.join(tmp, f"{rank}.pt")) for rank in range(2)]
    logprobs, entropy, old, ref, adv, mask = (x[_PERM] for x in _batch())
    for algo in ("randmask", "highmask", "stapo"):
        context = stapo.MiniBatchContext(seed=5, length=8)
        one = stapo.token_weights(algo, logprobs, entropy, adv, mask, TAU_P, 0.75, context)
        assert one.silenced.any(), algo
        assert torch.equal(torch.cat([p[algo] for p in parts]), one.silenced), algo


def test_algo_highmask_silences_the_candidates_s2t_keeps():
    logprobs, entropy, old, ref, adv, mask = _batch()
    cand = s2t.candidates(logprobs, adv, mask, TAU_P)
    s2t_silenced, tau_h = s2t.spurious_mask(logprobs, entropy, adv, mask, TAU_P, 0.75)
    weights, silenced, tau, den, _ = stapo.token_weights("highmask", logprobs, entropy, adv, mask,
                                                         TAU_P, 0.75)
    assert torch.equal(silenced, cand & ~s2t_silenced) and silenced.any() and tau == tau_h
    assert (entropy[silenced] >= tau_h).all()  # the high-entropy candidates
    assert den.item() == mask.sum().item() - silenced.sum().item()
    # the complement
    assert not (silenced & s2t_silenced).any() and torch.equal(silenced | s2t_silenced, cand)


def test_algo_20_entropy_keeps_top_fifth_and_full_denominator():
    g = torch.Generator().manual_seed(2)
    B, T = 4, 25  # 100 response tokens with distinct entropies
    entropy = torch.randperm(100, generator=g).float().reshape(B, T)
    mask = torch.ones(B, T)
    lp = torch.full((B, T), -1.0)
    adv = torch.ones(B, T)
    weights, silenced, tau, den, _ = \
        stapo.token_weights("20-entropy", lp, entropy, adv, mask, TAU_P, quantile=0.5)
    assert tau == pytest.approx(79.2)  # 0.8 * 99, whatever quantile S2T uses
    assert weights.sum().item() == 20 and torch.equal(weights > 0, entropy >= 80)
    assert silenced.sum().item() == 80
    assert den.item() == 100  # all response tokens


def test_algo_grpo_is_mean_of_sequence_means():
    logprobs, entropy, old, ref, adv, mask = _batch()
    weights, silenced, tau, den, _ = \
        stapo.token_weights("grpo", logprobs, entropy, adv, mask, TAU_P)
    assert not silenced.any()
    assert den.item() == 6
    loss, _ = stapo.policy_loss(logprobs, old, adv, weights, 0.2, 0.2, denominator=den)
    seq_means = []
    for i in range(6):
        n = int(mask[i].sum())
        li, _ = stapo.policy_loss(logprobs[i:i + 1, :n], old[i:i + 1, :n], adv[i:i + 1, :n],
                                  torch.ones(1, n), 0.2, 0.2)
        seq_means.append(li.item())
    assert loss.item() == pytest.approx(sum(seq_means) / 6, abs=1e-6)
    token_mean, _ = stapo.policy_loss(logprobs, old, adv, mask, 0.2, 0.2)
    # ragged lengths: differs from the token mean
    assert abs(token_mean.item() - loss.item()) > 1e-3


def test_algo_unknown_name():
    x = torch.zeros(1, 2)
    for call in (lambda: stapo.token_weights("ppo", x, x, x, x), lambda: stapo.algorithm("ppo")):
        with pytest.raises(ValueError, match="stapo, justrl, grpo, 20-entropy, fullmask"):
            call()
