"""tools/mechanism.py: the mechanism experiment's statistics against hand-worked values, the
held-out sets it builds, and one tiny run on the toy task that writes its lines and resumes."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.toy_task import EVEN, budget_args, one_thread, patch_toy_task, toy_run, varied_data
from tools import mechanism

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------- the statistics
def test_sd_upper_bound_and_sample_size():
    """The upper 95% bound of an sd of 10 values is sd sqrt(9 / 3.325113) = 1.6452 sd; a paired
    t-test at d = 0.5 needs ((1.959964 + 0.841621) 2)^2 + 1.959964^2 / 2 = 33.32 -> 34 pairs (the
    noncentral t's exact answer is 34 too), and 34 pairs detect d = 0.4975."""
    assert mechanism.sd_upper(2.0, 10) == pytest.approx(2 * math.sqrt(9 / 3.325113), rel=1e-5)
    assert mechanism.pairs_needed(1.0, 0.5) == 34
    assert mechanism.pairs_needed(2.0, 0.5) == math.ceil((2.801585 * 4) ** 2 + 1.920729)
    assert mechanism.detectable(1.0, 34) == pytest.approx(2.801585 / math.sqrt(34 - 1.920729),
                                                          rel=1e-5)


def line(state, ll, entropy, acc, cos, base=None):
    """A measured mini-batch with the arms' held-out values (justrl, stapo, randmask)."""
    base = base or {"ll": -1.0, "entropy": 0.5, "acc": 0.25}
    return {"kind": "minibatch", "state": state, "silenced": 1, "silenced_graded": 1,
            "seconds": 10.0, "base": base, "first_order": {"cos": cos},
            "arms": {arm: {"ll": ll[i], "entropy": entropy[i], "acc": acc[i], "predicted": 0.0}
                     for i, arm in enumerate(mechanism.ARMS)}}


def test_outcomes_and_report_against_hand_worked_values():
    """Primary STAPO - JustRL in held-out log-likelihood: differences +0.002, +0.004, +0.003,
    -0.001: mean 0.002, sd sqrt((0 + 4 + 1 + 9) / 3) e-3 = 2.1602e-3, t = 1.8516 on 3 df, two-sided
    p = 0.1611 (3 df in closed form: 1 - 2/pi (atan(t/sqrt 3) + (t/sqrt 3) / (1 + t^2/3)));
    Wilcoxon: ranks 2, 4, 3 positive and 1 negative, W+ = 9 of 10, exact p = 2 * 2 / 16 = 0.25."""
    lines = [line("a", (-1.0, -0.998, -0.999), (0.5, 0.49, 0.5), (0.25, 0.25, 0.25), -0.1),
             line("a", (-1.0, -0.996, -0.997), (0.5, 0.5, 0.5), (0.25, 0.26, 0.25), -0.2),
             line("b", (-1.0, -0.997, -1.0), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), 0.1),
             line("b", (-1.0, -1.001, -1.0), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), -0.3)]
    o = mechanism.outcomes(lines[0])
    assert o["primary"] == pytest.approx(0.002) and o["ll_vs_randmask"] == pytest.approx(0.001)
    assert o["entropy"] == pytest.approx(-0.01) and o["acc"] == 0 and o["cosine"] == -0.1
    t = mechanism.test([mechanism.outcomes(x)["primary"] for x in lines])
    assert t["mean"] == pytest.approx(0.002) and t["sd"] == pytest.approx(math.sqrt(14 / 3) * 1e-3)
    assert t["t"] == pytest.approx(0.002 / (math.sqrt(14 / 3) * 1e-3 / 2))
    x = t["t"] / math.sqrt(3)
    assert t["p"] == pytest.approx(1 - 2 / math.pi * (math.atan(x) + x / (1 + x * x)), abs=1e-9)
    assert (t["w_plus"], t["w_p"]) == (9.0, pytest.approx(0.25))
    text = mechanism.report(lines, sesoi=0.001)
    assert "| primary | 4 | +2.000e-03" in text
    assert "| > 0 | cannot tell |" in text.splitlines()[8]  # the primary's row
    assert text.splitlines()[10].startswith("| entropy |") and "| < 0 |" in text.splitlines()[10]
    assert "reading (the plan's rules): cannot tell" in text
    assert "JustRL's update 0.000e+00 nats/token; the primary's mean is (no share of 0)" in text
    # RandMask - JustRL: a +0.001, +0.003 (t = 2 on 1 df: p = 1 - 2/pi atan 2 = 0.295); b 0, 0
    assert "at random): a +2.00e-03 (-1.07e-02, +1.47e-02; t p 0.295" in text
    assert "; b +0.00e+00" in text and "; all +1.00e-03 (" in text
    lower = [{**x, "base": {**x["base"], "ll": -1.002}} for x in lines]  # JustRL's dLL +0.002
    assert "JustRL's update 2.000e-03 nats/token; the primary's mean is +1.00e+00 of it" in \
        mechanism.report(lower, sesoi=0.001)
    assert "| a | 2 |" in text and "| b | 2 |" in text and "| all | 4 |" in text
    n_point = mechanism.pairs_needed(t["sd"], 0.001)
    assert f"needs {n_point} mini-batches" in text


