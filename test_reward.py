"""Tests of reward.py (paper Sec. 1/6: the +-1 reward on the final answer; Sec. 7: rule-based grading).

Agreement with the careful human labels of shared/data/grader_cases.jsonl (>= 97%, zero false positives on the
categories where a false positive rewards a wrong or missing answer), every benchmark's gold grading itself,
hostile inputs (fast, no side effects, also in a thread), and one test per normalization / comparison rule.
Run with `pytest -s test_reward.py` to see the agreement table."""
import ast
import json
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

import reward

_REWARD_DATA = Path(__file__).parent.parent / "shared" / "data"
_REWARD_ZERO_FP = ("near_miss", "no_answer", "hedging", "empty_box")


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
    per = defaultdict(lambda: [0, 0, 0])  # category -> [agree, total, false positives]
    for row in _reward_jsonl(_REWARD_DATA / "grader_cases.jsonl"):
        if row["ambiguous"]:
            continue
        got = reward.grade(row["response"], row["gold"])
        stats = per[row["category"]]
        stats[0] += got == row["correct"]
        stats[1] += 1
        stats[2] += got and not row["correct"]
    agree, total, fp = (sum(s[i] for s in per.values()) for i in range(3))
    print(f"\n| category | agree | n | false positives |\n|---|---|---|---|")
    for cat, (a, n, f) in sorted(per.items()):
        print(f"| {cat} | {a / n:.0%} | {n} | {f} |")
    print(f"| **all** | **{agree / total:.1%}** | {total} | {fp} |")
    assert agree / total >= 0.97
    assert sum(per[c][2] for c in _REWARD_ZERO_FP) == 0


def _reward_benchmark_golds():
    """(benchmark, prediction, gold) for every row of every benchmark file, with a minimal local field mapping."""
    bench = _REWARD_DATA / "benchmarks"
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
    for name in ("minerva_math", "math5000"):
        for row in _reward_jsonl(bench / f"{name}.jsonl"):
            yield name, _reward_last_box(row["solution"]), _reward_last_box(row["solution"])
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
    assert len(rows) == 8 and not any(failed.values()), {k: v[:5] for k, v in failed.items() if v}


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
        assert time.monotonic() - start < 1.0  # the bound for one grade
        assert reward.reward(response, gold, mode="strict") in (1.0, -1.0)
    assert not (tmp_path / "X").exists()


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
    ("\\mathbf{\\frac{1}{2}}", "0.5", True), ("{100^\\circ}", "100", True), ("{\\text{Tuesday}}", "\\text{Tuesday}", True),
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
])
def test_reward_equivalence_rules(pred, gold, expected):
    assert reward.is_equivalent(pred, gold) is expected


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
