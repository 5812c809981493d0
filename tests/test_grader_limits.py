"""grader/limits.py: the grader's budgets, through reward.grade: hostile inputs, any nesting, long
flat inputs and a grade off the main thread all end within the timeout plus a margin, and run
nothing.
"""
import threading
import time

import pytest

import reward


# ==================================================================================================
# grader/limits.py: every grade bounded in time, without signals
# ==================================================================================================
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
        assert time.monotonic() - start < reward.TIMEOUT_S + _GRADE_MARGIN_S
        assert reward.reward(response, gold, mode="strict") in (1.0, -1.0)
    assert not (tmp_path / "X").exists()


_GRADE_MARGIN_S = 1.5  # headroom for a busy machine, not a race: the measured overshoot < 0.15 s
# (open, close) of every nesting construct the grader reads;
# each is fed 10,000 deep, 5,000 wide and unclosed
_REWARD_NESTING = {"box": ("\\boxed{", "}"), "fbox": ("\\fbox{", "}"), "brace": ("{", "}"),
                   "frac": ("\\frac{1}{", "}"), "frac numerator": ("\\frac{", "}{3}"),
                   "sqrt": ("\\sqrt{", "}"), "root": ("\\sqrt[3]{", "}"),
                   "left": ("\\left(", "\\right)"), "paren": ("(", ")"), "bracket": ("[", "]"),
                   "set": ("\\{", "\\}"), "abs": ("|", "|"), "text": ("\\text{", "}"),
                   "mathbf": ("\\mathbf{", "}"), "power": ("2^{", "}"), "sin": ("\\sin(", ")"),
                   "pmatrix": ("\\begin{pmatrix}", "\\end{pmatrix}")}


def _nested(construct, shape):
    """A hostile response: the construct nested 10,000 deep around 1, repeated 5,000 times, or
    opened 20,000 times."""
    open_, close = _REWARD_NESTING[construct]
    body = {"deep": open_ * 10_000 + "1" + close * 10_000,
            "wide": "+".join([open_ + "1" + close] * 5_000), "unclosed": open_ * 20_000}[shape]
    return body if construct in ("box", "fbox") else "\\boxed{" + body + "}"


@pytest.mark.parametrize("shape", ["deep", "wide", "unclosed"])
@pytest.mark.parametrize("construct", _REWARD_NESTING)
def test_reward_grade_time_is_bounded_for_any_nesting(construct, shape):
    """The whole of grade (extraction, normalization, parsing, comparison) ends within its timeout
    plus a margin, whatever the nesting (10,000 nested boxes took 0.85-5 s with a 1 s timeout before
    the deadline covered extraction and nested boxes stopped being joined); the verdict is a bool,
    never an exception."""
    response, timeout = _nested(construct, shape), 0.5
    for gold in ("2", ["1", "2"], "x"):  # none of them is the value of any of these responses
        start = time.monotonic()
        assert reward.grade(response, gold, timeout=timeout) is False
        assert time.monotonic() - start < timeout + _GRADE_MARGIN_S, (construct, shape, gold)
    assert reward.extract_answer(response) is None or \
        isinstance(reward.extract_answer(response), str)


def test_reward_long_flat_inputs_are_bounded():
    """Long inputs without nesting: many boxes, many joined boxes, a long sum, long text,
    digits, phrases."""
    responses = [", ".join(f"\\boxed{{{k}}}" for k in range(20_000)), "\\boxed{1} or " * 20_000,
                 "\\boxed{" + "+".join(f"\\sqrt{{{k}+\\sqrt{{{k + 1}}}}}"
                                       for k in range(100)) + "}",
                 "\\boxed{" + ", ".join(f"x<{k}" for k in range(240)) + "}",
                 "The answer is " + "1+" * 100_000 + "1.", "<answer>" * 20_000,
                 "answer is " * 20_000, "1" * 1_000_000, "\\boxed{" + "7" * 1_000_000 + "}"]
    for response in responses:
        for gold in ("0.33", "2", ["1", "2"]):
            start = time.monotonic()
            assert reward.grade(response, gold, timeout=0.5) is False
            assert time.monotonic() - start < 0.5 + _GRADE_MARGIN_S, response[:40]


def test_reward_grade_is_bounded_in_a_thread():
    """No signals: grading works off the main thread and the deadline still holds."""
    out = []
    thread = threading.Thread(
        target=lambda: out.append(reward.grade(_REWARD_HOSTILE["power tower"], "5", timeout=0.5)))
    start = time.monotonic()
    thread.start()
    thread.join(5)
    assert out == [False] and time.monotonic() - start < 1.0
    assert reward.grade("\\boxed{(x+1)^{100} + \\sin x}", "(x+1)^{100} + \\sin x + 1",
                        timeout=0.0) is False
