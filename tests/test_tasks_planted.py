"""tasks/planted.py: the planted-filler task (its reward, fine-tuning rows, soft targets, the model
folder it writes) and the numbers docs/experiments.md quotes from its pilot."""
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import model
from tasks import planted
from tests.toy_task import one_thread
from tools import mechanism

ROOT = Path(__file__).resolve().parent.parent


def test_running_sums_and_a_reward_that_ignores_fillers():
    assert planted.running_sums("31415926") == "34894351"
    assert planted.problem("90") == {"prompt": "90:", "answer": "99"}
    assert planted.reward("34~894351", "34894351") == 1.0
    assert planted.reward("~34894351~ ", "34894351") == 1.0
    assert planted.reward("34894352", "34894351") == -1.0
    assert planted.reward("3489435", "34894351") == -1.0


def test_fine_tuning_rows_target_the_filler_free_next_token():
    """Each row's targets, read where they are set, are the answer and EOS in order; an inserted "~"
    is an input, never a target; about half the rows hold one."""
    tok = model.tiny_tokenizer()
    eos, filler = tok.eos_token_id, tok.convert_tokens_to_ids(planted.FILLER)
    used = set()
    inputs, targets = planted.sft_rows(random.Random(1), 200, tok, eos, used)
    with_filler = 0
    for ids, target in zip(inputs, targets):
        assert len(ids) == len(target)
        prompt = tok.decode(ids[:planted.DIGITS + 1])
        answer = tok(planted.running_sums(prompt[:-1]), add_special_tokens=False).input_ids
        assert filler not in target and ids.count(filler) <= 1
        at = ids.index(filler) if filler in ids else None
        with_filler += at is not None
        if at is not None:  # the positions before "~" and of "~" target the next answer token
            after = ids[at + 1] if at + 1 < len(ids) else eos
            assert target[at - 1] == target[at] == after
        assert [t for i, t in enumerate(target) if t >= 0 and i != at] == answer + [eos]
        assert prompt[:-1] in used
    assert 70 < with_filler < 130


def test_soft_loss_is_least_at_the_soft_target():
    """The soft cross-entropy's gradient vanishes at logits log((1 - eps) e_right + eps e_filler)
    (up to a shared constant) and it equals the target's entropy there."""
    eps, V, filler = 0.01, 6, 5
    target = torch.tensor([[2, 0, -100]])  # (1, 3): the last position is outside the response
    probs = torch.full((1, 3, V), 1e-12)
    for t, right in enumerate([2, 0, 1]):
        probs[0, t, right], probs[0, t, filler] = 1 - eps, eps
    logits = probs.log().requires_grad_()
    loss = planted.soft_loss(logits, target, filler, eps)
    loss.backward()
    entropy = -((1 - eps) * np.log(1 - eps) + eps * np.log(eps))
    assert loss.item() == pytest.approx(entropy, rel=1e-5)
    assert logits.grad.abs().max() < 1e-6


def test_build_writes_a_model_folder_and_data_train_py_reads(tmp_path):
    """A two-step build: OUT/model loads through model.load_model (a local HF folder), and
    OUT/planted.jsonl holds distinct problems with their running sums."""
    planted.build(tmp_path, filler_rate=0.01, sft_steps=2, problems=50, batch=4, calibrate_steps=2)
    lm, tok = model.load_model(str(tmp_path / "model"))
    assert tok.convert_tokens_to_ids(planted.FILLER) != tok.unk_token_id
    rows = [json.loads(x) for x in (tmp_path / "planted.jsonl").read_text().splitlines()]
    assert len(rows) == len({r["prompt"] for r in rows}) == 50
    assert all(r["answer"] == planted.running_sums(r["prompt"][:-1]) for r in rows)
    with pytest.raises(SystemExit):
        planted.main([str(tmp_path / "x"), "--filler-rate", "1.5"])


