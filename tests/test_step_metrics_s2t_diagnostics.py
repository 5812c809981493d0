"""step_metrics/s2t_diagnostics.py: what S2T saw and did, against hand computations: the per
mini-batch sums of p, H and the logit-gradient norm (`diagnostics`), the seeded sample of
tokens.jsonl (`token_sample`), the entropy change of one update (`entropy_change`), tokens by kind
and part of the response (`token_cells`).
"""
import math

import pytest
import torch

import model
import s2t
from model import Policy, tiny_model
from step_metrics import s2t_diagnostics
from tests.s2t_threshold import HIGH_LP, LOW_LP, TAU_P


# ==================================================================================================
# step_metrics/s2t_diagnostics.py: diagnostics, token_sample, entropy_change, token_cells
# ==================================================================================================
def test_s2t_diagnostics():
    lp = torch.tensor([[LOW_LP, LOW_LP, HIGH_LP, LOW_LP]])
    ent = torch.tensor([[0.2, 0.6, 1.0, 0.1]])
    col = torch.tensor([[0.9, 0.5, 0.3, 0.9]])
    adv = torch.ones(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    silenced = torch.tensor([[True, False, False, True]])  # the last one is padding: ignored
    d = s2t_diagnostics.diagnostics(model.TokenStats(lp, ent, col), adv, mask, silenced,
                                    tau_p=TAU_P)
    # sums and counts, not means
    assert d["candidates"] == 2 and d["silenced"] == 1 and d["kept"] == 2
    assert d["silenced_p"] == pytest.approx(0.001, rel=1e-5)
    assert d["silenced_h"] == pytest.approx(0.2)
    # w = A = 1: sqrt(1 - 2p + sum p^2)
    assert d["gn_silenced"] == pytest.approx(math.sqrt(1 - 0.002 + 0.9), rel=1e-5)
    kept = math.sqrt(1 - 0.002 + 0.5) + math.sqrt(1 - 1.0 + 0.3)
    assert d["gn_kept"] == pytest.approx(kept, rel=1e-5)
    assert all(isinstance(v, float) for v in d.values())
    none = s2t_diagnostics.diagnostics(model.TokenStats(lp, ent, col), adv, mask,
                                       torch.zeros_like(silenced), tau_p=TAU_P)
    assert none["silenced"] == 0 and none["silenced_p"] == 0.0 and none["kept"] == 3


def test_s2t_token_sample():
    """Every candidate and silenced token is drawn (up to n), n of the others at random,
    with the right values."""
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
    d = s2t_diagnostics.token_sample(model.TokenStats(lp, ent, col), adv, mask, silenced, 40,
                                     torch.Generator().manual_seed(1), TAU_P)
    picked = torch.zeros(B, T, dtype=torch.bool)
    picked[d["row"], d["col"]] = True
    assert (picked & special).sum() == special.sum()  # all special tokens
    # n others, never padding
    assert (picked & ~special).sum() == 40 and not (picked & (mask == 0)).any()
    rest = ((mask > 0) & ~special).sum().item()
    torch.testing.assert_close(d["weight"],
                               torch.where(special[d["row"], d["col"]], 1.0, rest / 40))
    torch.testing.assert_close(d["p"], lp[d["row"], d["col"]].exp())
    torch.testing.assert_close(d["H"], ent[d["row"], d["col"]])
    torch.testing.assert_close(d["A"], adv.expand(B, T)[d["row"], d["col"]])
    torch.testing.assert_close(d["grad_norm"],
                               s2t.grad_norm_logits(adv.expand(B, T), lp, col)[d["row"], d["col"]])
    assert torch.equal(d["silenced"], silenced[d["row"], d["col"]])
    assert torch.equal(d["candidate"], s2t.candidates(lp, adv, mask, TAU_P)[d["row"], d["col"]])
    again = s2t_diagnostics.token_sample(model.TokenStats(lp, ent, col), adv, mask, silenced, 40,
                             torch.Generator().manual_seed(1), TAU_P)
    assert torch.equal(again["row"], d["row"]) and torch.equal(again["col"], d["col"])  # seeded
    # more special tokens than n: a random n of them, each standing for special / n tokens
    few = s2t_diagnostics.token_sample(model.TokenStats(lp, ent, col), adv, mask, silenced, 3,
                                       torch.Generator().manual_seed(1), TAU_P)
    assert len(few["row"]) == 6 and (few["weight"] == special.sum() / 3).sum() == 3


def test_entropy_change_against_a_hand_computation():
    """One AdamW step on a tiny model: the mean entropy change at silenced, kept-candidate and other
    positions (chosen by hand) equals the change of the entropies computed by hand from the model's
    logits before and after."""
    torch.manual_seed(0)
    lm = tiny_model(vocab_size=32)
    policy = Policy(lm)
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    response = torch.tensor([[11, 12, 13, 14], [15, 16, 17, 0]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    input_ids, attention_mask = torch.cat([prompt, response], 1), \
        torch.cat([torch.ones_like(prompt), response_mask], 1)
    silenced = torch.zeros(2, 4, dtype=torch.bool)
    silenced[0, 1] = True
    cand = torch.zeros(2, 4, dtype=torch.bool)
    cand[0, 1] = cand[0, 2] = cand[1, 0] = True

    def hand_entropy():  # H at response position t of row b: softmax of the logits predicting it
        with torch.no_grad():
            logp = torch.log_softmax(
                lm(input_ids=input_ids, attention_mask=attention_mask).logits.float(), -1)
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
    got = s2t_diagnostics.entropy_change(before, after, response_mask, silenced, cand)
    kinds = {"silenced": [(0, 1)], "candidate": [(0, 2), (1, 0)],
             "other": [(0, 0), (0, 3), (1, 1), (1, 2)]}
    for kind, where in kinds.items():
        assert got[f"entropy_change/{kind}_n"] == len(where)
        assert got[f"entropy_change/{kind}_sum"] == \
            pytest.approx(sum(h1[w] - h0[w] for w in where), abs=1e-4)
    assert abs(got["entropy_change/silenced_sum"]) > 1e-3  # the update moved the entropy


def test_token_cells_split_the_response_by_kind_and_part():
    """s2t_diagnostics.token_cells on a hand-built case: every response token in exactly one
    kind x part."""
    lp = torch.log(torch.tensor([[0.001, 0.5, 0.001, 0.9], [0.001, 0.3, 0.9, 0.5]]))
    adv = torch.tensor([[1.0], [-1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    graded = torch.tensor([[True, True, False, False], [True, False, False, False]])
    cells = s2t_diagnostics.token_cells(lp, adv, mask, graded, TAU_P)
    want = {"candidate_graded": [(0, 0)], "candidate_after": [(0, 2)],
            "high_p_pos_graded": [(0, 1)], "high_p_pos_after": [(0, 3)], "low_p_graded": [(1, 0)],
            "high_p_rest_after": [(1, 1), (1, 2)]}
    for cell, sel in cells.items():
        assert sel.nonzero().tolist() == [list(w) for w in want.get(cell, [])], cell
    # a partition of the response tokens
    assert torch.equal(sum(sel.int() for sel in cells.values()), mask)
