"""reward.py: answer extraction and grading (the grader's parts: tests/test_grader_*.py), your own
reward function, the graded characters and tokens.
"""
import ast
import json
import os
import shlex
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import eval as ev
import model
import reward
import train
from model import tiny_model, tiny_tokenizer
from rollout import Rollout
from step_metrics import step_log
from tests.toy_task import (
    ROOT,
    TESTDATA,
    TOY_VOCAB,
    one_line_error,
    one_thread,
    read_metrics,
    reward_jsonl,
    toy_args,
    toy_data,
)


# ==================================================================================================
# reward.py: answer extraction and grading
# ==================================================================================================
def _reward_last_box(text):
    """A deliberately separate brace matcher for the test's own gold mapping."""
    i = text.rfind("\\boxed")
    j, depth = text.index("{", i), 0
    for k in range(j, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[j + 1 : k]


def test_reward_grader_cases_agreement():
    """testdata/grader_cases.jsonl: the project's own cases, labelled by mathematical truth; every
    one must agree."""
    per, wrong = defaultdict(lambda: [0, 0, 0]), []  # category -> [agree, total, false positives]
    for row in reward_jsonl(TESTDATA / "grader_cases.jsonl"):
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
    """(benchmark, prediction, gold) for every row of every benchmark file, with a minimal local
    field mapping."""
    bench = TESTDATA / "benchmarks"
    for name in ("aime24", "aime25"):
        for row in reward_jsonl(bench / f"{name}.jsonl"):
            yield name, row["answer"], row["answer"]
            yield name, str(int(row["answer"])), row["answer"]  # 033 -> 33
    for row in reward_jsonl(bench / "amc23.jsonl"):
        gold = str(row["answer"])
        yield "amc23", gold, gold
        if float(gold).is_integer():
            yield "amc23", str(int(float(gold))), gold  # 27.0 -> 27
    for row in reward_jsonl(bench / "math500.jsonl"):
        yield "math500", row["answer"], row["answer"]
    for row in reward_jsonl(bench / "minerva_math.jsonl"):
        yield "minerva_math", _reward_last_box(row["solution"]), _reward_last_box(row["solution"])
    for row in reward_jsonl(bench / "olympiadbench.jsonl"):
        yield "olympiadbench", ", ".join(row["final_answer"]), row["final_answer"]
    for row in reward_jsonl(bench / "gsm8k.jsonl"):
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


def test_reward_source_never_evaluates_text():
    """No call in reward.py evaluates text (eval, sympy.S/sympify/parse_expr run Python); no torch,
    no signals."""
    for node in ast.walk(ast.parse(Path(reward.__file__).read_text())):
        assert getattr(node, "id", None) not in {"eval", "exec", "compile", "__import__", "sympify",
                                                 "parse_expr"}
        assert getattr(node, "attr", None) not in {"sympify", "S", "parse_expr", "parse_latex"}
        imported = {a.name.split(".")[0] for a in getattr(node, "names", [])} \
            | {getattr(node, "module", None)}
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
    # another method, not a hedge
    ("So \\boxed{3}. Alternatively, we can solve it with Vieta: 1 + 2 = 3.", "3"),
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
    # an invented next turn
    ("so the answer is 2/3 <|im_start|>user\nWhat is 1+1? The answer is 2.", "2/3"),
    ("\\boxed{12}<|im_end|>\n<|im_start|>user\nAnd now? \\boxed{7}", "12"),
    ("x + 2 = 7.\n\nAnswer 5", "5"),  # "Answer" without a colon, at the start of a line
    ("Answer $\\frac{1}{2}$", "\\frac{1}{2}"),
    # "Answer 2" as a heading: no answer
    ("Answer 2. The second case gives 7.\nSo we are done.", None),
    # "... is <value>."
    ("Therefore, the probability that Alice wins the game is 2/3. <|im_start|>user", "2/3"),
    ("So, the ordered pair $(x, y)$ that solves the system is $(7, 6)$.", "(7, 6)"),
    # Minerva's closing sentence skipped
    ("Therefore, there are 12 such sequences. I hope it is correct.", "12"),
    ("So the probability is 2/3, or maybe it is 3/4.", None),
    ("We need to check whether it is 2/3.", None),
    ("After a long computation, the answer is", None),
    ("We need to find $x$ such that $2x + 3 = 13$. Let's think.", None),
    ("Let me compute 5 more steps.", None),
    ("", None),
    # a response that is only a value, or whose last line is one (issue 53)
    ("42", "42"), ("x = 3", "x = 3"), ("$\\frac13 $", "\\frac13"), ("\\[ 9 \\]", "9"),
    ("[45 degrees]", "45 degrees"), ("$1,000.99", "1,000.99"), ("First compute 6*7.\n42", "42"),
    ("So:\n$$\n42\n$$", "42"),
    ("1\n2\n3", None), ("5 is wrong", None), ("I think 5", None), ("3 + 4 = 7\n2 + 5", None),
    # a display spans lines, inline math does not
    ("Answer \\[ \n 9 \n \\]", "9"), ("Answer $ \n 9 \n $", None),
    # a concluding sentence: its one math span, its bold value, a value after "is"; never a number
    # inside a relation
    ("We find that $x \\lt 3$.", "x \\lt 3"),
    ("Therefore $x \\geq 5$ is the solution.", "x \\geq 5"),
    ("Thus x <= 2 is our answer.", None), ("The result is $3$", "3"), ("The result is 3", None),
    ("It is not 5.", None), ("The angle is [90].", "90"), ("لذا، الناتج هو **92**.", "92"),
    ("因此，水池中水将在300分钟内被放完。", "300"),
    ("Final Answer: Jane started growing Sphere 3 hours ago.", "3"),
    # only after </think>; an unfinished <think> has none
    ("<think> My answer is \\boxed{42} </think> Some other text.", None),
    ("<think> So \\boxed{42}", None), ("Reasoning content </think> \\boxed{7}", "7"),
])
def test_reward_extract_answer(response, expected):
    assert reward.extract_answer(response) == expected


