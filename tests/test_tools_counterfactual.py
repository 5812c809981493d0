"""tools/counterfactual.py (RQ2): the estimator on a tabular policy with known effects, token picks,
Wilson intervals, the command on a tiny run."""
import importlib.util
import json
import math
import shutil

import pytest
import torch

import train
from model import tiny_model
from tests.toy_task import EVEN, one_thread, patch_toy_task, toy_args, toy_data
from tools import counterfactual, counterfactual_tables

# ==================================================================================================
# tools/counterfactual.py and s2t_diagnostics.entropy_change: what the mask removes and what an
# update does to entropy (RQ2)
# ==================================================================================================
# A tabular policy whose tokens' effects on success are known exactly. Prompt [gold]; response: a
# hint A or B (1/2 each), then the answer digit (gold with probability 0.9 after A, 0.2 after B,
# else one of the 9 other digits), then filler tokens that cannot change anything, never EOS (so
# every response runs to the budget).
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
                    # the redraw without the token
                    if not cont and exclude is not None and token == exclude[i]:
                        if t < 2:
                            continue  # the hint or the answer: draw again (rejection)
                        token = _FILL + 1  # the filler's only alternative: another filler
                    cont.append(token)
                out.append(cont)
        return out
    return sample


def _tabular_grade(prompts):
    def grade(row, response):
        # every continuation got exactly the budget its prefix left
        assert len(response) == _CF_LEN, response
        return 1.0 if response[1] == prompts[row][0] else -1.0
    return grade


def test_counterfactual_estimator_on_a_known_policy():
    """effect = P(success | y_<=t) - P(success | y_<t) lands within 3 standard errors of the exact
    value for a hint token (+0.35 / -0.35), a deciding token (+0.1, +0.8, -0.2) and tokens that
    cannot change the answer (0, also the last one); comparing with the response's own reward
    instead (a wrong estimator) misses by far more."""
    prompts = [[7], [3], [3]]
    f = [_FILL] * 4
    responses = [[_HINT_A, 7] + f, [_HINT_B, 3] + f, [_HINT_B, 5] + f]  # right, right, wrong
    v = 0.5 * 0.9 + 0.5 * 0.2  # P(success) before the hint
    exact = {(0, 0): 0.9 - v, (0, 1): 1 - 0.9, (0, 3): 0.0, (0, 5): 0.0, (1, 0): 0.2 - v,
             (1, 1): 1 - 0.2, (2, 1): 0 - 0.2}
    calls = []
    effects = counterfactual.token_effects(_tabular_sampler(calls), _tabular_grade(prompts),
                                           list(zip(prompts, responses)), list(exact), k=2000,
                                           max_response_len=_CF_LEN, seed=3, prefixes_per_call=4)
    # Q(a) - Q(not a): effect = (1 - p) contrast, p = 0.5 (hints), 0.9 / 0.2 (answers)
    contrast = {(0, 0): 0.9 - 0.2, (0, 1): 1.0, (0, 3): 0.0, (0, 5): 0.0, (1, 0): 0.2 - 0.9,
                (1, 1): 1.0, (2, 1): 0 - 0.2}
    for e in effects:
        truth = exact[e.row, e.t]
        assert e.k == 2000 and abs(e.effect - truth) <= 3 * e.stderr + 1e-12, (e, truth)
        assert e.contrast_ci[0] <= contrast[e.row, e.t] <= e.contrast_ci[1], \
            (e, contrast[e.row, e.t])
        assert e.contrast == pytest.approx(e.keep - e.exclude)
        assert e.effect == pytest.approx(e.keep - e.resample) and e.stderr < 0.03
        if truth == 0:
            assert e.effect == 0 and e.stderr == 0  # nothing after the answer can change it
        reward_of_response = 1.0 if responses[e.row][1] == prompts[e.row][0] else 0.0
        # the response's reward is not the success with y_t kept
        if (e.row, e.t) in ((0, 0), (1, 0)):
            assert abs(reward_of_response - e.resample - truth) > 3 * e.stderr + 0.05
    # one call per group of <= 4 prefixes (the last token's kept prefix is the response itself: no
    # call), longest budget first, each call seeded differently; then the redraws without the token,
    # in calls of their own
    assert [n for n, _, _ in calls] == [4, 4, 4, 1, 4, 3] and len({s for _, _, s in calls}) == 6
    assert all([m for _, m, _ in part] == sorted((m for _, m, _ in part), reverse=True)
               for part in (calls[:4], calls[4:]))
    again = counterfactual.token_effects(_tabular_sampler([]), _tabular_grade(prompts),
                                         list(zip(prompts, responses)), list(exact), k=2000,
                                         max_response_len=_CF_LEN, seed=3, prefixes_per_call=4)
    assert again == effects  # seeded: reproducible


