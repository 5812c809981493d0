"""reward.py: answer extraction and grading (the grader's parts: tests/test_grader_*.py; your own
reward function: tests/test_grader_user_reward.py), the graded characters and tokens.
"""
import ast
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import reward
from model import tiny_tokenizer
from rollout import Rollout
from step_metrics import step_log
from tests.toy_task import TESTDATA, reward_jsonl


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