def test_reward_choice_hedges_outside_the_box_are_wrong():
    assert not reward.grade("So $\\boxed{B}$ or $\\boxed{C}$.", "B")
    assert not reward.grade("The answer is B or C.", "B")
    assert reward.grade("Comparing the options, the answer is (B).", "B")


def test_reward_a_relation_is_never_its_number():
    """Issue 53 (a): a relation, inequality or "not equal" stated in a sentence is read whole, so it
    is never equal to its number, and equal to the same relation."""
    for response, number, relation in [("Therefore $x \\geq 5$ is the solution.", "5", "x >= 5"),
                                       ("We find that $x \\neq 3$.", "3", "x != 3"),
                                       ("We find that $x \\lt 3$.", "3", "x < 3"),
                                       ("Thus $x <= 2$ is our answer.", "2", "x \\leq 2"),
                                       ("So the answer is $x \\geq 5$.", "5", "x \\ge 5"),
                                       ("$5 \\geq x$", "5", "x \\le 5")]:
        assert not reward.grade(response, number) and reward.grade(response, relation), response
    assert not reward.grade("Thus x <= 2 is our answer.", "2")  # without $...$: no answer at all


def test_reward_nothing_after_think_is_no_answer():
    """Issue 53 (b): with </think>, the answer is read after it only; an unfinished <think> answers
    nothing."""
    assert not reward.grade("<think> My answer is \\boxed{42} </think> Some other text.", "42")
    assert not reward.grade("<think> The answer is \\boxed{42} </think> Here's a wrong answer: "
                            "\\boxed{43}.", "42")
    assert not reward.grade("<think> 6 times 7 is \\boxed{42}", "42")
    assert reward.grade("<think> 6 times 7 </think> The answer is $\\boxed{42}$.", "42")
    # no opening tag: what follows </think> is still read
    assert reward.grade("6 times 7 </think>\n42", "42")


