"""grader/user_reward.py: your own reward function, through reward.reward, reward.rewards and
reward.load_reward: loaded once and checked, called with the row's fields or in batches, every
error one line naming it; train.py's and eval.py's runs with it.
"""
import json
import os
import shlex
import textwrap
from pathlib import Path

import pytest

import eval as ev
import model
import reward
import train
from model import tiny_model, tiny_tokenizer
from tests.toy_task import (
    ROOT,
    TOY_VOCAB,
    one_line_error,
    one_thread,
    read_metrics,
    toy_args,
    toy_data,
)


# ==================================================================================================
# grader/user_reward.py: your own reward function
# ==================================================================================================
def test_reward_your_own_function_is_loaded_checked_and_named_in_its_errors(tmp_path, monkeypatch):
    """--reward FILE.py:FUNCTION or MODULE:FUNCTION: the function is loaded once and called as
    (response, answer); every way it can be wrong is one line naming it, and what it returns must be
    a finite number (positive = correct). The example in examples/ grades a non-math task."""
    example = "examples/reward_last_line.py:last_line"
    monkeypatch.chdir(ROOT)
    assert reward.reward("Let me think.\n\"Paris\".", "paris", example) == 1.0
    assert reward.reward("Paris?\nLyon", ["Paris", "Lyon"], example) == 1.0
    assert reward.reward("Paris, I think", "Paris", example) == -1.0 \
        and reward.correct("", "Paris", example) is False
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
    assert reward.reward("4", "4", spec("half")) == 0.5 \
        and reward.reward("5", "4", spec("half")) == -0.5
    assert reward.correct("4", "4", spec("flag")) is True \
        and reward.reward("5", "4", spec("flag")) == 0.0
    assert reward.load_reward(spec("half")) is reward.load_reward(spec("half"))  # imported once
    assert reward.load_reward("os.path:join") is os.path.join  # an importable module
    line = next(n for n, x in enumerate((tmp_path / "mine.py").read_text().splitlines(), 1)
                if "1 / 0" in x)
    for name, expected in (("boom", f"raised ZeroDivisionError at {tmp_path / 'mine.py'}:{line}: "
                                    f"division by zero"),
                           ("nan", "returned nan, not a finite number"),
                           ("text", "returned '1.0', not a finite number")):
        with pytest.raises(reward.RewardError) as e:
            reward.reward("4", "4", spec(name))
        assert str(e.value) == f"reward function {spec(name)} {expected}"
    for bad, expected in ((spec("one"), "one must take two arguments, (response, answer)"),
                          (spec("not_a_function"), "has no function not_a_function"),
                          (spec("missing"), "has no function missing"),
                          (f"{tmp_path / 'nope.py'}:f", f"no such file {tmp_path / 'nope.py'}"),
                          (f"{tmp_path / 'broken.py'}:f",
                           "raised ModuleNotFoundError: No module named 'no_such_module_here'"),
                          ("no_such_module_here:f",
                           "importing no_such_module_here raised ModuleNotFoundError"),
                          ("dapoo", "unknown reward 'dapoo'; valid: dapo, binary, strict, or your "
                                    "own as FILE.py:FUNCTION or MODULE:FUNCTION")):
        with pytest.raises(ValueError) as e:
            reward.load_reward(bad)
        assert expected in str(e.value) and "\n" not in str(e.value), (bad, str(e.value))
    assert "torch" not in reward.__dict__ \
        and "import torch" not in Path(reward.__file__).read_text()