def test_reading_rules():
    """Significant and positive supports; significant and negative refutes; a 90% interval inside
    +-SESOI refutes at this scale; the rest cannot tell; Wilcoxon's disagreement is named."""
    def primary(mean, p, ci90, w_p=0.01):
        return {"mean": mean, "p": p, "ci90": ci90, "w_p": w_p}

    assert mechanism.reading(primary(1e-3, 0.01, (5e-4, 2e-3)), 1e-4).startswith("supports")
    assert "fragile" in mechanism.reading(primary(1e-3, 0.01, (5e-4, 2e-3), w_p=0.2), 1e-4)
    assert mechanism.reading(primary(-1e-3, 0.01, (-2e-3, -5e-4)), 1e-4).startswith("refutes the")
    assert mechanism.reading(primary(1e-5, 0.5, (-5e-5, 5e-5)), 1e-4).startswith("refutes at")
    assert mechanism.reading(primary(1e-5, 0.5, (-5e-4, 5e-4)), 1e-4) == "cannot tell"


def test_secondary_reading_rules():
    """Holm p < 0.05 in the plan's predicted direction supports (STAPO - RandMask and accuracy
    > 0, entropy and the cosine < 0), in the other refutes; Holm p >= 0.05 cannot tell."""
    assert mechanism.secondary_reading("ll_vs_randmask", 1e-4, 0.01) == "supports"
    assert mechanism.secondary_reading("acc", -0.01, 0.049) == "refutes"
    assert mechanism.secondary_reading("entropy", -1e-3, 0.01) == "supports"
    assert mechanism.secondary_reading("cosine", 0.2, 0.001) == "refutes"
    assert mechanism.secondary_reading("cosine", -0.2, 0.05) == "cannot tell"


def test_the_plan_quotes_the_pilot_it_was_sized_from():
    """docs/experiments.md's plan and pilot table are the report's numbers on the committed pilot
    lines (docs/experiments/mechanism/pilot/): the primary's sd, its upper bound, the sample sizes
    at the plan's SESOI, what 60 mini-batches detect, JustRL's own |dLL|, the per-state rows."""
    import numpy as np

    from run_folder import read_log

    pilot = ROOT / "docs/experiments/mechanism/pilot"
    lines = [x for state in ("initial", "justrl-step4")
             for x in read_log(pilot / state / mechanism.FILE) if x["kind"] == "minibatch"]
    doc = (ROOT / "docs/experiments.md").read_text()
    primary = [mechanism.outcomes(x)["primary"] for x in lines]
    sd, n = float(np.std(primary, ddof=1)), len(primary)
    upper = mechanism.sd_upper(sd, n)
    justrl = np.mean([abs(x["arms"]["justrl"]["ll"] - x["base"]["ll"]) for x in lines])
    assert mechanism.SESOI == 2e-4 and "**Smallest effect of interest** (SESOI): 2e-4" in doc
    assert f"pilot's mean |dLL| {justrl:.2e}" in doc
    assert f"over its {n} mini-batches is\n{sd:.2e} nats per token" in doc
    assert f"upper 95% bound of {upper:.2e} (chi-square, {n - 1} df)" in doc
    assert f"with {mechanism.pairs_needed(sd, mechanism.SESOI)} mini-batches at the point sd and " \
           f"{mechanism.pairs_needed(upper, mechanism.SESOI)} at the upper bound" in doc
    assert f"detect {mechanism.detectable(sd, 60):.2e} with 80% power, at the upper bound " \
           f"{mechanism.detectable(upper, 60):.2e}" in doc
    table = mechanism.report(lines).splitlines()
    for row in table[2:4]:  # | state | n | silenced | dLL | ... | mean (CI) | s |
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert f"| {' | '.join(cells[:4])} | {cells[-2].split(' ')[0]} |" in doc
    for state in ("initial", "justrl-step4"):
        mine = [p for p, x in zip(primary, lines) if x["state"] == state]
        assert f"{np.std(mine, ddof=1):.2e} over" in doc