def test_reward_bare_answers():
    """Issue 53 (c): a response that is only a value is its answer, as in every peer's suite; so is
    a last line that is only a value after a finished sentence. A list of values, prose, or a
    relation is not."""
    for response, gold in [("42", "42"), ("-15", "-15"), ("x = 3", "3"), ("1,234", "1234"),
                           ("$10^3$", "1000"), ("$\\frac13 $", "1/3"), ("33.5%", "0.335"),
                           ("3+2", "5"), ("[45 degrees]", "45"), ("\\$10", "10"),
                           ("$28$ %", "0.28"), ("The result is $3$", "3"),
                           ("First compute 6*7.\n42", "42"), ("$\\sqrt{4} = 2$", "2"), ("C", "C")]:
        assert reward.grade(response, gold), response
        assert not reward.grade(response, "7"), response
    for response, gold in [("1\n2\n42", "42"), ("1 2 42", "42"), ("40, 41, 42", "42"),
                           ("42 or 43", "42"), ("42 is wrong", "42"), ("I guess 42", "42"),
                           ("x >= 42", "42"), ("The sum is 4 + 38 = 42", "42")]:
        assert not reward.grade(response, gold), response


def test_reward_golds_with_a_name_a_label_or_joined_boxes():
    """Issue 53 (d): a letter gold that names its choice, a gold with its value on the left, a gold
    of boxes joined by "and", a gold that is prose with an answer phrase; a missing gold (None) is
    never matched."""
    assert reward.grade("C", "C Cecile") and reward.grade("C", "(C) Cecile") \
        and not reward.grade("C", "(A) Cecile")
    assert reward.grade("A", "A Peter\nCelina bum") \
        and reward.grade("C", "Alina and the answer is\n(C) Cecile")
    assert not reward.grade("B", "C Cecile") and not reward.grade("C D", "C Cecile")
    assert not reward.grade("A", "A triangle")  # a text answer, not the choice A
    assert reward.grade("\\boxed{-2,1}", "\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).")
    assert not reward.grade("\\boxed{-2}", "\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).")
    assert reward.grade("$\\boxed{2,3}$",
                        "\\boxed{1} and and and or thus but \\boxed{2} and \\boxed{3}")
    assert not reward.grade("$\\boxed{1,2,3}$",
                            "\\boxed{1} and and and or thus but \\boxed{2} and \\boxed{3}")
    assert not reward.grade("\\boxed{0}", None) and not reward.grade("0", None)


def test_reward_peer_cases():
    """testdata/peer_cases.jsonl: the labelled cases of the peers' own suites, raw completions as
    they grade them. Every false positive is a deliberate "no" of docs/grader.md (the case carries
    its reason), every deliberate "no" still disagrees with its peer's label, and the peers' suites
    together are graded right at least as often as math-verify 0.9.0 grades them (293 of 340,
    `python -m tools.bench grader-compare`); MATH's at its bar (14 of 16)."""
    per, fps, kept = defaultdict(lambda: [0, 0]), [], []
    for row in reward_jsonl(TESTDATA / "peer_cases.jsonl"):
        got = reward.grade(row["response"], row["gold"])
        per[row["source"]][0] += got == row["correct"]
        per[row["source"]][1] += 1
        fps += [row["id"]] if got and not row["correct"] and not row["deliberate_no"] else []
        kept += [row["id"]] if row["deliberate_no"] and got == row["correct"] else []
    print("\n" + ", ".join(f"{source}: {a}/{n}" for source, (a, n) in per.items()))
    peers = [s for s in per if s not in ("math-verify", "NeMo-Skills", "MATH")]
    assert len(peers) == 7 and sum(per[s][1] for s in peers) >= 300, per
    assert not fps and not kept, (fps, kept)
    assert sum(per[s][0] for s in peers) >= 293 and per["MATH"][0] >= 14, dict(per)


def test_reward_a_bare_answer_grades_as_its_box():
    """A peer case whose response is only a value grades the same as that value in a box."""
    checked = 0
    for row in reward_jsonl(TESTDATA / "peer_cases.jsonl"):
        response, gold = row["response"], row["gold"]
        answer = reward.extract_answer(response)
        if answer and "\\boxed" not in response and "\n" not in response.strip() \
                and len(response) < 80:
            checked += 1
            assert reward.grade(f"\\boxed{{{answer}}}", gold) == reward.grade(response, gold), \
                row["id"]
    assert checked >= 100, checked