def test_reward_functions_read_the_row_by_keyword_or_in_batches(tmp_path, monkeypatch):
    """Your function may take the prompt and the row's other fields by keyword (as TRL passes
    dataset columns), all of them as **row, or a batch (declared `batched = True`: lists in, a list
    out, one call); the two-argument form keeps working; a field it needs that the row lacks, a
    batch of the wrong length and an exception (file:line) are one line naming it. (A reward saw
    only (response, answer): the problem's units or tolerance could not reach it.)"""
    (tmp_path / "row.py").write_text(textwrap.dedent("""
        calls = []
        def units(response, answer, unit, prompt=None):
            return 1.0 if response == f"{answer} {unit}" and prompt.startswith("How") else -1.0
        def every(response, answer, **row):
            return float(len(row))
        def pair(response, answer):
            return 1.0 if response == answer else -1.0
        def batch(responses, answers, prompt, unit=None):
            calls.append(len(responses))
            return [1.0 if r == a and u == "m" else -1.0 """
            """for r, a, u in zip(responses, answers, unit)]
        batch.batched = True
        def short(responses, answers):
            return [1.0]
        short.batched = True
        def long(responses, answers):
            return [1.0] * 30
        long.batched = True
        def text(responses, answers):
            return ", ".join(["1.0"] * 30)
        text.batched = True
        def fails(responses, answers):
            return [1 / 0 for _ in responses]
        fails.batched = True
        """))
    spec = lambda name: f"{tmp_path / 'row.py'}:{name}"  # noqa: E731
    rows = [{"problem": "How far?", "answer": "3",
             "fields": {"q": "How far?", "answer": "3", "unit": "m"}},
            {"problem": "How long?", "answer": "4",
             "fields": {"q": "How long?", "answer": "4", "unit": "s"}}]
    assert reward.reward("3 m", "3", spec("units"), rows[0]) == 1.0 \
        and reward.reward("3 s", "3", spec("units"), rows[0]) == -1.0
    assert reward.correct("4 s", "4", spec("units"), rows[1]) is True
    # q, unit, prompt (answer is its own argument)
    assert reward.reward("x", "3", spec("every"), rows[0]) == 3.0
    # the old form, rows given
    assert reward.rewards(["3", "5"], ["3", "4"], spec("pair"), rows) == [1.0, -1.0]
    # a row without the field: None there
    assert reward.rewards(["3", "4", "4"], ["3", "4", "4"], spec("batch"),
                          rows + [{"problem": "?"}]) == [1.0, -1.0, -1.0]
    assert reward.load_reward(spec("batch")).__globals__["calls"] == [3]  # one call for the batch
    assert reward.reward("3", "3", spec("batch"), rows[0]) == 1.0  # one response: a batch of one
    with pytest.raises(reward.RewardError) as e:
        reward.reward("3 m", "3", spec("units"), {"problem": "How?", "fields": {"q": "How?"}})
    assert str(e.value) == (f"reward function {spec('units')} takes 'unit', a field this row lacks "
                            f"(its fields: q, prompt); give it a default")
    with pytest.raises(reward.RewardError) as e:
        reward.rewards(["3", "4"], ["3", "4"], spec("short"), rows)
    assert str(e.value) == (f"reward function {spec('short')} returned 1 value for 2 responses "
                            f"(it is batched: one number per response)")
    with pytest.raises(reward.RewardError) as e:  # it said "returned [1.0, ... 1.0,, not a list"
        reward.rewards(["3"] * 30, ["3"] * 30, spec("short"), rows * 15)
    assert str(e.value).endswith("returned 1 value for 30 responses (it is batched: one number "
                                 "per response)")
    with pytest.raises(reward.RewardError) as e:
        reward.rewards(["3", "4"], ["3", "4"], spec("long"), rows)
    assert str(e.value).endswith("returned 30 values for 2 responses (it is batched: one number "
                                 "per response)")
    with pytest.raises(reward.RewardError) as e:
        reward.rewards(["3", "4"], ["3", "4"], spec("text"), rows)
    shown = repr(", ".join(["1.0"] * 30))[:57] + "..."  # cut, and said so
    assert str(e.value).endswith(f"returned {shown}, not a list of 2 numbers (it is batched: one "
                                 f"per response)")
    line = next(n for n, x in enumerate((tmp_path / "row.py").read_text().splitlines(), 1)
                if "1 / 0" in x)
    with pytest.raises(reward.RewardError,
                       match=f"raised ZeroDivisionError at {tmp_path / 'row.py'}:{line}: "):
        reward.rewards(["3"], ["3"], spec("fails"), rows[:1])
    monkeypatch.chdir(ROOT)  # the examples, as the docs run them
    example = "examples/reward_with_row.py:"
    assert reward.rewards(["\\boxed{9.8}", "\\boxed{9.7}", "no"], ["9.81"] * 3,
                          example + "within_tolerance",
                          [{"problem": "g?", "fields": {"tolerance": 0.05}}] * 3) == \
        [1.0, -1.0, -1.0]
    assert reward.reward("\\boxed{9.81}", "9.81", example + "within_tolerance",
                         {"problem": "g?"}) == 1.0
    assert reward.rewards(["so \\boxed{4}", "\\boxed{4}", "1+3: \\boxed{4}", "\\boxed{5}"],
                          ["4"] * 4, example + "concise",
                          [{"problem": "1+3"}] * 4) == [1.0, 1.5, 0.5, -1.0]


_ROW_DATA = [{"q": f"{a}{b}", "sum": str(a + b), "parity": "even" if (a + b) % 2 == 0 else "odd"}
             for a in range(10) for b in range(10 - a)]


_ROW_REWARD = ("""
def by_parity(response, answer, parity, prompt=None):  # the row's parity field decides, """
               """its prompt must be there
    assert prompt is not None and len(prompt) == 2
    said = response.strip()[:1]
    return 1.0 if said.isdigit() and ("even" if int(said) % 2 == 0 else "odd") == parity else -1.0
""")