def test_the_results_are_the_report_of_the_committed_main_runs():
    """docs/experiments.md's SmolLM2 results: every line of `tools.mechanism --report` on the
    committed main-run lines (docs/experiments/mechanism/main/), and each number its reading
    quotes: the counts, the relative sizes, the power, the clip, the silenced tokens, the lr."""
    import numpy as np

    from run_folder import read_log

    runs = ROOT / "docs/experiments/mechanism/main"
    text = (ROOT / "docs/experiments.md").read_text()
    doc = " ".join(text.split())  # lines joined
    logs = {state: read_log(runs / state / mechanism.FILE) for state in ("initial", "justrl-step4")}
    lines = [x for log in logs.values() for x in log if x["kind"] == "minibatch"]
    assert [len([x for x in lines if x["state"] == s]) for s in logs] == [30, 30]
    for row in mechanism.report(lines).splitlines():
        assert row in text.splitlines(), row
    last = [max(x["step"] for x in log if x["kind"] == "scan") for log in logs.values()]
    assert f"after steps 1001-{last[0]} (initial) and 1001-{last[1]}" in doc
    minutes = np.mean([x["seconds"] for x in lines]) / 60
    assert f"~{minutes:.1f} minutes a mini-batch" in doc

    def mean_of(key, state="all", arm="justrl"):  # mean (arm - base) over a state's lines
        return np.mean([x["arms"][arm][key] - x["base"][key] for x in lines
                        if state in ("all", x["state"])])

    out = {k: [mechanism.outcomes(x)[k] for x in lines] for k in mechanism.outcomes(lines[0])}
    t = mechanism.test(out["primary"])
    justrl = np.mean([abs(x["arms"]["justrl"]["ll"] - x["base"]["ll"]) for x in lines])
    (lo, hi), sesoi = t["ci"], mechanism.SESOI
    assert t["w_p"] < 1e-4 and f"by {-t['mean']:.1e} nats per token *less*" in doc
    assert f"(95% CI {-hi:.1e} to {-lo:.1e} less; t p = {t['p']:.4f}; " \
           f"{sum(d > 0 for d in out['primary'])} of 60 positive), {-t['mean'] / justrl:.1%} of " \
           f"the whole update's held-out effect (mean |dLL| {justrl:.1e}; {-hi / justrl:.1%} to " \
           f"{-lo / justrl:.1%} by the interval), {-hi / sesoi:.2f} to {-lo / sesoi:.2f} " \
           "times" in doc
    for state in logs:
        mine = [d for d, x in zip(out["primary"], lines) if x["state"] == state]
        own = np.mean([abs(x["arms"]["justrl"]["ll"] - x["base"]["ll"]) for x in lines
                       if x["state"] == state])
        ci = mechanism.test(mine)["ci"]
        assert ci[1] < 0 and f"{state} {np.mean(mine):.2e} ({-np.mean(mine) / own:.1%}" in doc
    step4 = mechanism.test([d for d, x in zip(out["primary"], lines)
                            if x["state"] == "justrl-step4"])["ci"]
    assert -sesoi / 2 < step4[0]
    assert f"interval, {step4[0]:.2e} to {step4[1]:.2e}, inside half" in doc
    assert f"could have detected {mechanism.detectable(t['sd'], 60):.1e} with 80% power; the " \
           f"observed sd ({t['sd']:.2e})" in doc
    # STAPO - RandMask: 0 where RandMask left out the same tokens
    vs = out["ll_vs_randmask"]
    same = [x["randmask_same"] for x in lines]
    assert all(d == 0 for d, s in zip(vs, same) if s)
    other = mechanism.test([d for d, s in zip(vs, same) if not s])
    assert f"costs {-np.mean(vs):.1e} nats per token more" in doc
    assert f"the same tokens in {sum(same)} of the 60 mini-batches (a difference of exactly 0); " \
           f"over the other {other['n']} the difference is {other['mean']:.1e} (t p = " \
           f"{other['p']:.3f}" in doc
    assert f"mean cosine {np.mean(out['cosine']):+.3f}, positive in " \
           f"{sum(c > 0 for c in out['cosine'])} of 60" in doc
    # entropy: STAPO's, and how much of it RandMask's update shares
    dh, entropy = mean_of("entropy"), np.mean(out["entropy"])
    assert f"by {-entropy:.1e} nats per token more than JustRL's, {entropy / dh:.0%} of the " \
           f"update's own {dh:.1e}" in doc
    chance = mechanism.test([x["arms"]["randmask"]["entropy"] - x["arms"]["justrl"]["entropy"]
                             for x in lines])
    choice = mechanism.test([x["arms"]["stapo"]["entropy"] - x["arms"]["randmask"]["entropy"]
                             for x in lines])
    assert f"lowers it by {-chance['mean']:.1e} more than JustRL's (95% CI " \
           f"{-chance['ci'][1]:.1e} to {-chance['ci'][0]:.1e}), " \
           f"{chance['mean'] / entropy:.0%} of STAPO's; STAPO - RandMask is " \
           f"{choice['mean']:.1e} (95% CI {choice['ci'][0]:.1e} to {choice['ci'][1]:.1e})" in doc
    acc = mechanism.test(out["acc"])
    assert f"{acc['mean']:.1e} (95% CI {acc['ci'][0]:.1e} to {acc['ci'][1]:+.1e}); the sample " \
           f"could have detected {mechanism.detectable(acc['sd'], 60):.1e}" in doc
    assert f"{sum(a == 0 for a in out['acc'])} of the 60 differences are 0" in doc
    # the clip: every update's norm above 1, so N / (N - 1) cancels; the arms' norm ratio
    norms = [x["arms"][a]["grad_norm"] for x in lines for a in mechanism.ARMS]
    assert min(norms) > 1 and f"Every one of the {len(norms)} updates was clipped" in doc
    assert f"norms {min(norms):.2f} to {max(norms):.2f} before the clip" in doc
    ratio = [x["arms"]["stapo"]["grad_norm"] / x["arms"]["justrl"]["grad_norm"] for x in lines]
    assert f"(STAPO's norm is {min(ratio):.2f} to {max(ratio):.2f} times JustRL's)" in doc
    r = {s: np.corrcoef([q for q, x in zip(ratio, lines) if x["state"] == s],
                        [d for d, x in zip(out["primary"], lines) if x["state"] == s])[0, 1]
         for s in logs}
    assert f"(correlation {r['justrl-step4']:.2f} there, {r['initial']:.2f} in the initial" in doc
    chance_ll = np.mean([x["arms"]["randmask"]["ll"] - x["arms"]["justrl"]["ll"] for x in lines])
    assert f"not-pre-registered line) is {chance_ll / t['mean']:.0%} of the primary" in doc
    # what the sample is: the candidates, the silenced tokens, the held-out likelihood
    candidates = [x["candidates"] for x in lines]
    assert f"2 to {max(candidates)} candidates (2 in {candidates.count(2)} of the 60)" in doc
    one_kept = sum(x["candidates"] - x["silenced"] == 1 for x in lines)
    assert f"all but the highest-entropy one in {one_kept} of the 60" in doc
    tokens = [tok for x in lines for tok in x["silenced_tokens"]]
    h, p = [tok["H"] for tok in tokens], [tok["p"] for tok in tokens]
    assert f"the {len(tokens)} silenced tokens' entropies run from {min(h):.3f} to {max(h):.1f} " \
           f"nats (median {np.median(h):.2f}, {sum(v < 0.5 for v in h)} below 0.5), their p from " \
           f"{min(p):.1e} to {max(p):.1e}" in doc
    assert f"~{np.mean([x['tokens'] for x in lines]):.0f} tokens) a mini-batch" in doc
    base = [np.mean([x["base"]["ll"] for x in lines if x["state"] == s]) for s in logs]
    assert f"(mean log-likelihood {base[0]:.2f} and {base[1]:.2f} nats per token" in doc
    # the second state's checkpoint: past the warm-up, so its updates ran at the planned lr
    steps = read_log(runs / "justrl-3.5e-6-4/metrics.jsonl")
    assert f"its {sum(x['updates'] for x in steps):.0f} JustRL updates are past the 8" in doc
    assert {x["arms"][a]["lr"] for x in lines for a in mechanism.ARMS} == {3.5e-6}