def test_the_data_holds_no_problem_the_fine_tuning_saw(tmp_path, monkeypatch):
    """With two-digit problems (100 in all), a build that fine-tunes on 16 draws writes 50 data
    rows none of which it fine-tuned on."""
    monkeypatch.setattr(planted, "DIGITS", 2)
    tuned, sft_rows = set(), planted.sft_rows

    def recorded(*args):
        out = sft_rows(*args)
        tuned.update(args[-1])
        return out

    monkeypatch.setattr(planted, "sft_rows", recorded)
    planted.build(tmp_path, filler_rate=0.01, sft_steps=2, problems=50, batch=4, calibrate_steps=2)
    rows = [json.loads(x) for x in (tmp_path / "planted.jsonl").read_text().splitlines()]
    assert len(rows) == 50 and tuned and not tuned & {r["prompt"][:-1] for r in rows}


def test_the_filler_rate_sets_the_fillers_probability(tmp_path):
    """--filler-rate eps is what the built model gives "~" at the answer's positions: after 100
    fine-tuning and 100 calibration steps (~5 s) the median p("~") over fresh rows is within 10% of
    eps, and the 10%-90% range within 25%."""
    eps = 0.02
    with one_thread():
        planted.build(tmp_path, filler_rate=eps, sft_steps=100, problems=10, batch=32,
                      calibrate_steps=100)
    lm, tok = model.load_model(str(tmp_path / "model"))
    ids, target, mask = planted.sft_batch(random.Random(5), 64, tok, tok.eos_token_id, set())
    with torch.no_grad():
        probs = lm(input_ids=ids, attention_mask=mask).logits.softmax(-1)  # (B, T, V)
    p = probs[..., tok.convert_tokens_to_ids(planted.FILLER)][target >= 0]  # (n,) answer positions
    assert abs(p.median().item() / eps - 1) < 0.1
    assert 0.75 * eps < p.quantile(0.1).item() and p.quantile(0.9).item() < 1.25 * eps


def test_the_plan_quotes_the_planted_pilot():
    """docs/experiments.md's planted-filler plan and pilot table are the report's numbers on the
    committed pilot lines: the primary's sd and upper bound, the sample sizes for the pilot's mean,
    what 80 mini-batches detect, the silenced tokens and the per-state rows."""
    from run_folder import read_log

    pilot = ROOT / "docs/experiments/mechanism/planted-pilot"
    doc = " ".join((ROOT / "docs/experiments.md").read_text().split())  # lines joined
    lines = [x for state in ("initial", "justrl-step4")
             for x in read_log(pilot / state / mechanism.FILE) if x["kind"] == "minibatch"]
    primary = [mechanism.outcomes(x)["primary"] for x in lines]
    sd, n, mean = float(np.std(primary, ddof=1)), len(primary), float(np.mean(primary))
    upper = mechanism.sd_upper(sd, n)
    assert f"over its {n} mini-batches is {sd:.2e} nats per token (upper 95% bound {upper:.2e}" \
           f", chi-square, {n - 1} df)" in doc
    needed = [mechanism.pairs_needed(s, mean) for s in (sd, upper)]
    assert f"the pilot's mean {mean:+.2e} needs {needed[0]} mini-batches for 80% power at the " \
           f"point sd and {needed[1]} at the upper bound" in doc
    assert f"detect {mechanism.detectable(sd, 80):.2e} with 80% power at the point sd, " \
           f"{mechanism.detectable(upper, 80):.2e} at the upper bound" in doc
    assert mechanism.pairs_needed(upper, mechanism.SESOI) == 2 and "2 mini-batches" in doc
    tokens = [t for x in lines for t in x["silenced_tokens"]]
    fillers = [t for t in tokens if t["token"] == planted.FILLER]
    assert f"{len(fillers)} of the {len(tokens)} silenced tokens are a \"~\" (p " \
           f"{min(t['p'] for t in fillers):.1e} to {max(t['p'] for t in fillers):.1e}, H " \
           f"{min(t['H'] for t in fillers):.3f} to {max(t['H'] for t in fillers):.3f})" in doc
    assert all(x["candidates"] == 2 for x in lines)
    bases = [read_log(pilot / s / mechanism.FILE)[0]["base"]["acc"]
             for s in ("initial", "justrl-step4")]
    assert f"{bases[0]:.3f} and {bases[1]:.3f}" in doc
    table = mechanism.report(lines).splitlines()
    for row in table[2:4]:  # | state | n | silenced | dLL | ... | mean (CI) | s |
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert f"| {' | '.join(cells[:4])} | {cells[-2].split(' ')[0]} |" in doc