def test_train_and_eval_pass_the_row_to_your_reward_function(tmp_path, monkeypatch):
    """train.py's step and held-out evaluation and eval.py --run call your function with the row's
    fields: a reward that reads a `parity` field trains (samples.jsonl shows its rewards for both
    splits), and eval.py gives the run's held-out numbers with it."""
    monkeypatch.setattr("startup.run.lm_vocab_size", lambda tokenizer: TOY_VOCAB)
    monkeypatch.setattr("startup.run.load_model",
                        lambda name, **kw: (tiny_model(vocab_size=TOY_VOCAB), tiny_tokenizer()))
    (tmp_path / "parity.py").write_text(_ROW_REWARD)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _ROW_DATA))
    spec = f"{tmp_path / 'parity.py'}:by_parity"
    args = toy_args(str(data), tmp_path / "run", heldout=4, steps=2, reward=spec,
                    prompt_key="q", answer_key="sum")
    with one_thread():
        assert train.main(args) == 0
    parity = {r["q"]: r["parity"] for r in _ROW_DATA}
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {s["split"] for s in samples} == {"train", "heldout"}
    for s in samples:
        said = s["response"].strip()[:1]
        right = said.isdigit() and ("even" if int(said) % 2 == 0 else "odd") == parity[s["prompt"]]
        assert s["reward"] == (1.0 if right else -1.0), s
    last = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    monkeypatch.setattr(model, "lm_vocab_size", lambda tokenizer: TOY_VOCAB)
    results = ev.main(["--run", str(tmp_path / "run")])
    bench = results["models"][str(tmp_path / "run" / "hf")]["benchmarks"]["heldout"]
    assert bench["metrics"]["avg@k"] == pytest.approx(100 * last["eval/acc"])
    assert {p["fields"]["parity"] for p in bench["problems"]} <= {"even", "odd"}
    before = dict(bench["metrics"])
    for p in bench["problems"]:
        for sample in p["samples"]:
            sample["correct"] = None
    # re-graded with the stored rows
    assert ev.regrade(results)["models"][str(tmp_path / "run" / "hf")]["benchmarks"]["heldout"][
        "metrics"] == before


_HALF_REWARD = """
def even(response, answer):  # the toy task's EVEN check with rewards +-0.5
    return 0.5 if response.strip()[:1] in ("0", "2", "4", "6", "8") and response.strip() else -0.5

def boom(response, answer):
    raise KeyError("no verifier for this row")
"""


