"""grader/extraction.py: where the final answer sits, through reward.extract_answer and
reward.grade: nested boxes, boxes joined by spaces.
"""
import reward


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
