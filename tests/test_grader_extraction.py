"""grader/extraction.py: where the final answer sits, through reward.extract_answer and
reward.grade: nested boxes, boxes joined by spaces, only after </think>, a bare value.
"""
import reward
from tests.toy_task import TESTDATA, reward_jsonl


# ==================================================================================================
# grader/extraction.py: the boxes of a response
# ==================================================================================================
def test_reward_nested_boxes():
    """A box inside a box is part of its content (10,000 nested boxes were joined into a 100-MB
    answer); a box that holds only a box is its inner box."""
    deep = "\\boxed{" * 10_000 + "1" + "}" * 10_000
    assert reward.extract_answer(deep) == "1" and reward.grade(deep, "1") and \
        not reward.grade(deep, "2")
    assert reward.extract_answer("\\boxed{\\boxed{5}+1}") == "\\boxed{5}+1"
    assert reward.extract_answer("so \\boxed{3} and \\boxed{\\boxed{4}}") == "3, 4"
    assert reward.extract_answer("\\boxed{ \\boxed{4} and \\boxed{5}}") == \
        " \\boxed{4} and \\boxed{5}"


def test_reward_boxes_separated_by_spaces_are_one_list():
    """Decided in issue 53, as math-verify reads them: boxes with only spaces (or layout) between
    them are one list, like boxes joined by a comma, "and" or "or": wrong for one answer, right for
    as many answers."""
    assert not reward.grade("\\boxed{9} \\boxed{42}", "42") and \
        reward.grade("\\boxed{9} \\boxed{42}", "9, 42")
    assert not reward.grade("\\boxed{9}\\boxed{42}", "42") and \
        reward.grade("\\boxed{9} \\quad \\boxed{42}", "42, 9")
    # text between them: the last box
    assert reward.grade("\\boxed{9}. Then, recounting, \\boxed{42}", "42")


# ==================================================================================================
# grader/extraction.py: the final answer (after </think>, a bare value)
# ==================================================================================================
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


def test_reward_a_bare_answer_in_markdown_bold():
    """A final answer in markdown bold: the bold is layout, the value its answer. ("64 + 67 =
    **131**" and "**131**" graded wrong: the stars stayed in the answer.) Bold never makes a value
    of what is not one: a power, a hedge, a list, a sentence."""
    for response in ("64 + 67 = **131**", "**131**", "64 + 67 = **131**.",
                     "First add the tens.\n64 + 67 = **131**"):
        assert reward.extract_answer(response) in ("64 + 67 = 131", "131"), response
        assert reward.grade(response, "131") and not reward.grade(response, "130"), response
    assert reward.extract_answer("a**2 + b**2") == "a**2 + b**2"  # powers, not bold
    for response, gold in [("**131** or **132**", "131"), ("**131** is wrong", "131"),
                           ("**1** **2** **131**", "131"), ("I guess **131**", "131"),
                           ("**131 apples and 3 pears**", "131")]:
        assert not reward.grade(response, gold), response


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
