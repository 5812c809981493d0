"""The reward (docs/paper.md §1 and §6: the DAPO reward on the last \\boxed{}; §7: rule-based
grading of the benchmarks): read the final answer of a response, decide whether it equals the gold,
and pay +1 or -1; or call your own reward function instead.

`grade(response, gold)` takes the final answer (after </think> only; the last \\boxed{...}, else
"the answer is ..." phrases, a response or last line that is only a value, or a final sentence
stating one value; never "the last number in the text") and decides whether it equals the gold.
`graded_chars` (and, for token ids, `graded_count`) says how much of a response the reward reads: up
to and including its answer. The grader's parts live in grader/: where an answer sits (extraction),
how its text is cleaned (normalize), the math answer parser (model output never reaches eval, exec,
sympify or parse_expr), equality (equivalence) and its budgets (limits); your own reward function is
loaded and called by grader/user_reward.py.

Deliberate differences D11-D15: docs/paper.md, "Deliberate differences".
"""
import functools
import time

from grader import user_reward
from grader.equivalence import answer_parts, equivalent
from grader.extraction import extract_final
from grader.limits import Refused
from grader.normalize import clean_answer, squash
# reward.RewardError: your reward function failed (train.py and eval.py catch it)
from grader.user_reward import BUILTIN, RewardError  # noqa: F401

# ------------------------------------------------------------------------------------------- limits
TIMEOUT_S = 1.0  # wall-clock budget of one grade() call


# --------------------------------------------------------------------------------------- public API
def _golds(gold):
    """A gold answer as a list of strings: a list means several answers (OlympiadBench);
    27.0 -> "27.0"; None: none."""
    return [str(g) for g in ([gold] if isinstance(gold, (str, int, float)) else gold or [])]


def extract_answer(response, timeout=TIMEOUT_S):
    """The final answer of a response as a string ('' for an empty box), or None when there is none
    (or no answer could be found within `timeout` seconds)."""
    try:
        return extract_final(response, time.monotonic() + timeout)[0] \
            if isinstance(response, str) else None
    except Refused:
        return None


def grade(response, gold, timeout=TIMEOUT_S):
    """Whether the final answer of `response` equals `gold` (a string, or a list of strings for
    several answers); extraction and comparison together stop within about `timeout` seconds (the
    deadline starts here; measured: at most ~0.15 s later on hostile inputs, docs/grader.md)."""
    deadline = time.monotonic() + timeout
    try:
        answer, text, boxes = extract_final(response, deadline) if isinstance(response, str) \
            else (None, "", [])
    except Refused:
        return False
    golds = _golds(gold)
    if not (answer and answer.strip() and golds):
        return False
    return equivalent(answer, golds, deadline) or answer_parts(text, boxes, golds, deadline)


def reward(response, gold, mode="dapo", row=None):
    """The RL reward. "dapo": +1 / -1 by `grade`; "binary": 1 / 0; "strict": +1 / -1 by the paper's
    rule, a normalized string match of the last \\boxed{} only; "FILE.py:FUNCTION" or
    "MODULE:FUNCTION": your function (`load_reward`), called as FUNCTION(response, gold, **the
    fields of `row` it takes), row = the data row the response answers ({"problem", "fields"},
    data.read_rows). A response is correct when its reward is positive."""
    if ":" in mode:  # your own function (D15)
        return user_reward.call(load_reward(mode), mode, [response], [gold], [row])[0]
    if mode == "strict":  # the paper's string match; the default compares values (D11)
        deadline = time.monotonic() + TIMEOUT_S
        try:
            boxes = extract_final(response, deadline)[2] if isinstance(response, str) else []
            box = boxes[-1][2] if boxes else None
            pred = clean_answer(box, deadline)[0] if box else ""
            golds = ", ".join(clean_answer(g, deadline)[0] for g in _golds(gold))
        except Refused:
            return -1.0
        return 1.0 if pred and squash(pred) == squash(golds) else -1.0
    if mode not in BUILTIN:
        raise ValueError(f"unknown reward {mode!r}; valid: {', '.join(BUILTIN)}, or your own as "
                         f"FILE.py:FUNCTION or MODULE:FUNCTION")
    return 1.0 if grade(response, gold) else (0.0 if mode == "binary" else -1.0)


def rewards(responses, golds, mode="dapo", rows=None):
    """`reward` of each response (golds[i], rows[i]: its gold and data row; rows None: none); your
    own function declared batched is called once, with lists (`user_reward.call`). train.py's and
    eval.py's call."""
    if ":" not in mode:  # the built-in modes read no row
        return [reward(response, gold, mode) for response, gold in zip(responses, golds)]
    fn, rows = load_reward(mode), [None] * len(responses) if rows is None else list(rows)
    if getattr(fn, "batched", False):
        return user_reward.call(fn, mode, list(responses), list(golds), rows)
    return [user_reward.call(fn, mode, [response], [gold], [row])[0]
            for response, gold, row in zip(responses, golds, rows)]


def correct(response, gold, mode="dapo", row=None):
    """Whether `response` is correct under the reward `mode`: its reward is positive. train.py's
    reward/acc and held-out accuracy and eval.py's avg@k count this (for dapo and binary it is
    `grade`)."""
    return rewards([response], [gold], mode, [row])[0] > 0


def graded_chars(response, mode="dapo"):
    """How many leading characters of `response` the reward reads, up to and including the answer
    (the rest is text after the graded answer, which the reward cannot see): for the built-in modes,
    the end of the last occurrence of the extracted answer (the whole response when there is none);
    for your own reward function, the `graded_chars(response)` its module defines
    (tasks/chain_sums.py), else the whole response."""
    if ":" in mode:
        own = getattr(load_reward(mode), "__globals__", {}).get("graded_chars")
        return int(own(response)) if callable(own) else len(response)
    answer = extract_answer(response)
    at = response.rfind(answer) if answer else -1
    return len(response) if at < 0 else at + len(answer)


def graded_count(tokenizer, ids: list[int], mode: str) -> int:
    """How many leading tokens of a response (ids; `tokenizer` decodes them) hold the characters the
    reward reads (`graded_chars`): the fewest whose decoded text has them, by bisection on the
    decoded length of the response's prefixes."""
    chars = graded_chars(tokenizer.decode(ids, skip_special_tokens=True), mode)
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= chars \
            else (mid + 1, hi)
    return lo


# ---------------------------------------------------------------------------------- your own reward
def load_reward(spec):
    """The function `spec` names, checked: a built-in mode ("dapo", "binary", "strict": reward
    itself), or your own, "FILE.py:FUNCTION" or "MODULE:FUNCTION" (`user_reward.load_function`: a
    spec it cannot load raises ValueError in one line; loaded once per process)."""
    if spec in BUILTIN:
        return functools.partial(reward, mode=spec)
    return user_reward.load_function(spec)