def test_counterfactual_pick_tokens_and_summary():
    """Silenced tokens, the candidates kept and other tokens of correct responses only, at most n of
    each; the summary table has a row per kind."""
    silenced = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]).bool()
    cand = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]).bool()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    correct = torch.tensor([True, True, False])
    picked = counterfactual.pick_tokens(silenced, cand, mask, correct, 2,
                                        torch.Generator().manual_seed(0))
    kinds = {k: [(r, t) for kk, r, t in picked if kk == k] for k in counterfactual_tables.KINDS}
    assert kinds["silenced"] == [(0, 1), (0, 2)] and kinds["candidate"] == [(0, 0), (1, 1)]
    # row 2 is wrong
    assert len(kinds["other"]) == 2 and set(kinds["other"]) <= {(0, 3), (1, 0), (1, 2)}
    def line(kind, row, keep, resample, exclude, negligible, part="graded"):
        return {"kind": kind, "row": row, "part": part, "keep": keep, "resample": resample,
                "exclude": exclude, "effect": keep - resample, "contrast": keep - exclude,
                "negligible": negligible, "delta": 0.2}

    lines = [line("silenced", 0, 1.0, 1.0, 1.0, True), line("silenced", 1, 0.5, 1.0, 1.0, False),
             line("other", 0, 1.0, 0.75, 0.5, False, "after")]
    table = counterfactual_tables.summary(lines)
    # two responses: intervals resample them; 1 of 2 negligible, both effects <= 0, 1 of 2 settled
    assert "| silenced, graded | 2 (2) | -0.250 (-0.500, +0.000) | -0.250 (-0.500, +0.000) | " \
           "50% (0%, 100%) (delta 0.2) | 100% | 50% | 0.75 / 1.00 / 1.00 |" in table
    assert "| candidate, graded | 0 |" in table and "| silenced, after | 0 |" in table
    assert "| other, after | 1 (1) | +0.250 (+0.250, +0.250) | +0.500 (+0.500, +0.500) | " \
           "0% (0%, 0%)" in table
    assert all(line.count("|") == table.splitlines()[0].count("|") for line in table.splitlines())


def test_counterfactual_contrast_redraw_and_equivalence():
    """The redraw without the token never returns it, even where the policy puts almost all its mass
    on it; the equivalence test: Newcombe's interval against the published example
    (56/70 - 48/80: 0.0524 to 0.3339, method 10) and "negligible" only when the interval lies inside
    +-delta (all K draws agreeing at K = 8 is not enough)."""
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
        draws = counterfactual.redraw_without(lm, [prefix, prefix], [top, 3], 400, 1.0, top_p, 32,
                                              seed=1)
        assert top not in draws[0] and 3 not in draws[1] and len(draws[0]) == 400
        assert top in draws[1] or top_p == 1.0  # the other row may draw it
    # the nucleus that holds the token alone: the rest of the softmax, renormalized
    draws = counterfactual.redraw_without(lm, [prefix], [top], 50, 0.01, 0.5, 32, seed=1)
    assert top not in draws[0]
    # Newcombe's example has unequal n: the formula with the two Wilson intervals
    p1, p2 = 56 / 70, 48 / 80
    (l1, u1), (l2, u2) = counterfactual_tables.wilson(56, 70), counterfactual_tables.wilson(48, 80)
    d = p1 - p2
    assert (d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2),
            d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)) == \
        pytest.approx((0.0524, 0.3339), abs=1e-4)
    # unanimous: not 0 wide
    assert counterfactual_tables.newcombe(8, 8, 8) == pytest.approx((-0.3244, 0.3244), abs=1e-4)
    assert counterfactual_tables.newcombe(32, 32, 32)[1] == pytest.approx(0.1072, abs=1e-4)
    # a large interval around a small difference: not negligible
    lo, hi = counterfactual_tables.newcombe(16, 14, 32)
    assert lo < 0.0625 < 0.2 < hi  # 0.0625 is inside +-0.2, its interval is not