# ------------------------------------------------------------------------------- the held-out sets
def test_worked_solution_of_a_chained_sum():
    from tasks.chain_sums import problem

    row = {"problem": problem((7, 5, 9))["prompt"], "answer": "21"}
    assert mechanism.worked_solution(row, "worked") == \
        " 7 + 5 = 12, 12 + 9 = 21. The answer is 21.\n\n"
    assert mechanism.worked_solution(row, "answer") == "21"
    with pytest.raises(ValueError, match="not a chained sum"):
        mechanism.worked_solution({"problem": "What is 2 + 2?", "answer": "4"}, "worked")


def test_teacher_forced_shares_the_common_prompt_prefix():
    """Prompts [5 6 7 1] and [5 6 8]: the prompt is [5 6], the responses [7 1 | t t] and [8 | u];
    the target marks the solution's columns only; one prompt alone keeps its last token."""
    batch, target = mechanism.teacher_forced([[5, 6, 7, 1], [5, 6, 8]], [[20, 21], [30]], pad=0)
    assert batch.prompt_ids.tolist() == [[5, 6], [5, 6]]
    assert batch.response_ids.tolist() == [[7, 1, 20, 21], [8, 30, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert target.tolist() == [[False, False, True, True], [False, True, False, False]]
    batch, target = mechanism.teacher_forced([[4, 5], [6]], [[9], [9]], pad=0)  # nothing shared
    assert batch.prompt_ids.tolist() == [[4, 5], [0, 6]] and target.tolist() == [[True], [True]]


@pytest.fixture
def group():
    """A 1-process group, as train.py's code needs (its collectives)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_teacher_forced_log_probs_are_the_whole_sequences(group):
    """The log-probs train.token_stats gives at the target columns of a shared-prefix Rollout are
    those of a plain forward over each prompt + target."""
    from types import SimpleNamespace

    import train
    from model import Policy, tiny_model

    lm = tiny_model()
    prompts, targets = [[5, 6, 7, 9], [5, 6, 8], [5, 6, 10, 11, 12]], [[20, 21], [30], [40, 41, 42]]
    batch, target = mechanism.teacher_forced(prompts, targets, pad=0)
    cfg = SimpleNamespace(max_tokens_per_micro_batch=64, temperature=1.0, chunk_size=1024)
    stats = train.token_stats(Policy(lm), batch, cfg, torch.device("cpu"))
    for i, (p, t) in enumerate(zip(prompts, targets)):
        with torch.no_grad():
            logits = lm(input_ids=torch.tensor([p + t])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(1, torch.tensor(t)[:, None])
        torch.testing.assert_close(stats.logprobs[i][target[i]], expected[:, 0], atol=1e-5,
                                   rtol=0)


# --------------------------------------------------------------------------- a run on the toy task
def test_state_puts_back_the_policy_adamw_and_schedule(tmp_path, monkeypatch, group):
    """After two updates `State.restore` gives back the state's parameters, AdamW moments, lr and
    schedule: from a fresh AdamW (its moments gone again) and from one with moments and a lr in
    its warm-up; the first-order change is <theta - theta_state, direction>."""
    import train

    with one_thread():
        run = toy_run(tmp_path, monkeypatch, warmup_steps=4)

        def update():
            for p in run.policy.parameters():
                p.grad = torch.randn_like(p)
            train.optimizer_step(run)

        for fresh in (True, False):
            state = mechanism.State(run, tmp_path / "state.pt",
                                    [torch.ones(p.numel()) for p in run.policy.parameters()])
            params = {k: v.clone() for k, v in run.policy.state_dict().items()}
            moments = {i: {k: v.clone() for k, v in x.items()}
                       for i, x in run.optimizer.state_dict()["state"].items()}
            lr, epoch = run.optimizer.param_groups[0]["lr"], run.scheduler.last_epoch
            update()
            update()
            assert run.optimizer.param_groups[0]["lr"] != lr
            moved = sum(float((p.detach() - params[n]).sum())
                        for n, p in run.policy.named_parameters())
            assert state.moved(state.grad_ll) == pytest.approx(moved, rel=1e-4)
            state.restore()
            for k, v in run.policy.state_dict().items():
                assert torch.equal(v, params[k]), k
            after = run.optimizer.state_dict()["state"]
            assert after.keys() == moments.keys() and (after == {}) == fresh
            assert all(torch.equal(after[i][k], v) for i, x in moments.items()
                       for k, v in x.items())
            assert (run.optimizer.param_groups[0]["lr"], run.scheduler.last_epoch) == (lr, epoch)
            update()  # the next state: moments, a later lr


def toy_argv(tmp_path, out, mini_batches, *extra):
    flags = budget_args(varied_data(tmp_path), tmp_path / "unused", "stapo", {"heldout": 6}, 40)
    cut = flags.index("--out-dir")
    return ["--out-dir", str(out), "--mini-batches", str(mini_batches), "--solutions", "answer",
            "--acc-samples", "2", "--acc-prompts", "4", "--prompts-per-call", "3", "--first-step",
            "2", "--max-steps", "20", *extra, "--", *flags[:cut], *flags[cut + 2:]]


def untimed(x):
    """A line without its timings (`seconds`, `*_s`)."""
    if not isinstance(x, dict):
        return x
    return {k: untimed(v) for k, v in x.items() if k != "seconds" and not k.endswith("_s")}


def test_tiny_run_writes_its_lines_and_resumes(tmp_path, monkeypatch, capsys, group):
    """Two measured mini-batches of the toy task (tau_p 0.2: the random model's tokens are
    candidates): a setup line, then one line per mini-batch whose arms differ only in their token
    weights (JustRL silences nothing, STAPO and RandMask the same count, N the kept tokens); the
    lines of a stopped scan, continued with --resume auto, are those of an uninterrupted one; the
    scan starts at --first-step."""
    patch_toy_task(monkeypatch, EVEN)
    out = tmp_path / "scan"
    with one_thread():
        assert mechanism.main(toy_argv(tmp_path, out, 2)) == 0
        lines = [json.loads(x) for x in (out / mechanism.FILE).read_text().splitlines()]
        measured = [x for x in lines if x["kind"] == "minibatch"]
        assert lines[0]["kind"] == "setup" and lines[0]["state"] == "initial"
        assert len(measured) == 2 and lines[0]["heldout"] == [6, 4] and lines[1]["step"] == 2
        for x in measured:
            a = x["arms"]
            assert x["silenced_graded"] >= 1 and a["justrl"]["silenced"] == 0
            assert a["stapo"]["silenced"] == a["randmask"]["silenced"] == x["silenced"]
            assert a["justrl"]["N"] == x["tokens"] == a["stapo"]["N"] + x["silenced"]
            assert all(a[arm]["ll"] != x["base"]["ll"] for arm in mechanism.ARMS)
            assert len(x["silenced_tokens"]) == x["silenced"]
            assert math.isfinite(x["first_order"]["cos"])
        # a stop after the first mini-batch: the lines up to it, and a torn one
        first = lines.index(measured[0])
        (out / mechanism.FILE).write_text("".join(json.dumps(x) + "\n"
                                                  for x in lines[:first + 1]) + '{"kind": "mi')
        assert mechanism.main(toy_argv(tmp_path, out, 2)) == 2
        assert "continue it with --resume auto" in capsys.readouterr().err
        assert mechanism.main(toy_argv(tmp_path, out, 2, "--resume", "auto")) == 0
        again = [json.loads(x) for x in (out / mechanism.FILE).read_text().splitlines()]
    assert [untimed(x) for x in again] == [untimed(x) for x in lines]
    assert mechanism.main(["--report", str(out)]) == 0
    assert "| initial | 2 |" in capsys.readouterr().out
    assert torch.is_grad_enabled()


def test_one_line_errors(tmp_path, capsys):
    for argv, expected in [([], "give --out-dir DIR"),
                           (["--out-dir", str(tmp_path), "--resume", "yes"], "invalid choice"),
                           (["--out-dir", str(tmp_path), "--mini-batches", "0"], "must be >= 1"),
                           (["--out-dir", str(tmp_path), "--", "--stps", "1"], "did you mean"),
                           (["--report"], "needs folders the tool wrote"),
                           (["--report", str(tmp_path)], "no mechanism.jsonl")]:
        try:
            status = mechanism.main(argv)
        except SystemExit as stop:  # the flags' parser: one line, status 2
            status = stop.code
        assert status == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err and "Traceback" not in err, err