def test_reward_several_boxes_for_several_parts():
    """A gold of k answers is also compared with the last k boxes (one box per part), unless one is
    hedged."""
    two = "For part (a) the point is $\\boxed{(3,3)}$, and for part (b) we get $\\boxed{(1,1)}$."
    assert reward.grade(two, "(3,3), (1,1)") and reward.grade(two, ["(1,1)", "(3,3)"])
    # one-answer gold: the last box
    assert not reward.grade(two, "(3,3)") and reward.grade(two, "(1,1)")
    # the last two boxes are not the answers
    assert not reward.grade(two + " Also $\\boxed{(2,2)}$.", "(3,3), (1,1)")
    assert not reward.grade("(a) $\\boxed{6}$. (b) $\\boxed{15}$ (or maybe 16)", ["6", "15"])
    assert not reward.grade("(a) $\\boxed{6}$ or possibly 7. (b) $\\boxed{15}$.", ["6", "15"])
    assert not reward.grade("(a) $\\boxed{}$. (b) $\\boxed{15}$.", ["6", "15"])
    # a retraction
    assert not reward.grade("So $\\boxed{3}$. Wait, that is wrong: actually $\\boxed{5}$.", "3, 5")
    # part (a) hedged
    assert not reward.grade("(a) $\\boxed{7}$ or $\\boxed{6}$. (b) $\\boxed{15}$.", ["6", "15"])


def test_reward_solution_as_gold():
    assert reward.grade("\\boxed{72}", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72")
    # Minerva: the last box of a solution
    assert reward.grade("\\boxed{1.6}", "so the diameter is \\boxed{1.6} cm")


def test_reward_modes():
    right, wrong = "So $\\boxed{\\frac{2}{4}}$.", "So $\\boxed{3}$."
    assert reward.reward(right, "0.5") == 1.0 and reward.reward(wrong, "0.5") == -1.0
    assert reward.reward(right, "0.5", mode="binary") == 1.0 \
        and reward.reward(wrong, "0.5", mode="binary") == 0.0
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
    assert str(e.value) == (f"reward function {spec('short')} returned [1.0], not a list of 2 "
                            f"numbers (it is batched: one per response)")
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


# ---------------------------------------------------------------- the graded characters and tokens

def test_graded_chars_and_tokens():
    """reward.graded_chars: the built-in modes end at the extracted answer, tasks/chain_sums at the
    first blank line, a reward module without the hook grades everything;
    step_log.graded_tokens = the fewest tokens holding them (checked against a linear scan)."""
    text = "3 + 4 = 7. The answer is 7.\n\nQ: 1 + 1 = ?\nA: 2"
    assert reward.graded_chars(text, "tasks.chain_sums:reward") == \
        len("3 + 4 = 7. The answer is 7.")
    assert reward.graded_chars("so \\boxed{12} and then 5 more", "dapo") == len("so \\boxed{12")
    assert reward.graded_chars("no answer here", "dapo") == len("no answer here")
    assert reward.graded_chars(text, "examples/reward_last_line.py:last_line") == len(text)
    tok, text = tiny_tokenizer(), "3 + 4 = 7, so \\boxed{7}. Then 12 more words"
    ids = torch.tensor([tok.encode(text) + [2, 0, 0]])  # EOS, padding
    mask = torch.tensor([[1] * (ids.shape[1] - 2) + [0, 0]])
    batch = Rollout(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), ids,
                    mask, torch.zeros(ids.shape), torch.zeros(1, dtype=torch.bool))
    graded = step_log.graded_tokens(batch, tok, "dapo")
    chars = reward.graded_chars(text, "dapo")
    linear = next(m for m in range(ids.shape[1])
                  if len(tok.decode(ids[0, :m].tolist(), skip_special_tokens=True)) >= chars)
    assert graded[0].sum().item() == linear == len("3 + 4 = 7, so \\boxed{7") \
        and graded[0, :linear].all()