def test_counterfactual_command_on_a_tiny_run(tmp_path, monkeypatch, capsys):
    """`python -m tools.counterfactual RUN --steps 1 2` on a toy run (step 2 from the checkpoint of
    step 1): it regenerates both steps exactly, both mini-batches' masks by replaying the updates
    (checked against the run's logs: rewards, lengths, candidate and silenced counts), writes one
    line per token with the fields a reader needs, for every kind, prints the summary, and the same
    command writes the same file again."""
    patch_toy_task(monkeypatch, EVEN)
    run = tmp_path / "run"
    args = toy_args(toy_data(tmp_path), run, tau_p=0.08, export_hf=False)
    with one_thread():
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
    assert {x["step"] for x in lines} == {1, 2} \
        and {x["kind"] for x in lines} == set(counterfactual_tables.KINDS)
    for x in lines:
        assert {"kind", "effect", "stderr", "k", "step", "row", "t", "token", "p", "H", "A", "keep",
                "resample", "reward", "context", "exclude", "contrast", "contrast_ci", "negligible",
                "part"} <= x.keys()
        assert x["contrast"] == pytest.approx(x["keep"] - x["exclude"]) \
            and x["part"] in ("graded", "after")
        lo, hi = x["contrast_ci"]
        assert x["negligible"] == (-0.2 < lo and hi < 0.2) and lo <= x["contrast"] <= hi
        assert x["k"] == 4 and x["rollout_matches_run"] is True and -1 <= x["effect"] <= 1
        assert x["mini_batch"] == x["row"] // 8  # 2 prompts x G 4 per mini-batch
        assert x["effect"] == pytest.approx(x["keep"] - x["resample"])
        assert (x["A"] > 0 and x["p"] < 0.08) == (x["kind"] != "other") == x["candidate"]
        assert x["kind"] != "other" or x["reward"] > 0
        assert x["s2t_rule"] == (x["kind"] == "silenced")  # a STAPO run: its mask is the rule
    assert all(sum(x["kind"] == kind and x["step"] == step for x in lines) <= 2  # --tokens 2
               for kind in counterfactual_tables.KINDS for step in (1, 2))
    assert {x["mini_batch"] for x in lines} == {0, 1}
    out = capsys.readouterr().out
    assert "| kind | tokens (responses) | mean effect (95% CI) | mean contrast" in out \
        and "| silenced, " in out
    assert (run / "counterfactual.png").is_file() or importlib.util.find_spec("matplotlib") is None
    assert counterfactual.main([str(run), "--steps", "4"]) == 2  # no checkpoint of step 3 exists
    assert "step_3" in capsys.readouterr().err \
        and (run / "counterfactual.jsonl").read_text() == first
    # --table: runs pooled per algorithm (a run given twice counts once)
    assert counterfactual.main(["--table", str(run), str(run),
                                "--out", str(tmp_path / "new" / "pooled.png")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith(
        f"| stapo (1 seeds, steps 1-2) | silenced, graded | "
        f"{sum(x['kind'] == 'silenced' and x['part'] == 'graded' for x in lines)} ")
    assert (tmp_path / "new" / "pooled.png").is_file() \
        or importlib.util.find_spec("matplotlib") is None
    assert counterfactual.main(["--table", str(tmp_path)]) == 2
    assert "no counterfactual.jsonl in" in capsys.readouterr().err


def test_counterfactual_reward_that_reads_the_row(tmp_path, monkeypatch):
    """A --reward FILE.py:FUNCTION that needs a field of the data row: tools/counterfactual.py
    grades the regenerated step and every continuation with the row, as train.py did (it called the
    reward with the text and answer only)."""
    patch_toy_task(monkeypatch, EVEN)
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}{b}", "answer": str(a + b),
                                        "wanted": "02468"[a % 5]}) + "\n"
                            for a in range(10) for b in range(10 - a)))
    (tmp_path / "row_reward.py").write_text(
        "def first(response, answer, wanted):\n"
        "    return 1.0 if response.strip()[:1] <= wanted else -1.0\n")
    run = tmp_path / "run"
    args = toy_args(str(data), run, tau_p=0.08, export_hf=False, steps=1)
    with one_thread():
        assert train.main(args + ["--reward", f"{tmp_path / 'row_reward.py'}:first"]) == 0
        assert counterfactual.main([str(run), "--steps", "1", "--k", "2", "--tokens", "1"]) == 0
    lines = [json.loads(x) for x in (run / "counterfactual.jsonl").read_text().splitlines()]
    assert lines and all(x["rollout_matches_run"] is True for x in lines)