def test_train_and_eval_use_your_own_reward_function(tmp_path, monkeypatch, capsys):
    """train.py --reward FILE.py:FUNCTION trains on that function's rewards (samples.jsonl shows
    them) and counts a positive reward as correct in reward/acc and the held-out accuracy; eval.py
    --run takes the run's reward and gives the same held-out numbers; a bad spec is one line before
    the model loads, and an error inside the function while training or evaluating is one line
    naming the function and the exception, exit status 2."""
    monkeypatch.setattr("startup.run.lm_vocab_size", lambda tokenizer: TOY_VOCAB)
    monkeypatch.setattr("startup.run.load_model",
                        lambda name, **kw: (tiny_model(vocab_size=TOY_VOCAB), tiny_tokenizer()))
    (tmp_path / "rewards.py").write_text(_HALF_REWARD)
    even, boom = f"{tmp_path / 'rewards.py'}:even", f"{tmp_path / 'rewards.py'}:boom"
    data = toy_data(tmp_path)
    with one_thread():
        assert train.main(toy_args(data, tmp_path / "run", heldout=4, steps=2, reward=even)) == 0
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {s["reward"] for s in samples if s["split"] == "train"} <= {0.5, -0.5}
    # the same reward
    assert {s["reward"] for s in samples if s["split"] == "heldout"} <= {0.5, -0.5}
    for m in read_metrics(tmp_path / "run"):
        assert m["reward/mean"] == pytest.approx(0.5 * m["reward/acc"]
                                                 - 0.5 * (1 - m["reward/acc"]))
    last = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    assert len(last["eval/correct"]) == 4 \
        and sum(last["eval/correct"]) == last["eval/acc"] * last["eval/n"]
    monkeypatch.setattr(model, "lm_vocab_size", lambda tokenizer: TOY_VOCAB)
    results = ev.main(["--run", str(tmp_path / "run")])
    assert results["config"]["reward"] == even
    bench = results["models"][str(tmp_path / "run" / "hf")]["benchmarks"]["heldout"]
    assert bench["metrics"]["avg@k"] == pytest.approx(100 * last["eval/acc"])
    capsys.readouterr()
    monkeypatch.setattr("startup.run.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert train.main(toy_args(data, tmp_path / "bad",
                               reward=f"{tmp_path / 'rewards.py'}:odd")) == 2
    one_line_error(capsys, f"train.py: error: reward {tmp_path / 'rewards.py'}:odd: "
                            f"{tmp_path / 'rewards.py'} has no function odd")
    monkeypatch.setattr("startup.run.load_model",
                        lambda name, **kw: (tiny_model(vocab_size=TOY_VOCAB), tiny_tokenizer()))
    args = toy_args(data, tmp_path / "boom", reward=boom)
    with one_thread():
        assert train.main(args) == 2
    at = f"{tmp_path / 'rewards.py'}:6"  # the line that raised (its file:line: it had none)
    one_line_error(capsys, f"train.py: error: reward function {boom} raised KeyError at {at}: "
                            f"'no verifier for this row'; fix it, then continue with: python "
                            f"{shlex.join(['train.py', *args])} --resume auto")
    # the fix: the user's own command (here with another function) and --resume auto, not --config
    # RUN/config.json, which names the broken function again
    fixed = [even if a == boom else a for a in args]
    assert train.main(fixed) == 2
    one_line_error(capsys, f"holds a run that stopped before its first checkpoint (config.json): "
                            f"start it again with python {shlex.join(['train.py', *fixed])} "
                            f"--resume auto, choose another --out-dir")
    with one_thread():
        assert train.main(fixed + ["--resume", "auto"]) == 0
    assert json.loads((tmp_path / "boom" / "config.json").read_text())["reward"] == even
    with pytest.raises(SystemExit) as e:
        ev.main(["--run", str(tmp_path / "run"), "--reward", boom, "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and [x for x in err.splitlines() if "error" in x] == [
        f"eval.py: error: reward function {boom} raised KeyError at {at}: "
        f"'no verifier for this row'"]
    assert "Traceback" not in err


_ODD_REWARD = """
import sys


def exits(response, answer):
    sys.exit(3)


def counts(response, answer, meta):
    meta["n"] += 1  # a nested field of its row
    return 1.0
"""


def test_your_reward_function_that_exits_is_one_line_and_sees_copies_of_its_row(
        tmp_path, monkeypatch, capsys):
    """A function that calls sys.exit(3) is one line naming it and where (train.py: exit 2, the
    command that continues), not a silent exit 3; a function that changes a nested field of its row
    (meta["n"] += 1) changes a copy: the data eval.py saves in results.json, and the next call's
    row, are as read. (Only Exception was caught: exit 3, no line; results.json held n = k.)"""
    (tmp_path / "odd.py").write_text(_ODD_REWARD)
    exits, counts = f"{tmp_path / 'odd.py'}:exits", f"{tmp_path / 'odd.py'}:counts"
    rows = [{"problem": "1+1", "fields": {"meta": {"n": 0}}}] * 2
    with pytest.raises(reward.RewardError) as e:
        reward.rewards(["2"], ["2"], exits, rows[:1])
    assert str(e.value) == f"reward function {exits} called sys.exit(3) at {tmp_path / 'odd.py'}:6"
    assert reward.rewards(["2", "3"], ["2", "2"], counts, rows) == [1.0, 1.0]
    assert rows[0]["fields"] == {"meta": {"n": 0}}
    monkeypatch.setattr("startup.run.lm_vocab_size", lambda tokenizer: TOY_VOCAB)
    monkeypatch.setattr("startup.run.load_model",
                        lambda name, **kw: (tiny_model(vocab_size=TOY_VOCAB), tiny_tokenizer()))
    args = toy_args(toy_data(tmp_path), tmp_path / "run", reward=exits)
    with one_thread():
        assert train.main(args) == 2
    one_line_error(capsys, f"train.py: error: reward function {exits} called sys.exit(3) at "
                           f"{tmp_path / 'odd.py'}:6; fix it, then continue with: ")
    data = tmp_path / "meta.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a}+1", "sum": str(a + 1), "meta": {"n": 0}}) + "\n"
                            for a in range(2)))
    results = ev.main(["--models", "tiny", "--data", str(data), "--prompt-key", "q",
                       "--answer-key", "sum", "--k", "2", "--max-new-tokens", "2", "--reward",
                       counts, "--out", str(tmp_path / "eval")])
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    for got in (results, saved):
        problems = got["models"]["tiny"]["benchmarks"]["meta"]["problems"]
        assert [p["fields"]["meta"] for p in problems] == [{"n": 0}, {"n": 0}]