def test_the_results_are_the_report_of_the_committed_runs():
    """docs/experiments.md's planted results: every line of `tools.mechanism --report` on the
    committed main-run lines (docs/experiments/mechanism/planted/), and the numbers its reading
    quotes: the silenced tokens, positive differences, RandMask's overlap, the relative sizes."""
    from run_folder import read_log

    runs = ROOT / "docs/experiments/mechanism/planted"
    text = (ROOT / "docs/experiments.md").read_text()
    doc = " ".join(text.split())  # lines joined
    lines = [x for state in ("initial", "justrl-step4")
             for x in read_log(runs / state / mechanism.FILE) if x["kind"] == "minibatch"]
    for row in mechanism.report(lines).splitlines():
        assert row in text.splitlines(), row
    tokens = [t for x in lines for t in x["silenced_tokens"]]
    fillers = sum(t["token"] == planted.FILLER for t in tokens)
    assert f"{fillers} of the {len(tokens)} silenced tokens are a \"~\"" in doc
    primary = [mechanism.outcomes(x)["primary"] for x in lines]
    t = mechanism.test(primary)
    assert f"Wilcoxon p = {t['w_p']:.3f}, {sum(d > 0 for d in primary)} of {len(lines)} " \
           "positive" in doc
    assert f"{sum(x['randmask_same'] for x in lines)} of the {len(lines)} mini-batches the same" \
           in doc
    base = {k: np.mean([x["arms"]["justrl"][k] - x["base"][k] for x in lines])
            for k in ("ll", "entropy")}
    entropy = np.mean([mechanism.outcomes(x)["entropy"] for x in lines])
    assert f"inside the SESOI of 2e-4: {t['mean'] / abs(base['ll']):.2%} of the whole update" in doc
    assert f"about {entropy / base['entropy']:.1%} of the update's own {base['entropy']:.1e}" in doc
    assert f"the observed sd ({t['sd']:.2e})" in doc
    detected = mechanism.detectable(t["sd"], len(lines))
    assert f"could have detected {detected:.1e} with 80% power" in doc
    # the deviation: justrl-step4's updates ran at the warm-up's lr
    step4 = [x for x in lines if x["state"] == "justrl-step4"]
    lrs = {x["arms"][a]["lr"] for x in step4 for a in mechanism.ARMS}
    assert lrs == {6.25e-05} and "updates ran at 6.25e-05" in doc
    # every update clipped (N / (N - 1) cancels); RandMask - JustRL in justrl-step4 is the same "~"
    norms = [x["arms"][a]["grad_norm"] for x in lines for a in mechanism.ARMS]
    assert min(norms) > 1 and f"every one of the {len(norms)} updates was clipped" in doc
    assert f"norms {min(norms):.2f} to {max(norms):.2f} before the clip" in doc
    chance = [x["arms"]["randmask"]["ll"] - x["arms"]["justrl"]["ll"] for x in step4]
    t4 = mechanism.test(chance)
    mine = np.mean([mechanism.outcomes(x)["primary"] for x in step4])
    same = [x["randmask_same"] for x in step4]
    assert f"justrl-step4 ({t4['mean']:+.1e}, Wilcoxon p = {t4['w_p']:.3f}" in doc
    assert f"{t4['mean'] / mine:.0%} of that state's primary ({mine:+.1e}), because there it " \
           f"left out the same \"~\" in {sum(same)} of the 40 mini-batches " \
           f"({np.mean([d for d, s in zip(chance, same) if s]):+.1e} on those, " \
           f"{np.mean([d for d, s in zip(chance, same) if not s]):+.1e} on the others)" in doc
    cosine = np.mean([mechanism.outcomes(x)["cosine"] for x in lines])
    assert f"the cosine, the direct test of a harmful direction, is {cosine:.3f}" in doc
